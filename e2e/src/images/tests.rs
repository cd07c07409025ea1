use super::*;

/// Stand-ins for the build outputs: any dynamic binary does for the specs (the test binary
/// itself), so the specs can be checked on a machine that has built nothing else.
fn stand_ins() -> HostInputs {
    let exe = std::env::current_exe().unwrap();
    let root = crate::artifacts::workspace_root();
    HostInputs {
        tessera_scheduler: exe.clone(),
        tessera_device_plugin: exe.clone(),
        tessera_dra_plugin: exe.clone(),
        shim: exe.clone(),
        kube_scheduler: exe.clone(),
        k8s_version: "v1.34.4".into(),
        cuda_probe: exe.clone(),
        driver_libs: vec![exe.clone()],
        busybox: exe,
        pause_c: root.join("e2e/images/pause.c"),
    }
}

/// What a Dockerfile's final stage puts in the image's config and file system.
#[derive(Debug, Default)]
struct Stage {
    base: String,
    copies: Vec<String>,
    user: Option<String>,
    entrypoint: Vec<String>,
    cmd: Vec<String>,
    expose: Vec<String>,
    /// Instructions that would change the image in ways the specs do not model.
    unhandled: Vec<String>,
}

fn final_stage(dockerfile: &str) -> Stage {
    // Continuation lines joined, comments and blank lines dropped.
    let mut logical = Vec::new();
    let mut cur = String::new();
    for line in dockerfile.lines() {
        let t = line.trim();
        if cur.is_empty() && (t.is_empty() || t.starts_with('#')) {
            continue;
        }
        if let Some(head) = t.strip_suffix('\\') {
            cur.push_str(head);
            cur.push(' ');
        } else {
            cur.push_str(t);
            logical.push(std::mem::take(&mut cur));
        }
    }
    let mut stage = Stage::default();
    for l in logical {
        let (kw, rest) = l.split_once(char::is_whitespace).unwrap_or((&l, ""));
        let rest = rest.trim();
        let json = |s: &str| -> Vec<String> {
            serde_json::from_str(s).unwrap_or_else(|e| panic!("not exec form {s:?}: {e}"))
        };
        match kw.to_ascii_uppercase().as_str() {
            "FROM" => {
                stage = Stage {
                    base: rest
                        .split_whitespace()
                        .find(|w| !w.starts_with("--"))
                        .unwrap()
                        .to_owned(),
                    ..Stage::default()
                };
            }
            "COPY" | "ADD" => {
                let args: Vec<&str> = rest
                    .split_whitespace()
                    .filter(|w| !w.starts_with("--"))
                    .collect();
                stage.copies.push(args.last().unwrap().to_string());
            }
            "USER" => stage.user = Some(rest.to_owned()),
            "ENTRYPOINT" => stage.entrypoint = json(rest),
            "CMD" => stage.cmd = json(rest),
            "EXPOSE" => stage.expose.extend(rest.split_whitespace().map(|p| {
                if p.contains('/') {
                    p.to_owned()
                } else {
                    format!("{p}/tcp")
                }
            })),
            "ENV" | "WORKDIR" | "VOLUME" | "LABEL" | "STOPSIGNAL" | "HEALTHCHECK" | "SHELL"
            | "ONBUILD" => stage.unhandled.push(kw.to_owned()),
            _ => {}
        }
    }
    stage
}

/// COPY destinations of the Dockerfiles that the e2e images leave out, and why.
const LEFT_OUT: &[(&str, &str)] = &[(
    "/opt/tessera/lib/musl/",
    "the musl shim is built only with SHIM_MUSL=1; the chart installs it only when present",
)];

/// Paths that come from the base image (distroless), not from the Dockerfile's COPYs.
fn from_base(path: &str) -> bool {
    ["/lib/", "/lib64/", "/usr/lib/", "/usr/lib64/", "/etc/"]
        .iter()
        .any(|p| path.starts_with(p))
        || path == "/tmp"
        || path == "/root"
}

