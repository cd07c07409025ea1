//! Per-container usage from the shim's shared-region files under
//! `<hook>/vgpu/containers/<podUID>_<container>/*.cache`, exported with HAMi's v2.9+ names
//! (contract §8.2), and the feedback HAMi's vGPU monitor gives the shims through the same files
//! (`recent_kernel`, `utilization_switch`: core contract §5.4, `docs/design/sm-limiter.md`).
//! Truncated, foreign or corrupt files are logged and skipped; they never affect other
//! containers.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tessera_runtime::{DisplayChain, spawn_blocking_in_span};
use vgpu_region::feedback::{ContainerView, CorePolicy, Feedback, FeedbackClock};
use vgpu_region::{MAX_DEVICES, RegionSnapshot};

use crate::edges::{EdgeError, PodSource};
use crate::metrics::PluginMetrics;
pub use crate::metrics::{PodNames, VgpuSample};
pub use tessera_node_core::accounting::{RegionPath, booked_gpus, booked_memory};

/// Largest file the monitor reads: the shim's region file (`vgpu_region::FILE_SIZE`); a larger
/// file is not one, and nothing past this size is ever read.
const MAX_REGION_FILE: u64 = vgpu_region::FILE_SIZE as u64;

/// Entries of one container directory the scan looks at (the shim writes one or two files).
const MAX_ENTRIES_PER_CONTAINER: usize = 256;

/// Opens and reads one region file written by a container (the directory is the container's:
/// anything in it may be hostile). `O_NOFOLLOW` refuses a symlink (to `/dev/zero`, into
/// `/proc/1/root`, …), `O_NONBLOCK` keeps a FIFO from blocking the open, `fstat` on the opened
/// descriptor requires a regular file with a single link (no hard link to a file elsewhere) of at
/// most [`MAX_REGION_FILE`] bytes, and the read is bounded by that size whatever the file does
/// afterwards. Ownership is not checked: the shim runs as the container's user, which the plugin
/// does not know (any UID, in a user namespace too); these checks do not depend on it.
pub fn read_region_file(path: &Path) -> Result<Vec<u8>, SkipReason> {
    open_region_file(path).map(|(_, bytes)| bytes)
}

/// [`read_region_file`], keeping the checked descriptor (the feedback writes through it).
fn open_region_file(path: &Path) -> Result<(File, Vec<u8>), SkipReason> {
    use std::io::Read;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => SkipReason::Symlink,
            _ => SkipReason::Open(e),
        })?;
    let meta = file.metadata().map_err(SkipReason::Stat)?;
    if !meta.file_type().is_file() {
        return Err(SkipReason::NotRegularFile {
            mode: meta.mode() & libc::S_IFMT,
        });
    }
    if meta.nlink() != 1 {
        return Err(SkipReason::HardLinks(meta.nlink()));
    }
    if meta.len() > MAX_REGION_FILE {
        return Err(SkipReason::TooLarge(meta.len()));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    (&file)
        .take(MAX_REGION_FILE)
        .read_to_end(&mut bytes)
        .map_err(SkipReason::Read)?;
    Ok((file, bytes))
}

/// `<podUID>_<container>`: pod UIDs contain no `_`, container names (DNS labels) neither.
pub fn parse_container_dir(name: &str) -> Option<(&str, &str)> {
    let (uid, container) = name.split_once('_')?;
    (!uid.is_empty() && !container.is_empty()).then_some((uid, container))
}

/// Samples of one region (pure).
pub fn samples(pod_uid: &str, container: &str, region: &RegionSnapshot) -> Vec<VgpuSample> {
    let devices = usize::try_from(region.device_num)
        .unwrap_or(MAX_DEVICES)
        .min(MAX_DEVICES);
    (0..devices)
        .map(|d| {
            let live = region
                .procs
                .iter()
                .filter(|p| p.status != vgpu_region::status::EXITED);
            let (mut ctx, mut module, mut buffer, mut sm_util) = (0u64, 0u64, 0u64, 0u64);
            for p in live {
                ctx = ctx.saturating_add(p.used[d].context_size);
                module = module.saturating_add(p.used[d].module_size);
                buffer = buffer.saturating_add(p.used[d].data_size);
                sm_util = sm_util.saturating_add(p.sm_util[d]);
            }
            VgpuSample {
                pod_uid: pod_uid.to_owned(),
                container: container.to_owned(),
                vdevice_index: d,
                device_uuid: region.uuids.get(d).cloned().unwrap_or_default(),
                memory_used_bytes: region.device_usage(d),
                memory_limit_bytes: region.limit[d],
                context_bytes: ctx,
                module_bytes: module,
                buffer_bytes: buffer,
                host_memory_bytes: region.host_usage(d),
                sm_limit: region.sm_limit[d],
                sm_util,
                last_kernel_time: region.last_kernel_time,
            }
        })
        .collect()
}

