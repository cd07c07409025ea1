//! The shared region (HAMi-core's `shared_region_t`, byte-compatible) and container-wide
//! accounting.
//!
//! * Limits and counters live in the mmapped file at `CUDA_DEVICE_MEMORY_SHARED_CACHE`; offsets
//!   come from `vgpu-region`.
//! * Reserve is check-and-add under one lock across processes: a pid-holding spin lock in the
//!   header word HAMi-core leaves unused (`sm_init_flag`), taken over from a dead holder, plus a
//!   process mutex for threads. Creating or repairing the file takes an open-file-description
//!   lock (`F_OFD_SETLKW`) on the byte just past the struct (the file's extra byte, so it never
//!   conflicts with HAMi-core's `lockf` over the struct); the kernel drops it for a killed
//!   process.
//! * Release is a lock-free saturating subtract.
//! * Dead processes (`/proc/<pid>/stat` gone, zombie, or a different start time because the pid
//!   was reused) are swept by the watcher thread every 250 ms and before any would-be OOM.
//! * A missing file is created; a truncated, uninitialised or garbage file is reinitialised; a
//!   file of another layout version is left alone and this process accounts privately.

use std::ffi::CString;
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use vgpu_region::{FILE_SIZE, MAGIC, MAX_DEVICES, MAX_PROCS, REGION_SIZE, offset, slot, status};

use crate::config::Config;
use crate::log;

pub struct Region {
    base: *mut u8,
    fd: i32,
    mutex: Mutex<()>,
    /// This process's slot index, `NO_SLOT` until registered (again after a fork).
    my_slot: AtomicUsize,
    /// Whether the region is a private anonymous mapping (the file was unusable).
    pub private: bool,
    /// Limits from the device plugin's limits file, enforced whatever the (container-writable)
    /// region file says. `None`: HAMi semantics, the region's limits.
    fixed: Option<([u64; MAX_DEVICES], [u64; MAX_DEVICES])>,
    /// Device memory per device under opt-in oversubscription (`Config::device_share`); 0 =
    /// none. Process-local like `fixed`: every process reads it from the same limits file.
    share: [u64; MAX_DEVICES],
}

// SAFETY: the mapping is shared memory accessed only through atomics; the raw pointer is valid
// for the life of the process (never unmapped).
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

const NO_SLOT: usize = usize::MAX;

/// This process's pid, cached: `getpid` is a system call on current glibc. Reset after fork.
static MY_PID: AtomicI32 = AtomicI32::new(0);

/// One of the container's processes on a device ([`Region::processes_on`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessUse {
    /// As the container sees it (its PID namespace).
    pub pid: u32,
    /// As NVML reports it (the host's PID namespace); 0 while unknown.
    pub host_pid: u32,
    /// Bytes charged on the device.
    pub used: u64,
}

pub fn my_pid() -> i32 {
    let p = MY_PID.load(Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    let p = std::process::id() as i32;
    MY_PID.store(p, Ordering::Relaxed);
    p
}

static REGION: OnceLock<Region> = OnceLock::new();
static CONFIG: OnceLock<Config> = OnceLock::new();
/// Held while the region is being attached, and by `fork`'s prepare handler: a child never
/// inherits a half-attached region (a `OnceLock` mid-initialisation would block it forever).
static INIT: Mutex<()> = Mutex::new(());

thread_local! {
    /// The locks the forking thread holds from the prepare handler to the parent/child ones.
    static FORK_GUARDS: std::cell::RefCell<Vec<std::sync::MutexGuard<'static, ()>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// `pthread_atfork` prepare: no attach in flight and no thread inside the region lock (so the
/// cross-process spin lock is not held by this process either) while the address space is
/// copied.
pub fn fork_prepare() {
    let mut guards = vec![INIT.lock().unwrap_or_else(|e| e.into_inner())];
    if let Some(r) = REGION.get() {
        guards.push(r.mutex.lock().unwrap_or_else(|e| e.into_inner()));
    }
    let _ = FORK_GUARDS.try_with(|g| *g.borrow_mut() = guards);
}

/// `pthread_atfork` parent: release what prepare took (in reverse order).
pub fn fork_parent() {
    let _ = FORK_GUARDS.try_with(|g| {
        let mut g = g.borrow_mut();
        while g.pop().is_some() {}
    });
}

pub fn config() -> &'static Config {
    CONFIG.get_or_init(|| {
        let c = Config::from_env();
        for w in &c.warnings {
            log::warning!("{w}");
        }
        c
    })
}

/// The region, attached on first use.
pub fn get() -> &'static Region {
    match REGION.get() {
        Some(r) => r,
        None => {
            let _g = INIT.lock().unwrap_or_else(|e| e.into_inner());
            REGION.get_or_init(|| Region::attach(config()))
        }
    }
}

