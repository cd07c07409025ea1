//! HAMi-core's shared-region file (`CUDA_DEVICE_MEMORY_SHARED_CACHE`): the layout constants and
//! a safe reader.
//!
//! The layout is `shared_region_t` of HAMi-core 1.2 on x86_64/aarch64 glibc (`sem_t` = 32
//! bytes; core contract §4.2). It is frozen by HAMi's Go monitor
//! (`pkg/monitor/nvidia/v1/spec.go`), so every offset here is pinned by a test. The shim
//! (`libvgpu-shim`) writes the file through these offsets; the device plugin's monitor reads it
//! with [`RegionSnapshot::parse`], which never panics on any input; [`feedback`] is the
//! monitor's decision on what to write back (`recent_kernel`, `utilization_switch`).
// Daemon and library code returns errors; only tests may unwrap (clippy.toml allows it there).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

use thiserror::Error;

pub mod feedback;
pub mod protocol;

/// `MULTIPROCESS_SHARED_REGION_MAGIC_FLAG`: `initialized_flag` once the header is complete.
pub const MAGIC: i32 = 19_920_718;
pub const MAJOR_VERSION: u32 = 1;
pub const MINOR_VERSION: u32 = 2;
/// `CUDA_DEVICE_MAX_COUNT`.
pub const MAX_DEVICES: usize = 16;
/// `SHARED_REGION_MAX_PROCESS_NUM`.
pub const MAX_PROCS: usize = 1024;
/// Bytes of one NUL-padded UUID string.
pub const UUID_LEN: usize = 96;
/// `sizeof(shared_region_t)`.
pub const REGION_SIZE: usize = 2_008_952;
/// HAMi-core sizes the file with `lseek(REGION_SIZE)` and a 1-byte write.
pub const FILE_SIZE: usize = REGION_SIZE + 1;
/// Default path when `CUDA_DEVICE_MEMORY_SHARED_CACHE` is unset.
pub const DEFAULT_PATH: &str = "/tmp/cudevshr.cache";

/// Byte offsets of the header fields of `shared_region_t`.
pub mod offset {
    /// atomic i32, `== MAGIC` once initialised (stored last, with release order).
    pub const INITIALIZED_FLAG: usize = 0;
    pub const MAJOR_VERSION: usize = 4;
    pub const MINOR_VERSION: usize = 8;
    pub const SM_INIT_FLAG: usize = 12;
    /// atomic usize: pid holding `sem`.
    pub const OWNER_PID: usize = 16;
    /// `sem_t` (32 bytes).
    pub const SEM: usize = 24;
    /// u64.
    pub const DEVICE_NUM: usize = 56;
    /// `char[16][96]`.
    pub const UUIDS: usize = 64;
    /// `u64[16]`, bytes, 0 = unlimited.
    pub const LIMIT: usize = 1600;
    /// `u64[16]`, percent.
    pub const SM_LIMIT: usize = 1728;
    /// `shrreg_proc_slot_t[1024]`.
    pub const PROCS: usize = 1856;
    /// atomic i32.
    pub const PROC_NUM: usize = 2_008_896;
    /// atomic i32, written by the host monitor.
    pub const UTILIZATION_SWITCH: usize = 2_008_900;
    /// atomic i32, written by the library and the host monitor.
    pub const RECENT_KERNEL: usize = 2_008_904;
    /// i32.
    pub const PRIORITY: usize = 2_008_908;
    /// atomic u64, epoch seconds.
    pub const LAST_KERNEL_TIME: usize = 2_008_912;
    /// `sem_t` (32 bytes).
    pub const SEM_POSTINIT: usize = 2_008_920;
}

