//! A container's (or a DRA claim's) cache directory on the host, with a size limit (issue 28,
//! item 5). The directory is a host path the container writes (the shim's region file lives
//! there), so without a limit a container could fill the node's disk outside its
//! ephemeral-storage accounting. With a limit the plugin mounts a tmpfs of that size and inode
//! count on the directory: writes beyond it fail with `ENOSPC` inside the container, and the
//! pages are charged to the memory cgroup of the process that writes them (the container's),
//! not to the node.
//!
//! The mount must reach the host's mount table, where the kubelet resolves the directory it
//! bind-mounts into the container: the plugin's host directory needs
//! `mountPropagation: Bidirectional`. The plugin checks that (the host's `/proc/1/mountinfo`,
//! with `hostPID`) after every mount: a mount the host cannot see would hide the region from
//! the plugin (the container would write the directory underneath), so it is undone and the
//! directory stays unlimited, which the caller reports.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// The limit of one cache directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheDirLimit {
    /// Bytes the directory may hold (the tmpfs `size`).
    pub bytes: u64,
    /// Files and directories it may hold (the tmpfs `nr_inodes`, the root included).
    pub inodes: u64,
}

/// The command-line flags of the limit, shared by the device plugin (a container's directory)
/// and the DRA plugin (a claim's).
#[derive(Debug, Clone, clap::Args)]
#[command(about = None, long_about = None)]
pub struct CacheDirArgs {
    /// MiB each cache directory may hold (a container's `<hook>/vgpu/containers/<pod>_<ctr>`, a
    /// DRA claim's `<hook>/vgpu/claims/<uid>`, where the shim keeps its region): a tmpfs of that
    /// size is mounted there when the container is allocated or the claim prepared, its pages
    /// charged to the memory of the container that writes them. 0: a plain directory, no limit.
    /// Needs the host directory mounted with `mountPropagation: Bidirectional`; without it the
    /// directory stays unlimited and the plugin says so.
    #[arg(long, env = "CACHE_DIR_LIMIT_MIB", default_value_t = 0)]
    pub cache_dir_limit_mib: u64,
    /// Files (and directories) each cache directory may hold, with `--cache-dir-limit-mib`.
    #[arg(long, env = "CACHE_DIR_LIMIT_FILES", default_value_t = 32)]
    pub cache_dir_limit_files: u64,
}

impl CacheDirArgs {
    /// The directories these flags ask for; `proc_root` is the host's `/proc` (`hostPID`), where
    /// the host's mount table is read.
    pub fn cache_dirs(&self, proc_root: &Path) -> CacheDirs {
        // The host's mount table: where the kubelet resolves the directory it mounts.
        let host_mountinfo = proc_root.join("1/mountinfo");
        match self.cache_dir_limit_mib {
            0 => CacheDirs {
                host_mountinfo,
                ..CacheDirs::default()
            },
            mib => CacheDirs::limited(
                CacheDirLimit {
                    bytes: mib.saturating_mul(1 << 20),
                    inodes: self.cache_dir_limit_files,
                },
                host_mountinfo,
            ),
        }
    }
}

/// How the directories are prepared: where the host's mount table is read, and the limit.
#[derive(Debug, Clone)]
pub struct CacheDirs {
    /// `None`: plain directories (no limit).
    pub limit: Option<CacheDirLimit>,
    /// The host's mount table (`/proc/1/mountinfo` with `hostPID`).
    pub host_mountinfo: PathBuf,
    /// Whether [`CacheDirs::prepare_reported`] has warned that the limit cannot be applied.
    said_unlimited: Arc<AtomicBool>,
    /// The host saw one of these mounts: propagation is a property of the plugin's host
    /// directory (its peer group), which only the host's root changes, so later mounts are not
    /// checked again (reading the host's mount table costs milliseconds while containers start).
    host_sees_mounts: Arc<AtomicBool>,
}

impl Default for CacheDirs {
    fn default() -> Self {
        CacheDirs {
            limit: None,
            host_mountinfo: PathBuf::from("/proc/1/mountinfo"),
            said_unlimited: Arc::default(),
            host_sees_mounts: Arc::default(),
        }
    }
}

/// What [`CacheDirs::prepare`] made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prepared {
    /// A plain directory: no limit was asked for.
    Plain,
    /// A tmpfs of the limit's size, which the host sees.
    Limited,
    /// The limit could not be applied (why); the directory is plain.
    Unlimited(String),
}

