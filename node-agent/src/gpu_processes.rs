//! The edges the unaccounted-process check reads ([`crate::unaccounted`]): every process NVML
//! reports on a GPU, of every kind, and what `/proc/<pid>` says about a process (its cgroup's
//! pod and container, its PID inside its own PID namespace).
//!
//! * [`GpuProcessSource::processes_on`] lists one GPU's compute, graphics and MPS-client
//!   processes (nvml-wrapper 0.13 calls the `_v3` entry points), merged per PID. A list the
//!   GPU or driver does not offer (`NotSupported`, or a driver without the `_v3` symbol) is left
//!   out and named in [`ProcessesOnGpu::unsupported`], so the caller can say what it cannot see;
//!   any other NVML error fails the GPU. [`list_all`] does every GPU and never fails as a whole.
//! * [`ProcReader`] reads `<proc root>/<pid>/cgroup` and `<proc root>/<pid>/status` (the proc
//!   root is `/proc`, the host's with `hostPID`; tests use a temp dir): the PID directory must be
//!   a real directory and the file is opened with `O_NOFOLLOW`, must be a regular file, and is
//!   read to at most [`MAX_PROC_FILE`] bytes. [`ProcReader::identify_all`] gives the
//!   [`crate::unaccounted::Observation::identities`] map, leaving out PIDs it cannot read
//!   (they exited meanwhile), which the classifier then reports as undetermined.
//!
//! Blocking (NVML calls and file reads): the monitor runs these in `spawn_blocking`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;

pub use crate::pod_cgroup::ns_pid_from_status;
use crate::pod_cgroup::owner_from_proc_cgroup;
use crate::unaccounted::{GpuProcess, ProcessIdentity, ProcessKind};

/// Most bytes read of one `/proc/<pid>` file: `cgroup` is one line per hierarchy and `status`
/// about 1.5 KiB; anything past this is not looked at.
pub const MAX_PROC_FILE: u64 = 64 * 1024;

/// Why one GPU's processes could not be listed.
#[derive(Debug, thiserror::Error)]
pub enum GpuProcessError {
    #[error("NVML cannot find GPU {uuid}")]
    Device {
        uuid: String,
        #[source]
        source: NvmlError,
    },
    #[error("NVML cannot list the {} processes of GPU {uuid}", kind.as_str())]
    List {
        uuid: String,
        kind: ProcessKind,
        #[source]
        source: NvmlError,
    },
}

/// One GPU's processes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessesOnGpu {
    /// Every process, once per PID, with every list it was in; sorted by PID.
    pub processes: Vec<GpuProcess>,
    /// The lists this GPU or driver does not offer: processes of these kinds are not seen.
    pub unsupported: Vec<ProcessKind>,
}

/// Where the processes on a GPU come from: NVML, or a test's fake.
pub trait GpuProcessSource: Send + Sync {
    /// Every process on GPU `gpu_uuid`, of every kind NVML lists.
    fn processes_on(&self, gpu_uuid: &str) -> Result<ProcessesOnGpu, GpuProcessError>;
}

impl GpuProcessSource for Nvml {
    fn processes_on(&self, gpu_uuid: &str) -> Result<ProcessesOnGpu, GpuProcessError> {
        let device = self
            .device_by_uuid(gpu_uuid)
            .map_err(|source| GpuProcessError::Device {
                uuid: gpu_uuid.to_owned(),
                source,
            })?;
        let lists = [
            (ProcessKind::Compute, device.running_compute_processes()),
            (ProcessKind::Graphics, device.running_graphics_processes()),
            (ProcessKind::Mps, device.mps_running_compute_processes()),
        ];
        let mut found = Vec::new();
        let mut unsupported = Vec::new();
        for (kind, listed) in lists {
            match listed {
                Ok(infos) => found.extend(infos.into_iter().map(|info| (kind, info))),
                // A GPU without graphics or MPS, or a driver older than the `_v3` calls: that
                // list cannot be seen; the others still count.
                Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => {
                    unsupported.push(kind)
                }
                Err(source) => {
                    return Err(GpuProcessError::List {
                        uuid: gpu_uuid.to_owned(),
                        kind,
                        source,
                    });
                }
            }
        }
        Ok(ProcessesOnGpu {
            processes: merge_by_pid(gpu_uuid, found),
            unsupported,
        })
    }
}