#[test]
fn specs_match_the_dockerfiles() {
    let root = crate::artifacts::workspace_root();
    let specs = specs_for(&stand_ins(), &ImageNames::default()).unwrap();
    for (dockerfile, id) in [
        ("docker/device-plugin.Dockerfile", "tessera-device-plugin"),
        ("docker/scheduler.Dockerfile", "tessera-scheduler"),
    ] {
        let stage = final_stage(&std::fs::read_to_string(root.join(dockerfile)).unwrap());
        assert!(
            stage.unhandled.is_empty(),
            "{dockerfile}'s final stage uses {:?}: teach images.rs and this test about it",
            stage.unhandled
        );
        let spec = specs.iter().find(|s| s.id == id).unwrap();
        assert_eq!(spec.names[0], tessera_image(id), "{dockerfile}");
        assert!(
            stage.base.starts_with("gcr.io/distroless/cc-"),
            "{dockerfile}: base {} is not distroless cc; the spec's base needs a look",
            stage.base
        );

        let files: BTreeSet<&str> = spec
            .files
            .iter()
            .map(|f| f.path_in_image.as_str())
            .collect();
        let mut copied = BTreeSet::new();
        for dest in &stage.copies {
            if LEFT_OUT.iter().any(|(p, _)| p == dest) {
                continue;
            }
            assert!(
                files.contains(dest.as_str()),
                "{dockerfile} copies to {dest}, the e2e image has no such file"
            );
            copied.insert(dest.as_str());
        }
        let own: BTreeSet<&str> = files.iter().copied().filter(|p| !from_base(p)).collect();
        assert_eq!(own, copied, "{dockerfile}: files beyond the base image");

        let base_user = stage.base.ends_with(":nonroot").then(|| "65532".to_owned());
        let user = stage.user.clone().or(base_user);
        let norm = |u: Option<String>| u.filter(|u| u != "0" && u != "root" && u != "0:0");
        assert_eq!(norm(spec.user.clone()), norm(user), "{dockerfile}: USER");
        assert_eq!(
            spec.entrypoint, stage.entrypoint,
            "{dockerfile}: ENTRYPOINT"
        );
        assert_eq!(spec.cmd, stage.cmd, "{dockerfile}: CMD");
        let ports = |v: &[String]| v.iter().cloned().collect::<BTreeSet<_>>();
        assert_eq!(
            ports(&spec.exposed_ports),
            ports(&stage.expose),
            "{dockerfile}: EXPOSE"
        );

        // distroless/cc: the loader and glibc, users, /tmp.
        assert!(files.iter().any(|p| p.ends_with("/libc.so.6")), "{files:?}");
        assert!(files.iter().any(|p| p.contains("/ld-linux")), "{files:?}");
        for p in ["/etc/passwd", "/etc/group", "/tmp"] {
            assert!(files.contains(p), "{dockerfile}: {p}");
        }
        let tmp = spec
            .files
            .iter()
            .find(|f| f.path_in_image == "/tmp")
            .unwrap();
        assert_eq!(tmp.mode, 0o1777);
    }
}

#[test]
fn other_specs_name_and_place_what_the_cluster_needs() {
    let extra = ImageNames {
        kube_scheduler: vec![
            "registry.k8s.io/kube-scheduler:v1.34.2".into(),
            "registry.cn-hangzhou.aliyuncs.com/google_containers/kube-scheduler:v1.34.4".into(),
        ],
        pause: vec!["registry.k8s.io/pause:3.9".into()],
        ..ImageNames::default()
    };
    let specs = specs_for(&stand_ins(), &extra).unwrap();
    let get = |id: &str| specs.iter().find(|s| s.id == id).unwrap();
    let ks = get("kube-scheduler");
    assert_eq!(
        ks.names,
        [
            "registry.k8s.io/kube-scheduler:v1.34.4",
            "registry.k8s.io/kube-scheduler:v1.34.2",
            "registry.cn-hangzhou.aliyuncs.com/google_containers/kube-scheduler:v1.34.4",
        ]
    );
    assert!(
        ks.files
            .iter()
            .any(|f| f.path_in_image == "/usr/local/bin/kube-scheduler")
    );
    assert!(
        ks.env
            .iter()
            .any(|e| e.starts_with("PATH=") && e.contains("/usr/local/bin"))
    );
    assert_eq!(
        get("pause").names,
        [PAUSE_IMAGE, "registry.k8s.io/pause:3.9"]
    );
    assert_eq!(get("pause").entrypoint, ["/pause"]);

    let probe = get("cuda-probe");
    // Also under the release's name, which the simulated GPUs' example pod names.
    assert_eq!(
        probe.names,
        [
            CUDA_PROBE_IMAGE.to_owned(),
            tessera_image(GPU_PROBE_REPOSITORY)
        ]
    );
    let paths: BTreeSet<&str> = probe
        .files
        .iter()
        .map(|f| f.path_in_image.as_str())
        .collect();
    for p in ["/usr/bin/cuda_probe", "/bin/busybox", "/bin/sh"] {
        assert!(paths.contains(p), "{p}");
    }
    // The fake driver and the shim are Rust: libgcc_s must be in the image.
    assert!(
        paths.iter().any(|p| p.ends_with("/libgcc_s.so.1")),
        "{paths:?}"
    );
    assert!(
        !paths
            .iter()
            .any(|p| p.contains("libcuda") || p.contains("libnvidia-ml")),
        "the driver comes from the runtime, not the image: {paths:?}"
    );
    assert_eq!(specs.len(), 6);
}

