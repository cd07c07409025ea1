//! The release's images and SBOMs, from binaries built per platform (`scripts/release.sh` runs
//! `tessera-release images`): the e2e image builder ([`crate::images`]) made a release tool.
//!
//! Each image is one OCI archive holding an image index of every platform built, labelled with
//! the version, the commit and its time (`org.opencontainers.image.*`), its `created` time the
//! commit's, so the same commit gives the same digests. The libraries of the distroless base come
//! from Debian: the host's for amd64 (`ldd`), `libc6-arm64-cross` for arm64 (resolved from the
//! binaries' `NEEDED` entries with `readelf`, which reads any architecture's ELF).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use oci_spec::image::Arch;

use crate::images::{
    self, BuiltImage, DISTROLESS_PATH, DISTROLESS_SSL, ImageError, ImageFile, ImageMeta, ImageSpec,
    io, msg as err,
};

/// Where Tessera's images are published (the chart's default registry and repositories).
pub const REGISTRY: &str = "ghcr.io/tessera-gpu";
/// Where Debian's arm64 cross C library lives on an amd64 build machine.
pub const ARM64_SYSROOT_LIB: &str = "/usr/aarch64-linux-gnu/lib";

/// One platform's build outputs.
#[derive(Debug, Clone)]
pub struct PlatformBuild {
    /// `amd64` or `arm64` (OCI's names).
    pub arch: String,
    /// tessera-scheduler, tessera-device-plugin, tessera-dra-plugin, libvgpu.so and, optionally,
    /// libvgpu-musl.so.
    pub bin_dir: PathBuf,
    /// A static busybox of that architecture (the chart's init container installs the shim with
    /// it).
    pub busybox: PathBuf,
}

fn oci_arch(arch: &str) -> Result<Arch, ImageError> {
    match arch {
        "amd64" => Ok(Arch::Amd64),
        "arm64" => Ok(Arch::ARM64),
        other => Err(err(format!("unknown architecture {other} (amd64, arm64)"))),
    }
}

