//! The real `dlsym` on musl.
//!
//! musl has no `dlvsym` and no symbol versions: `dlsym` is one unversioned symbol, and since the
//! shim exports its own, every `dlsym` reference (the shim's own included) binds to the shim.
//! So the real one is read from the C library's ELF dynamic symbol table:
//!
//! 1. `dl_iterate_phdr` walks the loaded objects; the C library is the one whose `PT_LOAD`
//!    segments contain `dl_iterate_phdr` itself (on musl, libc and the dynamic loader are one
//!    object, `/lib/ld-musl-<arch>.so.1`, whatever name the program linked it by).
//! 2. Its `PT_DYNAMIC` gives `DT_SYMTAB`, `DT_STRTAB` and `DT_GNU_HASH` / `DT_HASH`; `dlsym` is
//!    looked up through the hash table (GNU first, SysV otherwise), and must be a defined
//!    global or weak function.
//!
//! Should the C library not define it (a libc that is not musl, or glibc before 2.34, where it
//! lives in `libdl.so.2`), a second walk takes the first other object in load order, the shim
//! excepted, that defines a `dlsym` function; only then are other objects' tables read.
//!
//! Every read is bounded by the tables' own sizes and loop caps, and nothing here can panic
//! (the callback is `extern "C"`, called by libc).
//!
//! `RTLD_NEXT` stays caller-relative: musl's `dlsym` is an assembly stub that takes the
//! caller's return address (`(%rsp)` on x86_64, `x30` on aarch64) and passes it to the hidden
//! `__dlsym`, and the shim's naked `dlsym` reaches it with a plain jump, so the address is the
//! caller's, as with glibc.

use std::ffi::{c_int, c_void};

const DT_NULL: i64 = 0;
const DT_HASH: i64 = 4;
const DT_STRTAB: i64 = 5;
const DT_SYMTAB: i64 = 6;
const DT_STRSZ: i64 = 10;
const DT_SYMENT: i64 = 11;
const DT_GNU_HASH: i64 = 0x6fff_fef5;

const STT_FUNC: u8 = 2;
const STB_GLOBAL: u8 = 1;
const STB_WEAK: u8 = 2;
const SHN_UNDEF: u16 = 0;

/// Caps on table walks: far beyond any real library, small enough never to hang.
const MAX_DYN: usize = 4096;
const MAX_CHAIN: usize = 1 << 20;

#[repr(C)]
struct Dyn {
    tag: i64,
    val: u64,
}

#[repr(C)]
struct Sym {
    name: u32,
    info: u8,
    other: u8,
    shndx: u16,
    value: u64,
    size: u64,
}

struct Search {
    /// An address inside the C library (`dl_iterate_phdr`).
    anchor: usize,
    /// The shim's own `dlsym`, never an answer.
    ours: usize,
    /// Second pass: look at the other objects too.
    fallback: bool,
    /// `dlsym` in the object that contains `anchor`.
    libc: usize,
    /// The first `dlsym` found in any other object (second pass).
    other: usize,
}

fn gnu_hash(name: &[u8]) -> u32 {
    name.iter().fold(5381u32, |h, &c| {
        h.wrapping_mul(33).wrapping_add(u32::from(c))
    })
}

fn sysv_hash(name: &[u8]) -> u32 {
    let mut h: u32 = 0;
    for &c in name {
        h = (h << 4).wrapping_add(u32::from(c));
        let g = h & 0xf000_0000;
        if g != 0 {
            h ^= g >> 24;
        }
        h &= !g;
    }
    h
}

/// A dynamic-section address: musl leaves `d_ptr` as the link-time value (an offset from the
/// load base for a shared object); glibc rewrites it to the run-time address. Both are handled.
fn at(base: usize, v: u64) -> usize {
    let v = v as usize;
    if v < base { base.wrapping_add(v) } else { v }
}

/// One object's dynamic symbol table.
struct Table {
    base: usize,
    symtab: usize,
    syment: usize,
    strtab: usize,
    strsz: usize,
    gnu_hash: usize,
    sysv_hash: usize,
}

impl Table {
    /// # Safety
    /// `dynamic` points to a loaded object's `PT_DYNAMIC` of at most `max` entries.
    unsafe fn read(base: usize, dynamic: *const Dyn, max: usize) -> Option<Table> {
        let mut t = Table {
            base,
            symtab: 0,
            syment: std::mem::size_of::<Sym>(),
            strtab: 0,
            strsz: usize::MAX,
            gnu_hash: 0,
            sysv_hash: 0,
        };
        for i in 0..max.min(MAX_DYN) {
            // SAFETY: within the object's dynamic segment (bounded by its size).
            let d = unsafe { dynamic.add(i).read_unaligned() };
            match d.tag {
                DT_NULL => break,
                DT_SYMTAB => t.symtab = at(base, d.val),
                DT_STRTAB => t.strtab = at(base, d.val),
                DT_STRSZ => t.strsz = d.val as usize,
                DT_SYMENT => t.syment = d.val as usize,
                DT_GNU_HASH => t.gnu_hash = at(base, d.val),
                DT_HASH => t.sysv_hash = at(base, d.val),
                _ => {}
            }
        }
        let usable = t.symtab != 0
            && t.strtab != 0
            && t.syment >= std::mem::size_of::<Sym>()
            && (t.gnu_hash != 0 || t.sysv_hash != 0);
        usable.then_some(t)
    }

