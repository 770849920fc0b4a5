//! Devices, contexts, loaded modules and raw launches, through cudarc's driver bindings.
//!
//! Work runs in the device's primary context (the one CuPy and torch use), made current for the
//! duration of a call and the caller's previous context restored afterwards. Modules are loaded
//! once per (device, cubin) and kept for the life of the process; which of a launch's candidate
//! variants fits a device is decided once per (device, candidates) from the compiled kernels.

use std::collections::HashMap;
use std::ffi::{c_void, CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{self as cu, CUresult};

use super::compile;
use super::libs;
use super::variant::Variant;
use crate::error::{FlashError, Result};

/// A CUDA driver call's result as a FlashError naming the call.
pub fn check(call: &str, r: CUresult) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: out-pointer; the driver returns a static string.
    let msg = unsafe {
        if cu::cuGetErrorName(r, &mut name) == CUresult::CUDA_SUCCESS && !name.is_null() {
            CStr::from_ptr(name).to_string_lossy().into_owned()
        } else {
            format!("{r:?}")
        }
    };
    Err(FlashError::Cuda { call: call.to_string(), message: msg })
}

/// One GPU: its primary context and properties.
pub struct Device {
    pub ordinal: usize,
    pub ctx: cu::CUcontext,
    pub name: String,
    pub cc: (i32, i32),
    /// NVRTC target: sm_90a on Hopper (wgmma-capable), sm_XY elsewhere.
    pub arch: String,
    pub sm_count: i32,
    pub max_smem_optin: i32,
    /// Shared memory an SM holds, and what each resident block costs of it besides its own.
    pub smem_per_sm: i32,
    pub smem_reserved_per_block: i32,
}

// SAFETY: CUcontext / CUdevice are driver handles usable from any thread.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

static INIT: OnceLock<std::result::Result<(), FlashError>> = OnceLock::new();
static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<Device>>>> = OnceLock::new();

/// Loads libcuda and initialises the driver once.
pub fn init() -> Result<()> {
    INIT.get_or_init(|| {
        libs::ensure_driver()?;
        // SAFETY: the library is present (checked above).
        match unsafe { cu::cuInit(0) } {
            CUresult::CUDA_SUCCESS => Ok(()),
            r => Err(FlashError::CudaUnavailable(format!(
                "cuInit failed ({}): no usable NVIDIA GPU",
                check("cuInit", r).err().map(|e| e.to_string()).unwrap_or_default()
            ))),
        }
    })
    .clone()
}

/// Number of CUDA devices (0 when the driver is missing).
pub fn device_count() -> Result<usize> {
    init()?;
    let mut n = 0;
    // SAFETY: out-pointer.
    check("cuDeviceGetCount", unsafe { cu::cuDeviceGetCount(&mut n) })?;
    Ok(n.max(0) as usize)
}

fn attribute(dev: cu::CUdevice, a: cu::CUdevice_attribute) -> Result<i32> {
    let mut v = 0;
    // SAFETY: out-pointer, valid device.
    check("cuDeviceGetAttribute", unsafe { cu::cuDeviceGetAttribute(&mut v, a, dev) })?;
    Ok(v)
}

