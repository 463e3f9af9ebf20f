//! A stand-in for NVIDIA's CUDA driver (`libcuda.so`) on machines without a GPU, so that
//! the code that will talk to every real GPU — Fulmen's CUDA backend, through cudarc — runs
//! in CI. Copied as `libcuda.so` into a folder first on `LD_LIBRARY_PATH`, cudarc loads it
//! as the driver (it is built as `libfulmen_cuda_standin.so`, so that cargo's own library
//! path never offers it as the machine's driver).
//!
//! ```text
//! cuModuleLoadData(cubin or PTX)    ─▶ the kernels the image really holds (ELF sections,
//!                                       .entry lines), if it runs on the reported compute
//!                                       capability
//! cuModuleGetFunction(name)          ─▶ that kernel, which must be in the image and in
//!                                       the emulator
//! cuLaunchKernel(f, grid, block, shared, stream, params)
//!   ├─ a GPU's limits: ≤ 1024 threads per block, grid ≤ 2^31-1 × 65535 × 65535,
//!   │   dynamic shared memory ≤ 48 KiB unless the kernel opted in (cuFuncSetAttribute)
//!   ├─ the emulator's compiled kernel of that name, given the very parameter array
//!   └─ every live allocation's guard zones checked: a write out of bounds is
//!       CUDA_ERROR_ILLEGAL_ADDRESS, sticky, as on a GPU
//! cuMemAlloc*: 256-byte aligned, guarded, within FULMEN_STANDIN_MEMORY per device
//!              (else CUDA_ERROR_OUT_OF_MEMORY)
//! ```
//!
//! Work runs late, as on a GPU: launches, `…Async` copies and `cuMemFreeAsync` are checked
//! and counted when called, queued, and run in order when the host waits (a stream or
//! context synchronisation, a synchronous copy or free), or when the queue grows long. A
//! fault found while running them poisons the context and is returned by the call that
//! waited. Pinned host memory is read and written only when its copy runs. See `queue.rs`.
//!
//! Environment (read once, at `cuInit`):
//!
//! | variable | meaning |
//! |---|---|
//! | `FULMEN_STANDIN_DEVICES` | devices it reports (default 2) |
//! | `FULMEN_STANDIN_MEMORY` | bytes of memory per device (default 2 GiB) |
//! | `FULMEN_STANDIN_COMPUTE=M.m` | the compute capability the devices report (default 9.0, an H100/H200's): a cubin loads only on its own major version at its minor or above, PTX on its target or above (else CUDA_ERROR_NO_BINARY_FOR_GPU / CUDA_ERROR_INVALID_PTX, as a driver answers) |
//! | `FULMEN_STANDIN_FAIL_COPY=N` | the Nth copy fails (CUDA_ERROR_UNKNOWN, not sticky) |
//! | `FULMEN_STANDIN_FAIL_LAUNCH=N` | the Nth launch fails (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, not sticky) |
//! | `FULMEN_STANDIN_STICKY_LAUNCH=N` | the Nth launch faults when it runs: it poisons its context, so the wait that ran it and every later call on the context fail with CUDA_ERROR_ILLEGAL_ADDRESS until the context is recreated (its primary context released by every holder, or reset) |
//! | `FULMEN_STANDIN_COUNTS=FILE` | at exit, writes the calls it received (launches, syncs, copies and bytes, allocations, modules loaded and how many of them were PTX) to FILE as JSON |
//!
//! What it cannot prove: that the kernels' machine code is right (it runs the emulator's
//! host build of the same sources), the GPU's memory model (the emulator's atomics are
//! sequentially consistent and its memory coherent), or anything about timing.

// The driver API's names, and its contract: callers pass valid pointers and handles (this
// library checks what a driver checks, and no more).
#![allow(non_snake_case)]
#![allow(clippy::missing_safety_doc, clippy::not_unsafe_ptr_arg_deref)]

mod image;
mod launch;
mod memory;
mod queue;

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};

use fulmen_kernels::Kernel;
use fulmen_kernels::emu::{EmuLaunchConfig, EmuMemory};

use queue::{Queue, Source, Work};

/// The driver's result code (a C enum: only codes the CUDA 12.8 headers declare are used).
pub type CUresult = c_uint;

