//! Devices: one GPU each, behind one interface for both backends.
//!
//! - **emulated**: the kernel sources compiled for the host (see `emu/`), with its own
//!   memory, a byte budget, and injectable faults;
//! - **cuda**: an NVIDIA GPU through the driver API (`cuda_backend.rs`), kernels compiled
//!   by NVRTC for the device's architecture (`nvrtc.rs`).
//!
//! Work is asynchronous on both: launches, uploads and copies between buffers are queued
//! on the handle's stream (or the thread's, inside [`in_stream`]) and the call returns at
//! once; the host waits only where it needs a value (a read, [`Device::synchronize`]) or a
//! staging half it is about to refill (see [`UPLOAD_HALF_BYTES`]).
//!
//! A device has several streams: a handle is on one ([`Device::on_stream`]; stream 0 is the
//! device's own), and the engine gives each partition a stream of its own, so that one
//! partition's wait does not wait for another's work. Work on one stream runs in order;
//! work that uses a buffer made on another stream first makes its stream wait, on the
//! device, for that stream, if it may still be running (`Device::after`, a counted stream
//! wait; the host goes on). Buffers go back to the pool when
//! dropped, while queued work may still use them: a stream takes a block at once where
//! every *other* stream has passed the point it was let go (its own later work is queued
//! after its own earlier work anyway), and another block, or a fresh one, otherwise (the
//! emulator checks that no queued work refers to memory lent again, see `emu_queue.rs`).

use std::ffi::c_void;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::counts::{Counts, each_count, meter};
pub use crate::counts::{DeviceCounts, STAGING_BYTES, UPLOAD_HALF_BYTES, metered};
use crate::cuda_backend::CudaBackend;
use crate::emu::{EmuLaunchConfig, EmuMemory};
use crate::emu_queue::Op;

pub(crate) mod stream;
use crate::kernels::Kernel;
use crate::memory::{DeviceBuffer, Pool, size_class};
use crate::selection::DeviceSelection;
use crate::{KernelError, Result};
pub use stream::in_stream;
use stream::{Stream, UploadRing};

/// The GPUs this process has opened, by ordinal: one [`Device`] each, whatever selection
/// string or memory limit named it (a limit is a quota on the one device).
fn opened_gpus() -> std::sync::MutexGuard<'static, std::collections::HashMap<usize, Device>> {
    static GPUS: std::sync::OnceLock<Mutex<std::collections::HashMap<usize, Device>>> =
        std::sync::OnceLock::new();
    GPUS.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// What a device did with one kernel: launches and the device bytes they were given
/// ([`Device::kernel_counts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelCounts {
    /// The kernel.
    pub kernel: Kernel,
    /// Its launches.
    pub launches: u64,
    /// The sizes of the buffers its launches were given, summed.
    pub device_bytes: u64,
}

/// The two kinds of device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// An NVIDIA GPU through the CUDA driver.
    Cuda,
    /// The CUDA execution model on the host CPU.
    Emulated,
}

/// How emulated devices are made.
#[derive(Debug, Clone)]
pub struct EmulatorOptions {
    /// Bytes each device may hold at once.
    pub memory_budget: usize,
    /// Multiprocessors the device reports. Kept small so that grid-stride kernels launch
    /// few blocks, which is what makes the emulator fast enough for whole-query tests.
    pub multiprocessors: u32,
    /// Seeds the shuffled order of threads between barriers.
    pub seed: u64,
    /// OS threads a launch spreads its blocks over (0: one per core).
    pub workers: u32,
}

impl Default for EmulatorOptions {
    fn default() -> Self {
        Self {
            memory_budget: 2 << 30,
            multiprocessors: 2,
            seed: 0x5EED,
            workers: 0,
        }
    }
}