impl CacheDirs {
    /// Directories limited to `limit`, checked against the host mount table at `host_mountinfo`.
    pub fn limited(limit: CacheDirLimit, host_mountinfo: PathBuf) -> CacheDirs {
        CacheDirs {
            limit: Some(limit),
            host_mountinfo,
            said_unlimited: Arc::default(),
            host_sees_mounts: Arc::default(),
        }
    }

    /// [`CacheDirs::prepare`], and a limit that cannot be applied, which leaves the directory
    /// unlimited, said once as a warning (a node whose plugin lacks the mount propagation says
    /// so at its first GPU pod or claim), then at debug level.
    pub fn prepare_reported(&self, dir: &Path) -> io::Result<()> {
        if let Prepared::Unlimited(why) = self.prepare(dir)? {
            let dir = dir.display();
            if self.said_unlimited.swap(true, Ordering::Relaxed) {
                tracing::debug!(%dir, "cache directory not limited: {why}");
            } else {
                tracing::warn!(%dir, "cache directories are not size-limited on this node: {why}");
            }
        }
        Ok(())
    }

    /// Empties and (re)creates `dir`, mode 0777 (the shim runs as the container's user, which
    /// the plugin does not know), with the limit when one is set. An existing mount on `dir`
    /// (a previous `Allocate` of the same container) is detached first.
    pub fn prepare(&self, dir: &Path) -> io::Result<Prepared> {
        remove(dir)?;
        std::fs::create_dir_all(dir)?;
        set_mode_0777(dir)?;
        let Some(limit) = self.limit else {
            return Ok(Prepared::Plain);
        };
        if let Err(e) = mount_tmpfs(dir, limit) {
            return Ok(Prepared::Unlimited(format!("mounting a tmpfs failed: {e}")));
        }
        let seen = if self.host_sees_mounts.load(Ordering::Relaxed) {
            Ok(true)
        } else {
            host_sees(&self.host_mountinfo, dir)
        };
        match seen {
            Ok(true) => {
                self.host_sees_mounts.store(true, Ordering::Relaxed);
                set_mode_0777(dir)?;
                Ok(Prepared::Limited)
            }
            seen => {
                let why = match seen {
                    Ok(_) => "the host does not see the mount (the plugin's host directory \
                              needs mountPropagation: Bidirectional)"
                        .to_owned(),
                    Err(e) => format!(
                        "the host's mount table ({}) cannot be read: {e}",
                        self.host_mountinfo.display()
                    ),
                };
                unmount(dir)?;
                Ok(Prepared::Unlimited(why))
            }
        }
    }
}

fn set_mode_0777(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777))
}

/// Removes a cache directory and everything in it, unmounting a tmpfs there first (detached:
/// a container that still has it open keeps its view until it exits). Links are removed, never
/// followed. A directory that does not exist is not an error.
pub fn remove(dir: &Path) -> io::Result<()> {
    match dir.symlink_metadata() {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
        Ok(m) if !m.is_dir() => return std::fs::remove_file(dir),
        Ok(_) => {}
    }
    if is_mount_point(dir)? {
        unmount(dir)?;
    }
    std::fs::remove_dir_all(dir)
}

/// Whether `dir` is on another file system than its parent (a mount point).
fn is_mount_point(dir: &Path) -> io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let Some(parent) = dir.parent() else {
        return Ok(true);
    };
    Ok(dir.symlink_metadata()?.dev() != parent.symlink_metadata()?.dev())
}

fn mount_tmpfs(dir: &Path, limit: CacheDirLimit) -> io::Result<()> {
    use nix::mount::MsFlags;
    let options = format!(
        "size={},nr_inodes={},mode=0777",
        limit.bytes.max(4096),
        limit.inodes.max(2)
    );
    nix::mount::mount(
        Some("tessera-cache"),
        dir,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some(options.as_str()),
    )
    .map_err(io::Error::from)
}

/// Detached (`MNT_DETACH`): the mount leaves the tree now and goes when its last user does; a
/// link planted at the path is not followed (`UMOUNT_NOFOLLOW`).
fn unmount(dir: &Path) -> io::Result<()> {
    use nix::mount::MntFlags;
    nix::mount::umount2(dir, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW)
        .map_err(io::Error::from)
}

/// Whether the mount table at `mountinfo` has a mount point at `dir` (field 5 of
/// `/proc/<pid>/mountinfo`, with the kernel's octal escapes).
fn host_sees(mountinfo: &Path, dir: &Path) -> io::Result<bool> {
    let text = std::fs::read_to_string(mountinfo)?;
    let want = dir.to_string_lossy();
    Ok(mount_points(&text).any(|p| p == want))
}