/// NVML's entries of one GPU merged per PID: every kind it was listed as, the largest usage
/// NVML could tell (`None` if it could tell none).
pub fn merge_by_pid(
    gpu_uuid: &str,
    found: impl IntoIterator<Item = (ProcessKind, ProcessInfo)>,
) -> Vec<GpuProcess> {
    let mut by_pid: BTreeMap<u32, (Option<u64>, BTreeSet<ProcessKind>)> = BTreeMap::new();
    for (kind, info) in found {
        let used = match info.used_gpu_memory {
            UsedGpuMemory::Used(bytes) => Some(bytes),
            UsedGpuMemory::Unavailable => None,
        };
        let (most, kinds) = by_pid.entry(info.pid).or_default();
        *most = (*most).max(used);
        kinds.insert(kind);
    }
    by_pid
        .into_iter()
        .map(|(pid, (used_bytes, kinds))| GpuProcess {
            gpu_uuid: gpu_uuid.to_owned(),
            pid,
            used_bytes,
            kinds,
        })
        .collect()
}

/// Every GPU's processes, never failing as a whole.
#[derive(Debug, Default)]
pub struct NodeProcesses {
    /// Of every GPU that answered, sorted by GPU (in the order asked), then PID.
    pub processes: Vec<GpuProcess>,
    /// Lists a GPU does not offer, per GPU UUID.
    pub unsupported: Vec<(String, ProcessKind)>,
    /// GPUs whose processes could not be listed this pass.
    pub failed: Vec<GpuProcessError>,
}

/// [`GpuProcessSource::processes_on`] for each of `gpu_uuids`.
pub fn list_all(source: &dyn GpuProcessSource, gpu_uuids: &[String]) -> NodeProcesses {
    let mut out = NodeProcesses::default();
    for uuid in gpu_uuids {
        match source.processes_on(uuid) {
            Ok(on_gpu) => {
                out.processes.extend(on_gpu.processes);
                out.unsupported
                    .extend(on_gpu.unsupported.into_iter().map(|k| (uuid.clone(), k)));
            }
            Err(e) => out.failed.push(e),
        }
    }
    out
}

/// Why a `/proc/<pid>` file was not read.
#[derive(Debug, thiserror::Error)]
pub enum ProcReadError {
    #[error("PID 0 names no process")]
    PidZero,
    #[error("process {pid} is gone")]
    Gone { pid: u32 },
    #[error("{} is a symlink or not a directory, not a process's /proc entry", path.display())]
    NotProcDirectory { path: PathBuf },
    #[error("{} is a symlink or not a regular file", path.display())]
    NotRegularFile { path: PathBuf },
    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Reads processes' `/proc` entries under a root (`/proc`, or a test's directory).
#[derive(Debug, Clone)]
pub struct ProcReader {
    root: PathBuf,
}

impl Default for ProcReader {
    fn default() -> Self {
        ProcReader::new("/proc")
    }
}