/// Byte offsets inside one `shrreg_proc_slot_t`.
pub mod slot {
    pub const SIZE: usize = 1960;
    /// atomic i32: container pid, 0 = free.
    pub const PID: usize = 0;
    /// atomic i32: host pid, 0 until known.
    pub const HOSTPID: usize = 4;
    /// `device_memory_t[16]`.
    pub const USED: usize = 8;
    /// `sizeof(device_memory_t)`.
    pub const DEVICE_MEMORY_SIZE: usize = 64;
    /// Offsets inside `device_memory_t` (atomic u64 each).
    pub const MEM_CONTEXT_SIZE: usize = 0;
    pub const MEM_MODULE_SIZE: usize = 8;
    pub const MEM_DATA_SIZE: usize = 16;
    pub const MEM_OFFSET: usize = 24;
    pub const MEM_TOTAL: usize = 32;
    /// `device_memory_t.unused[0]`, unused by HAMi. Tessera: bytes of host memory this process
    /// was given in place of device memory past the container's device share (opt-in
    /// oversubscription, docs/oversubscription.md). Not part of `total`, which stays device
    /// memory only.
    pub const MEM_HOST: usize = 40;
    /// `u64[16]`: NVML-measured bytes.
    pub const MONITORUSED: usize = 1032;
    /// `device_util_t[16]`.
    pub const DEVICE_UTIL: usize = 1160;
    pub const DEVICE_UTIL_SIZE: usize = 48;
    pub const UTIL_DEC: usize = 0;
    pub const UTIL_ENC: usize = 8;
    pub const UTIL_SM: usize = 16;
    /// atomic i32: 1 running, 2 suspended, 0 exited.
    pub const STATUS: usize = 1928;
    /// atomic u64 (HAMi-core's seqlock; the Go side sees `unused[0]`).
    pub const SEQLOCK: usize = 1936;
    /// `u64[2]`, unused by HAMi. Tessera stores the process start time (clock ticks since boot,
    /// `/proc/<pid>/stat` field 22) in the first word, to tell a reused pid from the original.
    pub const UNUSED: usize = 1944;
    pub const START_TIME: usize = UNUSED;

    /// Offset of slot `i` from the start of the region.
    pub const fn base(i: usize) -> usize {
        super::offset::PROCS + SIZE * i
    }
    /// Offset of `used[dev]` field `field` inside a slot.
    pub const fn mem(dev: usize, field: usize) -> usize {
        USED + DEVICE_MEMORY_SIZE * dev + field
    }
}

/// Process slot status values.
pub mod status {
    pub const EXITED: i32 = 0;
    pub const RUNNING: i32 = 1;
    pub const SUSPENDED: i32 = 2;
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum RegionError {
    #[error("region file is {0} bytes, shorter than the {REGION_SIZE}-byte HAMi-core 1.x layout")]
    TooShort(usize),
    #[error("region is not initialised (flag {0:#x}, expected {MAGIC:#x})")]
    NotInitialized(i32),
    #[error("region has unsupported layout version {0}.{1}")]
    UnsupportedVersion(u32, u32),
}

/// Per-device memory counters of one process slot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    pub context_size: u64,
    pub module_size: u64,
    pub data_size: u64,
    pub offset: u64,
    pub total: u64,
    /// Host memory given in place of device memory (Tessera's oversubscription; 0 under HAMi).
    pub host: u64,
}

/// One process slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcSlot {
    pub pid: i32,
    pub hostpid: i32,
    pub used: [DeviceMemory; MAX_DEVICES],
    pub monitorused: [u64; MAX_DEVICES],
    pub sm_util: [u64; MAX_DEVICES],
    pub status: i32,
    pub start_time: u64,
}

/// A decoded copy of a region, as the host monitor sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionSnapshot {
    pub major_version: u32,
    pub minor_version: u32,
    pub device_num: u64,
    /// UUID strings (up to the first NUL; invalid UTF-8 is replaced).
    pub uuids: Vec<String>,
    pub limit: [u64; MAX_DEVICES],
    pub sm_limit: [u64; MAX_DEVICES],
    /// Slots `0..proc_num` (`proc_num` clamped to `0..=1024`).
    pub procs: Vec<ProcSlot>,
    pub utilization_switch: i32,
    pub recent_kernel: i32,
    pub priority: i32,
    pub last_kernel_time: u64,
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    b.get(off..off + 4)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u32::from_ne_bytes)
}
fn i32_at(b: &[u8], off: usize) -> i32 {
    u32_at(b, off) as i32
}
fn u64_at(b: &[u8], off: usize) -> u64 {
    b.get(off..off + 8)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u64::from_ne_bytes)
}

