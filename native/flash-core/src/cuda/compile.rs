//! NVRTC: kernel source + defines -> cubin for one arch, cached in memory and on disk.
//!
//! Disk cache: `$FLASH_NIF_CACHE_DIR`, else `$XDG_CACHE_HOME/flash_nif`, else `~/.cache/flash_nif`;
//! per variant and arch `<variant>-<arch>-<key>.cubin` and its NVRTC log `.log` (ptxas's resource
//! report, so that a cached compile check needs no recompile), where the key hashes the expanded
//! source, the options, the arch, the NVRTC version and this crate's version. Writes go through a
//! temporary file and a rename (the log before the cubin), so concurrent processes never read a
//! half-written entry.

use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::sys as nv;

use super::variant::Variant;
use super::{elf, libs, sources};
use crate::error::{FlashError, Result};

static MEMORY: OnceLock<Mutex<HashMap<u64, Compiled>>> = OnceLock::new();

/// The cache directory (created on first write).
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FLASH_NIF_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("flash_nif");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("flash_nif")
}

fn nvrtc_err(call: &str, r: nv::nvrtcResult) -> FlashError {
    FlashError::Cuda { call: call.to_string(), message: format!("{r:?}") }
}

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    libs::ensure_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: out-pointers to two ints.
    let r = unsafe { nv::nvrtcVersion(&mut major, &mut minor) };
    if r != nv::nvrtcResult::NVRTC_SUCCESS {
        return Err(nvrtc_err("nvrtcVersion", r));
    }
    Ok((major, minor))
}

/// Development probes only: `FLASH_NIF_NVRTC_DEFINES="NAME=VALUE ..."` adds these defines to every
/// kernel's options (and so to the cache key), e.g. a timing probe's switch, so that one wheel runs
/// several probe builds (tools/ab_probe.sh). Unset in every product path; where set, the process
/// says so on stderr once.
pub const EXTRA_DEFINES_ENV: &str = "FLASH_NIF_NVRTC_DEFINES";

fn extra_defines() -> Option<String> {
    static SAID: std::sync::Once = std::sync::Once::new();
    let extra = std::env::var(EXTRA_DEFINES_ENV).ok().filter(|e| !e.trim().is_empty())?;
    SAID.call_once(|| eprintln!("flash_nif: {EXTRA_DEFINES_ENV}={extra}: these defines go into every kernel's compile"));
    Some(extra)
}

/// NVRTC options for `v` on `arch` (e.g. "sm_90a"): its defines, and ptxas's resource report
/// (registers, spills, stack) in the log.
pub fn options(v: &Variant, arch: &str) -> Vec<String> {
    let mut o = vec![format!("-arch={arch}"), "-std=c++17".to_string(), "-default-device".to_string()];
    o.extend(v.defines.iter().map(|(k, x)| format!("-D{k}={x}")));
    if let Some(extra) = extra_defines() {
        o.extend(extra.split_whitespace().map(|d| format!("-D{d}")));
    }
    o.push("-Xptxas=-v".to_string());
    o
}

/// What a compile produced.
#[derive(Clone)]
pub struct Compiled {
    pub cubin: Arc<Vec<u8>>,
    /// The NVRTC log: ptxas's resource report (empty from a disk entry whose log was lost).
    pub log: Arc<str>,
    /// Dynamic shared memory per block, as the kernel declares it (elf.rs).
    pub smem_bytes: usize,
    pub from_cache: bool,
}

/// Compiles (or fetches from the caches) the cubin of `v` for `arch`.
pub fn compile(v: &Variant, arch: &str) -> Result<Compiled> {
    compile_with(v, arch, false)
}

/// As [`compile`]; `fresh` skips the cache lookups (the result still refreshes them).
pub fn compile_with(v: &Variant, arch: &str, fresh: bool) -> Result<Compiled> {
    let (major, minor) = nvrtc_version()?;
    let src = sources::expand(v.source)
        .ok_or_else(|| FlashError::Internal(format!("kernel source {} is not embedded", v.source)))?;
    let opts = options(v, arch);
    let key = sources::fnv1a(&[
        src.as_bytes(),
        opts.join(" ").as_bytes(),
        arch.as_bytes(),
        format!("nvrtc {major}.{minor}").as_bytes(),
        crate::VERSION.as_bytes(),
    ]);
    let mem = MEMORY.get_or_init(|| Mutex::new(HashMap::new()));
    let path = cache_dir().join(format!("{}-{arch}-{key:016x}.cubin", v.name()));
    if !fresh {
        if let Some(c) = mem.lock().ok().and_then(|m| m.get(&key).cloned()) {
            return Ok(c);
        }
        if let Some(c) = read_entry(&path) {
            if let Ok(mut m) = mem.lock() {
                m.insert(key, c.clone());
            }
            return Ok(c);
        }
    }
    let (cubin, log) = run_nvrtc(&src, v, &opts)?;
    let smem_bytes = elf::smem_bytes(&cubin).map_err(|e| FlashError::Internal(format!("{}: {e}", v.name())))?;
    write_atomic(&path.with_extension("log"), log.as_bytes()); // a cache that cannot be written
    write_atomic(&path, &cubin); // only costs a recompile
    let c = Compiled { cubin: Arc::new(cubin), log: log.into(), smem_bytes, from_cache: false };
    if let Ok(mut m) = mem.lock() {
        m.insert(key, Compiled { from_cache: true, ..c.clone() });
    }
    Ok(c)
}

