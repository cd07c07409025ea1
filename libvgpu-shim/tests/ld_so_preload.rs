//! Loading through `/etc/ld.so.preload`, as the device plugin mounts it into containers, rather
//! than `LD_PRELOAD`. The file is written inside a private mount namespace (an overlay on `/etc`
//! that only the probe sees), so the test never touches the host's `/etc`.

use std::process::Command;

use shim_harness::*;

#[test]
fn limit_is_enforced_when_loaded_from_etc_ld_so_preload() {
    let a = artifacts();
    let host_file = std::path::Path::new("/etc/ld.so.preload");
    let host_file_existed = host_file.exists();
    let dir = tempfile::tempdir().unwrap();
    let (upper, work) = (dir.path().join("upper"), dir.path().join("work"));
    std::fs::create_dir_all(&upper).unwrap();
    std::fs::create_dir_all(&work).unwrap();
    let limit = (64 * MIB).to_string();

    // The same probe as the LD_PRELOAD tests, minus LD_PRELOAD.
    let mut probe_cmd = probe(
        &dir.path().join("region.cache"),
        &[("CUDA_DEVICE_MEMORY_LIMIT", "64m")],
        &["limit", &limit],
    );
    probe_cmd.env_remove("LD_PRELOAD");
    let script = format!(
        "set -e; mount -t overlay overlay -o lowerdir=/etc,upperdir={},workdir={} /etc; \
         echo {} > /etc/ld.so.preload; exec \"$@\"",
        upper.display(),
        work.display(),
        a.shim.display()
    );
    let mut cmd = Command::new("unshare");
    cmd.args([
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        &script,
        "sh",
    ])
    .arg(probe_cmd.get_program())
    .args(probe_cmd.get_args());
    cmd.env_clear();
    for (k, v) in probe_cmd.get_envs() {
        if let Some(v) = v {
            cmd.env(k, v);
        }
    }
    let out = cmd.output().expect("run unshare");
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Only a user without the right to make mount namespaces may skip; CI runs as root.
    // SAFETY: getuid has no preconditions.
    let root = unsafe { libc::getuid() } == 0;
    if !root && !out.status.success() && stderr.contains("unshare") {
        shim_harness::skip(&format!(
            "private mount namespaces need root here: {stderr}"
        ));
        return;
    }
    // The probe fails unless the allocation one byte past 64 MiB is refused, i.e. unless the
    // shim was loaded from the file.
    assert_ok(&out);
    assert_eq!(
        host_file.exists(),
        host_file_existed,
        "the host's /etc was touched"
    );
}
