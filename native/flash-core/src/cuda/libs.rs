//! Finding libcuda and libnvrtc at run time, before cudarc touches them.
//!
//! cudarc (with `dynamic-loading`) opens the libraries by soname on first use and panics when they
//! are missing, so every entry point calls [`ensure_driver`] / [`ensure_nvrtc`] first and turns
//! absence into [`FlashError::CudaUnavailable`]. NVRTC may come from the system (`libnvrtc.so.13`
//! through the loader's path) or from pip's `nvidia-cuda-nvrtc` wheel
//! (`site-packages/nvidia/cu13/lib`, `nvidia/cuda_nvrtc/lib` for CUDA 12). A pip copy is opened by
//! full path with `RTLD_GLOBAL`, its `libnvrtc-builtins` first; the loader then resolves cudarc's
//! later open by soname to the library already in the process.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use crate::error::{FlashError, Result};

static EXTRA_ROOTS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static NVRTC: OnceLock<std::result::Result<String, String>> = OnceLock::new();
static DRIVER: OnceLock<std::result::Result<(), String>> = OnceLock::new();

/// Adds directories (e.g. Python's `sys.path` entries) where pip's `nvidia/...` packages may live.
/// Only has an effect before the first GPU call.
pub fn add_search_roots<I: IntoIterator<Item = PathBuf>>(roots: I) {
    if let Ok(mut v) = EXTRA_ROOTS.lock() {
        for r in roots {
            if !v.contains(&r) {
                v.push(r);
            }
        }
    }
}

/// Directories searched for pip's NVIDIA wheels: `FLASH_NIF_NVRTC_DIR` (the lib folder itself),
/// the registered roots, `PYTHONPATH` entries and `$VIRTUAL_ENV`'s site-packages.
fn search_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os("FLASH_NIF_NVRTC_DIR") {
        dirs.push(PathBuf::from(d));
    }
    let mut roots: Vec<PathBuf> = EXTRA_ROOTS.lock().map(|v| v.clone()).unwrap_or_default();
    if let Some(pp) = std::env::var_os("PYTHONPATH") {
        roots.extend(std::env::split_paths(&pp));
    }
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        if let Ok(rd) = std::fs::read_dir(Path::new(&venv).join("lib")) {
            roots.extend(rd.flatten().map(|e| e.path().join("site-packages")));
        }
    }
    for r in roots {
        for sub in ["nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib", "nvidia/cu12/lib"] {
            dirs.push(r.join(sub));
        }
    }
    dirs
}

#[cfg(unix)]
fn open_global(path: &Path) -> std::result::Result<(), String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading a shared library runs its initialisers; NVIDIA's libraries have no unsound
    // ones. The handle is leaked on purpose: the library must stay loaded for the process.
    let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }
        .map_err(|e| format!("{}: {e}", path.display()))?;
    std::mem::forget(lib);
    Ok(())
}

#[cfg(not(unix))]
fn open_global(path: &Path) -> std::result::Result<(), String> {
    Err(format!("{}: preloading is only implemented on Unix", path.display()))
}

fn find_nvrtc() -> std::result::Result<String, String> {
    // SAFETY: only probes dlopen with cudarc's candidate names.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Ok("system".to_string());
    }
    let mut tried = Vec::new();
    for dir in search_dirs() {
        let Ok(rd) = std::fs::read_dir(&dir) else { continue };
        let mut names: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
        names.sort();
        let is = |p: &PathBuf, prefix: &str| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(prefix))
        };
        let Some(main) = names.iter().rev().find(|p| is(p, "libnvrtc.so.")) else { continue };
        for b in names.iter().filter(|p| is(p, "libnvrtc-builtins.so.")) {
            let _ = open_global(b);
        }
        match open_global(main) {
            Ok(()) if unsafe { cudarc::nvrtc::sys::is_culib_present() } => {
                return Ok(main.display().to_string())
            }
            Ok(()) => tried.push(format!("{} (loaded, but not under a soname cudarc knows)", main.display())),
            Err(e) => tried.push(e),
        }
    }
    Err(format!(
        "libnvrtc was not found on the loader path nor in pip's nvidia packages{}; \
         install it with `pip install nvidia-cuda-nvrtc` or set FLASH_NIF_NVRTC_DIR",
        if tried.is_empty() { String::new() } else { format!(" (tried: {})", tried.join("; ")) }
    ))
}

/// Makes NVRTC loadable; returns where it came from ("system" or the pip path).
pub fn ensure_nvrtc() -> Result<String> {
    NVRTC.get_or_init(find_nvrtc).clone().map_err(FlashError::CudaUnavailable)
}

/// Checks that the CUDA driver library (libcuda.so.1) can be opened.
pub fn ensure_driver() -> Result<()> {
    DRIVER
        .get_or_init(|| {
            // SAFETY: only probes dlopen with cudarc's candidate names.
            if unsafe { cudarc::driver::sys::is_culib_present() } {
                Ok(())
            } else {
                Err("the NVIDIA driver library (libcuda.so.1) was not found: no NVIDIA GPU driver on this machine"
                    .to_string())
            }
        })
        .clone()
        .map_err(FlashError::CudaUnavailable)
}