/// A disk entry, or None when it is missing or unreadable (then it is rebuilt).
fn read_entry(path: &Path) -> Option<Compiled> {
    let cubin = std::fs::read(path).ok()?;
    let smem_bytes = elf::smem_bytes(&cubin).ok()?;
    let log = std::fs::read_to_string(path.with_extension("log")).unwrap_or_default();
    Some(Compiled { cubin: Arc::new(cubin), log: log.into(), smem_bytes, from_cache: true })
}

fn write_atomic(path: &Path, bytes: &[u8]) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = dir.join(format!(".{}.{}.tmp", std::process::id(), path.file_name().and_then(|n| n.to_str()).unwrap_or("x")));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

fn run_nvrtc(src: &str, v: &Variant, opts: &[String]) -> Result<(Vec<u8>, String)> {
    let csrc = CString::new(src).map_err(|_| FlashError::Internal("NUL in kernel source".into()))?;
    let cname = CString::new(v.source).unwrap_or_default();
    let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid C strings; no headers.
    let r = unsafe {
        nv::nvrtcCreateProgram(&mut prog, csrc.as_ptr(), cname.as_ptr(), 0, std::ptr::null(), std::ptr::null())
    };
    if r != nv::nvrtcResult::NVRTC_SUCCESS {
        return Err(nvrtc_err("nvrtcCreateProgram", r));
    }
    struct Guard(nv::nvrtcProgram);
    impl Drop for Guard {
        fn drop(&mut self) {
            // SAFETY: created above, destroyed once.
            unsafe {
                nv::nvrtcDestroyProgram(&mut self.0);
            }
        }
    }
    let guard = Guard(prog);
    let copts: Vec<CString> = opts.iter().map(|o| CString::new(o.as_str()).unwrap_or_default()).collect();
    let ptrs: Vec<*const c_char> = copts.iter().map(|c| c.as_ptr()).collect();
    // SAFETY: the program is live; the option pointers outlive the call.
    let rc = unsafe { nv::nvrtcCompileProgram(guard.0, ptrs.len() as i32, ptrs.as_ptr()) };
    let log = program_log(guard.0);
    if rc != nv::nvrtcResult::NVRTC_SUCCESS {
        return Err(FlashError::Nvrtc { kernel: format!("{} ({})", v.name(), opts.join(" ")), log });
    }
    let mut size = 0usize;
    // SAFETY: compiled program; out-pointer.
    let r = unsafe { nv::nvrtcGetCUBINSize(guard.0, &mut size) };
    if r != nv::nvrtcResult::NVRTC_SUCCESS {
        return Err(nvrtc_err("nvrtcGetCUBINSize", r));
    }
    let mut cubin = vec![0u8; size];
    // SAFETY: the buffer holds `size` bytes.
    let r = unsafe { nv::nvrtcGetCUBIN(guard.0, cubin.as_mut_ptr() as *mut c_char) };
    if r != nv::nvrtcResult::NVRTC_SUCCESS {
        return Err(nvrtc_err("nvrtcGetCUBIN", r));
    }
    Ok((cubin, log))
}

fn program_log(prog: nv::nvrtcProgram) -> String {
    let mut n = 0usize;
    // SAFETY: live program; out-pointer.
    if unsafe { nv::nvrtcGetProgramLogSize(prog, &mut n) } != nv::nvrtcResult::NVRTC_SUCCESS || n == 0 {
        return String::new();
    }
    let mut buf = vec![0u8; n];
    // SAFETY: the buffer holds n bytes.
    unsafe { nv::nvrtcGetProgramLog(prog, buf.as_mut_ptr() as *mut c_char) };
    String::from_utf8_lossy(&buf).trim_end_matches('\0').trim().to_string()
}