/// The region if already attached (never attaches; for the launch path).
pub fn try_get() -> Option<&'static Region> {
    REGION.get()
}

/// After `fork`: the child must register its own slot (called from the atfork child handler).
pub fn after_fork_in_child() {
    fork_parent(); // the same locks, released in the child's copy
    MY_PID.store(0, Ordering::Relaxed);
    if let Some(r) = REGION.get() {
        r.my_slot.store(NO_SLOT, Ordering::Release);
        if r.private {
            // Process-local accounting: the copy of the parent's counters is the parent's.
            for i in 0..MAX_PROCS {
                r.zero_slot(i);
            }
            r.i32(offset::PROC_NUM).store(0, Ordering::Release);
        }
    }
}

fn process_start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?;
    if matches!(state, "Z" | "X" | "x") {
        return None;
    }
    // Field 22 overall = the 20th after the state field.
    fields.nth(18)?.parse().ok()
}

/// A slot's process is alive if `/proc/<pid>` exists, is not a zombie and (when recorded) has
/// the same start time.
pub fn alive(pid: i32, start_time: u64) -> bool {
    if pid <= 0 {
        return false;
    }
    match process_start_time(pid) {
        Some(t) => start_time == 0 || t == start_time,
        None => false,
    }
}

fn fixed_limits(cfg: &Config) -> Option<([u64; MAX_DEVICES], [u64; MAX_DEVICES])> {
    cfg.from_limits_file
        .then_some((cfg.memory_limit, cfg.sm_limit))
}

/// The last OS error as text.
fn os_err() -> String {
    std::io::Error::last_os_error().to_string()
}

/// Opens the region file without ever following a symlink or touching anything but a regular
/// file of ours: an existing file is opened `O_NOFOLLOW` and must be a regular file with one
/// link, owned by this process's effective uid or by root; a missing one is created with
/// `O_CREAT | O_EXCL` (so a link planted in between fails instead of being followed) and only
/// that new file is given its mode. Returns the fd (the caller owns it) and whether it was
/// created.
///
/// Mode of a created file: 0666 when created by root (the container's other users share the
/// file; root's is the only owner they accept besides their own), 0600 otherwise (no other
/// user would accept a file owned by this uid, so nobody else needs to write it).
pub fn open_region_file(path: &std::ffi::CStr) -> Result<(i32, bool), String> {
    const FLAGS: i32 =
        libc::O_RDWR | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_NOCTTY;
    // SAFETY: plain syscalls on a NUL-terminated path and fds we own; results checked.
    unsafe {
        let euid = libc::geteuid();
        for _ in 0..8 {
            let mut created = false;
            let mut fd = libc::open(path.as_ptr(), FLAGS);
            if fd < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOENT) {
                let mode = if euid == 0 { 0o666 } else { 0o600 };
                fd = libc::open(path.as_ptr(), FLAGS | libc::O_CREAT | libc::O_EXCL, mode);
                if fd < 0 {
                    if std::io::Error::last_os_error().raw_os_error() == Some(libc::EEXIST) {
                        continue; // another process created it first: open theirs
                    }
                    return Err(os_err());
                }
                created = true;
            }
            if fd < 0 {
                let e = std::io::Error::last_os_error();
                return Err(if e.raw_os_error() == Some(libc::ELOOP) {
                    "is a symbolic link; not followed".to_owned()
                } else {
                    e.to_string()
                });
            }
            let mut st: libc::stat = std::mem::zeroed();
            let why = if libc::fstat(fd, &mut st) != 0 {
                Some(os_err())
            } else if st.st_mode & libc::S_IFMT != libc::S_IFREG {
                Some("is not a regular file".to_owned())
            } else if st.st_nlink != 1 {
                Some(format!("has {} hard links", st.st_nlink))
            } else if st.st_uid != euid && st.st_uid != 0 {
                Some(format!(
                    "is owned by uid {}, neither this process's ({euid}) nor root",
                    st.st_uid
                ))
            } else {
                None
            };
            if let Some(why) = why {
                libc::close(fd);
                return Err(why);
            }
            // Back to blocking mode (O_NONBLOCK only guarded the open against a FIFO).
            let fl = libc::fcntl(fd, libc::F_GETFL);
            if fl >= 0 {
                libc::fcntl(fd, libc::F_SETFL, fl & !libc::O_NONBLOCK);
            }
            if created {
                // Exactly the mode above, whatever the umask; only on the file just created.
                libc::fchmod(fd, if euid == 0 { 0o666 } else { 0o600 });
            }
            return Ok((fd, created));
        }
        Err("keeps appearing and disappearing".to_owned())
    }
}