const SUCCESS: CUresult = 0;
const INVALID_VALUE: CUresult = 1;
const OUT_OF_MEMORY: CUresult = 2;
const NOT_INITIALIZED: CUresult = 3;
const NO_DEVICE: CUresult = 100;
const INVALID_DEVICE: CUresult = 101;
const INVALID_IMAGE: CUresult = 200;
const NO_BINARY_FOR_GPU: CUresult = 209;
const INVALID_PTX: CUresult = 218;
const INVALID_CONTEXT: CUresult = 201;
const INVALID_HANDLE: CUresult = 400;
const NOT_FOUND: CUresult = 500;
const ILLEGAL_ADDRESS: CUresult = 700;
const LAUNCH_OUT_OF_RESOURCES: CUresult = 701;
const LAUNCH_FAILED: CUresult = 719;
const NOT_SUPPORTED: CUresult = 801;
const UNKNOWN: CUresult = 999;

/// `CUdevice_attribute` values this driver answers.
const ATTR_MAX_THREADS_PER_BLOCK: c_uint = 1;
const ATTR_MAX_BLOCK_DIM_X: c_uint = 2;
const ATTR_MAX_BLOCK_DIM_Y: c_uint = 3;
const ATTR_MAX_BLOCK_DIM_Z: c_uint = 4;
const ATTR_MAX_GRID_DIM_X: c_uint = 5;
const ATTR_MAX_GRID_DIM_Y: c_uint = 6;
const ATTR_MAX_GRID_DIM_Z: c_uint = 7;
const ATTR_MAX_SHARED_MEMORY_PER_BLOCK: c_uint = 8;
const ATTR_WARP_SIZE: c_uint = 10;
const ATTR_MULTIPROCESSOR_COUNT: c_uint = 16;
const ATTR_COMPUTE_CAPABILITY_MAJOR: c_uint = 75;
const ATTR_COMPUTE_CAPABILITY_MINOR: c_uint = 76;
const ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: c_uint = 97;
const ATTR_MEMORY_POOLS_SUPPORTED: c_uint = 115;
/// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`.
const FUNC_ATTR_MAX_DYNAMIC_SHARED: c_uint = 8;

/// Dynamic shared memory a kernel may use without opting in, and the most it may opt in
/// to (an H100/H200's per-block limits).
const DEFAULT_SHARED: u32 = 48 << 10;
const OPTIN_SHARED: u32 = 227 << 10;
/// Multiprocessors each device reports: few, as the emulated device does, so that
/// grid-stride kernels launch few blocks and whole-query tests stay fast.
const MULTIPROCESSORS: c_int = 2;

/// What the driver was asked to do, written to `FULMEN_STANDIN_COUNTS` at exit.
#[derive(Default)]
struct Counts {
    launches: AtomicU64,
    stream_syncs: AtomicU64,
    context_syncs: AtomicU64,
    stream_waits: AtomicU64,
    h2d_copies: AtomicU64,
    h2d_bytes: AtomicU64,
    d2h_copies: AtomicU64,
    d2h_bytes: AtomicU64,
    d2d_copies: AtomicU64,
    d2d_bytes: AtomicU64,
    allocations: AtomicU64,
    frees: AtomicU64,
    modules: AtomicU64,
    ptx_modules: AtomicU64,
    sticky_errors: AtomicU64,
}

impl Counts {
    fn json(&self) -> String {
        let fields = [
            ("launches", &self.launches),
            ("stream_syncs", &self.stream_syncs),
            ("context_syncs", &self.context_syncs),
            ("stream_waits", &self.stream_waits),
            ("h2d_copies", &self.h2d_copies),
            ("h2d_bytes", &self.h2d_bytes),
            ("d2h_copies", &self.d2h_copies),
            ("d2h_bytes", &self.d2h_bytes),
            ("d2d_copies", &self.d2d_copies),
            ("d2d_bytes", &self.d2d_bytes),
            ("allocations", &self.allocations),
            ("frees", &self.frees),
            ("modules", &self.modules),
            ("ptx_modules", &self.ptx_modules),
            ("sticky_errors", &self.sticky_errors),
        ];
        let body: Vec<String> = fields
            .iter()
            .map(|(k, v)| format!("\"{k}\": {}", v.load(Ordering::Relaxed)))
            .collect();
        format!("{{{}}}\n", body.join(", "))
    }
}