/// Why an entry of the containers directory was not read.
#[derive(Debug, thiserror::Error)]
pub enum SkipReason {
    #[error("a symlink (not followed)")]
    Symlink,
    #[error("not a directory (not followed)")]
    NotADirectory,
    #[error("cannot open")]
    Open(#[source] std::io::Error),
    #[error("fstat")]
    Stat(#[source] std::io::Error),
    #[error("not a regular file (mode {mode:o})")]
    NotRegularFile { mode: u32 },
    #[error("{0} hard links (expected 1)")]
    HardLinks(u64),
    #[error("{0} bytes is too large for a region file")]
    TooLarge(u64),
    #[error("read")]
    Read(#[source] std::io::Error),
    #[error("not a HAMi-core region")]
    Region(#[source] vgpu_region::RegionError),
    #[error("its pod has no GPU booking on this node (yet)")]
    NoBooking,
}

/// A skipped entry (logged by the caller).
#[derive(Debug)]
pub struct SkippedFile {
    pub path: String,
    pub reason: SkipReason,
}

/// How often the monitor warns about the skipped entries of one container (or claim)
/// directory; between warnings it logs them at debug. A container writes what it likes into its
/// directory, so without this 300 empty files gave 300 warnings per pass (issue 28).
pub const SKIPPED_WARN_PERIOD: Duration = Duration::from_secs(600);

/// The skipped entries of one pass, grouped by the directory (container or claim) they are in:
/// `(directory, count, the first entry)`, in directory order.
pub fn group_skipped(skipped: &[SkippedFile]) -> Vec<(String, usize, &SkippedFile)> {
    let mut groups: BTreeMap<String, (usize, &SkippedFile)> = BTreeMap::new();
    for s in skipped {
        let dir = Path::new(&s.path)
            .parent()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        groups.entry(dir).or_insert((0, s)).0 += 1;
    }
    groups
        .into_iter()
        .map(|(dir, (count, first))| (dir, count, first))
        .collect()
}

/// The monitor's log of skipped entries: at most one line per directory per pass, and a warning
/// per directory at most once per [`SKIPPED_WARN_PERIOD`]. Directories that had nothing skipped
/// in a pass are forgotten, so it holds no more than the node's directories.
#[derive(Debug, Default)]
pub struct SkipLog {
    warned: std::sync::Mutex<BTreeMap<String, tokio::time::Instant>>,
}

impl SkipLog {
    /// Logs one pass's `skipped` entries; `what` names them ("region file", "claim region file").
    pub fn report(&self, what: &str, skipped: &[SkippedFile]) {
        let now = tokio::time::Instant::now();
        let groups = group_skipped(skipped);
        let Ok(mut warned) = self.warned.lock() else {
            return;
        };
        warned.retain(|dir, _| groups.iter().any(|(d, _, _)| d == dir));
        for (dir, count, first) in groups {
            let due = warned
                .get(&dir)
                .is_none_or(|last| now.duration_since(*last) >= SKIPPED_WARN_PERIOD);
            if due {
                warned.insert(dir.clone(), now);
                tracing::warn!(
                    %dir,
                    skipped = count,
                    first = %first.path,
                    reason = %DisplayChain(&first.reason),
                    "{what}s skipped (said at most once per {} s for this directory)",
                    SKIPPED_WARN_PERIOD.as_secs()
                );
            } else {
                tracing::debug!(%dir, skipped = count, first = %first.path, reason = %DisplayChain(&first.reason), "{what}s skipped");
            }
        }
    }
}

/// The region files under `containers_dir` (not opened yet), and the entries that cannot hold
/// any. Never fails as a whole.
pub fn region_paths(containers_dir: &Path) -> (Vec<RegionPath>, Vec<SkippedFile>) {
    region_paths_named(containers_dir, parse_container_dir)
}

/// The region files of prepared DRA claims: `<claims_dir>/<claim UID>/<name>.cache`, one
/// directory per claim shared by every container using it. Each [`RegionPath`] carries the
/// claim UID as `pod_uid` and an empty `container`.
pub fn claim_region_paths(claims_dir: &Path) -> (Vec<RegionPath>, Vec<SkippedFile>) {
    region_paths_named(claims_dir, |name| {
        crate::container_env::path_safe(name).then_some((name, ""))
    })
}

/// Reads every region file of the prepared DRA claims under `claims_dir`
/// ([`claim_region_paths`]). Never fails as a whole.
pub fn scan_claims(claims_dir: &Path) -> (Vec<VgpuSample>, Vec<SkippedFile>) {
    read_regions(claim_region_paths(claims_dir))
}

/// The region files in the directories of `dir` whose names `owner` accepts (as its
/// `(pod UID, container)`), and the entries that cannot hold any.
fn region_paths_named(
    dir: &Path,
    owner: fn(&str) -> Option<(&str, &str)>,
) -> (Vec<RegionPath>, Vec<SkippedFile>) {
    let mut out = Vec::new();
    let mut skipped = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (out, skipped);
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some((uid, container)) = owner(&name) else {
            continue;
        };
        // `file_type` does not follow symlinks: only real directories are entered.
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            skipped.push(SkippedFile {
                path: entry.path().display().to_string(),
                reason: SkipReason::NotADirectory,
            });
            continue;
        }
        let Ok(files) = std::fs::read_dir(entry.path()) else {
            continue;
        };
        // A container can fill its directory with entries; only so many are looked at.
        for file in files.flatten().take(MAX_ENTRIES_PER_CONTAINER) {
            let path = file.path();
            if path.extension().is_none_or(|e| e != "cache") {
                continue;
            }
            out.push(RegionPath {
                pod_uid: uid.to_owned(),
                container: container.to_owned(),
                path,
            });
        }
    }
    (out, skipped)
}

/// Opens, checks and parses one region file ([`read_region_file`], [`RegionSnapshot::parse`]).
fn open_region(path: &Path) -> Result<(FileId, RegionSnapshot), SkipReason> {
    use std::os::unix::fs::MetadataExt;
    let (file, bytes) = open_region_file(path)?;
    let meta = file.metadata().map_err(SkipReason::Stat)?;
    let region = RegionSnapshot::parse(&bytes).map_err(SkipReason::Region)?;
    Ok((
        FileId {
            dev: meta.dev(),
            ino: meta.ino(),
        },
        region,
    ))
}

/// The inode a region was read from: the feedback writes into that inode only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
}

/// Reads every region file under `containers_dir`. Never fails as a whole.
pub fn scan(containers_dir: &Path) -> (Vec<VgpuSample>, Vec<SkippedFile>) {
    read_regions(region_paths(containers_dir))
}

/// Opens and parses the regions found by a directory walk.
fn read_regions(found: (Vec<RegionPath>, Vec<SkippedFile>)) -> (Vec<VgpuSample>, Vec<SkippedFile>) {
    let (regions, skipped) = read_shim_regions(found);
    let samples = regions
        .iter()
        .flat_map(|(p, region)| samples(&p.pod_uid, &p.container, region))
        .collect();
    (samples, skipped)
}

/// Opens, checks and parses each region a directory walk found; those that cannot be read are
/// added to the skipped entries.
pub fn read_shim_regions(
    (paths, mut skipped): (Vec<RegionPath>, Vec<SkippedFile>),
) -> (Vec<(RegionPath, RegionSnapshot)>, Vec<SkippedFile>) {
    let mut out = Vec::new();
    for p in paths {
        match open_region(&p.path) {
            Ok((_, region)) => out.push((p, region)),
            Err(reason) => skipped.push(SkippedFile {
                path: p.path.display().to_string(),
                reason,
            }),
        }
    }
    (out, skipped)
}

/// Why the feedback could not be written into one region file.
#[derive(Debug, thiserror::Error)]
pub enum FeedbackWriteError {
    #[error("cannot open the region file again for writing")]
    Reopen(#[source] std::io::Error),
    #[error("the path no longer names the single-link regular file that was read")]
    Replaced,
    #[error("write")]
    Write(#[source] std::io::Error),
}

/// Writes a feedback's `recent_kernel` and `utilization_switch` into the region file at `path`,
/// each only if it differs from `before` (what was read from inode `read_from`). Returns whether
/// anything was written.
///
/// The pass closes every file after reading it (a container filling its directory with region
/// files must not exhaust the plugin's descriptors), so the path is opened again: with `O_PATH`
/// and `O_NOFOLLOW` first (no side effect whatever the path names now), then it must still be
/// a regular single-link file and the same inode as read, and only then is that descriptor
/// reopened for writing through `/proc/self/fd` (the same inode, whatever the path names by
/// then). Only the two aligned 4-byte words inside the fixed layout are written (`pwrite`,
/// which the shim's shared mapping sees: one page cache), so a hostile file gets at most those
/// 8 bytes, in the container's own region.
pub fn write_feedback(
    path: &Path,
    read_from: FileId,
    before: &RegionSnapshot,
    feedback: &Feedback,
) -> Result<bool, FeedbackWriteError> {
    use std::os::unix::fs::FileExt;
    let words = [
        (
            vgpu_region::offset::RECENT_KERNEL,
            before.recent_kernel,
            feedback.recent_kernel,
        ),
        (
            vgpu_region::offset::UTILIZATION_SWITCH,
            before.utilization_switch,
            feedback.utilization_switch,
        ),
    ];
    if words.iter().all(|(_, was, now)| was == now) {
        return Ok(false);
    }
    let writable = reopen_region(path, Some(read_from))?;
    for (offset, was, now) in words {
        if was != now {
            writable
                .write_all_at(&now.to_ne_bytes(), offset as u64)
                .map_err(FeedbackWriteError::Write)?;
        }
    }
    Ok(true)
}

/// Opens the region file at `path` again for reading and writing, without following a link:
/// `O_PATH` and `O_NOFOLLOW` first (no side effect whatever the path names now), then it must be
/// a regular single-link file (and, with `read_from`, the inode that was read), and only then is
/// that descriptor reopened through `/proc/self/fd` (the same inode, whatever the path names by
/// then).
fn reopen_region(path: &Path, read_from: Option<FileId>) -> Result<File, FeedbackWriteError> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let handle = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(FeedbackWriteError::Reopen)?;
    let meta = handle.metadata().map_err(FeedbackWriteError::Reopen)?;
    let id = FileId {
        dev: meta.dev(),
        ino: meta.ino(),
    };
    if !meta.file_type().is_file() || meta.nlink() != 1 || read_from.is_some_and(|r| r != id) {
        return Err(FeedbackWriteError::Replaced);
    }
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY)
        .open(format!("/proc/self/fd/{}", handle.as_raw_fd()))
        .map_err(FeedbackWriteError::Reopen)
}

/// Records `host_pid` in the slot of the container's region at `path` whose PID (in the
/// container) is `pid` (issue 31: the shim keeps NVML's process lists and utilization to the
/// host PIDs its region records). The slot's PID is read again just before the write, so a slot
/// reused meanwhile is left alone; only that slot's aligned 4-byte `hostpid` word is written
/// (`pwrite`), in the container's own region. Returns whether a slot had that PID.
pub fn write_host_pid(path: &Path, pid: u32, host_pid: u32) -> Result<bool, FeedbackWriteError> {
    use std::os::unix::fs::FileExt;
    use vgpu_region::{MAX_PROCS, offset, slot};
    let file = reopen_region(path, None)?;
    let read_i32 = |at: usize| -> Result<i32, FeedbackWriteError> {
        let mut word = [0u8; 4];
        file.read_exact_at(&mut word, at as u64)
            .map_err(FeedbackWriteError::Write)?;
        Ok(i32::from_ne_bytes(word))
    };
    let procs = read_i32(offset::PROC_NUM)?.clamp(0, MAX_PROCS as i32) as usize;
    for i in 0..procs {
        if read_i32(slot::base(i) + slot::PID)? == pid as i32 {
            file.write_all_at(
                &(host_pid as i32).to_ne_bytes(),
                (slot::base(i) + slot::HOSTPID) as u64,
            )
            .map_err(FeedbackWriteError::Write)?;
            return Ok(true);
        }
    }
    Ok(false)
}

/// One region's outcome in a feedback pass.
#[derive(Debug)]
pub struct FeedbackOutcome {
    pub region: RegionPath,
    pub feedback: Feedback,
    /// Whether a word was written (`Ok(false)`: nothing changed).
    pub written: Result<bool, FeedbackWriteError>,
}

/// One control period of the feedback (HAMi's `Observe`) over every region file under
/// `containers_dir`: read them all, decide ([`vgpu_region::feedback::decide`]), write back what
/// changed. `policy` is the node's `GPU_CORE_UTILIZATION_POLICY` (what `Allocate` gives every
/// container: the region does not record it). `booked` is [`booked_gpus`] of the node's pods: a
/// region counts only on GPUs its pod was booked, whatever UUIDs it names (HAMi believes the
/// region), and the region of a pod without a booking is neither counted nor written (an
/// informer that has not synced yet must not lift every limit). Files that cannot be read are
/// left out of the decision and returned; they never stop the others.
pub fn feedback_pass(
    containers_dir: &Path,
    policy: CorePolicy,
    clock: FeedbackClock,
    booked: &BTreeMap<String, BTreeSet<String>>,
) -> (Vec<FeedbackOutcome>, Vec<SkippedFile>) {
    feedback_pass_over(region_paths(containers_dir), policy, clock, booked)
}

/// [`feedback_pass`] over the prepared DRA claims' regions ([`claim_region_paths`]): `booked`
/// maps each claim's UID to the GPUs allocated to it. A claim's region is one container's in
/// the decision: every container using the claim writes it.
pub fn claims_feedback_pass(
    claims_dir: &Path,
    policy: CorePolicy,
    clock: FeedbackClock,
    booked: &BTreeMap<String, BTreeSet<String>>,
) -> (Vec<FeedbackOutcome>, Vec<SkippedFile>) {
    feedback_pass_over(claim_region_paths(claims_dir), policy, clock, booked)
}

fn feedback_pass_over(
    (paths, mut skipped): (Vec<RegionPath>, Vec<SkippedFile>),
    policy: CorePolicy,
    clock: FeedbackClock,
    booked: &BTreeMap<String, BTreeSet<String>>,
) -> (Vec<FeedbackOutcome>, Vec<SkippedFile>) {
    let mut opened = Vec::with_capacity(paths.len());
    for p in paths {
        let opened_region = match booked.get(&p.pod_uid) {
            None => Err(SkipReason::NoBooking),
            Some(gpus) => open_region(&p.path).map(|(id, region)| (id, region, gpus)),
        };
        match opened_region {
            Ok((id, region, gpus)) => opened.push((p, id, region, gpus)),
            Err(reason) => skipped.push(SkippedFile {
                path: p.path.display().to_string(),
                reason,
            }),
        }
    }
    let views: Vec<ContainerView> = opened
        .iter()
        .map(|(_, _, region, gpus)| {
            let mut view = ContainerView::from_region(region, policy);
            view.gpus.retain(|g| gpus.contains(&g.uuid));
            view
        })
        .collect();
    let decisions = vgpu_region::feedback::decide(&views, clock);
    let outcomes = opened
        .into_iter()
        .zip(decisions)
        .map(|((region_path, id, region, _), feedback)| FeedbackOutcome {
            written: write_feedback(&region_path.path, id, &region, &feedback),
            region: region_path,
            feedback,
        })
        .collect();
    (outcomes, skipped)
}

/// The container directories to remove (pure): `<podUID>_<container>` entries, each with its
/// age, whose pod is not among `live_uids` (the node's pods, fresh from the API server) and that
/// are older than `grace` (a directory is made at `Allocate`, before its pod could be missing).
/// Names that are not container directories are never chosen.
pub fn stale_container_dirs(
    entries: &[(String, std::time::Duration)],
    live_uids: &std::collections::BTreeSet<String>,
    grace: std::time::Duration,
) -> Vec<String> {
    entries
        .iter()
        .filter(|(name, age)| {
            *age >= grace
                && parse_container_dir(name).is_some_and(|(uid, _)| !live_uids.contains(uid))
        })
        .map(|(name, _)| name.clone())
        .collect()
}

/// Removes the directories of containers whose pod is gone (region files, and the directory the
/// container had mounted), so nothing of a deleted pod stays on the node. Symlinks are removed,
/// never followed (`remove_dir_all` does not follow them). Returns what was removed and what
/// could not be, with the reason.
pub fn remove_stale_container_dirs(
    containers_dir: &Path,
    live_uids: &std::collections::BTreeSet<String>,
    grace: std::time::Duration,
) -> Vec<(String, std::io::Result<()>)> {
    let Ok(entries) = std::fs::read_dir(containers_dir) else {
        return Vec::new();
    };
    let now = std::time::SystemTime::now();
    let aged: Vec<(String, std::time::Duration)> = entries
        .flatten()
        .filter_map(|e| {
            let meta = e.path().symlink_metadata().ok()?;
            let age = now
                .duration_since(meta.modified().ok()?)
                .unwrap_or_default();
            Some((e.file_name().to_string_lossy().into_owned(), age))
        })
        .collect();
    stale_container_dirs(&aged, live_uids, grace)
        .into_iter()
        .map(|name| {
            let path = containers_dir.join(&name);
            // A size-limited directory is a tmpfs: unmounted first (crate::cache_dir).
            (name, crate::cache_dir::remove(&path))
        })
        .collect()
}

/// The vGPU monitor's periodic pass: per-container usage from the region files into the
/// metrics, and removal of the container directories of pods that are gone.
#[derive(Clone)]
pub struct VgpuMonitor {
    /// `<hook>/vgpu/containers`.
    pub containers_dir: PathBuf,
    pub pods: Arc<dyn PodSource>,
    pub metrics: PluginMetrics,
    /// Age a container directory must have before it counts as orphaned.
    pub orphan_grace: Duration,
    /// The rate limit of the warnings about what a container left in its directory.
    pub skip_log: Arc<SkipLog>,
}

impl std::fmt::Debug for VgpuMonitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VgpuMonitor")
            .field("containers_dir", &self.containers_dir)
            .finish_non_exhaustive()
    }
}