fn sample_spec(host_file: &Path) -> ImageSpec {
    ImageSpec {
        id: "sample".into(),
        names: vec![
            "tessera.local/sample:1".into(),
            "registry.example/other/sample:v2".into(),
        ],
        files: vec![
            ImageFile::host("/usr/bin/tool", host_file, 0o755),
            ImageFile::bytes("/etc/greeting", "hello\n", 0o644),
            ImageFile::dir("/tmp", 0o1777),
            ImageFile::symlink("/bin/sh", "busybox"),
            ImageFile::bytes("/a/very/deep/path/that/needs/parents/file.txt", "x", 0o600),
        ],
        user: Some("65532:65532".into()),
        entrypoint: vec!["/usr/bin/tool".into()],
        cmd: vec!["serve".into()],
        exposed_ports: vec!["443/tcp".into(), "9395/tcp".into()],
        env: vec![DISTROLESS_PATH.into()],
        working_dir: None,
    }
}

/// The layer's entries: path → (type, mode, size, mtime, uid).
fn layer_entries(tar: &Path, layer: &str) -> Vec<(String, tar::EntryType, u32, u64, u64, u64)> {
    let mut ar = tar::Archive::new(std::fs::File::open(tar).unwrap());
    let want = format!("blobs/sha256/{}", layer.trim_start_matches("sha256:"));
    for e in ar.entries().unwrap() {
        let mut e = e.unwrap();
        if e.path().unwrap().to_string_lossy() == want {
            let mut bytes = Vec::new();
            e.read_to_end(&mut bytes).unwrap();
            let mut inner = tar::Archive::new(bytes.as_slice());
            return inner
                .entries()
                .unwrap()
                .map(|x| {
                    let x = x.unwrap();
                    let h = x.header();
                    (
                        x.path().unwrap().to_string_lossy().into_owned(),
                        h.entry_type(),
                        h.mode().unwrap(),
                        h.size().unwrap(),
                        h.mtime().unwrap(),
                        h.uid().unwrap(),
                    )
                })
                .collect();
        }
    }
    panic!("no layer {want}");
}