impl RegionSnapshot {
    /// Decodes a region from the bytes of the file (or of a mapping of it).
    ///
    /// Accepts what HAMi's monitor accepts as "v1": magic set, major version 1, at least
    /// [`REGION_SIZE`] bytes. Any other input is an error, never a panic.
    pub fn parse(bytes: &[u8]) -> Result<Self, RegionError> {
        if bytes.len() < REGION_SIZE {
            return Err(RegionError::TooShort(bytes.len()));
        }
        let flag = i32_at(bytes, offset::INITIALIZED_FLAG);
        if flag != MAGIC {
            return Err(RegionError::NotInitialized(flag));
        }
        let (major, minor) = (
            u32_at(bytes, offset::MAJOR_VERSION),
            u32_at(bytes, offset::MINOR_VERSION),
        );
        if major != MAJOR_VERSION {
            return Err(RegionError::UnsupportedVersion(major, minor));
        }
        let uuids = (0..MAX_DEVICES)
            .map(|d| {
                let start = offset::UUIDS + d * UUID_LEN;
                let raw = &bytes[start..start + UUID_LEN];
                let end = raw.iter().position(|&c| c == 0).unwrap_or(UUID_LEN);
                String::from_utf8_lossy(&raw[..end]).into_owned()
            })
            .collect();
        let limit = std::array::from_fn(|d| u64_at(bytes, offset::LIMIT + 8 * d));
        let sm_limit = std::array::from_fn(|d| u64_at(bytes, offset::SM_LIMIT + 8 * d));
        let proc_num = i32_at(bytes, offset::PROC_NUM).clamp(0, MAX_PROCS as i32) as usize;
        let procs = (0..proc_num)
            .map(|i| {
                let b = slot::base(i);
                ProcSlot {
                    pid: i32_at(bytes, b + slot::PID),
                    hostpid: i32_at(bytes, b + slot::HOSTPID),
                    used: std::array::from_fn(|d| DeviceMemory {
                        context_size: u64_at(bytes, b + slot::mem(d, slot::MEM_CONTEXT_SIZE)),
                        module_size: u64_at(bytes, b + slot::mem(d, slot::MEM_MODULE_SIZE)),
                        data_size: u64_at(bytes, b + slot::mem(d, slot::MEM_DATA_SIZE)),
                        offset: u64_at(bytes, b + slot::mem(d, slot::MEM_OFFSET)),
                        total: u64_at(bytes, b + slot::mem(d, slot::MEM_TOTAL)),
                        host: u64_at(bytes, b + slot::mem(d, slot::MEM_HOST)),
                    }),
                    monitorused: std::array::from_fn(|d| {
                        u64_at(bytes, b + slot::MONITORUSED + 8 * d)
                    }),
                    sm_util: std::array::from_fn(|d| {
                        u64_at(
                            bytes,
                            b + slot::DEVICE_UTIL + slot::DEVICE_UTIL_SIZE * d + slot::UTIL_SM,
                        )
                    }),
                    status: i32_at(bytes, b + slot::STATUS),
                    start_time: u64_at(bytes, b + slot::START_TIME),
                }
            })
            .collect();
        Ok(Self {
            major_version: major,
            minor_version: minor,
            device_num: u64_at(bytes, offset::DEVICE_NUM),
            uuids,
            limit,
            sm_limit,
            procs,
            utilization_switch: i32_at(bytes, offset::UTILIZATION_SWITCH),
            recent_kernel: i32_at(bytes, offset::RECENT_KERNEL),
            priority: i32_at(bytes, offset::PRIORITY),
            last_kernel_time: u64_at(bytes, offset::LAST_KERNEL_TIME),
        })
    }

    /// Bytes in use on region device `dev` the way HAMi's monitor counts them: the sum of
    /// `used[dev].total` over slots whose status is not "exited". Saturates; 0 for a bad index.
    pub fn device_usage(&self, dev: usize) -> u64 {
        self.summed(dev, |m| m.total)
    }

    /// `field` of `used[dev]` summed over the slots not "exited"; saturates, 0 for a bad index.
    fn summed(&self, dev: usize, field: impl Fn(&DeviceMemory) -> u64) -> u64 {
        if dev >= MAX_DEVICES {
            return 0;
        }
        self.procs
            .iter()
            .filter(|p| p.status != status::EXITED)
            .fold(0u64, |acc, p| acc.saturating_add(field(&p.used[dev])))
    }

