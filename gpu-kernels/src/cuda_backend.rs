//! The CUDA backend of [`Device`](crate::Device): memory, copies and launches through the
//! driver API (cudarc's raw `result` layer, since device addresses travel as plain u64
//! like the emulator's).
//!
//! - Kernels are loaded once per device and file, from the image `images::module_image`
//!   picks: a cubin built ahead, one NVRTC compiles for the exact architecture (cached on
//!   disk), or PTX built ahead.
//! - Memory comes from the stream-ordered allocator (`cuMemAllocAsync`) where the device
//!   has one; the budget is kept by the device's pool as on the emulator.
//! - Work is queued without waiting on the stream of the handle that asks (the device's
//!   streams are made as handles ask for them, `Device::on_stream`): launches, copies
//!   between buffers, and uploads (each staged in one of two pinned halves, which
//!   `Device::write` refills only once every stream has passed them). Reads stage through
//!   their own pinned buffer and wait for their stream.
//! - Every call binds the device's context to the calling thread first.
//! - Threads waiting for the device block instead of spinning (the primary context is
//!   created with `CU_CTX_SCHED_BLOCKING_SYNC`), so waiting partitions leave the CPU to
//!   DataFusion's operators.
//! - A sticky error (after which every call on the context fails) is reported as
//!   [`KernelError::DeviceLost`], which quarantines the device.

use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError, result, sys};

use crate::kernels::Kernel;
use crate::{KernelError, Result};

use crate::device::{STAGING_BYTES, UPLOAD_HALF_BYTES};

/// Whether CUDA leaves the context unusable after `error` (every later call fails).
fn sticky(error: &DriverError) -> bool {
    use sys::cudaError_enum as E;
    matches!(
        error.0,
        E::CUDA_ERROR_ILLEGAL_ADDRESS
            | E::CUDA_ERROR_LAUNCH_FAILED
            | E::CUDA_ERROR_LAUNCH_TIMEOUT
            | E::CUDA_ERROR_ECC_UNCORRECTABLE
            | E::CUDA_ERROR_HARDWARE_STACK_ERROR
            | E::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | E::CUDA_ERROR_MISALIGNED_ADDRESS
            | E::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | E::CUDA_ERROR_INVALID_PC
            | E::CUDA_ERROR_ASSERT
            | E::CUDA_ERROR_CONTEXT_IS_DESTROYED
    )
}

fn driver(what: &str) -> impl Fn(DriverError) -> KernelError + '_ {
    move |e| KernelError::Driver(format!("{what}: {e}"))
}

impl CudaBackend {
    /// The error of a failed driver call: the device is lost when CUDA says so.
    fn failed(&self, what: &str, e: DriverError) -> KernelError {
        if sticky(&e) {
            KernelError::DeviceLost {
                device: format!("cuda:{}", self.ctx.ordinal()),
                message: format!("{what}: {e}"),
            }
        } else {
            KernelError::Driver(format!("{what}: {e}"))
        }
    }
}