#[test]
fn same_inputs_same_digests_and_the_layout_containerd_imports() {
    let dir = tempfile::tempdir().unwrap();
    let host = dir.path().join("tool");
    std::fs::write(&host, b"#!/bin/sh\necho tool\n").unwrap();
    let spec = sample_spec(&host);
    let a = build_image(&spec, &dir.path().join("one/sample.tar")).unwrap();
    // Another time, another place, a different mtime on the host file: same bytes.
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(&host, b"#!/bin/sh\necho tool\n").unwrap();
    let b = build_image(&spec, &dir.path().join("two/sample.tar")).unwrap();
    if a.manifest_digest != b.manifest_digest {
        let (x, y) = (read_archive(&a.tar).unwrap(), read_archive(&b.tar).unwrap());
        for (k, v) in &x.small_blobs {
            if !y.small_blobs.contains_key(k) {
                eprintln!("only in a: {}", String::from_utf8_lossy(v));
            }
        }
        for (k, v) in &y.small_blobs {
            if !x.small_blobs.contains_key(k) {
                eprintln!("only in b: {}", String::from_utf8_lossy(v));
            }
        }
    }
    assert_eq!(a.manifest_digest, b.manifest_digest);
    assert_eq!(
        std::fs::read(&a.tar).unwrap(),
        std::fs::read(&b.tar).unwrap()
    );

    let ar = read_archive(&a.tar).unwrap();
    assert_eq!(
        ar.paths[..4],
        ["oci-layout", "index.json", "blobs/", "blobs/sha256/"]
    );
    let layout: serde_json::Value =
        serde_json::from_slice(ar.oci_layout.as_ref().unwrap()).unwrap();
    assert_eq!(layout, serde_json::json!({"imageLayoutVersion": "1.0.0"}));
    assert!(
        ar.blobs.values().all(|(_, ok)| *ok),
        "a blob's name is not its digest"
    );
    assert_eq!(ar.blobs.len(), 3);

    // index.json: one descriptor per name, each the same manifest, named for containerd.
    assert_eq!(ar.index.schema_version(), 2);
    assert_eq!(ar.index.media_type(), &Some(MediaType::ImageIndex));
    let names: Vec<&str> = ar
        .index
        .manifests()
        .iter()
        .map(|d| {
            assert_eq!(d.media_type(), &MediaType::ImageManifest);
            assert_eq!(d.digest().to_string(), a.manifest_digest);
            assert_eq!(d.platform().as_ref().unwrap().os(), &Os::Linux);
            d.annotations().as_ref().unwrap()[CONTAINERD_IMAGE_NAME].as_str()
        })
        .collect();
    assert_eq!(names, spec.names);

    let manifest = ar.manifest(&a.manifest_digest).unwrap();
    assert_eq!(manifest.schema_version(), 2);
    assert_eq!(manifest.config().media_type(), &MediaType::ImageConfig);
    assert_eq!(manifest.layers().len(), 1);
    let layer = &manifest.layers()[0];
    assert_eq!(layer.media_type(), &MediaType::ImageLayer);
    assert_eq!(ar.blobs[&layer.digest().to_string()].0, layer.size());
    let config = ar.config(manifest.config().digest().as_ref()).unwrap();
    assert_eq!(config.rootfs().typ(), "layers");
    // Uncompressed: the diff ID is the layer digest.
    assert_eq!(config.rootfs().diff_ids(), &[layer.digest().to_string()]);
    assert_eq!(config.os(), &Os::Linux);
    let c = config.config().as_ref().unwrap();
    assert_eq!(c.user().as_deref(), Some("65532:65532"));
    assert_eq!(
        c.entrypoint().as_deref(),
        Some(&["/usr/bin/tool".to_owned()][..])
    );
    assert_eq!(c.cmd().as_deref(), Some(&["serve".to_owned()][..]));
    // (oci-spec reads the map back through a HashMap: any order.)
    let ports: BTreeSet<&str> = c
        .exposed_ports()
        .iter()
        .flatten()
        .map(String::as_str)
        .collect();
    assert_eq!(ports, BTreeSet::from(["443/tcp", "9395/tcp"]));
    // The raw JSON is Docker's shape for ports: a map.
    let raw: serde_json::Value =
        serde_json::from_slice(&ar.small_blobs[&manifest.config().digest().to_string()]).unwrap();
    assert_eq!(
        raw["config"]["ExposedPorts"],
        serde_json::json!({"443/tcp": {}, "9395/tcp": {}})
    );
    assert_eq!(
        raw["architecture"],
        if cfg!(target_arch = "aarch64") {
            "arm64"
        } else {
            "amd64"
        }
    );

    // The layer: sorted, parents first, fixed times and owners.
    let entries = layer_entries(&a.tar, layer.digest().as_ref());
    let paths: Vec<&str> = entries.iter().map(|e| e.0.as_str()).collect();
    let mut sorted = paths.clone();
    sorted.sort();
    assert_eq!(paths, sorted);
    assert!(paths.contains(&"a/very/deep/path/that/needs/parents/"));
    assert!(entries.iter().all(|e| e.4 == MTIME && e.5 == 0));
    let find = |p: &str| entries.iter().find(|e| e.0 == p).unwrap();
    assert_eq!(find("tmp/").2, 0o1777);
    assert_eq!(find("tmp/").1, tar::EntryType::Directory);
    assert_eq!(find("bin/sh").1, tar::EntryType::Symlink);
    assert_eq!(find("usr/bin/tool").2, 0o755);
    assert_eq!(find("usr/bin/tool").3, 20);
    assert_eq!(find("etc/greeting").2, 0o644);
}