    /// Host memory the container's live processes hold in place of device memory on region
    /// device `dev` (oversubscription); saturates, 0 for a bad index.
    pub fn host_usage(&self, dev: usize) -> u64 {
        self.summed(dev, |m| m.host)
    }

    /// Live (non-exited, non-zero pid) process slots.
    pub fn live_procs(&self) -> impl Iterator<Item = &ProcSlot> {
        self.procs
            .iter()
            .filter(|p| p.pid != 0 && p.status != status::EXITED)
    }
}

/// Parses HAMi-core's size syntax exactly as `get_limit_from_env` does (core contract §1.2; see
/// `docs/design/sm-limiter.md` and the shim's README for the quirks): the **last character**
/// picks the scale (`g`/`G` 2^30, `m`/`M` 2^20, `k`/`K` 2^10, else 1) and the digits are read
/// like `strtoul(s, NULL, 0)` (leading spaces, optional sign, `0x` hex, leading `0` octal; parsing
/// stops at the first non-digit). A negative number wraps like `strtoul` does. Overflow of
/// value × scale gives 0.
///
/// Returns the HAMi value and whether the text looks like something HAMi mis-parses (the shim
/// warns then: e.g. `4Gi` → 4 bytes, `010g` → octal 8 GiB, `-1` → unlimited).
pub fn parse_hami_size(text: &str) -> HamiSize {
    let bytes = text.as_bytes();
    let scale: u64 = match bytes.last() {
        Some(b'g' | b'G') => 1 << 30,
        Some(b'm' | b'M') => 1 << 20,
        Some(b'k' | b'K') => 1 << 10,
        _ => 1,
    };
    let (value, consumed) = strtoul(text);
    let result = value.checked_mul(scale).unwrap_or(0);
    // Text HAMi reads fully: [spaces] digits [one scale letter]. Anything else is suspicious.
    let trimmed = text.trim_start();
    let body = trimmed
        .strip_suffix(['g', 'G', 'm', 'M', 'k', 'K'])
        .unwrap_or(trimmed);
    let plain_decimal = !body.is_empty()
        && body.bytes().all(|c| c.is_ascii_digit())
        && !(body.len() > 1 && body.starts_with('0'));
    let suspicious = !plain_decimal || consumed == 0 || value.checked_mul(scale).is_none();
    HamiSize {
        bytes: result,
        suspicious,
    }
}

/// Result of [`parse_hami_size`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HamiSize {
    /// What HAMi-core would use (0 = no limit, `u64::MAX` = effectively no limit).
    pub bytes: u64,
    /// The text is not a plain `<decimal>[kKmMgG]`, so HAMi's result is probably not what the
    /// user meant.
    pub suspicious: bool,
}

/// `strtoul(s, &end, 0)` on a 64-bit target: returns the value and the number of bytes consumed
/// (0 when no digits). Out of range gives `u64::MAX`, as glibc does (ERANGE).
pub fn strtoul(s: &str) -> (u64, usize) {
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c) {
        i += 1;
    }
    let mut negative = false;
    if i < b.len() && (b[i] == b'+' || b[i] == b'-') {
        negative = b[i] == b'-';
        i += 1;
    }
    let mut base = 10;
    if i + 1 < b.len()
        && b[i] == b'0'
        && (b[i + 1] | 0x20) == b'x'
        && b.get(i + 2).is_some_and(u8::is_ascii_hexdigit)
    {
        base = 16;
        i += 2;
    } else if i < b.len() && b[i] == b'0' {
        base = 8;
    }
    let start = i;
    let mut value: u64 = 0;
    let mut overflow = false;
    while i < b.len() {
        let d = match b[i] {
            c @ b'0'..=b'9' => (c - b'0') as u64,
            c @ b'a'..=b'f' => (c - b'a' + 10) as u64,
            c @ b'A'..=b'F' => (c - b'A' + 10) as u64,
            _ => break,
        };
        if d >= base {
            break;
        }
        match value.checked_mul(base).and_then(|v| v.checked_add(d)) {
            Some(v) => value = v,
            None => overflow = true,
        }
        i += 1;
    }
    if i == start {
        return (0, 0);
    }
    if overflow {
        return (u64::MAX, i);
    }
    (
        if negative {
            value.wrapping_neg()
        } else {
            value
        },
        i,
    )
}