/// The mount points of a `mountinfo` text, unescaped (`\040` is a space, and so on).
pub fn mount_points(mountinfo: &str) -> impl Iterator<Item = String> + '_ {
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(unescape_octal)
}

fn unescape_octal(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let value = bytes[i + 1..i + 4]
                .iter()
                .fold(0u32, |acc, b| acc * 8 + u32::from(b - b'0'));
            out.push(u8::try_from(value).unwrap_or(b'?'));
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_points_are_field_five_unescaped() {
        let text = "22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda rw\n\
                    90 22 0:50 / /usr/local/vgpu/containers/u_main rw,nosuid - tmpfs tessera-cache rw,size=8192k\n\
                    91 22 0:51 / /a\\040b rw - tmpfs x rw\n\
                    short line\n";
        let points: Vec<String> = mount_points(text).collect();
        assert_eq!(points, ["/", "/usr/local/vgpu/containers/u_main", "/a b"]);
    }

    #[test]
    fn unescaping_leaves_other_backslashes_alone() {
        assert_eq!(unescape_octal("a\\134b"), "a\\b");
        assert_eq!(unescape_octal("a\\9b\\"), "a\\9b\\");
        assert_eq!(unescape_octal("\\04"), "\\04");
    }

    /// Without a limit: a plain 0777 directory, emptied on a second prepare; removal of a
    /// directory holding a link removes the link, never its target.
    #[test]
    fn plain_directories_are_emptied_and_removed_without_following_links() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("u_main");
        let dirs = CacheDirs::default();
        assert_eq!(dirs.prepare(&dir).unwrap(), Prepared::Plain);
        let mode = dir.symlink_metadata().unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o777);
        std::fs::write(dir.join("junk"), b"x").unwrap();
        assert_eq!(dirs.prepare(&dir).unwrap(), Prepared::Plain);
        assert!(!dir.join("junk").exists());
        let victim = root.path().join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join("link")).unwrap();
        remove(&dir).unwrap();
        assert!(!dir.exists());
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        remove(&dir).unwrap();
    }

    /// With a limit (as root, which CI is): writes stop at the limit with ENOSPC, files at the
    /// inode count; the host's mount table is read until it once showed a mount; one that does not list the mount undoes it, and the
    /// directory is plain and says why.
    #[test]
    fn a_limited_directory_stops_writes_at_its_size_and_an_unseen_mount_is_undone() {
        if !nix::unistd::geteuid().is_root() {
            shim_free_skip("mounting a tmpfs needs root");
            return;
        }
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("u_main");
        let limit = CacheDirLimit {
            bytes: 1 << 20,
            inodes: 8,
        };
        let dirs = CacheDirs::limited(limit, PathBuf::from("/proc/self/mountinfo"));
        assert_eq!(dirs.prepare(&dir).unwrap(), Prepared::Limited);
        let big = vec![7u8; 2 << 20];
        let err = std::fs::write(dir.join("big"), &big).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
        std::fs::remove_file(dir.join("big")).unwrap();
        let made = (0..20)
            .take_while(|i| std::fs::write(dir.join(format!("f{i}")), b"x").is_ok())
            .count();
        assert!(made < 8, "{made} files in an 8-inode directory");
        remove(&dir).unwrap();
        assert!(!dir.exists());

        // Once the host saw a mount, later ones are not checked again (no mount table read).
        let checked_once = CacheDirs {
            host_mountinfo: root.path().join("no-such-mountinfo"),
            ..dirs.clone()
        };
        assert_eq!(checked_once.prepare(&dir).unwrap(), Prepared::Limited);
        remove(&dir).unwrap();

        // A mount table that does not list the directory: the mount is undone.
        let elsewhere = root.path().join("mountinfo");
        std::fs::write(&elsewhere, "22 1 0:21 / / rw - ext4 /dev/vda rw\n").unwrap();
        let blind = CacheDirs::limited(limit, elsewhere);
        let Prepared::Unlimited(why) = blind.prepare(&dir).unwrap() else {
            panic!("an unseen mount was kept");
        };
        assert!(why.contains("Bidirectional"), "{why}");
        assert!(!is_mount_point(&dir).unwrap());
        std::fs::write(dir.join("big"), &big).unwrap();
        remove(&dir).unwrap();
    }

    fn shim_free_skip(why: &str) {
        assert!(
            std::env::var("TESSERA_NO_SKIP").as_deref() != Ok("1"),
            "skipped: {why} (TESSERA_NO_SKIP=1: a skip is a failure)"
        );
        eprintln!("skip: {why}");
    }
}