fn number(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.trim().parse().ok()
}

struct Config {
    devices: usize,
    memory: usize,
    compute: (u32, u32),
    fail_copy: Option<u64>,
    fail_launch: Option<u64>,
    sticky_launch: Option<u64>,
    counts: Option<String>,
}

impl Config {
    fn from_env() -> Self {
        Self {
            devices: number("FULMEN_STANDIN_DEVICES").unwrap_or(2) as usize,
            memory: number("FULMEN_STANDIN_MEMORY").unwrap_or(2 << 30) as usize,
            compute: std::env::var("FULMEN_STANDIN_COMPUTE")
                .ok()
                .and_then(|v| {
                    let (major, minor) = v.trim().split_once('.')?;
                    Some((major.parse().ok()?, minor.parse().ok()?))
                })
                .unwrap_or((9, 0)),
            fail_copy: number("FULMEN_STANDIN_FAIL_COPY"),
            fail_launch: number("FULMEN_STANDIN_FAIL_LAUNCH"),
            sticky_launch: number("FULMEN_STANDIN_STICKY_LAUNCH"),
            counts: std::env::var("FULMEN_STANDIN_COUNTS").ok(),
        }
    }
}

/// A device's primary context: its memory, and its sticky error once it has one.
struct Context {
    device: usize,
    holders: Mutex<usize>,
    flags: AtomicU32,
    /// 0, or the error every call on this context now returns.
    sticky: AtomicU32,
    memory: RwLock<Arc<EmuMemory>>,
    /// Bytes each live allocation asked for, and their sum.
    sizes: Mutex<HashMap<u64, usize>>,
    in_use: AtomicUsize,
    /// Work queued on the context's streams, not run yet.
    queue: Queue,
}

impl Context {
    fn new(device: usize) -> Self {
        Self {
            device,
            holders: Mutex::new(0),
            flags: AtomicU32::new(0),
            sticky: AtomicU32::new(0),
            memory: RwLock::new(Arc::new(EmuMemory::default())),
            sizes: Mutex::new(HashMap::new()),
            in_use: AtomicUsize::new(0),
            queue: Queue::default(),
        }
    }

    /// Runs the context's queued work (a wait for the device), then reports its sticky
    /// error, if any.
    fn wait(&self) -> Result<(), CUresult> {
        self.queue.run(self)
    }

    fn check(&self) -> Result<(), CUresult> {
        match self.sticky.load(Ordering::Acquire) {
            0 => Ok(()),
            e => Err(e),
        }
    }

    fn poison(&self, error: CUresult, why: &str) -> CUresult {
        if self
            .sticky
            .compare_exchange(0, error, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            driver()
                .counts
                .sticky_errors
                .fetch_add(1, Ordering::Relaxed);
            eprintln!(
                "fulmen stand-in CUDA driver: device {} context poisoned ({}): {why}",
                self.device,
                name_of(error)
            );
        }
        error
    }

    fn memory(&self) -> Arc<EmuMemory> {
        Arc::clone(&self.memory.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// The context made anew: memory freed, sticky error cleared.
    fn reset(&self) {
        self.queue.clear();
        *self.memory.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(EmuMemory::default());
        lock(&self.sizes).clear();
        self.in_use.store(0, Ordering::Relaxed);
        self.sticky.store(0, Ordering::Release);
    }
}

struct Driver {
    config: Config,
    contexts: Vec<Context>,
    counts: Counts,
    /// Pinned host allocations: address → layout.
    host: Mutex<HashMap<usize, std::alloc::Layout>>,
    copies: AtomicU64,
}

static DRIVER: OnceLock<Driver> = OnceLock::new();

fn driver() -> &'static Driver {
    DRIVER.get_or_init(|| {
        let config = Config::from_env();
        let contexts = (0..config.devices).map(Context::new).collect();
        Driver {
            config,
            contexts,
            counts: Counts::default(),
            host: Mutex::new(HashMap::new()),
            copies: AtomicU64::new(0),
        }
    })
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

thread_local! {
    static CURRENT: Cell<*const Context> = const { Cell::new(std::ptr::null()) };
}

fn current() -> Result<&'static Context, CUresult> {
    let ctx = CURRENT.with(Cell::get);
    context_of(ctx.cast())
}

fn context_of(handle: *const c_void) -> Result<&'static Context, CUresult> {
    driver()
        .contexts
        .iter()
        .find(|c| std::ptr::eq(*c, handle.cast()))
        .ok_or(INVALID_CONTEXT)
}