/// The device with this ordinal (primary context retained for the life of the process).
pub fn device(ordinal: usize) -> Result<Arc<Device>> {
    init()?;
    let map = DEVICES.get_or_init(|| Mutex::new(HashMap::new()));
    let mut map = map.lock().map_err(|_| FlashError::Internal("device table poisoned".into()))?;
    if let Some(d) = map.get(&ordinal) {
        return Ok(d.clone());
    }
    let count = device_count()?;
    if ordinal >= count {
        return Err(FlashError::CudaUnavailable(format!(
            "CUDA device {ordinal} requested but {count} device(s) are visible"
        )));
    }
    let mut dev: cu::CUdevice = 0;
    // SAFETY: out-pointers; ordinal checked.
    check("cuDeviceGet", unsafe { cu::cuDeviceGet(&mut dev, ordinal as i32) })?;
    let mut name = [0 as std::ffi::c_char; 256];
    check("cuDeviceGetName", unsafe { cu::cuDeviceGetName(name.as_mut_ptr(), 255, dev) })?;
    // SAFETY: NUL-terminated by the driver (and by our zeroed buffer).
    let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
    use cu::CUdevice_attribute as A;
    let major = attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let sm_count = attribute(dev, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    let mut max_smem_optin = attribute(dev, A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
    // Testing aid: FLASH_NIF_MAX_SMEM=<bytes> makes a big GPU pick the tiles of a smaller one.
    if let Some(cap) = std::env::var("FLASH_NIF_MAX_SMEM").ok().and_then(|v| v.parse::<i32>().ok()) {
        max_smem_optin = max_smem_optin.min(cap);
    }
    let smem_per_sm = attribute(dev, A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?;
    let smem_reserved_per_block = attribute(dev, A::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK)?;
    let mut ctx: cu::CUcontext = std::ptr::null_mut();
    check("cuDevicePrimaryCtxRetain", unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, dev) })?;
    keep_pool_memory(dev)?;
    let arch = if major == 9 && minor == 0 { "sm_90a".to_string() } else { format!("sm_{major}{minor}") };
    let d = Arc::new(Device { ordinal, ctx, name, cc: (major, minor), arch, sm_count, max_smem_optin, smem_per_sm, smem_reserved_per_block });
    map.insert(ordinal, d.clone());
    Ok(d)
}

/// Bytes of freed stream-ordered memory (the workspace of every call: the backward's dQ sums are
/// q-sized f32) that the device's default pool keeps for the next call instead of returning them
/// to the driver at each synchronisation. With the driver's default (0), every backward paid a
/// fresh mapping of its workspace: +260 us of host time at B·S = 16k, H·D = 2048 on an H100
/// (bench/RESULTS.md). `FLASH_NIF_POOL_KEEP=<bytes>` sets it (0: the driver's behaviour).
pub const POOL_KEEP_ENV: &str = "FLASH_NIF_POOL_KEEP";
const POOL_KEEP_DEFAULT: u64 = 4 << 30;

fn keep_pool_memory(dev: cu::CUdevice) -> Result<()> {
    let mut keep = std::env::var(POOL_KEEP_ENV).ok().and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(POOL_KEEP_DEFAULT);
    let mut pool: cu::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: out-pointer; then the pool's attribute from a u64, as the driver API documents it.
    unsafe {
        check("cuDeviceGetDefaultMemPool", cu::cuDeviceGetDefaultMemPool(&mut pool, dev))?;
        check(
            "cuMemPoolSetAttribute(RELEASE_THRESHOLD)",
            cu::cuMemPoolSetAttribute(
                pool,
                cu::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut keep as *mut u64 as *mut std::ffi::c_void,
            ),
        )
    }
}

/// Makes `dev`'s primary context current until dropped, then restores the previous one.
pub struct ContextGuard {
    prev: cu::CUcontext,
}

impl ContextGuard {
    pub fn new(dev: &Device) -> Result<ContextGuard> {
        let mut prev: cu::CUcontext = std::ptr::null_mut();
        // SAFETY: out-pointer; the context is retained.
        check("cuCtxGetCurrent", unsafe { cu::cuCtxGetCurrent(&mut prev) })?;
        if prev != dev.ctx {
            check("cuCtxSetCurrent", unsafe { cu::cuCtxSetCurrent(dev.ctx) })?;
        }
        Ok(ContextGuard { prev })
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        // SAFETY: restoring the handle read in new() (null is valid: no context).
        unsafe {
            let mut cur: cu::CUcontext = std::ptr::null_mut();
            cu::cuCtxGetCurrent(&mut cur);
            if cur != self.prev {
                cu::cuCtxSetCurrent(self.prev);
            }
        }
    }
}

/// A kernel ready to launch on one device.
#[derive(Clone, Copy)]
pub struct Function {
    pub func: cu::CUfunction,
    pub threads: u32,
    pub smem: u32,
    /// Blocks of it an SM holds at once (the driver's occupancy, asked once at load).
    pub blocks_per_sm: u32,
}

// SAFETY: CUfunction handles are usable from any thread.
unsafe impl Send for Function {}
unsafe impl Sync for Function {}

static FUNCTIONS: OnceLock<Mutex<HashMap<(usize, Variant), Function>>> = OnceLock::new();
static CHOSEN: OnceLock<Mutex<HashMap<(usize, Variant), Variant>>> = OnceLock::new();

/// The first of `candidates` (config.rs's order of preference) whose kernel, as compiled for
/// `dev`, declares no more shared memory than `dev` allows per block; the choice is remembered.
pub fn choose(dev: &Device, candidates: &[Variant]) -> Result<Variant> {
    let first = candidates.first().ok_or_else(|| FlashError::Internal("no kernel variant to choose from".into()))?;
    let map = CHOSEN.get_or_init(|| Mutex::new(HashMap::new()));
    let key = (dev.ordinal, first.clone());
    if let Some(v) = map.lock().ok().and_then(|m| m.get(&key).cloned()) {
        return Ok(v);
    }
    let mut last = None;
    for v in candidates {
        match fits(dev, v, compile::compile(v, &dev.arch)?.smem_bytes) {
            Ok(()) => {
                if let Ok(mut m) = map.lock() {
                    m.insert(key, v.clone());
                }
                return Ok(v.clone());
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| FlashError::Internal("no kernel variant fits".into())))
}

fn fits(dev: &Device, v: &Variant, smem: usize) -> Result<()> {
    if smem <= dev.max_smem_optin.max(0) as usize {
        return Ok(());
    }
    Err(FlashError::Unsupported(format!(
        "kernel {} needs {smem} bytes of shared memory per block but {} ({}) allows {}",
        v.name(),
        dev.name,
        dev.arch,
        dev.max_smem_optin
    )))
}

/// Compiles (cached) and loads (cached) `v` on `dev`. The device's context must be current.
pub fn function(dev: &Device, v: &Variant) -> Result<Function> {
    let map = FUNCTIONS.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(f) = map.lock().ok().and_then(|m| m.get(&(dev.ordinal, v.clone())).copied()) {
        return Ok(f);
    }
    let compiled = compile::compile(v, &dev.arch)?;
    let smem = compiled.smem_bytes;
    fits(dev, v, smem)?;
    let mut module: cu::CUmodule = std::ptr::null_mut();
    // SAFETY: a cubin image for this device's arch; the context is current.
    check("cuModuleLoadData", unsafe { cu::cuModuleLoadData(&mut module, compiled.cubin.as_ptr() as *const c_void) })?;
    let entry = CString::new(v.kernel.entry()).expect("entry names have no NUL");
    let mut func: cu::CUfunction = std::ptr::null_mut();
    check("cuModuleGetFunction", unsafe { cu::cuModuleGetFunction(&mut func, module, entry.as_ptr()) })?;
    if smem > 48 * 1024 {
        check("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", unsafe {
            cu::cuFuncSetAttribute(
                func,
                cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
        })?;
    }
    let mut blocks_per_sm = 0;
    // SAFETY: out-pointer; the function just loaded, its shared-memory limit set.
    check("cuOccupancyMaxActiveBlocksPerMultiprocessor", unsafe {
        cu::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut blocks_per_sm, func, v.threads() as i32, smem)
    })?;
    let f = Function { func, threads: v.threads(), smem: smem as u32, blocks_per_sm: blocks_per_sm.max(1) as u32 };
    if let Ok(mut m) = map.lock() {
        m.insert((dev.ordinal, v.clone()), f);
    }
    Ok(f)
}

/// `f` asking for enough shared memory that an SM holds at most `per_sm` of its blocks at a time,
/// for a grid of at most `per_sm` blocks an SM launched dependent: the next kernel's blocks, placed
/// while this grid's last ones finish, then spread over the SMs instead of doubling up on those
/// that free first (decode at 8 x 8192 bf16, one block an SM, ran 67.6 us so against 74 in the
/// same call: bench/RESULTS.md session 61). `f` itself where its blocks are that few an SM already,
/// or where a block may not ask for that much.
pub fn alone(dev: &Device, f: Function, per_sm: u32) -> Result<Function> {
    let per_sm = per_sm.max(1);
    let pad = (dev.smem_per_sm / (per_sm as i32 + 1) - dev.smem_reserved_per_block + 1).max(0) as u32;
    if f.blocks_per_sm <= per_sm || pad <= f.smem || pad > dev.max_smem_optin.max(0) as u32 {
        return Ok(f);
    }
    static RAISED: OnceLock<Mutex<HashMap<usize, u32>>> = OnceLock::new();
    let raised = RAISED.get_or_init(|| Mutex::new(HashMap::new()));
    let key = f.func as usize;
    if raised.lock().map(|m| m.get(&key).copied().unwrap_or(0) < pad).unwrap_or(true) {
        // SAFETY: a loaded function; its launches ask for at most this limit.
        check("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", unsafe {
            cu::cuFuncSetAttribute(f.func, cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, pad as i32)
        })?;
        if let Ok(mut m) = raised.lock() {
            m.insert(key, pad);
        }
    }
    Ok(Function { smem: pad, blocks_per_sm: per_sm, ..f })
}

/// Launches `f` with one by-value parameter (the params struct) on `stream`. A grid with a zero
/// dimension launches nothing.
///
/// # Safety
/// `params` must match the kernel's parameter struct and every pointer in it must be valid
/// device memory of the sizes the kernel reads and writes, for as long as the stream runs.
pub unsafe fn launch<P>(name: &str, f: Function, grid: (u32, u32, u32), stream: cu::CUstream, params: &P) -> Result<()> {
    if !launches_blocks(name, grid)? {
        return Ok(());
    }
    let mut args = [params as *const P as *mut c_void];
    let r = cu::cuLaunchKernel(f.func, grid.0, grid.1, grid.2, f.threads, 1, 1, f.smem, stream, args.as_mut_ptr(), std::ptr::null_mut());
    if r == CUresult::CUDA_SUCCESS {
        return Ok(()); // no message built on the per-call path
    }
    check(&format!("cuLaunchKernel({name})"), r)
}

/// Whether `grid` launches any block (an empty dimension launches nothing); an error past CUDA's
/// limits in y and z.
fn launches_blocks(name: &str, grid: (u32, u32, u32)) -> Result<bool> {
    if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
        return Ok(false);
    }
    if grid.1 > 65535 || grid.2 > 65535 {
        return Err(FlashError::Unsupported(format!(
            "{name}: grid {grid:?} exceeds CUDA's limit of 65535 blocks in y (heads) or z (batch)"
        )));
    }
    Ok(true)
}

/// As [`launch`], but on a device of compute capability 9.0 or later the kernel may be scheduled
/// while the stream's previous kernel is still finishing (programmatic dependent launch): its
/// launch and first instructions overlap that kernel's tail. The kernel must then wait for the
/// previous kernel's results itself (grid_dep.h `wait_for_prior_grid`) before it reads them, and the
/// previous one may release it early (`release_dependent_grid`). Older devices launch it plainly.
///
/// # Safety
/// As [`launch`]; and the kernel waits as above.
pub unsafe fn launch_dependent<P>(dev: &Device, name: &str, f: Function, grid: (u32, u32, u32), stream: cu::CUstream, params: &P) -> Result<()> {
    if dev.cc.0 < 9 {
        // SAFETY: the caller's guarantees.
        return unsafe { launch(name, f, grid, stream, params) };
    }
    // SAFETY: the caller's guarantees.
    unsafe { launch_with(name, f, grid, stream, params, &mut [dependent_attribute()]) }
}

/// The launch attribute that lets a kernel start while the stream's previous kernel finishes.
fn dependent_attribute() -> cu::CUlaunchAttribute {
    // SAFETY: a plain C union; the attribute reads only programmaticStreamSerializationAllowed.
    let mut value: cu::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    value.programmaticStreamSerializationAllowed = 1;
    cu::CUlaunchAttribute { id: cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, pad: [0; 4], value }
}

/// As [`launch`], with the grid's blocks in clusters of `cluster_x` consecutive blocks along x
/// (Hopper and later; the kernel may then use the cluster's barriers and shared memory), and
/// launched dependent as [`launch_dependent`] (clusters exist only where that does).
///
/// # Safety
/// As [`launch_dependent`].
pub unsafe fn launch_cluster<P>(name: &str, f: Function, grid: (u32, u32, u32), cluster_x: u32, stream: cu::CUstream, params: &P) -> Result<()> {
    // SAFETY: a plain C union; the attribute reads only clusterDim.
    let mut value: cu::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    value.clusterDim.x = cluster_x;
    value.clusterDim.y = 1;
    value.clusterDim.z = 1;
    let cluster = cu::CUlaunchAttribute { id: cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, pad: [0; 4], value };
    // SAFETY: the caller's guarantees.
    unsafe { launch_with(name, f, grid, stream, params, &mut [cluster, dependent_attribute()]) }
}

/// As [`launch`], through cuLaunchKernelEx with these launch attributes.
///
/// # Safety
/// As [`launch`].
unsafe fn launch_with<P>(name: &str, f: Function, grid: (u32, u32, u32), stream: cu::CUstream, params: &P, attrs: &mut [cu::CUlaunchAttribute]) -> Result<()> {
    if !launches_blocks(name, grid)? {
        return Ok(());
    }
    let config = cu::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: f.threads,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: f.smem,
        hStream: stream,
        attrs: attrs.as_mut_ptr(),
        numAttrs: attrs.len() as u32,
    };
    let mut args = [params as *const P as *mut c_void];
    // SAFETY: the config and its attribute outlive the call; the caller's guarantees for the rest.
    let r = unsafe { cu::cuLaunchKernelEx(&config, f.func, args.as_mut_ptr(), std::ptr::null_mut()) };
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    check(&format!("cuLaunchKernelEx({name})"), r)
}

/// Device memory freed on drop (stream-ordered when a stream is given).
pub struct DeviceBuffer {
    pub ptr: cu::CUdeviceptr,
    stream: cu::CUstream,
}

impl DeviceBuffer {
    /// Allocates `bytes` (at least 1) on `stream` (stream-ordered allocator).
    pub fn alloc(bytes: usize, stream: cu::CUstream) -> Result<DeviceBuffer> {
        let mut ptr: cu::CUdeviceptr = 0;
        // SAFETY: out-pointer; a context is current.
        let r = unsafe { cu::cuMemAllocAsync(&mut ptr, bytes.max(1), stream) };
        if r == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(FlashError::OutOfMemory(format!("cuMemAllocAsync of {bytes} bytes on the GPU")));
        }
        check("cuMemAllocAsync", r)?;
        Ok(DeviceBuffer { ptr, stream })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by alloc() on this stream, freed once.
        unsafe {
            cu::cuMemFreeAsync(self.ptr, self.stream);
        }
    }
}