impl Region {
    fn attach(cfg: &Config) -> Region {
        match Self::open_file(cfg) {
            Ok(r) => r,
            Err(e) => {
                log::warning!(
                    "shared region {}: {e}; this process accounts privately",
                    cfg.cache_path
                );
                Self::private(cfg)
            }
        }
    }

    fn private(cfg: &Config) -> Region {
        // SAFETY: anonymous mapping of the struct size; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                FILE_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        let base = if p == libc::MAP_FAILED {
            // Nothing left to do but leak a heap copy; counters still work in-process.
            Box::leak(vec![0u64; FILE_SIZE.div_ceil(8)].into_boxed_slice())
                .as_mut_ptr()
                .cast()
        } else {
            p.cast()
        };
        let r = Region {
            base,
            fd: -1,
            mutex: Mutex::new(()),
            my_slot: AtomicUsize::new(NO_SLOT),
            private: true,
            fixed: fixed_limits(cfg),
            share: cfg.device_share,
        };
        r.initialize(cfg);
        r
    }

    fn open_file(cfg: &Config) -> Result<Region, String> {
        let path =
            CString::new(cfg.cache_path.clone()).map_err(|_| "path contains NUL".to_owned())?;
        let (fd, _created) = open_region_file(&path)?;
        // SAFETY: libc calls with checked results; the fd is kept for the life of the process.
        unsafe {
            let r = Region {
                base: std::ptr::null_mut(),
                fd,
                mutex: Mutex::new(()),
                my_slot: AtomicUsize::new(NO_SLOT),
                private: false,
                fixed: fixed_limits(cfg),
                share: cfg.device_share,
            };
            r.file_lock();
            let result = (|| {
                let mut st: libc::stat = std::mem::zeroed();
                if libc::fstat(fd, &mut st) != 0 {
                    return Err(std::io::Error::last_os_error().to_string());
                }
                let size = st.st_size as usize;
                // Every page of the region is given its blocks now, not at the first store
                // through the mapping: on a full file system (a size-limited cache directory
                // its container filled) a store to a page without blocks is SIGBUS, which
                // would kill the application; here it is an error and the process accounts
                // privately. A file system without fallocate gets the sparse file as before.
                match libc::posix_fallocate(fd, 0, FILE_SIZE as libc::off_t) {
                    0 => {}
                    libc::EOPNOTSUPP | libc::EINVAL => {
                        if size < FILE_SIZE && libc::ftruncate(fd, FILE_SIZE as libc::off_t) != 0 {
                            return Err(std::io::Error::last_os_error().to_string());
                        }
                    }
                    e => {
                        return Err(format!(
                            "cannot allocate the region's blocks: {}",
                            std::io::Error::from_raw_os_error(e)
                        ));
                    }
                }
                let p = libc::mmap(
                    std::ptr::null_mut(),
                    FILE_SIZE,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    0,
                );
                if p == libc::MAP_FAILED {
                    return Err(std::io::Error::last_os_error().to_string());
                }
                Ok((p.cast::<u8>(), size))
            })();
            let (base, size) = match result {
                Ok(v) => v,
                Err(e) => {
                    r.file_unlock();
                    libc::close(fd);
                    return Err(e);
                }
            };
            let mut r = r;
            r.base = base;
            let flag = r.i32(offset::INITIALIZED_FLAG).load(Ordering::Acquire);
            let major = r.i32(offset::MAJOR_VERSION).load(Ordering::Relaxed) as u32;
            if flag != MAGIC || size < REGION_SIZE {
                if size != 0 {
                    log::warning!(
                        "shared region {} was {} (size {size}); reinitialising it",
                        cfg.cache_path,
                        if flag != MAGIC {
                            "not initialised"
                        } else {
                            "truncated"
                        }
                    );
                }
                r.initialize(cfg);
            } else if major != vgpu_region::MAJOR_VERSION {
                r.file_unlock();
                libc::munmap(base.cast(), FILE_SIZE);
                libc::close(fd);
                return Err(format!("foreign layout version {major}"));
            } else {
                r.check_limits(cfg);
            }
            r.file_unlock();
            Ok(r)
        }
    }

    /// Writes a fresh header (limits from this process's environment). Caller holds the lock.
    fn initialize(&self, cfg: &Config) {
        self.i32(offset::INITIALIZED_FLAG)
            .store(0, Ordering::Release);
        // SAFETY: the mapping is FILE_SIZE bytes; zero everything but the flag first.
        unsafe { std::ptr::write_bytes(self.base.add(4), 0, REGION_SIZE - 4) };
        self.i32(offset::MAJOR_VERSION)
            .store(vgpu_region::MAJOR_VERSION as i32, Ordering::Relaxed);
        self.i32(offset::MINOR_VERSION)
            .store(vgpu_region::MINOR_VERSION as i32, Ordering::Relaxed);
        // HAMi-core processes or tools on the same file expect initialised pshared semaphores.
        // SAFETY: both fields are 32-byte sem_t slots inside the mapping.
        unsafe {
            libc::sem_init(self.base.add(offset::SEM).cast(), 1, 1);
            libc::sem_init(self.base.add(offset::SEM_POSTINIT).cast(), 1, 1);
        }
        for d in 0..MAX_DEVICES {
            self.u64(offset::LIMIT + 8 * d)
                .store(cfg.memory_limit[d], Ordering::Relaxed);
            self.u64(offset::SM_LIMIT + 8 * d)
                .store(cfg.sm_limit[d], Ordering::Relaxed);
        }
        self.i32(offset::UTILIZATION_SWITCH)
            .store(1, Ordering::Relaxed);
        self.i32(offset::RECENT_KERNEL).store(2, Ordering::Relaxed);
        self.i32(offset::PRIORITY)
            .store(cfg.priority, Ordering::Relaxed);
        self.i32(offset::INITIALIZED_FLAG)
            .store(MAGIC, Ordering::Release);
    }

    /// HAMi semantics: the region's limits win; a different environment only warns. With the
    /// device plugin's limits file the file wins: the region's copy (what the monitor reads) is
    /// rewritten if something changed it. Caller holds the file lock.
    fn check_limits(&self, cfg: &Config) {
        if cfg.from_limits_file {
            let mut changed = false;
            for d in 0..MAX_DEVICES {
                for (off, want) in [
                    (offset::LIMIT + 8 * d, cfg.memory_limit[d]),
                    (offset::SM_LIMIT + 8 * d, cfg.sm_limit[d]),
                ] {
                    if self.u64(off).swap(want, Ordering::Relaxed) != want {
                        changed = true;
                    }
                }
            }
            if changed {
                log::warning!(
                    "shared region {} held other limits than the device plugin's {}; restored",
                    cfg.cache_path,
                    crate::config::LIMITS_FILE
                );
            }
            return;
        }
        for d in 0..MAX_DEVICES {
            let have = self.limit(d);
            if have != cfg.memory_limit[d] && cfg.memory_limit[d] != 0 {
                log::warning!(
                    "limit inconsistency on device {d}: region {have}, environment {}; the region wins (delete the cache file to change it)",
                    cfg.memory_limit[d]
                );
                break;
            }
        }
    }

    fn at<T>(&self, off: usize) -> &T {
        debug_assert!(off + std::mem::size_of::<T>() <= FILE_SIZE);
        // SAFETY: every offset used is inside the mapping and naturally aligned (pinned by the
        // layout tests); the mapping lives for the whole process.
        unsafe { &*(self.base.add(off) as *const T) }
    }
    fn i32(&self, off: usize) -> &AtomicI32 {
        self.at(off)
    }
    fn u64(&self, off: usize) -> &AtomicU64 {
        self.at(off)
    }

    fn file_lock(&self) {
        self.fcntl_lock(libc::F_WRLCK as i16);
    }
    fn file_unlock(&self) {
        self.fcntl_lock(libc::F_UNLCK as i16);
    }
    fn fcntl_lock(&self, kind: i16) {
        if self.fd < 0 {
            return;
        }
        // SAFETY: a zeroed flock with the fields set below is valid for F_OFD_SETLKW.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = kind;
        fl.l_whence = libc::SEEK_SET as i16;
        fl.l_start = REGION_SIZE as libc::off_t;
        fl.l_len = 1;
        loop {
            // SAFETY: valid fd and flock.
            let r = unsafe { libc::fcntl(self.fd, libc::F_OFD_SETLKW, &mut fl) };
            if r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                return;
            }
        }
    }

    /// Runs `f` holding the region lock: the process mutex (threads) and the cross-process
    /// spin lock in `sm_init_flag`.
    fn locked<R>(&self, f: impl FnOnce() -> R) -> R {
        let _g = self.mutex.lock().unwrap_or_else(|e| e.into_inner());
        self.spin_lock();
        let r = f();
        self.i32(offset::SM_INIT_FLAG).store(0, Ordering::Release);
        r
    }

    /// The cross-process lock: `sm_init_flag` (4 bytes HAMi-core never uses and HAMi's monitor
    /// never reads) holds the owner's pid, 0 when free. Uncontended it costs two atomic
    /// operations (an `fcntl` lock cost two system calls, about 1 µs per allocation). A holder
    /// that died (`kill -9` inside the few-instruction critical section) is detected through
    /// `/proc` and its lock is taken over, so nobody waits for the dead.
    fn spin_lock(&self) {
        let word = self.i32(offset::SM_INIT_FLAG);
        let me = my_pid();
        let mut spins: u32 = 0;
        loop {
            match word.compare_exchange_weak(0, me, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return,
                Err(holder) => {
                    spins = spins.wrapping_add(1);
                    if spins.is_multiple_of(64) {
                        std::thread::yield_now();
                    }
                    if spins.is_multiple_of(4096) && holder != me && !alive(holder, 0) {
                        let _ =
                            word.compare_exchange(holder, 0, Ordering::AcqRel, Ordering::Relaxed);
                    }
                    std::hint::spin_loop();
                }
            }
        }
    }

    pub fn limit(&self, dev: usize) -> u64 {
        if dev >= MAX_DEVICES {
            return 0;
        }
        if let Some((mem, _)) = &self.fixed {
            return mem[dev];
        }
        self.u64(offset::LIMIT + 8 * dev).load(Ordering::Relaxed)
    }

    pub fn sm_limit(&self, dev: usize) -> u64 {
        if dev >= MAX_DEVICES {
            return 100;
        }
        if let Some((_, sm)) = &self.fixed {
            return sm[dev];
        }
        self.u64(offset::SM_LIMIT + 8 * dev).load(Ordering::Relaxed)
    }

    pub fn utilization_switch(&self) -> i32 {
        self.i32(offset::UTILIZATION_SWITCH).load(Ordering::Relaxed)
    }

    pub fn recent_kernel(&self) -> &AtomicI32 {
        self.i32(offset::RECENT_KERNEL)
    }

    pub fn set_last_kernel_time(&self, secs: u64) {
        self.u64(offset::LAST_KERNEL_TIME)
            .fetch_max(secs, Ordering::Relaxed);
    }

    /// Writes `uuids[dev]` (NUL-padded) unless it already holds this value; the host monitor maps
    /// the region's device indices to GPUs through these strings.
    pub fn set_uuid(&self, dev: usize, uuid: &str) {
        if dev >= MAX_DEVICES || uuid.len() >= vgpu_region::UUID_LEN {
            return;
        }
        let off = offset::UUIDS + dev * vgpu_region::UUID_LEN;
        self.locked(|| {
            // SAFETY: `off .. off + UUID_LEN` is inside the mapping; only this lock's holders
            // write the field.
            unsafe {
                let dst = self.base.add(off);
                let cur = std::slice::from_raw_parts(dst, vgpu_region::UUID_LEN);
                if cur[..uuid.len()] == *uuid.as_bytes() && cur[uuid.len()] == 0 {
                    return;
                }
                std::ptr::write_bytes(dst, 0, vgpu_region::UUID_LEN);
                std::ptr::copy_nonoverlapping(uuid.as_ptr(), dst, uuid.len());
            }
        });
    }

    pub fn set_device_num(&self, n: u64) {
        self.u64(offset::DEVICE_NUM).store(n, Ordering::Relaxed);
    }

    fn proc_num(&self) -> usize {
        self.i32(offset::PROC_NUM)
            .load(Ordering::Acquire)
            .clamp(0, MAX_PROCS as i32) as usize
    }

    fn slot_u64(&self, i: usize, field: usize) -> &AtomicU64 {
        self.u64(slot::base(i) + field)
    }
    fn slot_i32(&self, i: usize, field: usize) -> &AtomicI32 {
        self.i32(slot::base(i) + field)
    }

    /// Bytes used on `dev` by every process of the container.
    pub fn usage(&self, dev: usize) -> u64 {
        self.summed(dev, slot::MEM_TOTAL)
    }

    /// Field `field` of `used[dev]` summed over every process of the container.
    fn summed(&self, dev: usize, field: usize) -> u64 {
        if dev >= MAX_DEVICES {
            return 0;
        }
        (0..self.proc_num()).fold(0u64, |acc, i| {
            acc.saturating_add(
                self.slot_u64(i, slot::mem(dev, field))
                    .load(Ordering::Acquire),
            )
        })
    }

    /// Subtracts `bytes` from slot `i`'s `used[dev]` field `field`, saturating.
    fn subtract(&self, i: usize, dev: usize, field: usize, bytes: u64) {
        let _ = self.slot_u64(i, slot::mem(dev, field)).fetch_update(
            Ordering::AcqRel,
            Ordering::Acquire,
            |v| Some(v.saturating_sub(bytes)),
        );
    }

    /// Whether `bytes` more fit on `dev` under `limit` (non-zero) and the device share `share`
    /// (0: none): on the device (`on_host` false) device memory is held to the share when
    /// there is one, else to the limit; under a share, device and host memory together are
    /// held to the limit.
    fn fits(&self, dev: usize, bytes: u64, limit: u64, share: u64, on_host: bool) -> bool {
        let device = self.usage(dev);
        let within = |used: u64, cap: u64| used.checked_add(bytes).is_some_and(|t| t <= cap);
        let device_ok = on_host || within(device, if share > 0 { share } else { limit });
        let total_ok = share == 0 || within(device.saturating_add(self.host_usage(dev)), limit);
        device_ok && total_ok
    }

    fn zero_slot(&self, i: usize) {
        for d in 0..MAX_DEVICES {
            for f in [
                slot::MEM_CONTEXT_SIZE,
                slot::MEM_MODULE_SIZE,
                slot::MEM_DATA_SIZE,
                slot::MEM_OFFSET,
                slot::MEM_TOTAL,
                slot::MEM_HOST,
            ] {
                self.slot_u64(i, slot::mem(d, f))
                    .store(0, Ordering::Relaxed);
            }
            self.slot_u64(i, slot::MONITORUSED + 8 * d)
                .store(0, Ordering::Relaxed);
            self.slot_u64(
                i,
                slot::DEVICE_UTIL + slot::DEVICE_UTIL_SIZE * d + slot::UTIL_SM,
            )
            .store(0, Ordering::Relaxed);
        }
        self.slot_u64(i, slot::START_TIME)
            .store(0, Ordering::Relaxed);
        self.slot_i32(i, slot::HOSTPID).store(0, Ordering::Relaxed);
        self.slot_i32(i, slot::STATUS)
            .store(status::EXITED, Ordering::Relaxed);
        self.slot_i32(i, slot::PID).store(0, Ordering::Release);
    }

    /// Frees the slots of dead processes. Caller holds the lock. Returns how many were freed.
    fn sweep_locked(&self) -> usize {
        let me = my_pid();
        let mut freed = 0;
        let n = self.proc_num();
        for i in 0..n {
            let pid = self.slot_i32(i, slot::PID).load(Ordering::Acquire);
            if pid == 0 || pid == me {
                continue;
            }
            let start = self.slot_u64(i, slot::START_TIME).load(Ordering::Relaxed);
            if !alive(pid, start) {
                self.zero_slot(i);
                freed += 1;
            }
        }
        // Shrink `proc_num` over free tail slots; live slots never move (HAMi-core's
        // compaction moved them under their owners' feet).
        let mut n = n;
        while n > 0 && self.slot_i32(n - 1, slot::PID).load(Ordering::Acquire) == 0 {
            n -= 1;
        }
        self.i32(offset::PROC_NUM)
            .store(n as i32, Ordering::Release);
        freed
    }

    /// Frees the slots of dead processes (the watcher calls this periodically).
    pub fn sweep(&self) -> usize {
        self.locked(|| self.sweep_locked())
    }

    /// This process's slot, registering it on first use (and after a fork).
    fn my_slot(&self) -> Option<usize> {
        let s = self.my_slot.load(Ordering::Acquire);
        if s != NO_SLOT {
            return Some(s);
        }
        let me = my_pid();
        let start = process_start_time(me).unwrap_or(0);
        let found = self.locked(|| {
            let s = self.my_slot.load(Ordering::Acquire);
            if s != NO_SLOT {
                return Some(s);
            }
            self.sweep_locked();
            let n = self.proc_num();
            // Reuse a slot carrying our pid (a crash-looping pid), else a free one, else append.
            let reuse = (0..n).find(|&i| self.slot_i32(i, slot::PID).load(Ordering::Acquire) == me);
            let free =
                || (0..n).find(|&i| self.slot_i32(i, slot::PID).load(Ordering::Acquire) == 0);
            let i = match reuse.or_else(free) {
                Some(i) => i,
                None if n < MAX_PROCS => {
                    self.i32(offset::PROC_NUM)
                        .store(n as i32 + 1, Ordering::Release);
                    n
                }
                None => return None,
            };
            self.zero_slot(i);
            self.slot_u64(i, slot::START_TIME)
                .store(start, Ordering::Relaxed);
            self.slot_u64(i, slot::SEQLOCK).store(0, Ordering::Relaxed);
            self.slot_i32(i, slot::STATUS)
                .store(status::RUNNING, Ordering::Relaxed);
            self.slot_i32(i, slot::PID).store(me, Ordering::Release);
            self.my_slot.store(i, Ordering::Release);
            Some(i)
        });
        if found.is_none() {
            log::warning!(
                "shared region is full ({MAX_PROCS} processes); this process is not accounted"
            );
        }
        found
    }

    /// Registers this process (idempotent).
    pub fn register(&self) {
        let _ = self.my_slot();
    }

    fn add_locked(&self, i: usize, dev: usize, field: usize, bytes: u64) {
        self.slot_u64(i, slot::mem(dev, field))
            .fetch_add(bytes, Ordering::AcqRel);
        self.slot_u64(i, slot::mem(dev, slot::MEM_TOTAL))
            .fetch_add(bytes, Ordering::AcqRel);
    }

    /// Check-and-add, atomic across the container: charges `bytes` on `dev` to this process
    /// unless that would pass the limit. `Err(())` means out of memory.
    pub fn reserve(&self, dev: usize, bytes: u64) -> Result<(), ()> {
        self.reserve_as(dev, slot::MEM_DATA_SIZE, bytes)
    }

    /// [`Self::reserve`] into the per-process breakdown field `field` (`slot::MEM_DATA_SIZE`
    /// or `slot::MEM_MODULE_SIZE`); `total` is charged either way.
    pub fn reserve_as(&self, dev: usize, field: usize, bytes: u64) -> Result<(), ()> {
        if dev >= MAX_DEVICES {
            return Ok(());
        }
        let Some(i) = self.my_slot() else {
            return Ok(());
        };
        let limit = self.limit(dev);
        if limit == 0 {
            self.add_locked(i, dev, field, bytes);
            return Ok(());
        }
        let share = self.share(dev);
        self.locked(|| {
            let fits = |r: &Self| r.fits(dev, bytes, limit, share, false);
            if !fits(self) && (self.sweep_locked() == 0 || !fits(self)) {
                return Err(());
            }
            self.add_locked(i, dev, field, bytes);
            Ok(())
        })
    }

    /// The device share in force on `dev` (oversubscription); 0 = none.
    pub fn share(&self, dev: usize) -> u64 {
        self.share.get(dev).copied().unwrap_or(0)
    }

    /// Host memory the container's processes hold in place of device memory on `dev`.
    pub fn host_usage(&self, dev: usize) -> u64 {
        self.summed(dev, slot::MEM_HOST)
    }

    /// Check-and-add of `bytes` of host memory given in place of device memory on `dev`:
    /// only under oversubscription, and only while device and host memory together stay
    /// within the limit. `Err(())` means out of memory.
    pub fn reserve_host(&self, dev: usize, bytes: u64) -> Result<(), ()> {
        let (limit, share) = (self.limit(dev), self.share(dev));
        if dev >= MAX_DEVICES || limit == 0 || share == 0 {
            return Err(());
        }
        let Some(i) = self.my_slot() else {
            return Err(());
        };
        self.locked(|| {
            let fits = |r: &Self| r.fits(dev, bytes, limit, share, true);
            if !fits(self) && (self.sweep_locked() == 0 || !fits(self)) {
                return Err(());
            }
            self.slot_u64(i, slot::mem(dev, slot::MEM_HOST))
                .fetch_add(bytes, Ordering::AcqRel);
            Ok(())
        })
    }

    /// Gives back host memory charged by [`Self::reserve_host`].
    pub fn release_host(&self, dev: usize, bytes: u64) {
        if dev >= MAX_DEVICES {
            return;
        }
        if let Some(i) = self.my_slot() {
            self.subtract(i, dev, slot::MEM_HOST, bytes);
        }
    }

    /// Charges `bytes` that the driver already holds (no check: refusing cannot give them
    /// back). The usage may pass the limit; later reservations are refused until it is back.
    pub fn charge_as(&self, dev: usize, field: usize, bytes: u64) {
        if dev >= MAX_DEVICES {
            return;
        }
        if let Some(i) = self.my_slot() {
            self.add_locked(i, dev, field, bytes);
        }
    }

    /// Gives back `bytes` on `dev` (saturating: never wraps below zero).
    pub fn release(&self, dev: usize, bytes: u64) {
        self.release_as(dev, slot::MEM_DATA_SIZE, bytes)
    }

    /// [`Self::release`] from the breakdown field `field`.
    pub fn release_as(&self, dev: usize, field: usize, bytes: u64) {
        if dev >= MAX_DEVICES {
            return;
        }
        let Some(i) = self.my_slot() else {
            return;
        };
        for field in [field, slot::MEM_TOTAL] {
            self.subtract(i, dev, field, bytes);
        }
    }

    /// Normal exit: the slot is released immediately rather than at the next sweep.
    pub fn exit(&self) {
        let s = self.my_slot.swap(NO_SLOT, Ordering::AcqRel);
        if s != NO_SLOT && self.slot_i32(s, slot::PID).load(Ordering::Acquire) == my_pid() {
            self.locked(|| self.zero_slot(s));
        }
    }

    /// Writes measured per-process SM utilisation into this process's slot (monitor view).
    pub fn set_sm_util(&self, dev: usize, percent: u64) {
        if dev >= MAX_DEVICES {
            return;
        }
        if let Some(i) = self.my_slot() {
            self.slot_u64(
                i,
                slot::DEVICE_UTIL + slot::DEVICE_UTIL_SIZE * dev + slot::UTIL_SM,
            )
            .store(percent, Ordering::Relaxed);
        }
    }

    /// The container's live processes, with what each uses on `dev`: each live slot's pid in
    /// the container's PID namespace, its host pid (0 until the node's watch writes it) and its
    /// bytes on `dev` (0 for a process that only has a context there, or none).
    pub fn processes_on(&self, dev: usize) -> Vec<ProcessUse> {
        if dev >= MAX_DEVICES {
            return Vec::new();
        }
        (0..self.proc_num())
            .filter_map(|i| {
                let pid = self.slot_i32(i, slot::PID).load(Ordering::Acquire);
                let status = self.slot_i32(i, slot::STATUS).load(Ordering::Relaxed);
                let used = self
                    .slot_u64(i, slot::mem(dev, slot::MEM_TOTAL))
                    .load(Ordering::Acquire);
                (pid > 0 && status != status::EXITED).then(|| ProcessUse {
                    pid: pid as u32,
                    host_pid: self
                        .slot_i32(i, slot::HOSTPID)
                        .load(Ordering::Relaxed)
                        .max(0) as u32,
                    used,
                })
            })
            .collect()
    }

    /// Live container pids (for matching NVML process samples).
    pub fn pids(&self) -> Vec<u32> {
        (0..self.proc_num())
            .filter_map(|i| {
                let host = self.slot_i32(i, slot::HOSTPID).load(Ordering::Relaxed);
                let pid = self.slot_i32(i, slot::PID).load(Ordering::Relaxed);
                let p = if host > 0 { host } else { pid };
                (p > 0).then_some(p as u32)
            })
            .collect()
    }
}

/// `atexit` handler.
pub extern "C" fn on_exit() {
    if let Some(r) = REGION.get() {
        let _ = std::panic::catch_unwind(|| r.exit());
    }
}