fn device(dev: c_int) -> Result<&'static Context, CUresult> {
    usize::try_from(dev)
        .ok()
        .and_then(|d| driver().contexts.get(d))
        .ok_or(INVALID_DEVICE)
}

/// A stream: the context it belongs to.
struct Stream {
    context: &'static Context,
}

fn stream_context(stream: *mut c_void) -> Result<&'static Context, CUresult> {
    // Null is the default stream, 0x1 and 0x2 the legacy and per-thread ones: all of the
    // current context.
    if (stream as usize) <= 2 {
        return current();
    }
    // SAFETY: non-null streams are Boxes made by cuStreamCreate (cudarc never passes others).
    Ok(unsafe { &*(stream as *const Stream) }.context)
}

/// A loaded module: the kernels its image holds, and the functions handed out.
struct Module {
    context: &'static Context,
    kernels: Vec<String>,
    functions: Mutex<HashMap<String, Box<Function>>>,
}

/// A kernel of a module.
struct Function {
    kernel: Kernel,
    context: &'static Context,
    max_dynamic_shared: AtomicU32,
}

fn out<T>(ptr: *mut T, value: T) -> CUresult {
    if ptr.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: a non-null output pointer of the right type, per the driver API.
    unsafe { ptr.write(value) };
    SUCCESS
}

fn result(r: Result<(), CUresult>) -> CUresult {
    r.err().unwrap_or(SUCCESS)
}

extern "C" fn write_counts() {
    let d = driver();
    if let Some(path) = &d.config.counts
        && let Err(e) = std::fs::write(path, d.counts.json())
    {
        eprintln!("fulmen stand-in CUDA driver: cannot write {path}: {e}");
    }
}

unsafe extern "C" {
    fn atexit(callback: extern "C" fn()) -> c_int;
}