impl ProcReader {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        ProcReader { root: root.into() }
    }

    /// The text of `/proc/<pid>/cgroup` (at most [`MAX_PROC_FILE`] bytes, invalid UTF-8
    /// replaced).
    pub fn read_cgroup(&self, pid: u32) -> Result<String, ProcReadError> {
        self.read(pid, "cgroup")
    }

    /// The PID of `pid` inside its own PID namespace (the last `NSpid` of `/proc/<pid>/status`),
    /// `None` when the kernel does not say (before Linux 4.1).
    pub fn read_ns_pid(&self, pid: u32) -> Result<Option<u32>, ProcReadError> {
        self.read(pid, "status")
            .map(|text| ns_pid_from_status(&text))
    }

    /// What the classifier needs about `pid`: its cgroup's owner and its namespace PID (left
    /// `None` if only `status` cannot be read).
    pub fn identify(&self, pid: u32) -> Result<ProcessIdentity, ProcReadError> {
        let owner = owner_from_proc_cgroup(&self.read_cgroup(pid)?);
        let ns_pid = self.read_ns_pid(pid).ok().flatten();
        Ok(ProcessIdentity { owner, ns_pid })
    }

    /// [`ProcReader::identify`] of every PID; those that cannot be read are left out (with the
    /// reason, for a debug log): the classifier calls them undetermined.
    pub fn identify_all(
        &self,
        pids: impl IntoIterator<Item = u32>,
    ) -> (BTreeMap<u32, ProcessIdentity>, Vec<ProcReadError>) {
        let mut known = BTreeMap::new();
        let mut failed = Vec::new();
        for pid in pids.into_iter().collect::<BTreeSet<u32>>() {
            match self.identify(pid) {
                Ok(identity) => {
                    known.insert(pid, identity);
                }
                Err(e) => failed.push(e),
            }
        }
        (known, failed)
    }

    /// `<root>/<pid>/<name>`, bounded, without following a symlink at the PID directory or the
    /// file (procfs has none there; a test directory or a hostile mount might).
    fn read(&self, pid: u32, name: &str) -> Result<String, ProcReadError> {
        use std::os::unix::fs::OpenOptionsExt;
        if pid == 0 {
            return Err(ProcReadError::PidZero);
        }
        let dir = self.root.join(pid.to_string());
        let gone_or = |path: &Path, source: std::io::Error| match source.kind() {
            std::io::ErrorKind::NotFound => ProcReadError::Gone { pid },
            _ => match source.raw_os_error() {
                // ESRCH: the process died while its entry was being read.
                Some(libc::ESRCH) => ProcReadError::Gone { pid },
                _ => ProcReadError::Read {
                    path: path.to_path_buf(),
                    source,
                },
            },
        };
        let meta = std::fs::symlink_metadata(&dir).map_err(|e| gone_or(&dir, e))?;
        if !meta.file_type().is_dir() {
            return Err(ProcReadError::NotProcDirectory { path: dir });
        }
        let path = dir.join(name);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY)
            .open(&path)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ELOOP) => ProcReadError::NotRegularFile { path: path.clone() },
                _ => gone_or(&path, e),
            })?;
        let is_file = file
            .metadata()
            .map_err(|e| gone_or(&path, e))?
            .file_type()
            .is_file();
        if !is_file {
            return Err(ProcReadError::NotRegularFile { path });
        }
        let mut bytes = Vec::new();
        file.take(MAX_PROC_FILE)
            .read_to_end(&mut bytes)
            .map_err(|e| gone_or(&path, e))?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pod_cgroup::{CgroupOwner, PodCgroup};

    const UID: &str = "0b7e3c1a-5d2f-4e6a-9c8b-1a2b3c4d5e6f";
    const UID_: &str = "0b7e3c1a_5d2f_4e6a_9c8b_1a2b3c4d5e6f";
    const CID: &str = "4f9d1c2b3a4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4";

    fn proc_entry(root: &Path, pid: u32, cgroup: &str, status: &str) {
        let dir = root.join(pid.to_string());
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("cgroup"), cgroup).expect("cgroup");
        std::fs::write(dir.join("status"), status).expect("status");
    }

    #[test]
    fn a_containers_process_is_identified_by_its_cgroup_and_namespace_pid() {
        let root = tempfile::tempdir().expect("tempdir");
        proc_entry(
            root.path(),
            4242,
            &format!(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope\n"
            ),
            "Name:\tpython3\nTgid:\t4242\nNSpid:\t4242\t17\nPPid:\t4200\n",
        );
        let reader = ProcReader::new(root.path());
        let id = reader.identify(4242).expect("identified");
        assert_eq!(
            id.owner,
            CgroupOwner::Pod(PodCgroup {
                pod_uid: UID.into(),
                container_id: Some(CID.into())
            })
        );
        assert_eq!(id.ns_pid, Some(17));
    }

    #[test]
    fn gone_processes_and_pid_zero_are_errors_that_say_so() {
        let root = tempfile::tempdir().expect("tempdir");
        let reader = ProcReader::new(root.path());
        assert!(matches!(
            reader.identify(77),
            Err(ProcReadError::Gone { pid: 77 })
        ));
        assert!(matches!(reader.identify(0), Err(ProcReadError::PidZero)));
        // Without a status file the namespace PID is unknown, the cgroup still counts.
        let dir = root.path().join("5");
        std::fs::create_dir(&dir).expect("mkdir");
        std::fs::write(dir.join("cgroup"), "0::/system.slice/x.service\n").expect("cgroup");
        let id = reader.identify(5).expect("identified");
        assert_eq!(id.ns_pid, None);
        let (known, failed) = reader.identify_all([5, 77, 5]);
        assert_eq!(known.keys().copied().collect::<Vec<_>>(), vec![5]);
        assert_eq!(failed.len(), 1);
    }

    #[test]
    fn symlinks_and_special_files_are_not_followed() {
        let root = tempfile::tempdir().expect("tempdir");
        let elsewhere = tempfile::tempdir().expect("tempdir");
        proc_entry(elsewhere.path(), 1, "0::/kubepods/pod-x/y\n", "NSpid:\t1\n");
        // A PID directory that is a symlink.
        std::os::unix::fs::symlink(elsewhere.path().join("1"), root.path().join("10"))
            .expect("symlink");
        let reader = ProcReader::new(root.path());
        assert!(matches!(
            reader.read_cgroup(10),
            Err(ProcReadError::NotProcDirectory { .. })
        ));
        // A cgroup file that is a symlink.
        let dir = root.path().join("11");
        std::fs::create_dir(&dir).expect("mkdir");
        std::os::unix::fs::symlink(elsewhere.path().join("1/cgroup"), dir.join("cgroup"))
            .expect("symlink");
        assert!(matches!(
            reader.read_cgroup(11),
            Err(ProcReadError::NotRegularFile { .. })
        ));
        // A directory where the file should be.
        let dir = root.path().join("12");
        std::fs::create_dir_all(dir.join("cgroup")).expect("mkdir");
        assert!(matches!(
            reader.read_cgroup(12),
            Err(ProcReadError::NotRegularFile { .. }) | Err(ProcReadError::Read { .. })
        ));
    }

    #[test]
    fn reads_are_bounded() {
        let root = tempfile::tempdir().expect("tempdir");
        let huge = "x".repeat(usize::try_from(MAX_PROC_FILE).unwrap_or(0) * 2);
        proc_entry(root.path(), 3, &huge, &huge);
        let reader = ProcReader::new(root.path());
        assert_eq!(
            reader.read_cgroup(3).expect("read").len() as u64,
            MAX_PROC_FILE
        );
        assert_eq!(reader.read_ns_pid(3).expect("read"), None);
    }

    #[test]
    fn the_real_proc_of_this_test_process() {
        // This process: some cgroup (a host or a pod one, wherever CI runs), and its namespace
        // PID is the PID it sees for itself.
        let me = std::process::id();
        let id = ProcReader::default().identify(me).expect("own /proc entry");
        assert_eq!(id.ns_pid, Some(me));
    }

    #[test]
    fn ns_pid_is_the_innermost_namespaces() {
        assert_eq!(ns_pid_from_status("NSpid:\t4242\n"), Some(4242));
        assert_eq!(
            ns_pid_from_status("Name:\tx\nNSpid:\t4242\t17\t1\n"),
            Some(1)
        );
        assert_eq!(ns_pid_from_status("Name:\tx\n"), None);
        assert_eq!(ns_pid_from_status("NSpid:\n"), None);
        assert_eq!(ns_pid_from_status("NSpid:\tx\n"), None);
        assert_eq!(ns_pid_from_status("NSpid:\t0\n"), None);
        assert_eq!(ns_pid_from_status("NSpid:\t99999999999\n"), None);
    }

    #[derive(Debug)]
    struct Scripted;

    impl GpuProcessSource for Scripted {
        fn processes_on(&self, gpu_uuid: &str) -> Result<ProcessesOnGpu, GpuProcessError> {
            match gpu_uuid {
                "GPU-lost" => Err(GpuProcessError::List {
                    uuid: gpu_uuid.into(),
                    kind: ProcessKind::Compute,
                    source: NvmlError::GpuLost,
                }),
                _ => Ok(ProcessesOnGpu {
                    processes: vec![GpuProcess {
                        gpu_uuid: gpu_uuid.into(),
                        pid: 1,
                        used_bytes: None,
                        kinds: [ProcessKind::Compute].into(),
                    }],
                    unsupported: vec![ProcessKind::Mps],
                }),
            }
        }
    }

    #[test]
    fn list_all_keeps_the_gpus_that_answer() {
        let all = list_all(
            &Scripted,
            &["GPU-a".into(), "GPU-lost".into(), "GPU-b".into()],
        );
        let gpus: Vec<&str> = all.processes.iter().map(|p| p.gpu_uuid.as_str()).collect();
        assert_eq!(gpus, vec!["GPU-a", "GPU-b"]);
        assert_eq!(all.unsupported.len(), 2);
        assert_eq!(all.failed.len(), 1);
        let msg = tessera_runtime::DisplayChain(&all.failed[0]).to_string();
        assert!(msg.contains("compute processes of GPU GPU-lost"), "{msg}");
    }
}