#[test]
fn cache_reuses_same_inputs_and_replaces_stale_tars() {
    let dir = tempfile::tempdir().unwrap();
    let host = dir.path().join("tool");
    std::fs::write(&host, b"one").unwrap();
    let out = dir.path().join("images");
    std::fs::create_dir(&out).unwrap();
    let spec = sample_spec(&host);
    let first = build_cached(&spec, &out).unwrap();
    assert!(!first.reused);
    let again = build_cached(&spec, &out).unwrap();
    assert!(again.reused);
    assert_eq!(
        again,
        BuiltImage {
            reused: true,
            ..first.clone()
        }
    );

    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(&host, b"two").unwrap();
    let changed = build_cached(&spec, &out).unwrap();
    assert!(!changed.reused);
    assert_ne!(changed.tar, first.tar);
    assert_ne!(changed.manifest_digest, first.manifest_digest);
    assert!(!first.tar.exists(), "the stale tar is removed");
    let left: Vec<_> = std::fs::read_dir(&out).unwrap().flatten().collect();
    assert_eq!(left.len(), 1, "no scratch left behind: {left:?}");
}

#[test]
fn layout_refuses_clashes_and_escapes() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = sample_spec(Path::new("/nonexistent"));
    spec.files = vec![
        ImageFile::bytes("/a/b", "x", 0o644),
        ImageFile::bytes("/a", "y", 0o644),
    ];
    assert!(build_image(&spec, &dir.path().join("x.tar")).is_err());
    spec.files = vec![
        ImageFile::bytes("/a", "x", 0o644),
        ImageFile::bytes("/a", "y", 0o644),
    ];
    assert!(build_image(&spec, &dir.path().join("x.tar")).is_err());
    spec.files = vec![ImageFile::bytes("/a/../../etc/x", "x", 0o644)];
    assert!(build_image(&spec, &dir.path().join("x.tar")).is_err());
    spec.files = vec![ImageFile::bytes("relative", "x", 0o644)];
    assert!(build_image(&spec, &dir.path().join("x.tar")).is_err());
    // A directory given explicitly for its mode, before or after its children.
    spec.files = vec![
        ImageFile::bytes("/t/x", "x", 0o644),
        ImageFile::dir("/t", 0o1777),
    ];
    build_image(&spec, &dir.path().join("ok.tar")).unwrap();
}

#[test]
fn pause_is_static_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("pause");
    compile_static(&stand_ins().pause_c, &bin).unwrap();
    assert!(shared_libs(&bin).unwrap().is_empty(), "pause is not static");
    let out = Command::new(&bin).arg("-v").output().unwrap();
    assert!(out.status.success());
    let mut child = Command::new(&bin)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100));
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert_eq!(child.wait().unwrap().code(), Some(0));

    // And the image around it.
    let specs = specs_for(&stand_ins(), &ImageNames::default()).unwrap();
    let pause = specs.into_iter().find(|s| s.id == "pause").unwrap();
    let built = build_image(&pause, &dir.path().join("pause.tar")).unwrap();
    assert!(built.size < 2 << 20, "pause image is {} bytes", built.size);
}

#[test]
fn shared_libs_of_the_test_binary() {
    let libs = shared_libs(&std::env::current_exe().unwrap()).unwrap();
    assert!(libs.iter().any(|l| l.ends_with("libc.so.6")), "{libs:?}");
    assert!(
        libs.iter().all(|l| l.is_absolute() && l.is_file()),
        "{libs:?}"
    );
}

/// Runs `cmd`, killing it after `secs`.
fn bounded(cmd: &mut Command, secs: u64) -> std::process::Output {
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = done.clone();
    let killer = std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
        while std::time::Instant::now() < deadline {
            if flag.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    });
    let out = child.wait_with_output().unwrap();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    killer.join().unwrap();
    out
}

