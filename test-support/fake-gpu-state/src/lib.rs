//! The simulated GPU shared by the fake `libcuda.so.1` and the fake `libnvidia-ml.so.1`.
//!
//! Both fakes depend on this crate, so the layout is defined once. When env
//! `FAKE_GPU_STATE` names a file, the state is an mmap of that file (`MAP_SHARED`), so every
//! process of a test, and both fake libraries inside one process, see the same GPU. Without the
//! variable the state is an anonymous private mapping: per library, per process.
//!
//! What is simulated, per device:
//! * a kernel timeline: a launch occupies the whole device for its duration, kernels run one
//!   after another (`busy_until_ns`), and each busy interval is recorded in a ring with the pid
//!   that launched it; utilization over any window is the overlap of the ring with the window;
//! * per-process device memory (`procs`), so "used" and the process list can be reported, and
//!   the memory of a dead process is released the way a real driver does.
//!
//! Times are `CLOCK_MONOTONIC` nanoseconds (the same clock in every process of one host).

use std::sync::atomic::{AtomicU64, Ordering};

pub const MAGIC: u64 = 0x3454_5347_4b41_4646; // "FFAKGST4" little-endian tag
pub const MAX_DEVICES: usize = 16;
pub const RING: usize = 4096;
pub const MAX_PROCS: usize = 64;

#[repr(C)]
pub struct Interval {
    pub start_ns: AtomicU64,
    pub end_ns: AtomicU64,
    pub pid: AtomicU64,
    /// The launching process's PID namespace and start time (with `pid`, who it was).
    pub pidns: AtomicU64,
    pub start: AtomicU64,
}

#[repr(C)]
pub struct ProcEntry {
    /// The PID in the process's own PID namespace (`getpid()`).
    pub pid: AtomicU64,
    pub used_bytes: AtomicU64,
    /// The inode of that PID namespace (0: unknown). A real driver reports host PIDs; with this
    /// the fake NVML can too when it runs in an ancestor namespace (a `hostPID` device plugin
    /// looking at containers' processes): [`DeviceState::processes`].
    pub pidns: AtomicU64,
    /// Its PID in an ancestor PID namespace (the host's), once a process there has seen it
    /// (0: not yet): what NVML reports for it in every namespace, as a real driver reports host
    /// PIDs to a container ([`DeviceState::processes`]).
    pub host_pid: AtomicU64,
    /// Its start time (`/proc/<pid>/stat` field 22, clock ticks since boot; 0: unknown): with
    /// the PID and namespace, who it is. A dead container's PID namespace inode can be reused
    /// by a new container, whose PID 1 is then not the old one's.
    pub start_time: AtomicU64,
}

/// Who a process is: its PID in its own namespace, the namespace, its start time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcId {
    pub pid: u64,
    pub pidns: u64,
    pub start: u64,
}

impl ProcId {
    fn of_entry(e: &ProcEntry) -> ProcId {
        ProcId {
            pid: e.pid.load(Ordering::Relaxed),
            pidns: e.pidns.load(Ordering::Relaxed),
            start: e.start_time.load(Ordering::Relaxed),
        }
    }

    fn of_interval(iv: &Interval) -> ProcId {
        ProcId {
            pid: iv.pid.load(Ordering::Relaxed),
            pidns: iv.pidns.load(Ordering::Relaxed),
            start: iv.start.load(Ordering::Relaxed),
        }
    }
}

#[repr(C)]
pub struct DeviceState {
    /// Spin lock: 0 = free, otherwise the holder's pid (so a holder killed with `kill -9` can be
    /// detected and the lock stolen).
    pub lock: AtomicU64,
    pub busy_until_ns: AtomicU64,
    /// Number of intervals ever pushed; the ring slot is `head % RING`.
    pub head: AtomicU64,
    /// Total kernel time ever queued. Queued work runs back to back up to `busy_until_ns`, so
    /// the busy time completed by `t` is `busy_accum_ns − max(0, busy_until_ns − t)`.
    pub busy_accum_ns: AtomicU64,
    pub procs: [ProcEntry; MAX_PROCS],
    pub ring: [Interval; RING],
}

#[repr(C)]
pub struct GpuState {
    pub magic: AtomicU64,
    pub devices: [DeviceState; MAX_DEVICES],
}

// `#[inline]`: the fakes read the clocks on every simulated launch and query, as cheaply as when
// this code was compiled into each of them.
#[inline]
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).wrapping_mul(1_000_000_000) + ts.tv_nsec as u64
}