/// `readelf -d -l -W`: the program interpreter and the `NEEDED` libraries of an ELF file.
fn elf_needs(binary: &Path) -> Result<(Option<String>, Vec<String>), ImageError> {
    let out = Command::new("readelf")
        .args(["-d", "-l", "-W"])
        .arg(binary)
        .output()
        .map_err(|e| err(format!("running readelf on {}: {e}", binary.display())))?;
    if !out.status.success() {
        return Err(err(format!(
            "readelf {}: {}",
            binary.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let bracketed = |line: &str, after: &str| {
        line.split_once(after)
            .and_then(|(_, rest)| rest.split(']').next())
            .map(str::to_owned)
    };
    let interp = text
        .lines()
        .find_map(|l| bracketed(l, "Requesting program interpreter: "));
    let needed = text
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| bracketed(l, "Shared library: ["))
        .collect();
    Ok((interp, needed))
}

/// The loader and libraries `binaries` need from a foreign sysroot, as image files: each library
/// at `<image_dir>/<name>` (where the loader looks), the loader at its own path.
fn foreign_libs(
    binaries: &[&Path],
    sysroot_lib: &Path,
    image_dir: &str,
) -> Result<Vec<ImageFile>, ImageError> {
    let mut files = BTreeMap::new();
    let mut queue: Vec<PathBuf> = binaries.iter().map(|b| b.to_path_buf()).collect();
    let mut seen = BTreeSet::new();
    while let Some(elf) = queue.pop() {
        let (interp, needed) = elf_needs(&elf)?;
        if let Some(interp) = interp {
            let name = Path::new(&interp)
                .file_name()
                .ok_or_else(|| err(format!("interpreter {interp}")))?;
            files.insert(interp.clone(), sysroot_lib.join(name));
        }
        for name in needed {
            // Driver libraries are the container runtime's to mount.
            if name.starts_with("libcuda.so") || name.starts_with("libnvidia-ml.so") {
                continue;
            }
            let host = sysroot_lib.join(&name);
            if !host.exists() {
                return Err(err(format!(
                    "{} needs {name}, which {} does not have",
                    elf.display(),
                    sysroot_lib.display()
                )));
            }
            files.insert(format!("{image_dir}/{name}"), host.clone());
            if seen.insert(name) {
                queue.push(host);
            }
        }
    }
    Ok(files
        .into_iter()
        .map(|(path, host)| ImageFile::host(path, host, 0o755))
        .collect())
}

/// The distroless/cc base for `binaries` of `arch`.
fn base(arch: &str, binaries: &[&Path]) -> Result<Vec<ImageFile>, ImageError> {
    match arch {
        "amd64" if std::env::consts::ARCH == "x86_64" => images::distroless_cc(binaries),
        "arm64" => {
            let mut files = images::distroless_static();
            files.extend(foreign_libs(
                binaries,
                Path::new(ARM64_SYSROOT_LIB),
                "/lib/aarch64-linux-gnu",
            )?);
            Ok(files)
        }
        other => Err(err(format!(
            "cannot assemble a {other} image on {}",
            std::env::consts::ARCH
        ))),
    }
}

/// The images of one platform: the device plugin (with the DRA plugin, the shims and busybox)
/// and the scheduler extender, as `docker/*.Dockerfile` build them, the simulated GPUs' fake
/// driver (`simulated/` of the binaries; the chart's `simulatedGpus`) and the probe workload
/// their example runs (`simulated/cuda_probe`).
pub fn platform_specs(p: &PlatformBuild, version: &str) -> Result<[ImageSpec; IMAGES], ImageError> {
    let bin = |name: &str| {
        let path = p.bin_dir.join(name);
        if path.is_file() {
            Ok(path)
        } else {
            Err(err(format!("{} is missing", path.display())))
        }
    };
    let (plugin, dra, shim, scheduler) = (
        bin("tessera-device-plugin")?,
        bin("tessera-dra-plugin")?,
        bin("libvgpu.so")?,
        bin("tessera-scheduler")?,
    );
    let env = vec![DISTROLESS_PATH.to_owned(), DISTROLESS_SSL.to_owned()];
    let mut dp_files = base(&p.arch, &[&plugin, &dra, &shim])?;
    dp_files.extend([
        ImageFile::host("/usr/bin/tessera-device-plugin", &plugin, 0o755),
        ImageFile::host("/usr/bin/tessera-dra-plugin", &dra, 0o755),
        ImageFile::host("/opt/tessera/lib/libvgpu.so", &shim, 0o644),
        ImageFile::host("/opt/tessera/bin/busybox", &p.busybox, 0o755),
    ]);
    let musl = p.bin_dir.join("libvgpu-musl.so");
    if musl.is_file() {
        dp_files.push(ImageFile::host(
            "/opt/tessera/lib/musl/libvgpu.so",
            musl,
            0o644,
        ));
    }
    let device_plugin = ImageSpec {
        id: "tessera-device-plugin".into(),
        names: vec![format!("{REGISTRY}/tessera-device-plugin:{version}")],
        files: dp_files,
        user: None,
        entrypoint: vec!["/usr/bin/tessera-device-plugin".into()],
        cmd: vec![],
        exposed_ports: vec!["9394/tcp".into()],
        env: env.clone(),
        working_dir: None,
    };
    let mut sched_files = base(&p.arch, &[&scheduler])?;
    sched_files.push(ImageFile::host(
        "/usr/bin/tessera-scheduler",
        &scheduler,
        0o755,
    ));
    let scheduler = ImageSpec {
        id: "tessera-scheduler".into(),
        names: vec![format!("{REGISTRY}/tessera-scheduler:{version}")],
        files: sched_files,
        user: Some("65532:65532".into()),
        entrypoint: vec!["/usr/bin/tessera-scheduler".into()],
        cmd: vec!["serve".into()],
        exposed_ports: vec!["443/tcp".into(), "9395/tcp".into()],
        env,
        working_dir: None,
    };
    let (libcuda, libnvml) = (
        bin("simulated/libcuda.so.1")?,
        bin("simulated/libnvidia-ml.so.1")?,
    );
    let simulated_gpu = images::simulated_gpu_spec(
        vec![format!("{REGISTRY}/tessera-simulated-gpu:{version}")],
        &libcuda,
        &libnvml,
        &p.busybox,
    );
    let probe = bin("simulated/cuda_probe")?;
    let mut gpu_probe = images::gpu_probe_spec(
        vec![format!(
            "{REGISTRY}/{}:{version}",
            images::GPU_PROBE_REPOSITORY
        )],
        base(&p.arch, &[&probe, &shim, &libcuda, &libnvml])?,
        &probe,
        &p.busybox,
        vec![DISTROLESS_PATH.to_owned()],
    );
    gpu_probe.id = images::GPU_PROBE_REPOSITORY.into();
    Ok([device_plugin, scheduler, simulated_gpu, gpu_probe])
}

/// How many images a release has.
const IMAGES: usize = 4;

/// The workspace packages whose code an image carries (`platform_specs`' order), for its SBOM
/// (the probe is C: no crate).
const IMAGE_PACKAGES: [&[&str]; IMAGES] = [
    &[
        "tessera-device-plugin",
        "tessera-dra-plugin",
        "libvgpu-shim",
    ],
    &["tessera-scheduler"],
    &["fake-cuda", "fake-nvml"],
    &[],
];

/// What the release says of itself in every image.
#[derive(Debug, Clone)]
pub struct Release {
    pub version: String,
    pub revision: String,
    /// RFC 3339: the commit's time.
    pub created: String,
    pub source: String,
}

impl Release {
    fn meta(&self, arch: &str, title: &str) -> Result<ImageMeta, ImageError> {
        let labels: HashMap<String, String> = [
            ("org.opencontainers.image.title", title),
            ("org.opencontainers.image.version", &self.version),
            ("org.opencontainers.image.revision", &self.revision),
            ("org.opencontainers.image.created", &self.created),
            ("org.opencontainers.image.source", &self.source),
            ("org.opencontainers.image.licenses", "Apache-2.0"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        Ok(ImageMeta {
            arch: Some(oci_arch(arch)?),
            created: Some(self.created.clone()),
            labels,
        })
    }
}

/// Builds every image for every platform into `<out>/images/<image>.tar` and its SBOM into
/// `<out>/sbom/<image>.cdx.json`; returns the images.
pub fn build_release_images(
    release: &Release,
    platforms: &[PlatformBuild],
    out: &Path,
) -> Result<Vec<BuiltImage>, ImageError> {
    let mut specs: Vec<(String, [ImageSpec; IMAGES])> = Vec::new();
    for p in platforms {
        specs.push((p.arch.clone(), platform_specs(p, &release.version)?));
    }
    for d in ["images", "sbom"] {
        std::fs::create_dir_all(out.join(d)).map_err(io(format!("creating {d}")))?;
    }
    let mut built = Vec::new();
    for i in 0..IMAGE_PACKAGES.len() {
        let id = specs[0].1[i].id.clone();
        let name = specs[0].1[i].names[0].clone();
        let per_platform: Vec<(&ImageSpec, ImageMeta)> = specs
            .iter()
            .map(|(arch, s)| Ok((&s[i], release.meta(arch, &id)?)))
            .collect::<Result<_, ImageError>>()?;
        let image = images::build_multi_platform(
            &id,
            &name,
            &release.version,
            &per_platform,
            &out.join("images").join(format!("{id}.tar")),
        )?;
        let sbom = sbom(release, &image, platforms, &specs, i)?;
        std::fs::write(out.join("sbom").join(format!("{id}.cdx.json")), sbom)
            .map_err(io(format!("writing the SBOM of {id}")))?;
        built.push(image);
    }
    Ok(built)
}

/// The Rust crates compiled into the binaries of an image, from `cargo tree` on the lockfile:
/// `(name, version, from crates.io)`.
fn crates_of(
    packages: &[&str],
    triple: &str,
) -> Result<BTreeSet<(String, String, bool)>, ImageError> {
    let mut cmd = Command::new("cargo");
    cmd.args([
        "tree", "--locked", "-e", "normal", "--prefix", "none", "--format", "{p}",
    ])
    .args(["--target", triple]);
    for p in packages {
        cmd.args(["-p", p]);
    }
    let out = cmd
        .output()
        .map_err(|e| err(format!("running cargo tree: {e}")))?;
    if !out.status.success() {
        return Err(err(format!(
            "cargo tree: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let name = words.next()?;
            let version = words.next()?.strip_prefix('v')?;
            let local = l.contains(" (/");
            Some((name.to_owned(), version.to_owned(), !local))
        })
        .collect())
}

/// The Debian package (and version) a host file of the image comes from, if any.
fn debian_package(path: &Path) -> Option<(String, String)> {
    // dpkg knows a file by the path its package installed it at: on a merged-/usr system that
    // may be the path as given (/lib/x86_64-linux-gnu/…) or its target (/usr/lib/…).
    let real = std::fs::canonicalize(path).ok()?;
    let line = [path, real.as_path()].into_iter().find_map(|p| {
        let out = Command::new("dpkg").arg("-S").arg(p).output().ok()?;
        let text = String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()?
            .to_owned();
        out.status.success().then_some(text)
    })?;
    let pkg = line.split(':').next()?.trim().to_owned();
    let qualified = line.split_once(": ")?.0.to_owned();
    let version = Command::new("dpkg-query")
        .args(["-W", "-f=${Version}"])
        .arg(&qualified)
        .output()
        .ok()?;
    Some((
        pkg,
        String::from_utf8_lossy(&version.stdout).trim().to_owned(),
    ))
}

/// A CycloneDX 1.5 SBOM of image `which` (its index in `platform_specs`): the Rust crates of
/// its binaries per platform and the Debian packages its base files come from.
fn sbom(
    release: &Release,
    image: &BuiltImage,
    platforms: &[PlatformBuild],
    specs: &[(String, [ImageSpec; IMAGES])],
    which: usize,
) -> Result<Vec<u8>, ImageError> {
    let packages = IMAGE_PACKAGES[which];
    let mut components: BTreeMap<String, serde_json::Value> = BTreeMap::new();
    for (p, (_, s)) in platforms.iter().zip(specs) {
        let triple = match p.arch.as_str() {
            "arm64" => "aarch64-unknown-linux-gnu",
            _ => "x86_64-unknown-linux-gnu",
        };
        let crates = if packages.is_empty() {
            BTreeSet::new()
        } else {
            crates_of(packages, triple)?
        };
        for (name, version, registry) in crates {
            let purl = format!("pkg:cargo/{name}@{version}");
            let mut c = serde_json::json!({
                "type": if packages.contains(&name.as_str()) { "application" } else { "library" },
                "name": name, "version": version, "bom-ref": purl.clone(),
            });
            if registry {
                c["purl"] = serde_json::Value::String(purl.clone());
            }
            components.insert(purl, c);
        }
        for f in &s[which].files {
            let images::ImageSource::HostFile(host) = &f.source else {
                continue;
            };
            if host.starts_with(&p.bin_dir) {
                continue;
            }
            if let Some((pkg, version)) = debian_package(host) {
                let purl = format!("pkg:deb/debian/{pkg}@{version}?arch={}", p.arch);
                components.insert(
                    purl.clone(),
                    serde_json::json!({"type": "library", "name": pkg, "version": version,
                                       "purl": purl.clone(), "bom-ref": purl}),
                );
            }
        }
    }
    let digest = image.manifest_digest.trim_start_matches("sha256:");
    // A serial number derived from the image digest: the same image, the same SBOM.
    let serial = format!(
        "urn:uuid:{}-{}-{}-{}-{}",
        &digest[0..8],
        &digest[8..12],
        &digest[12..16],
        &digest[16..20],
        &digest[20..32]
    );
    let doc = serde_json::json!({
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "serialNumber": serial,
        "version": 1,
        "metadata": {
            "timestamp": release.created,
            "tools": {"components": [{"type": "application", "name": "tessera-release", "version": release.version}]},
            "component": {
                "type": "container",
                "name": image.names[0].split(':').next().unwrap_or_default(),
                "version": release.version,
                "bom-ref": image.manifest_digest,
                "hashes": [{"alg": "SHA-256", "content": digest}],
                "properties": [{"name": "org.opencontainers.image.revision", "value": release.revision}],
            },
        },
        "components": components.into_values().collect::<Vec<_>>(),
    });
    serde_json::to_vec_pretty(&doc).map_err(|e| err(format!("SBOM: {e}")))
}

/// Rewrites a gzipped tar (`helm package`'s chart) with every entry's time set to `mtime` and
/// no time in the gzip header, so the archive depends only on its contents.
pub fn normalize_tgz(path: &Path, mtime: u64) -> Result<(), ImageError> {
    use std::io::{Read, Write};
    let at = |what: &str| io(format!("{what} {}", path.display()));
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).map_err(at("opening"))?)
        .read_to_end(&mut raw)
        .map_err(at("reading"))?;
    let mut entries = Vec::new();
    let mut archive = tar::Archive::new(raw.as_slice());
    for e in archive.entries().map_err(at("reading"))? {
        let mut e = e.map_err(at("reading"))?;
        let mut data = Vec::new();
        e.read_to_end(&mut data).map_err(at("reading"))?;
        let path = e.path().map_err(at("reading"))?.into_owned();
        entries.push((
            path,
            e.header().mode().unwrap_or(0o644),
            e.header().entry_type(),
            data,
        ));
    }
    let tmp = path.with_extension("tgz.tmp");
    {
        let file = std::fs::File::create(&tmp).map_err(at("creating"))?;
        let gz = flate2::GzBuilder::new()
            .mtime(0)
            .write(file, flate2::Compression::default());
        let mut b = tar::Builder::new(gz);
        for (p, mode, kind, data) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(kind);
            h.set_mode(mode);
            h.set_size(data.len() as u64);
            h.set_mtime(mtime);
            h.set_uid(0);
            h.set_gid(0);
            b.append_data(&mut h, p, data.as_slice())
                .map_err(at("writing"))?;
        }
        let mut gz = b.into_inner().map_err(at("writing"))?;
        gz.flush().map_err(at("writing"))?;
        gz.finish().map_err(at("writing"))?;
    }
    std::fs::rename(&tmp, path).map_err(at("renaming"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_loader_and_needed_libraries_are_read_from_any_elf() {
        // This test binary: dynamically linked on every supported build machine.
        let me = std::env::current_exe().expect("exe");
        let (interp, needed) = super::elf_needs(&me).expect("readelf");
        assert!(interp.is_some_and(|i| i.starts_with('/')));
        assert!(
            needed.iter().any(|n| n.starts_with("libc.so")),
            "{needed:?}"
        );
    }
}