/// Faults to inject into an emulated device, counted from the moment the plan is set:
/// `fail_allocation: Some(1)` fails the next allocation, `Some(3)` the third from now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Which allocation from now fails.
    pub fail_allocation: Option<u64>,
    /// Which launch from now fails.
    pub fail_launch: Option<u64>,
    /// Which launch from now loses the device, as a sticky CUDA error does: it fails with
    /// [`KernelError::DeviceLost`] and the device is quarantined.
    pub lose_device_at_launch: Option<u64>,
}

/// Threads a multiprocessor holds at once on the GPUs kernels are built for (compute 8.0
/// and 9.0: A100, H100, H200). A launch's grid fills them all; where a kernel's registers or
/// shared memory allow fewer, the GPU runs the rest of the blocks as others finish.
pub const THREADS_PER_MULTIPROCESSOR: u32 = 2048;

/// Grid and block size of a launch (one-dimensional: every Fulmen kernel is).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in the grid.
    pub grid: u32,
    /// Threads per block.
    pub block: u32,
    /// Bytes of dynamic shared memory per block.
    pub shared_bytes: u32,
}

impl LaunchConfig {
    /// A grid-stride launch over `items` items with `block` threads per block: as many
    /// blocks as every multiprocessor can hold at once ([`THREADS_PER_MULTIPROCESSOR`]
    /// threads each: full occupancy where registers and shared memory allow it), never
    /// more than the items need, at least one.
    pub fn for_items(device: &Device, items: u64, block: u32) -> Self {
        let needed = items.div_ceil(block as u64).max(1);
        let per_multiprocessor = (THREADS_PER_MULTIPROCESSOR / block.max(1)).max(1) as u64;
        let fill = device.multiprocessors() as u64 * per_multiprocessor;
        Self {
            grid: needed.min(fill).max(1) as u32,
            block,
            shared_bytes: 0,
        }
    }
}

/// One kernel argument. Every argument travels as 8 bytes; a `U32` is read as its low half.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arg {
    /// A device address (0 for a null pointer).
    Ptr(u64),
    /// The address of a buffer of this many bytes (what the accounting counts as the
    /// device bytes a launch may touch), and the index of the stream the buffer was made
    /// on, [`DeviceBuffer::stream`] (a launch on another stream waits for it first).
    Buf(u64, usize, usize),
    /// A 64-bit integer.
    U64(u64),
    /// A 32-bit integer.
    U32(u32),
}

impl Arg {
    /// The address of a buffer.
    pub fn buf(buffer: &DeviceBuffer) -> Self {
        Self::part(buffer, 0, buffer.len())
    }

    /// The address of `len` bytes of a buffer from byte `offset` on.
    pub fn part(buffer: &DeviceBuffer, offset: usize, len: usize) -> Self {
        Self::Buf(buffer.addr() + offset as u64, len, buffer.stream())
    }

    /// The address of a buffer, or a null pointer.
    pub fn opt(buffer: Option<&DeviceBuffer>) -> Self {
        buffer.map_or(Self::Ptr(0), Self::buf)
    }

    fn bits(self) -> u64 {
        match self {
            Self::Ptr(p) | Self::Buf(p, ..) | Self::U64(p) => p,
            Self::U32(v) => v as u64,
        }
    }
}

enum Backend {
    Emulated(EmuMemory),
    Cuda(CudaBackend),
}

struct Inner {
    kind: DeviceKind,
    ordinal: usize,
    name: String,
    budget: usize,
    /// The device's whole memory (a GPU's; the budget on the emulator).
    total_memory: usize,
    /// A GPU's compute capability (major, minor); none on the emulator.
    compute_capability: Option<(i32, i32)>,
    multiprocessors: u32,
    seed: u64,
    workers: u32,
    pool: Pool,
    backend: Backend,
    /// What the device was asked to do (see [`DeviceCounts`]).
    counts: Counts,
    /// Launches and device bytes of each kernel, by [`Kernel::index`].
    per_kernel: Box<[[AtomicU64; 2]]>,
    /// Device errors that made an operator redo its work on the CPU.
    errors: AtomicU64,
    /// Nanoseconds operators spent in this device's work (see [`Device::add_work_time`]).
    work_ns: AtomicU64,
    /// Absolute allocation / launch numbers that fail, and the launch that loses the device.
    faults: Mutex<Faults>,
    /// Why the device is out of use, once it is: a sticky error lost its state.
    quarantine: Mutex<Option<String>>,
    quarantined: std::sync::atomic::AtomicBool,
    /// The device's streams, by index, made as handles ask for them (stream 0 at once).
    streams: Mutex<Vec<Arc<Stream>>>,
    /// Which upload staging half is filling, and which copies out of each the streams
    /// have yet to pass: the same on both backends, so that both count the same waits.
    uploads: Mutex<UploadRing>,
}