/// Why a monitor pass could not finish.
#[derive(Debug, thiserror::Error)]
pub enum MonitorError {
    #[error("the region file scan did not finish")]
    Scan(#[source] tokio::task::JoinError),
    #[error("cannot list the node's pods; gone pods' directories are kept for now")]
    LivePods(#[source] EdgeError),
    #[error("the removal of gone pods' directories did not finish")]
    Removal(#[source] tokio::task::JoinError),
    #[error("the feedback pass did not finish")]
    Feedback(#[source] tokio::task::JoinError),
}

impl VgpuMonitor {
    /// One pass. Files and directories that cannot be read or removed are logged and skipped.
    pub async fn pass(&self) -> Result<(), MonitorError> {
        let dir = self.containers_dir.clone();
        let (samples, skipped) = spawn_blocking_in_span(move || scan(&dir))
            .await
            .map_err(MonitorError::Scan)?;
        self.skip_log.report("region file", &skipped);
        let cached = self.pods.cached();
        self.metrics.set_mig(&cached);
        let names = cached
            .into_iter()
            .map(|p| (p.uid, (p.namespace, p.name)))
            .collect();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.metrics.set_vgpu(&samples, &names, now);

        // A deleted pod's container directories (region files included) go with it. Only
        // against a fresh list: an informer that has not synced yet would make every directory
        // look orphaned.
        let live: BTreeSet<String> = self
            .pods
            .fresh()
            .await
            .map_err(MonitorError::LivePods)?
            .into_iter()
            .map(|p| p.uid)
            .collect();
        let dir = self.containers_dir.clone();
        let grace = self.orphan_grace;
        let removed =
            spawn_blocking_in_span(move || remove_stale_container_dirs(&dir, &live, grace))
                .await
                .map_err(MonitorError::Removal)?;
        for (name, r) in removed {
            match r {
                Ok(()) => tracing::info!(dir = %name, "removed a gone pod's container directory"),
                Err(e) => {
                    tracing::warn!(dir = %name, error = %DisplayChain(&e), "cannot remove a gone pod's container directory")
                }
            }
        }
        Ok(())
    }
}

/// The feedback loop's periodic pass (HAMi's `watchAndFeedback`): every control period, one
/// [`feedback_pass`] over the node's region files.
#[derive(Clone)]
pub struct VgpuFeedback {
    /// `<hook>/vgpu/containers`.
    pub containers_dir: PathBuf,
    /// The node's pods: which GPUs each was booked ([`booked_gpus`]).
    pub pods: Arc<dyn PodSource>,
    /// The node's core policy (`gpuCorePolicy`, or `disable` with `disableCoreLimit`).
    pub policy: CorePolicy,
    /// The control period (`--vgpu-feedback-period-seconds`).
    pub period: Duration,
}

impl std::fmt::Debug for VgpuFeedback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VgpuFeedback")
            .field("containers_dir", &self.containers_dir)
            .field("policy", &self.policy)
            .field("period", &self.period)
            .finish_non_exhaustive()
    }
}

impl VgpuFeedback {
    /// One period. Unreadable files are skipped quietly (the usage pass warns about them);
    /// a file that cannot be written is logged.
    pub async fn pass(&self) -> Result<(), MonitorError> {
        let now_secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let clock = FeedbackClock {
            now_secs,
            period_secs: self.period.as_secs().max(1),
        };
        let dir = self.containers_dir.clone();
        let policy = self.policy;
        let booked = booked_gpus(&self.pods.cached());
        let (outcomes, skipped) =
            spawn_blocking_in_span(move || feedback_pass(&dir, policy, clock, &booked))
                .await
                .map_err(MonitorError::Feedback)?;
        log_feedback(&outcomes, &skipped);
        Ok(())
    }
}

/// Logs a feedback pass: each write at debug, each failed write as a warning. Unreadable files
/// are left at debug (the usage pass warns about them).
pub fn log_feedback(outcomes: &[FeedbackOutcome], skipped: &[SkippedFile]) {
    for s in skipped {
        tracing::debug!(path = %s.path, reason = %DisplayChain(&s.reason), "region file left out of the feedback");
    }
    for o in outcomes {
        let f = &o.feedback;
        match &o.written {
            Ok(true) => tracing::debug!(
                owner = %o.region.pod_uid,
                container = %o.region.container,
                recent_kernel = f.recent_kernel,
                utilization_switch = f.utilization_switch,
                active = f.active,
                blocked = f.blocked,
                limited = f.limited,
                "feedback written"
            ),
            Ok(false) => {}
            Err(e) => tracing::warn!(
                path = %o.region.path.display(),
                error = %DisplayChain(e),
                "cannot write the feedback into a region file"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host PID goes only into the slot with the container's PID, and a region the
    /// container made hostile (a slot count out of range, a short file, a link in its place)
    /// is refused without a panic, an unbounded read or a write elsewhere (issue 31).
    #[test]
    fn host_pids_are_written_into_the_right_slot_and_hostile_regions_refused() {
        use vgpu_region::{offset, slot};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.cache");
        std::fs::write(&path, crate::testing::region_with_process("GPU-0", 7)).unwrap();
        assert!(write_host_pid(&path, 7, 4242).unwrap());
        let bytes = std::fs::read(&path).unwrap();
        let at = slot::base(0) + slot::HOSTPID;
        assert_eq!(
            i32::from_ne_bytes(bytes[at..at + 4].try_into().unwrap()),
            4242
        );
        assert!(
            !write_host_pid(&path, 8, 4243).unwrap(),
            "no slot has PID 8"
        );

        // A slot count far beyond the file: at most MAX_PROCS slots read, then a read error.
        let mut huge = bytes.clone();
        huge[offset::PROC_NUM..offset::PROC_NUM + 4].copy_from_slice(&i32::MAX.to_ne_bytes());
        huge.truncate(slot::base(3));
        std::fs::write(&path, &huge).unwrap();
        assert!(write_host_pid(&path, 99, 1).is_err());
        let mut negative = bytes.clone();
        negative[offset::PROC_NUM..offset::PROC_NUM + 4].copy_from_slice(&(-5i32).to_ne_bytes());
        std::fs::write(&path, &negative).unwrap();
        assert!(!write_host_pid(&path, 7, 1).unwrap(), "no slot is read");
        std::fs::write(&path, b"short").unwrap();
        assert!(write_host_pid(&path, 7, 1).is_err());

        // A link to a file outside: refused, the target untouched.
        let outside = dir.path().join("outside");
        std::fs::write(&outside, &bytes).unwrap();
        let link = dir.path().join("link.cache");
        std::os::unix::fs::symlink(&outside, &link).unwrap();
        assert!(write_host_pid(&link, 7, 1).is_err());
        assert_eq!(std::fs::read(&outside).unwrap(), bytes);
    }

    #[test]
    fn only_directories_of_gone_pods_past_the_grace_are_stale() {
        use std::time::Duration;
        let live: std::collections::BTreeSet<String> = ["uid-live".to_owned()].into();
        let entries = vec![
            ("uid-live_main".to_owned(), Duration::from_secs(600)),
            ("uid-gone_main".to_owned(), Duration::from_secs(600)),
            ("uid-gone_side".to_owned(), Duration::from_secs(600)),
            ("uid-new_main".to_owned(), Duration::from_secs(5)),
            ("not-a-container-dir".to_owned(), Duration::from_secs(600)),
        ];
        let stale = stale_container_dirs(&entries, &live, Duration::from_secs(30));
        assert_eq!(stale, vec!["uid-gone_main", "uid-gone_side"]);
    }

    #[test]
    fn removal_takes_the_gone_pods_directories_and_never_follows_links() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep"), b"x").unwrap();
        let containers = root.path();
        std::fs::create_dir(containers.join("gone_main")).unwrap();
        std::fs::write(containers.join("gone_main/a.cache"), b"r").unwrap();
        std::os::unix::fs::symlink(outside.path(), containers.join("gone_main/link")).unwrap();
        std::os::unix::fs::symlink(outside.path(), containers.join("gone2_main")).unwrap();
        std::fs::create_dir(containers.join("live_main")).unwrap();
        let live: std::collections::BTreeSet<String> = ["live".to_owned()].into();
        let removed = remove_stale_container_dirs(containers, &live, std::time::Duration::ZERO);
        assert!(removed.iter().all(|(_, r)| r.is_ok()), "{removed:?}");
        assert!(!containers.join("gone_main").exists());
        assert!(containers.join("gone2_main").symlink_metadata().is_err());
        assert!(containers.join("live_main").is_dir());
        assert!(
            outside.path().join("keep").is_file(),
            "a link target was touched"
        );
    }

    #[tokio::test]
    async fn a_pass_removes_only_gone_pods_directories() {
        let root = tempfile::tempdir().unwrap();
        for dir in ["uid-live_c0", "uid-gone_c0"] {
            std::fs::create_dir(root.path().join(dir)).unwrap();
        }
        let api = crate::testing::MemoryApi::default();
        api.add_pod(crate::testing::bound_pod(
            crate::testing::NODE,
            "live",
            &[&[("GPU-0", 1000, 10)]],
            1,
        ));
        let monitor = VgpuMonitor {
            containers_dir: root.path().to_path_buf(),
            pods: Arc::new(api),
            metrics: PluginMetrics::with_legacy_names(false),
            orphan_grace: Duration::ZERO,
            skip_log: Default::default(),
        };
        monitor.pass().await.expect("a pass");
        assert!(root.path().join("uid-live_c0").is_dir());
        assert!(!root.path().join("uid-gone_c0").exists());
    }

    #[test]
    fn dir_names() {
        assert_eq!(
            parse_container_dir("0f1e-aa_main"),
            Some(("0f1e-aa", "main"))
        );
        assert_eq!(parse_container_dir("nounderscore"), None);
        assert_eq!(parse_container_dir("_x"), None);
    }

    fn put(b: &mut [u8], off: usize, v: &[u8]) {
        b[off..off + v.len()].copy_from_slice(v);
    }

    #[test]
    fn valid_region_yields_usage_and_limits() {
        use vgpu_region::{offset, slot};
        let mut b = vec![0u8; vgpu_region::FILE_SIZE];
        put(
            &mut b,
            offset::INITIALIZED_FLAG,
            &vgpu_region::MAGIC.to_ne_bytes(),
        );
        put(&mut b, offset::MAJOR_VERSION, &1u32.to_ne_bytes());
        put(&mut b, offset::MINOR_VERSION, &2u32.to_ne_bytes());
        put(&mut b, offset::DEVICE_NUM, &1u64.to_ne_bytes());
        put(&mut b, offset::UUIDS, b"GPU-aaa");
        put(&mut b, offset::LIMIT, &(3000u64 << 20).to_ne_bytes());
        put(&mut b, offset::SM_LIMIT, &30u64.to_ne_bytes());
        put(&mut b, offset::PROC_NUM, &2i32.to_ne_bytes());
        for (i, (total, status)) in [(512u64 << 20, 1i32), (100u64 << 20, 0)].iter().enumerate() {
            let base = offset::PROCS + i * slot::SIZE;
            put(&mut b, base + slot::PID, &(10 + i as i32).to_ne_bytes());
            put(&mut b, base + slot::STATUS, &status.to_ne_bytes());
            put(
                &mut b,
                base + slot::USED + slot::MEM_TOTAL,
                &total.to_ne_bytes(),
            );
            put(
                &mut b,
                base + slot::USED + slot::MEM_CONTEXT_SIZE,
                &(2u64 << 20).to_ne_bytes(),
            );
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let c = dir.path().join("uid1_main");
        std::fs::create_dir_all(&c).expect("mkdir");
        std::fs::write(c.join("x.cache"), &b).expect("write");
        let (samples, skipped) = scan(dir.path());
        assert!(skipped.is_empty(), "{skipped:?}");
        assert_eq!(samples.len(), 1);
        let s = &samples[0];
        assert_eq!(
            (
                s.pod_uid.as_str(),
                s.container.as_str(),
                s.device_uuid.as_str()
            ),
            ("uid1", "main", "GPU-aaa")
        );
        assert_eq!(s.memory_used_bytes, 512 << 20, "exited slots do not count");
        assert_eq!(s.memory_limit_bytes, 3000 << 20);
        assert_eq!(s.context_bytes, 2 << 20);
        assert_eq!(s.sm_limit, 30);
    }

    /// A region as the shim leaves it: one GPU at `cores` percent, the given priority and
    /// `recent_kernel`, switch 1 (its initial value).
    fn region_bytes(uuid: &str, cores: u64, priority: i32, recent_kernel: i32) -> Vec<u8> {
        use vgpu_region::offset;
        let mut b = vec![0u8; vgpu_region::FILE_SIZE];
        put(
            &mut b,
            offset::INITIALIZED_FLAG,
            &vgpu_region::MAGIC.to_ne_bytes(),
        );
        put(&mut b, offset::MAJOR_VERSION, &1u32.to_ne_bytes());
        put(&mut b, offset::MINOR_VERSION, &2u32.to_ne_bytes());
        put(&mut b, offset::DEVICE_NUM, &1u64.to_ne_bytes());
        put(&mut b, offset::UUIDS, uuid.as_bytes());
        put(&mut b, offset::SM_LIMIT, &cores.to_ne_bytes());
        put(&mut b, offset::UTILIZATION_SWITCH, &1i32.to_ne_bytes());
        put(&mut b, offset::RECENT_KERNEL, &recent_kernel.to_ne_bytes());
        put(&mut b, offset::PRIORITY, &priority.to_ne_bytes());
        b
    }

    fn words(path: &Path) -> (i32, i32) {
        let r = RegionSnapshot::parse(&std::fs::read(path).expect("read")).expect("region");
        (r.recent_kernel, r.utilization_switch)
    }

    const CLOCK: FeedbackClock = FeedbackClock {
        now_secs: 1_800_000_000,
        period_secs: 5,
    };

    #[test]
    fn a_feedback_pass_writes_priority_blocking_and_the_elastic_switch_into_the_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let write = |name: &str, bytes: &[u8]| {
            let c = dir.path().join(name);
            std::fs::create_dir_all(&c).expect("mkdir");
            std::fs::write(c.join("r.cache"), bytes).expect("write");
            c.join("r.cache")
        };
        let high = write("uid-high_main", &region_bytes("GPU-a", 30, 0, 2));
        let low = write("uid-low_main", &region_bytes("GPU-a", 30, 1, 2));
        let alone = write("uid-alone_main", &region_bytes("GPU-b", 30, 1, 2));
        write("uid-bad_main", b"corrupt");
        // Booked GPU-a and GPU-b between them; "uid-liar" names GPU-a but was booked GPU-c.
        let liar = write("uid-liar_main", &region_bytes("GPU-a", 30, 0, 2));
        let unbooked = write("uid-unknown_main", &region_bytes("GPU-a", 30, 0, 2));
        let booked: BTreeMap<String, BTreeSet<String>> = [
            ("uid-high", "GPU-a"),
            ("uid-low", "GPU-a"),
            ("uid-alone", "GPU-b"),
            ("uid-bad", "GPU-b"),
            ("uid-liar", "GPU-c"),
        ]
        .into_iter()
        .map(|(uid, gpu)| (uid.to_owned(), [gpu.to_owned()].into()))
        .collect();
        let pass = |policy| feedback_pass(dir.path(), policy, CLOCK, &booked);
        let (outcomes, skipped) = pass(CorePolicy::Default);
        assert_eq!(outcomes.len(), 4);
        assert_eq!(skipped.len(), 2, "{skipped:?}");
        assert_eq!(
            words(&unbooked),
            (2, 1),
            "a pod without a booking: untouched"
        );
        assert_eq!(words(&liar), (1, 0), "counted on no GPU: blocks nobody");
        assert!(outcomes.iter().all(|o| o.written.is_ok()), "{outcomes:?}");
        assert_eq!(words(&high), (1, 0), "high priority: decayed, lifted");
        assert_eq!(words(&low), (-1, 1), "low priority: blocked, limited");
        assert_eq!(words(&alone), (1, 0), "alone on its GPU: lifted");
        // The high-priority container goes idle: two periods later the other is released.
        for _ in 0..2 {
            pass(CorePolicy::Default);
        }
        assert_eq!(words(&low), (0, 0), "released and lifted");
        // Under force the switch is still written (the shim ignores it).
        let (outcomes, _) = pass(CorePolicy::Force);
        assert!(
            outcomes
                .iter()
                .filter(|o| o.region.pod_uid != "uid-liar")
                .all(|o| o.feedback.limited),
            "{outcomes:?}"
        );
    }

    #[test]
    fn a_pod_is_booked_the_gpus_of_its_allocation_annotations_only() {
        let pod = crate::testing::bound_pod(
            crate::testing::NODE,
            "p",
            &[&[("GPU-0", 1000, 10)], &[("GPU-1", 1000, 10)]],
            1,
        );
        let mut garbled = pod.clone();
        garbled.uid = "garbled".into();
        for v in garbled.annotations.values_mut() {
            *v = "not,a,list".into();
        }
        let booked = booked_gpus(&[pod.clone(), garbled]);
        assert_eq!(booked.len(), 1, "{booked:?}");
        assert_eq!(
            booked[&pod.uid],
            ["GPU-0".to_owned(), "GPU-1".to_owned()].into()
        );
    }

    /// The feedback writes only into the inode it read, never into whatever the path names by
    /// then (a container may swap the file, or put a link or a FIFO there, between the read and
    /// the write).
    #[test]
    fn the_feedback_is_written_only_into_the_file_that_was_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("r.cache");
        let region = region_bytes("GPU-a", 30, 1, 2);
        let feedback = Feedback {
            recent_kernel: 1,
            utilization_switch: 0,
            active: true,
            blocked: false,
            limited: false,
        };
        std::fs::write(&path, &region).expect("write");
        let (id, before) = open_region(&path).expect("open");
        assert!(write_feedback(&path, id, &before, &feedback).expect("written"));
        assert_eq!(words(&path), (1, 0));
        // Nothing changed: nothing is written.
        let (id, before) = open_region(&path).expect("open");
        assert!(!write_feedback(&path, id, &before, &feedback).expect("no write"));

        let outside = dir.path().join("outside");
        type Swap = fn(&Path, &Path, &[u8]);
        let swaps: [(&str, Swap); 4] = [
            ("another region file", |p, _, region| {
                // Made before the old one goes, so it cannot reuse its inode number.
                let new = p.with_extension("new");
                std::fs::write(&new, region).unwrap();
                std::fs::rename(&new, p).unwrap();
            }),
            ("a symlink", |p, outside, _| {
                std::fs::remove_file(p).unwrap();
                std::os::unix::fs::symlink(outside, p).unwrap();
            }),
            ("a hard link", |p, outside, _| {
                std::fs::remove_file(p).unwrap();
                std::fs::hard_link(outside, p).unwrap();
            }),
            ("a FIFO", |p, _, _| {
                std::fs::remove_file(p).unwrap();
                let made = std::process::Command::new("mkfifo")
                    .arg(p)
                    .status()
                    .unwrap();
                assert!(made.success());
            }),
        ];
        for (what, swap) in swaps {
            let _ = std::fs::remove_file(&path);
            std::fs::write(&path, &region).expect("write");
            std::fs::write(&outside, &region).expect("write");
            let (id, before) = open_region(&path).expect("open");
            swap(&path, &outside, &region);
            let r = write_feedback(&path, id, &before, &feedback);
            assert!(
                matches!(r, Err(FeedbackWriteError::Replaced)),
                "{what}: {r:?}"
            );
            assert_eq!(
                words(&outside),
                (2, 1),
                "{what}: the other file was written"
            );
        }
    }

    #[test]
    fn three_hundred_junk_files_in_one_container_are_one_line_per_pass() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = dir.path().join("0f1e2d3c-aaaa-bbbb-cccc-000000000001_main");
        std::fs::create_dir(&c).expect("mkdir");
        for i in 0..300 {
            std::fs::write(c.join(format!("junk-{i}.cache")), b"").expect("write");
        }
        let (_, skipped) = scan(dir.path());
        assert!(skipped.len() >= 256, "{}", skipped.len());
        let groups = group_skipped(&skipped);
        assert_eq!(groups.len(), 1, "one directory, one line");
        assert_eq!(groups[0].0, c.display().to_string());
        assert_eq!(groups[0].1, skipped.len());
    }

    #[tokio::test(start_paused = true)]
    async fn a_directory_is_warned_about_once_per_period_and_forgotten_when_clean() {
        let skipped = vec![SkippedFile {
            path: "/c/pod_main/x.cache".into(),
            reason: SkipReason::NoBooking,
        }];
        let log = SkipLog::default();
        let warned_at =
            |log: &SkipLog| log.warned.lock().expect("lock").get("/c/pod_main").copied();
        log.report("region file", &skipped);
        let first = warned_at(&log).expect("warned");
        tokio::time::advance(Duration::from_secs(60)).await;
        log.report("region file", &skipped);
        assert_eq!(warned_at(&log), Some(first), "not again within the period");
        tokio::time::advance(SKIPPED_WARN_PERIOD).await;
        log.report("region file", &skipped);
        assert!(
            warned_at(&log).expect("warned") > first,
            "again after the period"
        );
        log.report("region file", &[]);
        assert_eq!(warned_at(&log), None, "a clean directory is forgotten");
    }

    #[test]
    fn corrupt_and_foreign_files_are_skipped_not_fatal() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = dir.path().join("uid1_main");
        std::fs::create_dir_all(&c).expect("mkdir");
        std::fs::write(c.join("a.cache"), b"short").expect("write");
        std::fs::write(c.join("b.cache"), vec![0u8; vgpu_region::REGION_SIZE]).expect("write");
        std::fs::write(c.join("ignored.txt"), b"x").expect("write");
        std::fs::create_dir_all(dir.path().join("not-a-container-dir")).expect("mkdir");
        let (samples, skipped) = scan(dir.path());
        assert!(samples.is_empty());
        assert_eq!(skipped.len(), 2, "{skipped:?}");
        assert!(
            skipped
                .iter()
                .any(|s| DisplayChain(&s.reason).to_string().contains("shorter"))
        );
        assert!(skipped.iter().any(|s| {
            DisplayChain(&s.reason)
                .to_string()
                .contains("not initialised")
        }));
    }

    /// Attacks from a container's own directory: none may hang the scan, grow it, or make it
    /// read a file outside the directory. Each is skipped with a reason.
    #[test]
    fn hostile_entries_are_skipped_without_following_blocking_or_growing() {
        hostile_entries_are_skipped(scan, "uid1_main", "uid2_main");
    }

    /// A claim's directory is shared by every container using the claim, so it is read with
    /// the same rules.
    #[test]
    fn hostile_entries_in_a_claims_directory_are_skipped_the_same_way() {
        hostile_entries_are_skipped(scan_claims, "uid1", "uid2");
    }

    type Scan = fn(&Path) -> (Vec<VgpuSample>, Vec<SkippedFile>);

    /// `dir_name`: a directory holding hostile entries; `linked_dir`: a directory that is a
    /// symlink to the host's root.
    fn hostile_entries_are_skipped(scan: Scan, dir_name: &str, linked_dir: &str) {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = dir.path().join(dir_name);
        std::fs::create_dir_all(&c).expect("mkdir");
        std::os::unix::fs::symlink("/dev/zero", c.join("zero.cache")).expect("symlink");
        std::os::unix::fs::symlink("/proc/1/root/etc/hostname", c.join("proc.cache"))
            .expect("symlink");
        let made = std::process::Command::new("mkfifo")
            .arg(c.join("fifo.cache"))
            .status()
            .expect("mkfifo");
        assert!(made.success(), "mkfifo");
        // A sparse file far larger than a region: never read.
        let big = std::fs::File::create(c.join("big.cache")).expect("create");
        big.set_len(8 << 30).expect("set_len");
        // A hard link to a file outside the container's directory.
        let elsewhere = tempfile::tempdir().expect("tempdir");
        let outside = elsewhere.path().join("secret");
        std::fs::write(&outside, b"secret").expect("write");
        std::fs::hard_link(&outside, c.join("link.cache")).expect("hard link");
        // A container directory that is a symlink (to the host's root).
        std::os::unix::fs::symlink("/", dir.path().join(linked_dir)).expect("symlink");

        let (tx, rx) = std::sync::mpsc::channel();
        let root = dir.path().to_owned();
        std::thread::spawn(move || {
            let _ = tx.send(scan(&root));
        });
        let (samples, skipped) = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the scan finished (a FIFO did not block it)");
        assert!(samples.is_empty());
        let reason = |name: &str| {
            skipped
                .iter()
                .find(|s| s.path.ends_with(name))
                .map(|s| DisplayChain(&s.reason).to_string())
                .unwrap_or_else(|| panic!("{name} not skipped: {skipped:?}"))
        };
        assert!(reason("zero.cache").contains("symlink"));
        assert!(reason("proc.cache").contains("symlink"));
        assert!(reason("fifo.cache").contains("not a regular file"));
        assert!(reason("big.cache").contains("too large"));
        assert!(reason("link.cache").contains("hard links"));
        assert!(reason(linked_dir).contains("not a directory"));
        assert_eq!(skipped.len(), 6, "{skipped:?}");
    }
}
