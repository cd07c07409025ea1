//! The container's files on the host: the shim's path, the cache directory and the limits file
//! that the responses of [`tessera_node_core::container_env`] name. Shared by `Allocate` and the
//! DRA plugin's prepare. The pure part is re-exported here, so one path names both.

pub use tessera_node_core::container_env::*;

/// The host path of the shim under `hook_path`: the versioned library when the installer put one
/// there (`libvgpu.so.<plugin version>`), else `libvgpu.so`. Reads the file system.
pub fn resolve_shim_host_path(hook_path: &str) -> String {
    let vgpu_dir = format!("{}/vgpu", hook_path.trim_end_matches('/'));
    let versioned = format!("{vgpu_dir}/libvgpu.so.{}", env!("CARGO_PKG_VERSION"));
    if std::path::Path::new(&versioned).exists() {
        versioned
    } else {
        format!("{vgpu_dir}/libvgpu.so")
    }
}

/// Writes `file` as a new root-owned (the plugin's user) 0444 file: never through a symlink or
/// over an existing file (`O_CREAT | O_EXCL | O_NOFOLLOW`), mode set on the new file whatever the
/// umask. The directory is the one `Allocate` has just emptied and created.
pub fn write_limits_file(file: &LimitsFile) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o444)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&file.host_path)?;
    f.write_all(file.content.as_bytes())?;
    f.set_permissions(std::fs::Permissions::from_mode(0o444))?;
    f.sync_all()
}

#[cfg(test)]
mod tests {
    use hami_contract::devices::ContainerDevice;

    use super::*;

    #[test]
    fn the_limits_file_is_written_new_read_only_and_never_through_a_link() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = tempfile::tempdir().unwrap();
        let s = crate::testing::response_settings(dir.path());
        let target = ContainerTarget {
            pod_uid: "0f1e2d3c-aaaa-bbbb-cccc-000000000001".into(),
            container_name: "trainer".into(),
            disable_control: false,
            cache_id: "4f1c0000-0000-4000-8000-000000000000".into(),
            host_oversubscription: false,
        };
        let booked = [ContainerDevice::nvidia("GPU-aaa", 1024, 30)];
        let r = container_response(&booked, &target, &s).unwrap();
        std::fs::create_dir_all(&r.cache_dir).unwrap();
        write_limits_file(&r.limits_file).unwrap();
        let m = std::fs::metadata(&r.limits_file.host_path).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o444);
        // Owned by the plugin's user (root in the DaemonSet), like the directory it created.
        assert_eq!(m.uid(), std::fs::metadata(dir.path()).unwrap().uid());
        assert_eq!(
            std::fs::read_to_string(&r.limits_file.host_path).unwrap(),
            r.limits_file.content
        );
        assert!(
            r.limits_file
                .content
                .contains("CUDA_DEVICE_MEMORY_LIMIT_0=1024m\n")
        );
        // An existing file or a planted symlink is an error, never followed or overwritten.
        assert!(write_limits_file(&r.limits_file).is_err());
        std::fs::remove_file(&r.limits_file.host_path).unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "keep").unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::symlink(&victim, &r.limits_file.host_path).unwrap();
        assert!(write_limits_file(&r.limits_file).is_err());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
    }
}