/// A throw-away containerd (its own root, state and socket under a temp dir, CRI off), killed
/// when dropped.
struct Containerd {
    child: std::process::Child,
    sock: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn throwaway_containerd() -> Option<Containerd> {
    if !have("containerd") || !have("ctr") {
        shim_harness::skip("containerd/ctr not installed (apt-get install -y containerd runc)");
        return None;
    }
    if !is_root() {
        shim_harness::skip("containerd needs root");
        return None;
    }
    // Short: the socket path must fit in sun_path.
    let dir = tempfile::Builder::new()
        .prefix("ctd")
        .tempdir_in("/tmp")
        .unwrap();
    let d = dir.path().display();
    let sock = dir.path().join("c.sock");
    let config = format!(
        "version = 2\nroot = \"{d}/root\"\nstate = \"{d}/state\"\n\
         disabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\
         [grpc]\n  address = \"{d}/c.sock\"\n[ttrpc]\n  address = \"{d}/c.sock.ttrpc\"\n\
         [plugins.\"io.containerd.internal.v1.opt\"]\n  path = \"{d}/opt\"\n"
    );
    std::fs::write(dir.path().join("config.toml"), config).unwrap();
    let log = std::fs::File::create(dir.path().join("containerd.log")).unwrap();
    let child = Command::new("containerd")
        .arg("--config")
        .arg(dir.path().join("config.toml"))
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let ctd = Containerd {
        child,
        sock,
        _dir: dir,
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        if ctd.sock.exists()
            && bounded(
                Command::new("ctr").arg("-a").arg(&ctd.sock).arg("version"),
                5,
            )
            .status
            .success()
        {
            return Some(ctd);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "containerd did not come up: {}",
            std::fs::read_to_string(ctd._dir.path().join("containerd.log")).unwrap_or_default()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

#[test]
fn containerd_imports_the_archive_under_every_name() {
    let Some(ctd) = throwaway_containerd() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let host = dir.path().join("tool");
    std::fs::write(&host, b"#!/bin/sh\necho tool\n").unwrap();
    let spec = sample_spec(&host);
    let built = build_image(&spec, &dir.path().join("sample.tar")).unwrap();
    // The native snapshotter works on any file system; the nodes' overlayfs unpack is the
    // same layer.
    let out = bounded(
        &mut ctr_import(&ctd.sock, &["--snapshotter", "native"], &built.tar),
        60,
    );
    assert!(
        out.status.success(),
        "ctr import: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let ls = bounded(
        Command::new("ctr")
            .arg("-a")
            .arg(&ctd.sock)
            .args(["-n", "k8s.io", "images", "ls"]),
        30,
    );
    let text = String::from_utf8_lossy(&ls.stdout);
    for name in &spec.names {
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("{name} not imported:\n{text}"));
        assert!(line.contains(&built.manifest_digest), "{line}");
        assert!(line.contains("linux/"), "{line}");
    }
    // Unpacked: the snapshot of the image's layer exists.
    let check = bounded(
        Command::new("ctr")
            .arg("-a")
            .arg(&ctd.sock)
            .args(["-n", "k8s.io", "images", "check", "--quiet"]),
        30,
    );
    assert!(check.status.success());
    let snaps = bounded(
        Command::new("ctr").arg("-a").arg(&ctd.sock).args([
            "-n",
            "k8s.io",
            "snapshots",
            "--snapshotter",
            "native",
            "ls",
        ]),
        30,
    );
    assert!(
        String::from_utf8_lossy(&snaps.stdout).contains("Committed"),
        "no unpacked snapshot:\n{}",
        String::from_utf8_lossy(&snaps.stdout)
    );
}

/// The real images from the real build outputs (needs `make build` first and a static busybox):
/// `cargo test -p tessera-e2e --lib images::tests::build_all_from_the_workspace -- --ignored
/// --nocapture` prints what was built, how big, and how long it took (into a temporary
/// directory, removed afterwards), then fills [`default_out_dir`], the clusters' cache.
#[test]
#[ignore = "needs the workspace's build outputs and the control plane"]
fn build_all_from_the_workspace() {
    let a = crate::artifacts::artifacts().unwrap();
    // A fresh directory, so the first pass builds everything.
    let dir = tempfile::tempdir_in(crate::artifacts::workspace_root().join("target")).unwrap();
    let out = dir.path().to_owned();
    for pass in ["fresh", "reused"] {
        let t = std::time::Instant::now();
        let built = build_all(a, &ImageNames::default(), &out).unwrap();
        eprintln!("{pass}: {:.2?}", t.elapsed());
        for b in &built {
            eprintln!(
                "  {:<22} {:>6.1} MiB reused={} {} {}",
                b.id,
                b.size as f64 / (1 << 20) as f64,
                b.reused,
                b.manifest_digest,
                b.tar.display()
            );
            let ar = read_archive(&b.tar).unwrap();
            assert!(ar.blobs.values().all(|(_, ok)| *ok));
        }
    }
    // And the clusters' cache, warm for the next run.
    let built = build_all(a, &ImageNames::default(), &default_out_dir()).unwrap();
    eprintln!("{}", built[0].tar.parent().unwrap().display());
}