impl Inner {
    /// A device with nothing done yet (seed and workers are the emulator's; 0 elsewhere).
    fn new(
        kind: DeviceKind,
        ordinal: usize,
        name: String,
        budget: usize,
        multiprocessors: u32,
        backend: Backend,
    ) -> Self {
        Self {
            kind,
            ordinal,
            name,
            budget,
            total_memory: budget,
            compute_capability: None,
            multiprocessors,
            seed: 0,
            workers: 0,
            pool: Pool::default(),
            backend,
            counts: Counts::default(),
            per_kernel: Kernel::ALL.iter().map(|_| Default::default()).collect(),
            errors: AtomicU64::new(0),
            work_ns: AtomicU64::new(0),
            faults: Mutex::new(Faults::default()),
            quarantine: Mutex::new(None),
            quarantined: std::sync::atomic::AtomicBool::new(false),
            streams: Mutex::new(vec![Arc::new(Stream::new(0))]),
            uploads: Mutex::new(UploadRing::default()),
        }
    }

    fn streams(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Stream>>> {
        self.streams.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stream `index`, made (with every stream below it) if it is not yet.
    fn stream(&self, index: usize) -> Arc<Stream> {
        let mut streams = self.streams();
        while streams.len() <= index {
            let next = streams.len();
            streams.push(Arc::new(Stream::new(next)));
        }
        Arc::clone(&streams[index])
    }

    /// Streams made so far.
    fn stream_count(&self) -> usize {
        self.streams().len()
    }

    /// For each stream, by index: the ops queued on it so far (a block let go now may
    /// still be used by any of them).
    fn enqueued(&self) -> Vec<u64> {
        self.streams().iter().map(|s| s.enqueued()).collect()
    }

    /// For each stream, by index: the last op known to have finished.
    fn passed(&self) -> Vec<u64> {
        self.streams().iter().map(|s| s.passed()).collect()
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Faults {
    allocation: Option<u64>,
    launch: Option<u64>,
    lose_at_launch: Option<u64>,
}

/// A device. Cloning is cheap; clones share the device.
///
/// A handle may carry a memory limit ([`Device::with_memory_limit`]): a quota of the bytes
/// allocated through it (and its clones) on the one device, within the device's budget.
///
/// A handle is on one of the device's streams ([`Device::on_stream`]); every handle shares
/// the device's memory, kernels, counters and quarantine.
#[derive(Clone)]
pub struct Device {
    inner: Arc<Inner>,
    quota: Option<Arc<Quota>>,
    stream: Arc<Stream>,
}

/// A memory limit on one handle of a device.
struct Quota {
    limit: usize,
    /// (bytes in use, peak bytes in use) through the handle.
    usage: Mutex<(usize, usize)>,
}

impl Quota {
    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, usize)> {
        self.usage.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.inner.kind {
            DeviceKind::Cuda => "cuda",
            DeviceKind::Emulated => "emulated",
        };
        write!(f, "{kind}:{}", self.inner.ordinal)
    }
}

impl PartialEq for Device {
    /// The same device (whatever memory limits the two handles carry).
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for Device {}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Device({self}, {})", self.inner.name)
    }
}

impl Device {
    /// A new emulated device.
    pub fn emulated(ordinal: usize, options: &EmulatorOptions) -> Self {
        Self {
            inner: Arc::new(Inner {
                seed: options.seed ^ (ordinal as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                workers: options.workers,
                ..Inner::new(
                    DeviceKind::Emulated,
                    ordinal,
                    format!("Fulmen emulated device {ordinal}"),
                    options.memory_budget,
                    options.multiprocessors.max(1),
                    Backend::Emulated(EmuMemory::default()),
                )
            }),
            quota: None,
            stream: Arc::new(Stream::default()),
        }
        .on_stream(0)
    }

    /// CUDA device `ordinal`: the process's one handle of that GPU, opened on first use
    /// with a budget of 90 % of its memory. With `limit`, a handle holding at most `limit`
    /// bytes of it (a quota, see [`Device::with_memory_limit`]).
    pub fn cuda(ordinal: usize, limit: Option<usize>) -> Result<Self> {
        let mut gpus = opened_gpus();
        let device = match gpus.get(&ordinal) {
            Some(d) => d.clone(),
            None => {
                let d = Self::open_cuda(ordinal)?;
                gpus.insert(ordinal, d.clone());
                d
            }
        };
        drop(gpus);
        Ok(match limit {
            Some(limit) => device.with_memory_limit(limit),
            None => device,
        })
    }

    fn open_cuda(ordinal: usize) -> Result<Self> {
        let (backend, properties) = CudaBackend::open(ordinal)?;
        let (major, minor) = properties.compute_capability;
        Ok(Self {
            inner: Arc::new(Inner {
                total_memory: properties.total_memory,
                compute_capability: Some(properties.compute_capability),
                ..Inner::new(
                    DeviceKind::Cuda,
                    ordinal,
                    format!("{} (compute {major}.{minor})", properties.name),
                    properties.total_memory / 10 * 9,
                    properties.multiprocessors,
                    Backend::Cuda(backend),
                )
            }),
            quota: None,
            stream: Arc::new(Stream::default()),
        }
        .on_stream(0))
    }

    /// A handle of this device through which at most `limit` bytes are allocated at once
    /// (`fulmen.gpu.memory_limit`): a quota on the one device, not another device. The
    /// device's own budget still bounds all its handles together; everything else —
    /// memory pool, kernels, counters, quarantine — is the device's.
    pub fn with_memory_limit(&self, limit: usize) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            quota: Some(Arc::new(Quota {
                limit,
                usage: Mutex::new((0, 0)),
            })),
            stream: Arc::clone(&self.stream),
        }
    }

    /// A handle of this device (with this handle's memory limit) whose work goes on the
    /// device's stream `index`: its own order, which work on other streams neither waits
    /// for nor is waited for by, save where one uses a buffer another made (see
    /// [`Device::after`]). Stream 0 is the one every handle starts on; the engine gives each
    /// partition its own.
    pub fn on_stream(&self, index: usize) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            quota: self.quota.clone(),
            stream: self.inner.stream(index),
        }
    }

    /// The index of the handle's own stream (work goes there, save where it runs
    /// [`in_stream`] another).
    pub fn stream_index(&self) -> usize {
        self.stream.index
    }

    /// The index of the stream this handle's work goes on now: the thread's, where work
    /// runs [`in_stream`], else the handle's own.
    fn current_index(&self) -> usize {
        stream::scoped().unwrap_or(self.stream.index)
    }

    /// The stream this handle's work goes on now (see [`Device::stream_index`]).
    fn current(&self) -> Arc<Stream> {
        match stream::scoped() {
            Some(index) if index != self.stream.index => self.inner.stream(index),
            _ => Arc::clone(&self.stream),
        }
    }

    /// Streams the device has made so far (each handle's, see [`Device::on_stream`]).
    pub fn streams(&self) -> usize {
        self.inner.stream_count()
    }

    /// Which backend runs this device.
    pub fn kind(&self) -> DeviceKind {
        self.inner.kind
    }

    /// The device's ordinal within its kind.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// A human-readable name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// A GPU's compute capability (major, minor); `None` on the emulator.
    pub fn compute_capability(&self) -> Option<(i32, i32)> {
        self.inner.compute_capability
    }

    /// The device's whole memory: a GPU's total, of which Fulmen uses the budget (90 %);
    /// the budget itself on the emulator.
    pub fn total_memory(&self) -> usize {
        self.inner.total_memory
    }

    /// Multiprocessors, used to size grids.
    pub fn multiprocessors(&self) -> u32 {
        self.inner.multiprocessors
    }

    /// The bytes this handle may hold: the device's budget, or the handle's memory limit
    /// where that is lower.
    pub fn memory_budget(&self) -> usize {
        match &self.quota {
            Some(q) => q.limit.min(self.inner.budget),
            None => self.inner.budget,
        }
    }

    /// (bytes in use, peak bytes in use): through this handle where it carries a memory
    /// limit, else of the whole device.
    pub fn memory_usage(&self) -> (usize, usize) {
        match &self.quota {
            Some(q) => *q.lock(),
            None => self.inner.pool.usage(),
        }
    }

    /// (bytes in use, peak bytes in use) of the whole device, through every handle.
    pub fn device_memory_usage(&self) -> (usize, usize) {
        self.inner.pool.usage()
    }

    /// Allocations and launches made so far.
    pub fn counters(&self) -> (u64, u64) {
        (
            self.inner.counts.allocations.load(Ordering::Relaxed),
            self.inner.counts.launches.load(Ordering::Relaxed),
        )
    }

    /// Everything the device was asked to do so far.
    pub fn counts(&self) -> DeviceCounts {
        let c = &self.inner.counts;
        let mut d = DeviceCounts::default();
        macro_rules! load {
            ($f:ident) => {
                d.$f = c.$f.load(Ordering::Relaxed);
            };
        }
        each_count!(load);
        d
    }

    /// Each kernel launched so far on the device, in [`Kernel::ALL`]'s order: its launches
    /// and the device bytes they were given (the same figures as [`DeviceCounts`]'
    /// `launches` and `device_bytes`, which are their sums).
    pub fn kernel_counts(&self) -> Vec<KernelCounts> {
        Kernel::ALL
            .iter()
            .zip(&self.inner.per_kernel)
            .map(|(&kernel, [launches, bytes])| KernelCounts {
                kernel,
                launches: launches.load(Ordering::Relaxed),
                device_bytes: bytes.load(Ordering::Relaxed),
            })
            .filter(|k| k.launches > 0)
            .collect()
    }

    /// Adds `delta` to the device's counters and to this thread's [`metered`] scope.
    fn record(&self, delta: DeviceCounts) {
        let c = &self.inner.counts;
        macro_rules! add {
            ($f:ident) => {
                if delta.$f != 0 {
                    c.$f.fetch_add(delta.$f, Ordering::Relaxed);
                }
            };
        }
        each_count!(add);
        meter(&delta);
    }

    /// Counts a device error an operator met.
    pub fn count_error(&self) {
        self.inner.errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Device errors met so far by operators (redone on the CPU, or failing the query with
    /// `fulmen.gpu.on_error = fail`); exhausted memory, injected allocation and launch faults
    /// and calls on a quarantined device are not counted: they are not errors of the device.
    pub fn errors(&self) -> u64 {
        self.inner.errors.load(Ordering::Relaxed)
    }

    /// Adds time an operator spent in this device's work: queuing launches and copies,
    /// and waiting for the values it read back (measured on the host, not by the device).
    pub fn add_work_time(&self, elapsed: std::time::Duration) {
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.inner.work_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// The time operators spent in this device's work so far (see
    /// [`add_work_time`](Self::add_work_time)).
    pub fn work_time(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.inner.work_ns.load(Ordering::Relaxed))
    }

    /// Injects faults (emulated devices only).
    pub fn inject_faults(&self, plan: FaultPlan) -> Result<()> {
        if self.inner.kind != DeviceKind::Emulated {
            return Err(KernelError::Unsupported(
                "fault injection on a real GPU".into(),
            ));
        }
        let (allocations, launches) = self.counters();
        let mut faults = self.inner.faults.lock().unwrap_or_else(|p| p.into_inner());
        *faults = Faults {
            allocation: plan.fail_allocation.map(|n| allocations + n.max(1)),
            launch: plan.fail_launch.map(|n| launches + n.max(1)),
            lose_at_launch: plan.lose_device_at_launch.map(|n| launches + n.max(1)),
        };
        Ok(())
    }

    fn injected(&self, what: &'static str, number: u64) -> Result<()> {
        let faults = *self.inner.faults.lock().unwrap_or_else(|p| p.into_inner());
        let fail_at = if what == "allocation" {
            faults.allocation
        } else {
            faults.launch
        };
        if fail_at == Some(number) {
            return Err(KernelError::InjectedFault {
                device: self.to_string(),
                what,
                number,
            });
        }
        if what == "launch" && faults.lose_at_launch == Some(number) {
            return Err(self.lost(KernelError::DeviceLost {
                device: self.to_string(),
                message: format!("injected sticky fault at launch {number}"),
            }));
        }
        Ok(())
    }

    /// Why the device is quarantined, if it is.
    pub fn quarantined(&self) -> Option<String> {
        if !self.inner.quarantined.load(Ordering::Acquire) {
            return None;
        }
        self.inner
            .quarantine
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Takes the device out of use for the rest of the process: every later call on it,
    /// through any handle, fails at once with [`KernelError::Quarantined`], without
    /// touching the device.
    pub fn quarantine(&self, reason: &str) {
        let mut q = self
            .inner
            .quarantine
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if q.is_none() {
            *q = Some(reason.to_string());
            self.inner.quarantined.store(true, Ordering::Release);
        }
    }

    /// Fails at once when the device is quarantined.
    fn usable(&self) -> Result<()> {
        match self.quarantined() {
            None => Ok(()),
            Some(reason) => Err(KernelError::Quarantined {
                device: self.to_string(),
                reason,
            }),
        }
    }

    /// Quarantines the device when `error` says it is lost; returns the error.
    fn lost(&self, error: KernelError) -> KernelError {
        if let KernelError::DeviceLost { message, .. } = &error {
            self.quarantine(message);
        }
        error
    }

    /// Allocates `len` bytes of device memory (contents undefined).
    pub fn alloc(&self, len: usize) -> Result<DeviceBuffer> {
        self.usable()?;
        let number = self
            .inner
            .counts
            .allocations
            .fetch_add(1, Ordering::Relaxed)
            + 1;
        meter(&DeviceCounts {
            allocations: 1,
            ..DeviceCounts::default()
        });
        self.injected("allocation", number)?;
        let class = size_class(len);
        let stream = self.current();
        let me = stream.index;
        let passed = self.inner.passed();
        // A cached block may go to this stream once every other stream has passed the
        // work queued on it before the block was let go (this stream's own is queued
        // before whatever it queues now).
        let reusable = |clock: &[u64]| {
            clock
                .iter()
                .enumerate()
                .all(|(j, &op)| j == me || passed.get(j).is_some_and(|&p| p >= op))
        };
        if let Some(q) = &self.quota {
            let mut usage = q.lock();
            if usage.0 + class > q.limit {
                return Err(KernelError::OutOfDeviceMemory {
                    device: self.to_string(),
                    requested: class,
                    in_use: usage.0,
                    budget: q.limit,
                });
            }
            usage.0 += class;
            usage.1 = usage.1.max(usage.0);
        }
        let addr = self
            .inner
            .pool
            .take(
                &self.to_string(),
                class,
                self.inner.budget,
                reusable,
                || self.settle(),
                || self.backend_alloc(class),
                |addr| self.backend_free(addr),
            )
            .map_err(|e| {
                self.unreserve(class);
                self.lost(e)
            })?;
        if let Backend::Emulated(_) = &self.inner.backend
            && let Err(e) = self.enqueue(Op::Lend { addr, len })
        {
            self.release(addr, class);
            return Err(e);
        }
        Ok(DeviceBuffer {
            device: self.clone(),
            addr,
            len,
            class,
            stream: me,
        })
    }

    fn backend_alloc(&self, len: usize) -> Result<u64> {
        self.record(DeviceCounts {
            driver_allocations: 1,
            ..DeviceCounts::default()
        });
        match &self.inner.backend {
            Backend::Emulated(memory) => memory.alloc(len),
            Backend::Cuda(cuda) => {
                let stream = self.current();
                let addr = cuda.alloc(stream.index, len)?;
                // Stream-ordered where the device allocates so: an op of this stream's.
                stream.queued();
                Ok(addr)
            }
        }
    }

    fn backend_free(&self, addr: u64) {
        self.inner
            .counts
            .driver_frees
            .fetch_add(1, Ordering::Relaxed);
        match &self.inner.backend {
            // Stream-ordered, as cuMemFreeAsync: after the work queued before it.
            Backend::Emulated(_) => {
                let _ = self.enqueue(Op::Free { addr });
            }
            Backend::Cuda(cuda) => {
                let stream = self.current();
                cuda.free(stream.index, addr);
                stream.queued();
            }
        }
    }

    /// Allocates a buffer and copies `bytes` into it.
    pub fn upload(&self, bytes: &[u8]) -> Result<DeviceBuffer> {
        let buffer = self.alloc(bytes.len())?;
        if !bytes.is_empty() {
            self.write(&buffer, 0, bytes)?;
        }
        Ok(buffer)
    }

    pub(crate) fn release(&self, addr: u64, class: usize) {
        self.inner
            .pool
            .give_back(class, addr, self.inner.enqueued());
        self.unreserve(class);
    }

    /// Gives `class` bytes back to the handle's quota.
    fn unreserve(&self, class: usize) {
        if let Some(q) = &self.quota {
            let mut usage = q.lock();
            usage.0 = usage.0.saturating_sub(class);
        }
    }

    /// Frees the memory the pool keeps cached for reuse, once every stream has passed the
    /// work that may still use it (a quarantined device only forgets it).
    pub fn trim(&self) {
        if self.settle().is_err() {
            self.inner.pool.trim(|_| {});
            return;
        }
        self.inner.pool.trim(|addr| self.backend_free(addr));
    }

    /// Queues a launch of `kernel` on the handle's stream, or the thread's inside
    /// [`in_stream`] (the host does not wait for it).
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number, order and type, and every
    /// pointer must be a live buffer of this device, large enough for what the kernel
    /// reads and writes at those arguments. Only the typed wrappers in `ops` call this.
    pub unsafe fn launch(&self, kernel: Kernel, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        // SAFETY: this function's contract.
        unsafe { self.launch_reaching(kernel, cfg, args, &[]) }
    }

    /// As [`Device::launch`], for a kernel that also reads or writes `reached` through
    /// addresses in a table it is given (an expression's columns, an accumulator's input
    /// and state): they count as device bytes the launch may touch, and the emulated
    /// device checks that they are still live when the launch runs.
    ///
    /// # Safety
    /// As [`Device::launch`]; `reached` holds every buffer the tables point into.
    pub unsafe fn launch_reaching(
        &self,
        kernel: Kernel,
        cfg: LaunchConfig,
        args: &[Arg],
        reached: &[&DeviceBuffer],
    ) -> Result<()> {
        self.usable()?;
        // A wrong number of arguments would have the kernel read past the parameter array.
        let takes = kernel.param_sizes().len();
        if args.len() != takes {
            return Err(KernelError::LaunchFailed {
                kernel: kernel.name(),
                device: self.to_string(),
                message: format!("it takes {takes} parameters, {} were given", args.len()),
            });
        }
        let number = self.inner.counts.launches.fetch_add(1, Ordering::Relaxed) + 1;
        let per_kernel = &self.inner.per_kernel[kernel.index()];
        per_kernel[0].fetch_add(1, Ordering::Relaxed);
        meter(&DeviceCounts {
            launches: 1,
            ..DeviceCounts::default()
        });
        self.injected("launch", number)?;
        // Buffers made on other streams: their work first (a counted stream wait each,
        // where it may still run).
        self.after(
            (args.iter())
                .filter_map(|a| match *a {
                    Arg::Buf(_, _, stream) => Some(stream),
                    _ => None,
                })
                .chain(reached.iter().map(|b| b.stream())),
        )?;
        let buffers: Vec<(u64, usize)> = args
            .iter()
            .filter_map(|a| match *a {
                Arg::Buf(addr, len, _) => Some((addr, len)),
                _ => None,
            })
            .chain(reached.iter().map(|b| (b.addr(), b.len())))
            .collect();
        let touched: usize = buffers.iter().map(|(_, len)| len).sum();
        per_kernel[1].fetch_add(touched as u64, Ordering::Relaxed);
        self.record(DeviceCounts {
            device_bytes: touched as u64,
            ..DeviceCounts::default()
        });
        let mut slots: Vec<u64> = args.iter().map(|a| a.bits()).collect();
        if let Backend::Cuda(cuda) = &self.inner.backend {
            let mut params: Vec<*mut c_void> = slots
                .iter_mut()
                .map(|s| s as *mut u64 as *mut c_void)
                .collect();
            // SAFETY: forwarded from this function's contract; every slot is 8 bytes and
            // CUDA reads a u32 parameter from the first 4 (little-endian). The driver takes
            // the parameters' values when the launch is queued.
            let (grid, block, shared) = (cfg.grid, cfg.block, cfg.shared_bytes);
            let stream = self.current();
            unsafe { cuda.launch(stream.index, kernel, grid, block, shared, &mut params) }
                .map_err(|e| self.lost(e))?;
            stream.queued();
            return Ok(());
        }
        let cfg = EmuLaunchConfig {
            grid: [cfg.grid, 1, 1],
            block: [cfg.block, 1, 1],
            shared_bytes: cfg.shared_bytes,
            workers: self.inner.workers,
            seed: self.inner.seed.wrapping_add(number),
        };
        self.enqueue(Op::Launch {
            kernel,
            cfg,
            slots,
            buffers,
        })
    }
}

/// Opens the devices a selection names: `none` gives no device, `emulated:N` (or
/// `emulated:N/SET`) N new emulated devices, `cuda:0,1` those GPUs (an error if one is
/// missing), and `auto` every GPU of the machine (none without a driver). A GPU is opened
/// once per process: every selection naming it gets the same device. `budget` limits the
/// bytes held through the handles returned for CUDA devices (a quota on each GPU; emulated
/// devices take their budget from `emulator`).
pub fn open_devices(
    selection: &DeviceSelection,
    emulator: &EmulatorOptions,
    budget: Option<usize>,
) -> Result<Vec<Device>> {
    match selection {
        DeviceSelection::None => Ok(Vec::new()),
        DeviceSelection::Emulated(n) | DeviceSelection::EmulatedSet(n, _) => {
            Ok((0..*n).map(|i| Device::emulated(i, emulator)).collect())
        }
        DeviceSelection::Auto => crate::cuda::list_devices()
            .unwrap_or_default()
            .iter()
            .map(|d| Device::cuda(d.ordinal, budget))
            .collect(),
        DeviceSelection::Cuda(ordinals) => {
            ordinals.iter().map(|&o| Device::cuda(o, budget)).collect()
        }
    }
}