    /// The address of symbol `i` if it is the defined function `name`.
    ///
    /// # Safety
    /// `i` comes from this object's hash table.
    unsafe fn matches(&self, i: usize, name: &[u8]) -> Option<usize> {
        let p = self.symtab.wrapping_add(i.wrapping_mul(self.syment)) as *const Sym;
        // SAFETY: a symbol index from the object's own hash table.
        let s = unsafe { p.read_unaligned() };
        let kind = s.info & 0xf;
        let bind = s.info >> 4;
        if s.shndx == SHN_UNDEF
            || s.value == 0
            || kind != STT_FUNC
            || !(bind == STB_GLOBAL || bind == STB_WEAK)
        {
            return None;
        }
        let off = s.name as usize;
        if off >= self.strsz || self.strsz - off <= name.len() {
            return None;
        }
        let str_ = self.strtab.wrapping_add(off) as *const u8;
        // SAFETY: `name.len() + 1` bytes inside the string table (checked against DT_STRSZ).
        let bytes = unsafe { std::slice::from_raw_parts(str_, name.len() + 1) };
        (bytes[..name.len()] == *name && bytes[name.len()] == 0)
            .then(|| self.base.wrapping_add(s.value as usize))
    }

    /// # Safety
    /// The table was read from a loaded object.
    unsafe fn lookup(&self, name: &[u8]) -> Option<usize> {
        if self.gnu_hash != 0 {
            // SAFETY: the object's own DT_GNU_HASH table.
            return unsafe { self.lookup_gnu(name) };
        }
        // SAFETY: the object's own DT_HASH table.
        unsafe { self.lookup_sysv(name) }
    }

    unsafe fn lookup_gnu(&self, name: &[u8]) -> Option<usize> {
        let hdr = self.gnu_hash as *const u32;
        // SAFETY: the four-word header of DT_GNU_HASH.
        let (nbuckets, symoffset, bloom_size) =
            unsafe { (hdr.read(), hdr.add(1).read(), hdr.add(2).read()) };
        if nbuckets == 0 {
            return None;
        }
        let buckets = self
            .gnu_hash
            .wrapping_add(16)
            .wrapping_add(bloom_size as usize * std::mem::size_of::<usize>())
            as *const u32;
        // SAFETY: the buckets follow the bloom filter; the chains follow the buckets.
        let chains = unsafe { buckets.add(nbuckets as usize) };
        let h = gnu_hash(name);
        // SAFETY: `h % nbuckets` is a bucket index.
        let first = unsafe { buckets.add((h % nbuckets) as usize).read() } as usize;
        if first < symoffset as usize {
            return None;
        }
        for i in (first..).take(MAX_CHAIN) {
            // SAFETY: chain entries run parallel to the symbols from `symoffset` on, and a
            // chain ends at an entry with the low bit set.
            let h2 = unsafe { chains.add(i - symoffset as usize).read() };
            if (h | 1) == (h2 | 1) {
                // SAFETY: `i` is a symbol index from the table.
                if let Some(a) = unsafe { self.matches(i, name) } {
                    return Some(a);
                }
            }
            if h2 & 1 != 0 {
                break;
            }
        }
        None
    }

    unsafe fn lookup_sysv(&self, name: &[u8]) -> Option<usize> {
        let hdr = self.sysv_hash as *const u32;
        // SAFETY: the two-word header of DT_HASH.
        let (nbucket, nchain) = unsafe { (hdr.read(), hdr.add(1).read()) };
        if nbucket == 0 {
            return None;
        }
        // SAFETY: buckets then chains follow the header.
        let (buckets, chains) = unsafe { (hdr.add(2), hdr.add(2 + nbucket as usize)) };
        // SAFETY: `h % nbucket` is a bucket index.
        let mut i = unsafe { buckets.add((sysv_hash(name) % nbucket) as usize).read() };
        let mut steps = 0;
        while i != 0 && i < nchain && steps < MAX_CHAIN {
            // SAFETY: `i` is a symbol index below nchain (= the number of symbols).
            if let Some(a) = unsafe { self.matches(i as usize, name) } {
                return Some(a);
            }
            // SAFETY: as above.
            i = unsafe { chains.add(i as usize).read() };
            steps += 1;
        }
        None
    }
}