/// Wall-clock microseconds, the unit NVML uses for sample time stamps.
#[inline]
pub fn realtime_us() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    (ts.tv_sec as u64).wrapping_mul(1_000_000) + ts.tv_nsec as u64 / 1000
}

/// The inode of this process's PID namespace (0 when `/proc` cannot tell).
pub fn own_pidns() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
}

/// This process's start time ([`start_time`] of itself), read once.
pub fn own_start_time() -> u64 {
    static START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *START.get_or_init(|| start_time(std::process::id() as u64).unwrap_or(0))
}

/// The start time of `pid` as this process sees it (`/proc/<pid>/stat` field 22).
pub fn start_time(pid: u64) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether `pid` (seen here) is the process that started at `start` (0: any).
fn started_at(pid: u64, start: u64) -> bool {
    start == 0 || start_time(pid) == Some(start)
}

/// The PID, as this process sees it, of the process that is `ns_pid` in PID namespace `pidns`
/// and started at `start` (0: any): `ns_pid` itself in our own namespace; otherwise the process
/// in `/proc` whose namespace is `pidns` and whose innermost `NSpid` is `ns_pid` (found only from
/// an ancestor namespace).
pub fn pid_seen_here(ns_pid: u64, pidns: u64, start: u64) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    if pidns == 0 || pidns == own_pidns() {
        return (pid_alive(ns_pid) && started_at(ns_pid, start)).then_some(ns_pid);
    }
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        if std::fs::metadata(entry.path().join("ns/pid")).map_or(0, |m| m.ino()) != pidns {
            continue;
        }
        let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else {
            continue;
        };
        let innermost = status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .and_then(|v| v.split_whitespace().last())
            .and_then(|v| v.parse::<u64>().ok());
        if innermost == Some(ns_pid) && pid_alive(pid) && started_at(pid, start) {
            return Some(pid);
        }
    }
    None
}

pub fn pid_alive(pid: u64) -> bool {
    if pid == 0 || pid > i32::MAX as u64 {
        return false;
    }
    if pid == std::process::id() as u64 {
        return true;
    }
    // Zombies count as dead: their memory is gone on a real GPU too.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => match stat.rfind(')') {
            Some(i) => !matches!(
                stat[i + 1..].trim_start().chars().next(),
                Some('Z' | 'X' | 'x')
            ),
            None => true,
        },
        Err(_) => false,
    }
}

/// Opens (or creates) the state; `None` only if even an anonymous mapping fails.
pub fn open() -> Option<&'static GpuState> {
    open_path(std::env::var_os("FAKE_GPU_STATE").filter(|p| !p.is_empty()))
}

/// Opens the state at `path` (`None`: a private anonymous state).
pub fn open_path(path: Option<std::ffi::OsString>) -> Option<&'static GpuState> {
    let size = std::mem::size_of::<GpuState>();
    // SAFETY: plain libc calls; every result is checked before use, and the mapping is never
    // unmapped, which is what makes the `'static` reference sound.
    unsafe {
        let ptr = match path {
            Some(path) => {
                use std::os::unix::ffi::OsStrExt;
                let mut bytes = path.as_bytes().to_vec();
                bytes.push(0);
                let fd = libc::open(
                    bytes.as_ptr().cast(),
                    libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC,
                    0o666,
                );
                if fd < 0 {
                    return None;
                }
                libc::flock(fd, libc::LOCK_EX);
                let mut st: libc::stat = std::mem::zeroed();
                let ok = libc::fstat(fd, &mut st) == 0
                    && (st.st_size as usize >= size
                        || libc::ftruncate(fd, size as libc::off_t) == 0);
                let ptr = if ok {
                    libc::mmap(
                        std::ptr::null_mut(),
                        size,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_SHARED,
                        fd,
                        0,
                    )
                } else {
                    libc::MAP_FAILED
                };
                if ptr != libc::MAP_FAILED {
                    let state = &*(ptr as *const GpuState);
                    if state.magic.load(Ordering::Acquire) != MAGIC {
                        std::ptr::write_bytes(ptr.cast::<u8>(), 0, size);
                        state.magic.store(MAGIC, Ordering::Release);
                    }
                }
                libc::flock(fd, libc::LOCK_UN);
                libc::close(fd);
                ptr
            }
            None => libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            ),
        };
        if ptr == libc::MAP_FAILED {
            return None;
        }
        Some(&*(ptr as *const GpuState))
    }
}