struct Staging {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pinned buffer is only touched under the backend's mutex.
unsafe impl Send for Staging {}

/// The two pinned upload halves, one allocation of `2 * UPLOAD_HALF_BYTES`. Which half and
/// offset a piece goes to, and when a half may be refilled, is `Device::write`'s to say
/// (under its lock); this only holds the memory.
struct UploadHalves {
    ptr: *mut u8,
}

// SAFETY: the halves are written only by `Device::write`, under its upload lock, into
// ranges the stream has passed.
unsafe impl Send for UploadHalves {}
unsafe impl Sync for UploadHalves {}

pub(crate) struct CudaBackend {
    ctx: Arc<CudaContext>,
    /// The device's streams, by index (`Device::on_stream`), made as they are asked for.
    streams: Mutex<Vec<Arc<CudaStream>>>,
    /// An event for each stream other streams wait for ([`CudaBackend::join`]), by the
    /// stream's index, made the first time (recorded again for every wait).
    events: Mutex<Vec<Option<CudaEvent>>>,
    compute_capability: (i32, i32),
    async_alloc: bool,
    modules: Mutex<HashMap<&'static str, sys::CUmodule>>,
    functions: Mutex<HashMap<Kernel, sys::CUfunction>>,
    staging: Mutex<Staging>,
    uploads: UploadHalves,
}

// SAFETY: module and function handles are plain driver handles, valid on any thread once
// the context is bound; they are guarded by mutexes here.
unsafe impl Send for CudaBackend {}
unsafe impl Sync for CudaBackend {}

/// What `open` learns about the device.
pub(crate) struct CudaProperties {
    pub name: String,
    pub total_memory: usize,
    pub multiprocessors: u32,
    pub compute_capability: (i32, i32),
}

impl CudaBackend {
    pub fn open(ordinal: usize) -> Result<(Self, CudaProperties)> {
        if !crate::cuda::driver_present() {
            return Err(KernelError::Driver(
                "the CUDA driver library (libcuda) was not found".into(),
            ));
        }
        let count = CudaContext::device_count().map_err(driver("counting CUDA devices"))?;
        if ordinal >= count.max(0) as usize {
            return Err(KernelError::Driver(format!(
                "no CUDA device {ordinal} (this machine has {count})"
            )));
        }
        // Block, rather than spin, while waiting for the device (before the primary context
        // exists: its flags are fixed when it is created; a context another library made
        // first keeps its own, so this is best effort).
        let dev = result::device::get(ordinal as i32).map_err(driver("finding the device"))?;
        let blocking = sys::CUctx_flags::CU_CTX_SCHED_BLOCKING_SYNC as u32;
        // SAFETY: `dev` was just returned by cuDeviceGet; the call only sets flags.
        if let Err(e) = unsafe { sys::cuDevicePrimaryCtxSetFlags_v2(dev, blocking) }.result() {
            log::debug!("cuda:{ordinal}: blocking synchronisation not set: {e}");
        }
        let ctx = CudaContext::new(ordinal).map_err(driver("creating a CUDA context"))?;
        let stream = ctx.new_stream().map_err(driver("creating a CUDA stream"))?;
        let compute_capability = ctx
            .compute_capability()
            .map_err(driver("reading the compute capability"))?;
        let multiprocessors = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver("reading the multiprocessor count"))?;
        let properties = CudaProperties {
            name: ctx.name().map_err(driver("reading the device name"))?,
            total_memory: ctx
                .total_mem()
                .map_err(driver("reading the device memory"))?,
            multiprocessors: multiprocessors.max(1) as u32,
            compute_capability,
        };
        // SAFETY: allocates pinned host memory of the given size; freed in Drop.
        let staging = unsafe { result::malloc_host(STAGING_BYTES, 0) }
            .map_err(driver("allocating pinned memory"))?;
        // SAFETY: as above; freed in Drop.
        let uploads = match unsafe { result::malloc_host(2 * UPLOAD_HALF_BYTES, 0) } {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: allocated just above, not yet owned by anything.
                let _ = unsafe { result::free_host(staging) };
                return Err(driver("allocating pinned memory")(e));
            }
        };
        let backend = Self {
            async_alloc: ctx.has_async_alloc(),
            ctx,
            streams: Mutex::new(vec![stream]),
            events: Mutex::new(Vec::new()),
            compute_capability,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            staging: Mutex::new(Staging {
                ptr: staging.cast(),
                len: STAGING_BYTES,
            }),
            uploads: UploadHalves {
                ptr: uploads.cast(),
            },
        };
        Ok((backend, properties))
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the CUDA context"))
    }

    /// Stream `index` (made, with every stream below it, if it is not yet).
    fn stream(&self, index: usize) -> Result<Arc<CudaStream>> {
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        while streams.len() <= index {
            let made = self
                .ctx
                .new_stream()
                .map_err(|e| self.failed("creating a CUDA stream", e))?;
            streams.push(made);
        }
        Ok(Arc::clone(&streams[index]))
    }

    /// Waits for everything queued on stream `index`.
    pub fn sync(&self, index: usize) -> Result<()> {
        self.bind()?;
        self.stream(index)?
            .synchronize()
            .map_err(|e| self.failed("waiting for the stream", e))
    }

    /// Makes stream `index` wait, on the device, for everything queued on stream `other`
    /// so far (the host goes on): `other`'s event recorded there, then waited for.
    pub fn join(&self, index: usize, other: usize) -> Result<()> {
        self.bind()?;
        let (stream, producer) = (self.stream(index)?, self.stream(other)?);
        let mut events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        if events.len() <= other {
            events.resize_with(other + 1, || None);
        }
        let event = match events[other].take() {
            Some(event) => event,
            None => self
                .ctx
                .new_event(None)
                .map_err(|e| self.failed("creating a CUDA event", e))?,
        };
        event
            .record(&producer)
            .map_err(|e| self.failed("recording an event", e))?;
        stream
            .wait(&event)
            .map_err(|e| self.failed("waiting for another stream", e))?;
        events[other] = Some(event);
        Ok(())
    }

    /// Allocates `len` bytes, in the order of stream `index` where the device allocates so
    /// (another stream uses the block only once the host has waited for this one).
    pub fn alloc(&self, index: usize, len: usize) -> Result<u64> {
        self.bind()?;
        let len = len.max(1);
        let stream = self.stream(index)?;
        // SAFETY: the stream belongs to this context.
        let addr = unsafe {
            if self.async_alloc {
                result::malloc_async(stream.cu_stream(), len)
            } else {
                result::malloc_sync(len)
            }
        };
        addr.map_err(|e| match e.0 {
            sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => KernelError::OutOfDeviceMemory {
                device: format!("cuda:{}", self.ctx.ordinal()),
                requested: len,
                in_use: 0,
                budget: 0,
            },
            _ => self.failed(&format!("allocating {len} bytes"), e),
        })
    }

    /// Frees a block, in the order of stream `index` (the caller has waited for every
    /// other stream that may use it).
    pub fn free(&self, index: usize, addr: u64) {
        let Ok(stream) = self.bind().and_then(|()| self.stream(index)) else {
            return;
        };
        // SAFETY: `addr` came from `alloc` and the pool frees each block once.
        unsafe {
            let _ = if self.async_alloc {
                result::free_async(addr, stream.cu_stream())
            } else {
                result::free_sync(addr)
            };
        }
    }

    /// Fills `len` bytes of upload half `half` at `at` with `fill` (the upload's bytes, or
    /// a conversion of them made in this one copy) and queues their copy to device address
    /// `dst`, without waiting. The caller (`Device::write_with`) guarantees that the range
    /// fits the half and that the stream has passed every earlier copy out of it.
    #[allow(clippy::too_many_arguments)]
    pub fn stage_write(
        &self,
        index: usize,
        half: usize,
        at: usize,
        dst: u64,
        len: usize,
        fill: &dyn Fn(&mut [u8]),
    ) -> Result<()> {
        self.bind()?;
        let stream = self.stream(index)?;
        if half > 1 || at + len > UPLOAD_HALF_BYTES {
            return Err(KernelError::Unsupported(format!(
                "{len} bytes at {at} of upload half {half}"
            )));
        }
        // SAFETY: the range lies inside the pinned allocation (checked above) and no queued
        // copy reads it any more (the caller's guarantee), so it may be written; the
        // destination lies inside a live buffer (checked by Device::write_with).
        unsafe {
            let slot = std::slice::from_raw_parts_mut(
                self.uploads.ptr.add(half * UPLOAD_HALF_BYTES + at),
                len,
            );
            fill(slot);
            result::memcpy_htod_async(dst, slot, stream.cu_stream())
                .map_err(|e| self.failed("copying to the device", e))
        }
    }

    /// Reads from several buffers (each from its offset, into its host destination) through
    /// the staging buffer as `fills` packs them: each fill's copies queued back to back, one
    /// wait, then the pieces copied out.
    pub fn read_many(
        &self,
        index: usize,
        fills: &[Vec<crate::device::stream::StagedPiece>],
        reads: &mut [(&crate::memory::DeviceBuffer, usize, &mut [u8])],
    ) -> Result<()> {
        self.bind()?;
        let stream = self.stream(index)?;
        let staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        if fills.iter().flatten().any(|p| p.at + p.len > staging.len) {
            return Err(KernelError::Unsupported(
                "a read piece past the staging buffer".into(),
            ));
        }
        for fill in fills {
            for piece in fill {
                let (buffer, offset, _) = &reads[piece.read];
                // SAFETY: the piece lies inside the `out.len()` bytes of its buffer from its
                // offset (checked by the caller) and inside the pinned staging buffer (`staging_fills` keeps
                // at + len within STAGING_BYTES, its length).
                let queued = unsafe {
                    let pinned =
                        std::slice::from_raw_parts_mut(staging.ptr.add(piece.at), piece.len);
                    result::memcpy_dtoh_async(
                        pinned,
                        buffer.addr() + (offset + piece.from) as u64,
                        stream.cu_stream(),
                    )
                };
                if let Err(e) = queued {
                    // The copies queued before may still be writing the staging buffer:
                    // they finish before it is let go (the wait's own error is the
                    // device's, reported by the copy's).
                    let _ = stream.synchronize();
                    return Err(self.failed("copying from the device", e));
                }
            }
            stream
                .synchronize()
                .map_err(|e| self.failed("waiting for the stream", e))?;
            for piece in fill {
                let (_, _, out) = &mut reads[piece.read];
                // SAFETY: the stream has finished the copy into the staging range, and the
                // destination range lies inside `out` (from + len ≤ its length).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        staging.ptr.add(piece.at),
                        out[piece.from..piece.from + piece.len].as_mut_ptr(),
                        piece.len,
                    );
                }
            }
        }
        Ok(())
    }

    /// Queues a copy of `len` bytes between two device buffers on stream `index`.
    pub fn copy(&self, index: usize, dst: u64, src: u64, len: usize) -> Result<()> {
        self.bind()?;
        let stream = self.stream(index)?;
        // SAFETY: both ranges lie inside live buffers (checked by the caller).
        unsafe { result::memcpy_dtod_async(dst, src, len, stream.cu_stream()) }
            .map_err(|e| self.failed("copying on the device", e))
    }

    fn function(&self, kernel: Kernel) -> Result<sys::CUfunction> {
        if let Some(f) = self
            .functions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&kernel)
        {
            return Ok(*f);
        }
        let file = kernel.source_file();
        let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        let module = match modules.get(file) {
            Some(m) => *m,
            None => {
                let image = crate::images::module_image(file, self.compute_capability)?;
                log::debug!("cuda:{}: {file}: {}", self.ctx.ordinal(), image.origin);
                // SAFETY: `image` is a whole cubin, or NUL-terminated PTX, of this file.
                let m = unsafe { result::module::load_data(image.bytes.as_ptr().cast()) }
                    .map_err(|e| self.failed(&format!("loading {file} ({})", image.origin), e))?;
                modules.insert(file, m);
                m
            }
        };
        let name = CString::new(kernel.name())
            .map_err(|_| KernelError::Unsupported("kernel name".into()))?;
        // SAFETY: `module` is loaded and never unloaded while the backend lives.
        let f = unsafe { result::module::get_function(module, name) }
            .map_err(|e| self.failed("finding a kernel", e))?;
        self.functions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(kernel, f);
        Ok(f)
    }

    /// Queues a launch on stream `index` (a fault in the kernel shows at the next wait, as
    /// a sticky error).
    ///
    /// # Safety
    /// As `Device::launch`: `params` point at arguments matching the kernel's signature.
    pub unsafe fn launch(
        &self,
        index: usize,
        kernel: Kernel,
        grid: u32,
        block: u32,
        shared_bytes: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.bind()?;
        let stream = self.stream(index)?;
        let f = self.function(kernel)?;
        // SAFETY: per this function's contract.
        unsafe {
            result::launch_kernel(
                f,
                (grid, 1, 1),
                (block, 1, 1),
                shared_bytes,
                stream.cu_stream(),
                params,
            )
        }
        .map_err(|e| self.launch_failed(kernel, e))
    }

    fn launch_failed(&self, kernel: Kernel, e: DriverError) -> KernelError {
        match self.failed(&format!("kernel {}", kernel.name()), e) {
            lost @ KernelError::DeviceLost { .. } => lost,
            other => KernelError::LaunchFailed {
                kernel: kernel.name(),
                device: format!("cuda:{}", self.ctx.ordinal()),
                message: other.to_string(),
            },
        }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if self.bind().is_err() {
            return;
        }
        for stream in self
            .streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = stream.synchronize();
        }
        let staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: allocated with malloc_host in `open`, freed once here.
        let _ = unsafe { result::free_host(staging.ptr.cast()) };
        // SAFETY: allocated with malloc_host in `open`, freed once here, the stream idle.
        let _ = unsafe { result::free_host(self.uploads.ptr.cast()) };
        for (_, m) in self
            .modules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
        {
            // SAFETY: loaded in `function`, unloaded once here after the stream is idle.
            let _ = unsafe { result::module::unload(m) };
        }
    }
}