unsafe extern "C" fn visit(
    info: *mut libc::dl_phdr_info,
    _size: usize,
    data: *mut c_void,
) -> c_int {
    // SAFETY: `data` is the `Search` passed to dl_iterate_phdr; `info` is libc's.
    let (s, info) = unsafe { (&mut *data.cast::<Search>(), &*info) };
    if info.dlpi_phdr.is_null() {
        return 0;
    }
    let base = info.dlpi_addr as usize;
    let mut dynamic: Option<(*const Dyn, usize)> = None;
    let mut has_anchor = false;
    for i in 0..usize::from(info.dlpi_phnum) {
        // SAFETY: `dlpi_phnum` program headers at `dlpi_phdr`.
        let ph = unsafe { &*info.dlpi_phdr.add(i) };
        let start = base.wrapping_add(ph.p_vaddr as usize);
        match ph.p_type {
            libc::PT_DYNAMIC => {
                let n = ph.p_memsz as usize / std::mem::size_of::<Dyn>();
                dynamic = Some((start as *const Dyn, n));
            }
            libc::PT_LOAD
                if (start..start.wrapping_add(ph.p_memsz as usize)).contains(&s.anchor) =>
            {
                has_anchor = true;
            }
            _ => {}
        }
    }
    let Some((dynamic, n)) = dynamic else {
        return 0;
    };
    if !has_anchor && !s.fallback {
        return 0;
    }
    // SAFETY: the object's own dynamic segment, `n` entries.
    let Some(table) = (unsafe { Table::read(base, dynamic, n) }) else {
        return 0;
    };
    // SAFETY: the table of a loaded object.
    let found = unsafe { table.lookup(b"dlsym") }.filter(|&a| a != s.ours);
    match found {
        Some(a) if has_anchor => {
            s.libc = a;
            1 // done
        }
        Some(a) => {
            s.other = a;
            1 // the first in load order
        }
        None => 0,
    }
}

/// The C library's `dlsym`, NULL if none was found.
pub fn find_real_dlsym(ours: *mut c_void) -> *mut c_void {
    let mut s = Search {
        anchor: libc::dl_iterate_phdr as *const () as usize,
        ours: ours as usize,
        fallback: false,
        libc: 0,
        other: 0,
    };
    // Only the C library's tables are read unless it has no `dlsym`.
    for fallback in [false, true] {
        s.fallback = fallback;
        // SAFETY: `visit` only reads the loaded objects' headers and tables.
        unsafe { libc::dl_iterate_phdr(Some(visit), (&raw mut s).cast()) };
        if s.libc != 0 || s.other != 0 {
            break;
        }
    }
    let p = if s.libc != 0 { s.libc } else { s.other };
    p as *mut c_void
}

// Compiled into the glibc unit tests too: the lookup is libc-agnostic, and glibc (whose
// `dlvsym` gives the answer independently) checks it there.
#[cfg(test)]
mod tests {
    use std::ffi::c_void;

    #[test]
    fn hashes_match_the_elf_definitions() {
        assert_eq!(super::sysv_hash(b""), 0);
        assert_eq!(super::sysv_hash(b"printf"), 0x0779_05a6);
        assert_eq!(super::gnu_hash(b""), 0x0000_1505);
        assert_eq!(super::gnu_hash(b"printf"), 0x156b_2bb8);
    }

    #[test]
    fn finds_the_c_librarys_dlsym_and_never_ours() {
        let ours = crate::hooks::dlsym as *mut c_void;
        let found = super::find_real_dlsym(ours);
        assert!(!found.is_null());
        assert_ne!(found, ours);
        #[cfg(target_env = "gnu")]
        {
            // SAFETY: dlopen/dlvsym with constant strings.
            let expected = unsafe {
                let h = libc::dlopen(c"libc.so.6".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
                assert!(!h.is_null());
                let mut p = std::ptr::null_mut();
                for v in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
                    p = libc::dlvsym(h, c"dlsym".as_ptr(), v.as_ptr());
                    if !p.is_null() {
                        break;
                    }
                }
                p
            };
            if !expected.is_null() {
                assert_eq!(found, expected);
            }
        }
        // It is a working dlsym.
        // SAFETY: the real dlsym with a constant name.
        let getpid = unsafe {
            let f: unsafe extern "C" fn(*mut c_void, *const std::ffi::c_char) -> *mut c_void =
                std::mem::transmute(found);
            f(libc::RTLD_DEFAULT, c"getpid".as_ptr())
        };
        assert_eq!(getpid, libc::getpid as *mut c_void);
    }
}