// ---- initialisation and devices ----

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    if flags != 0 {
        return INVALID_VALUE;
    }
    static REGISTERED: OnceLock<()> = OnceLock::new();
    REGISTERED.get_or_init(|| {
        // SAFETY: registers a plain function to run at exit.
        unsafe { atexit(write_counts) };
    });
    if driver().contexts.is_empty() {
        return NO_DEVICE;
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    out(version, 12080)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    out(count, driver().contexts.len() as c_int)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGet(dev: *mut c_int, ordinal: c_int) -> CUresult {
    match device(ordinal) {
        Ok(_) => out(dev, ordinal),
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attribute: c_uint,
    dev: c_int,
) -> CUresult {
    if let Err(e) = device(dev) {
        return e;
    }
    let v = match attribute {
        ATTR_MAX_THREADS_PER_BLOCK | ATTR_MAX_BLOCK_DIM_X | ATTR_MAX_BLOCK_DIM_Y => 1024,
        ATTR_MAX_BLOCK_DIM_Z => 64,
        ATTR_MAX_GRID_DIM_X => i32::MAX,
        ATTR_MAX_GRID_DIM_Y | ATTR_MAX_GRID_DIM_Z => 65535,
        ATTR_MAX_SHARED_MEMORY_PER_BLOCK => DEFAULT_SHARED as c_int,
        ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN => OPTIN_SHARED as c_int,
        ATTR_WARP_SIZE => 32,
        ATTR_MULTIPROCESSOR_COUNT => MULTIPROCESSORS,
        ATTR_COMPUTE_CAPABILITY_MAJOR => driver().config.compute.0 as c_int,
        ATTR_COMPUTE_CAPABILITY_MINOR => driver().config.compute.1 as c_int,
        ATTR_MEMORY_POOLS_SUPPORTED => 1,
        _ => return INVALID_VALUE,
    };
    out(value, v)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> CUresult {
    if let Err(e) = device(dev) {
        return e;
    }
    if name.is_null() || len <= 0 {
        return INVALID_VALUE;
    }
    let text = format!("Fulmen stand-in GPU {dev} (H200 limits)");
    let bytes = text.as_bytes();
    let n = bytes.len().min(len as usize - 1);
    // SAFETY: the caller's buffer holds `len` bytes; n + 1 <= len.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), name.cast(), n);
        name.add(n).write(0);
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) -> CUresult {
    match device(dev) {
        Ok(_) => out(bytes, driver().config.memory),
        Err(e) => e,
    }
}

// ---- contexts ----

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut *mut c_void, dev: c_int) -> CUresult {
    match device(dev) {
        Ok(c) => {
            *lock(&c.holders) += 1;
            out(ctx, c as *const Context as *mut c_void)
        }
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: c_int) -> CUresult {
    match device(dev) {
        Ok(c) => {
            let mut holders = lock(&c.holders);
            if *holders == 0 {
                return INVALID_CONTEXT;
            }
            *holders -= 1;
            if *holders == 0 {
                c.reset();
            }
            SUCCESS
        }
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxReset_v2(dev: c_int) -> CUresult {
    match device(dev) {
        Ok(c) => {
            c.reset();
            SUCCESS
        }
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxSetFlags_v2(dev: c_int, flags: c_uint) -> CUresult {
    match device(dev) {
        Ok(c) => {
            c.flags.store(flags, Ordering::Relaxed);
            SUCCESS
        }
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxGetState(
    dev: c_int,
    flags: *mut c_uint,
    active: *mut c_int,
) -> CUresult {
    match device(dev) {
        Ok(c) => {
            let held = *lock(&c.holders) > 0;
            let r = out(flags, c.flags.load(Ordering::Relaxed));
            if r != SUCCESS {
                return r;
            }
            out(active, held as c_int)
        }
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxGetCurrent(ctx: *mut *mut c_void) -> CUresult {
    out(ctx, CURRENT.with(Cell::get) as *mut c_void)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(ctx: *mut c_void) -> CUresult {
    if !ctx.is_null()
        && let Err(e) = context_of(ctx)
    {
        return e;
    }
    CURRENT.with(|c| c.set(ctx.cast()));
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxGetDevice(dev: *mut c_int) -> CUresult {
    match current() {
        Ok(c) => out(dev, c.device as c_int),
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    driver()
        .counts
        .context_syncs
        .fetch_add(1, Ordering::Relaxed);
    result(current().and_then(Context::wait))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetFlags(flags: c_uint) -> CUresult {
    match current() {
        Ok(c) => {
            c.flags.store(flags, Ordering::Relaxed);
            SUCCESS
        }
        Err(e) => e,
    }
}

// ---- streams ----

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamCreate(stream: *mut *mut c_void, _flags: c_uint) -> CUresult {
    match current().and_then(|c| c.check().map(|()| c)) {
        Ok(context) => out(stream, Box::into_raw(Box::new(Stream { context })).cast()),
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamDestroy_v2(stream: *mut c_void) -> CUresult {
    if stream.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: made by cuStreamCreate and destroyed once (cudarc's CudaStream drop).
    drop(unsafe { Box::from_raw(stream as *mut Stream) });
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize(stream: *mut c_void) -> CUresult {
    driver().counts.stream_syncs.fetch_add(1, Ordering::Relaxed);
    result(stream_context(stream).and_then(Context::wait))
}

// ---- events ----
//
// A context's streams share one queue here (see `queue.rs`), so a stream's wait for an
// event recorded on another is already kept: work queued after the wait runs after the
// work queued before the record. The calls check their handles and count the waits.

/// An event: the context it was made in.
struct Event {
    context: &'static Context,
}

fn event_context(event: *mut c_void) -> Result<&'static Context, CUresult> {
    if event.is_null() {
        return Err(INVALID_HANDLE);
    }
    // SAFETY: non-null events are Boxes made by cuEventCreate.
    Ok(unsafe { &*(event as *const Event) }.context)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventCreate(event: *mut *mut c_void, _flags: c_uint) -> CUresult {
    match current().and_then(|c| c.check().map(|()| c)) {
        Ok(context) => out(event, Box::into_raw(Box::new(Event { context })).cast()),
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventDestroy_v2(event: *mut c_void) -> CUresult {
    if event.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: made by cuEventCreate and destroyed once (cudarc's CudaEvent drop).
    drop(unsafe { Box::from_raw(event as *mut Event) });
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecord(event: *mut c_void, stream: *mut c_void) -> CUresult {
    match (event_context(event), stream_context(stream)) {
        (Ok(e), Ok(s)) if std::ptr::eq(e, s) => result(e.check()),
        (Ok(_), Ok(_)) => INVALID_CONTEXT,
        (Err(e), _) | (_, Err(e)) => e,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitEvent(
    stream: *mut c_void,
    event: *mut c_void,
    _flags: c_uint,
) -> CUresult {
    driver().counts.stream_waits.fetch_add(1, Ordering::Relaxed);
    match (event_context(event), stream_context(stream)) {
        (Ok(_), Ok(s)) => result(s.check()),
        (Err(e), _) | (_, Err(e)) => e,
    }
}

// ---- errors ----

fn name_of(error: CUresult) -> &'static str {
    match error {
        SUCCESS => "CUDA_SUCCESS",
        INVALID_VALUE => "CUDA_ERROR_INVALID_VALUE",
        OUT_OF_MEMORY => "CUDA_ERROR_OUT_OF_MEMORY",
        NOT_INITIALIZED => "CUDA_ERROR_NOT_INITIALIZED",
        NO_DEVICE => "CUDA_ERROR_NO_DEVICE",
        INVALID_DEVICE => "CUDA_ERROR_INVALID_DEVICE",
        INVALID_IMAGE => "CUDA_ERROR_INVALID_IMAGE",
        NO_BINARY_FOR_GPU => "CUDA_ERROR_NO_BINARY_FOR_GPU",
        INVALID_PTX => "CUDA_ERROR_INVALID_PTX",
        INVALID_CONTEXT => "CUDA_ERROR_INVALID_CONTEXT",
        INVALID_HANDLE => "CUDA_ERROR_INVALID_HANDLE",
        NOT_FOUND => "CUDA_ERROR_NOT_FOUND",
        ILLEGAL_ADDRESS => "CUDA_ERROR_ILLEGAL_ADDRESS",
        LAUNCH_OUT_OF_RESOURCES => "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        LAUNCH_FAILED => "CUDA_ERROR_LAUNCH_FAILED",
        NOT_SUPPORTED => "CUDA_ERROR_NOT_SUPPORTED",
        _ => "CUDA_ERROR_UNKNOWN",
    }
}

fn text_of(error: CUresult) -> &'static CStr {
    match error {
        SUCCESS => c"no error",
        INVALID_VALUE => c"invalid argument",
        OUT_OF_MEMORY => c"out of memory",
        NOT_INITIALIZED => c"initialization error",
        NO_DEVICE => c"no CUDA-capable device is detected",
        INVALID_DEVICE => c"invalid device ordinal",
        INVALID_IMAGE => c"device kernel image is invalid",
        NO_BINARY_FOR_GPU => c"no kernel image is available for execution on the device",
        INVALID_PTX => c"a PTX JIT compilation failed",
        INVALID_CONTEXT => c"invalid device context",
        INVALID_HANDLE => c"invalid resource handle",
        NOT_FOUND => c"named symbol not found",
        ILLEGAL_ADDRESS => c"an illegal memory access was encountered",
        LAUNCH_OUT_OF_RESOURCES => c"too many resources requested for launch",
        LAUNCH_FAILED => c"unspecified launch failure",
        NOT_SUPPORTED => c"operation not supported",
        _ => c"unknown error",
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGetErrorString(error: CUresult, text: *mut *const c_char) -> CUresult {
    out(text, text_of(error).as_ptr())
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGetErrorName(error: CUresult, name: *mut *const c_char) -> CUresult {
    static NAMES: OnceLock<Mutex<HashMap<CUresult, std::ffi::CString>>> = OnceLock::new();
    let mut names = lock(NAMES.get_or_init(|| Mutex::new(HashMap::new())));
    let text = names
        .entry(error)
        .or_insert_with(|| std::ffi::CString::new(name_of(error)).unwrap_or_default());
    out(name, text.as_ptr())
}