impl DeviceState {
    fn lock(&self) -> DeviceGuard<'_> {
        let me = std::process::id() as u64;
        let mut spins: u64 = 0;
        loop {
            match self
                .lock
                .compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) => return DeviceGuard(self),
                Err(holder) => {
                    spins += 1;
                    if spins.is_multiple_of(1024) {
                        // A holder killed with SIGKILL never unlocks: steal from the dead.
                        if holder != me && !pid_alive(holder) {
                            let _ = self.lock.compare_exchange(
                                holder,
                                0,
                                Ordering::AcqRel,
                                Ordering::Relaxed,
                            );
                        }
                        std::thread::yield_now();
                    }
                    std::hint::spin_loop();
                }
            }
        }
    }

    /// Queues a kernel of `duration_ns` launched by `pid`; returns when it will finish.
    pub fn launch(&self, pid: u64, duration_ns: u64) -> u64 {
        let _guard = self.lock();
        let now = now_ns();
        let start = self.busy_until_ns.load(Ordering::Relaxed).max(now);
        let end = start + duration_ns.max(1);
        self.busy_until_ns.store(end, Ordering::Relaxed);
        self.busy_accum_ns.fetch_add(end - start, Ordering::Relaxed);
        let head = self.head.load(Ordering::Relaxed);
        let (ns, started) = (own_pidns(), own_start_time());
        if head > 0 {
            let last = &self.ring[((head - 1) as usize) % RING];
            if last.pid.load(Ordering::Relaxed) == pid
                && last.pidns.load(Ordering::Relaxed) == ns
                && last.start.load(Ordering::Relaxed) == started
                && last.end_ns.load(Ordering::Relaxed) == start
            {
                // Back-to-back kernels of one process: extend instead of filling the ring.
                last.end_ns.store(end, Ordering::Relaxed);
                return end;
            }
        }
        let slot = &self.ring[(head as usize) % RING];
        slot.start_ns.store(start, Ordering::Relaxed);
        slot.end_ns.store(end, Ordering::Relaxed);
        slot.pid.store(pid, Ordering::Relaxed);
        slot.pidns.store(ns, Ordering::Relaxed);
        slot.start.store(started, Ordering::Relaxed);
        self.head.store(head + 1, Ordering::Release);
        end
    }

    /// Busy nanoseconds completed by now since the device was created (exact for any history
    /// length, unlike the ring).
    pub fn busy_done_ns(&self) -> u64 {
        let _guard = self.lock();
        let now = now_ns();
        let ahead = self
            .busy_until_ns
            .load(Ordering::Relaxed)
            .saturating_sub(now);
        self.busy_accum_ns
            .load(Ordering::Relaxed)
            .saturating_sub(ahead)
    }

    /// Busy nanoseconds within `[from, to)`, for one process or for all.
    pub fn busy_ns(&self, pid: Option<ProcId>, from: u64, to: u64) -> u64 {
        let _guard = self.lock();
        let head = self.head.load(Ordering::Relaxed);
        let n = head.min(RING as u64);
        let mut busy = 0;
        for k in 0..n {
            let iv = &self.ring[((head - 1 - k) as usize) % RING];
            let (s, e) = (
                iv.start_ns.load(Ordering::Relaxed),
                iv.end_ns.load(Ordering::Relaxed),
            );
            if pid.is_some_and(|p| p != ProcId::of_interval(iv)) {
                continue;
            }
            let (s, e) = (s.max(from), e.min(to));
            if e > s {
                busy += e - s;
            }
        }
        busy
    }

    /// Processes with work in `[from, to)`.
    pub fn active_pids(&self, from: u64, to: u64) -> Vec<ProcId> {
        let _guard = self.lock();
        let head = self.head.load(Ordering::Relaxed);
        let n = head.min(RING as u64);
        let mut pids = Vec::new();
        for k in 0..n {
            let iv = &self.ring[((head - 1 - k) as usize) % RING];
            if iv.end_ns.load(Ordering::Relaxed) > from && iv.start_ns.load(Ordering::Relaxed) < to
            {
                let pid = ProcId::of_interval(iv);
                if !pids.contains(&pid) {
                    pids.push(pid);
                }
            }
        }
        pids
    }

    /// Adds (or with a negative delta, removes) device memory used by `pid`.
    pub fn add_memory(&self, pid: u64, delta: i64) {
        let _guard = self.lock();
        let ns = own_pidns();
        let started = if pid == std::process::id() as u64 {
            own_start_time()
        } else {
            start_time(pid).unwrap_or(0)
        };
        let mut free_slot = None;
        for entry in &self.procs {
            let p = entry.pid.load(Ordering::Relaxed);
            // The same PID in another namespace (every container's first process is 1) is
            // another process, and so is an earlier process of a reused namespace.
            let entry_ns = entry.pidns.load(Ordering::Relaxed);
            let entry_start = entry.start_time.load(Ordering::Relaxed);
            let same_start = entry_start == 0 || started == 0 || entry_start == started;
            if p == pid && same_start && (entry_ns == ns || entry_ns == 0 || ns == 0) {
                let cur = entry.used_bytes.load(Ordering::Relaxed) as i64;
                entry
                    .used_bytes
                    .store((cur + delta).max(0) as u64, Ordering::Relaxed);
                return;
            }
            if free_slot.is_none()
                && (p == 0 || (entry_ns == ns && (!pid_alive(p) || !started_at(p, entry_start))))
            {
                free_slot = Some(entry);
            }
        }
        if let Some(entry) = free_slot {
            entry.pid.store(pid, Ordering::Relaxed);
            entry.pidns.store(ns, Ordering::Relaxed);
            entry.host_pid.store(0, Ordering::Relaxed);
            entry.start_time.store(started, Ordering::Relaxed);
            entry
                .used_bytes
                .store(delta.max(0) as u64, Ordering::Relaxed);
        }
    }

    /// Live processes holding device memory (or a context), with their bytes, by the PID this
    /// process sees them under: a process of another PID namespace is translated when this
    /// process sees it (an ancestor namespace, as NVML reports host PIDs) and left out when it
    /// does not (a sibling container, or a process that is gone). What the fake driver's
    /// memory accounting counts. Translating also remembers each one's host PID
    /// ([`DeviceState::reported_processes`]).
    pub fn processes(&self) -> Vec<(u64, u64)> {
        self.entries()
            .into_iter()
            .filter_map(|(id, bytes)| {
                let here = pid_seen_here(id.pid, id.pidns, id.start)?;
                if id.pidns != 0 && id.pidns != own_pidns() {
                    self.remember_host_pid(id, here);
                }
                Some((here, bytes))
            })
            .collect()
    }

    /// The processes as NVML lists them here, `(PID, bytes)`: [`DeviceState::reported_pid`]
    /// of each, so a container is told host PIDs, other containers' included, as a real driver
    /// tells it.
    pub fn reported_processes(&self) -> Vec<(u64, u64)> {
        self.entries()
            .into_iter()
            .filter_map(|(id, bytes)| self.reported_pid(id).map(|p| (p, bytes)))
            .collect()
    }

    fn entries(&self) -> Vec<(ProcId, u64)> {
        let _guard = self.lock();
        self.procs
            .iter()
            .map(|e| (ProcId::of_entry(e), e.used_bytes.load(Ordering::Relaxed)))
            .filter(|(id, _)| id.pid != 0)
            .collect()
    }

    fn entry(&self, id: ProcId) -> Option<&ProcEntry> {
        self.procs.iter().find(|e| ProcId::of_entry(e) == id)
    }

    fn remember_host_pid(&self, id: ProcId, host_pid: u64) {
        if let Some(e) = self.entry(id) {
            e.host_pid.store(host_pid, Ordering::Relaxed);
        }
    }

    /// The PID NVML reports here for process `id`, as a driver reports PIDs: the host's. Seen
    /// from an ancestor namespace (the `hostPID` device plugin), it is found in `/proc` and
    /// remembered in the process's entry; elsewhere (a container) the remembered host PID,
    /// else, for a live process of this namespace not yet seen from above, its own PID; a
    /// sibling's process nobody has seen from above is left out.
    pub fn reported_pid(&self, id: ProcId) -> Option<u64> {
        let remembered = self
            .entry(id)
            .map_or(0, |e| e.host_pid.load(Ordering::Relaxed));
        let own = own_pidns();
        if id.pidns != 0 && id.pidns != own {
            if let Some(here) = pid_seen_here(id.pid, id.pidns, id.start) {
                self.remember_host_pid(id, here);
                return Some(here);
            }
            return (remembered != 0).then_some(remembered);
        }
        if !pid_alive(id.pid) || !started_at(id.pid, id.start) {
            return None;
        }
        Some(if remembered != 0 { remembered } else { id.pid })
    }

    pub fn used_bytes(&self) -> u64 {
        self.processes().iter().map(|&(_, b)| b).sum()
    }
}

struct DeviceGuard<'a>(&'a DeviceState);

impl Drop for DeviceGuard<'_> {
    fn drop(&mut self) {
        self.0.lock.store(0, Ordering::Release);
    }
}
