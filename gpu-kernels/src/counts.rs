//! Counting device work: what each device was asked to do ([`DeviceCounts`]), counted as
//! the driver calls the CUDA backend makes for it on every backend, and [`metered`] scopes
//! that give a stretch of a thread's work its own count (how operators count theirs).

use std::sync::atomic::AtomicU64;

/// The device's counters of its work, one per field of [`DeviceCounts`].
#[derive(Default)]
pub(crate) struct Counts {
    pub(crate) allocations: AtomicU64,
    pub(crate) driver_allocations: AtomicU64,
    pub(crate) driver_frees: AtomicU64,
    pub(crate) launches: AtomicU64,
    pub(crate) syncs: AtomicU64,
    pub(crate) stream_waits: AtomicU64,
    pub(crate) h2d_copies: AtomicU64,
    pub(crate) h2d_bytes: AtomicU64,
    pub(crate) d2h_copies: AtomicU64,
    pub(crate) d2h_bytes: AtomicU64,
    pub(crate) d2d_copies: AtomicU64,
    pub(crate) d2d_bytes: AtomicU64,
    pub(crate) device_bytes: AtomicU64,
}

/// Applies `$do` to each (field of `Counts`, field of `DeviceCounts`) pair.
macro_rules! each_count {
    ($do:ident) => {
        $do!(allocations);
        $do!(driver_allocations);
        $do!(driver_frees);
        $do!(launches);
        $do!(syncs);
        $do!(stream_waits);
        $do!(h2d_copies);
        $do!(h2d_bytes);
        $do!(d2h_copies);
        $do!(d2h_bytes);
        $do!(d2d_copies);
        $do!(d2d_bytes);
        $do!(device_bytes);
    };
}

thread_local! {
    /// The innermost [`metered`] scope of this thread, if any.
    static METER: std::cell::RefCell<Option<DeviceCounts>> = const { std::cell::RefCell::new(None) };
}

/// Adds `delta` to this thread's innermost [`metered`] scope, if there is one.
pub(crate) fn meter(delta: &DeviceCounts) {
    METER.with(|m| {
        if let Some(scope) = m.borrow_mut().as_mut() {
            scope.add(delta);
        }
    });
}

/// Runs `work` and returns what it asked of any device on this thread, besides its result.
/// Scopes nest and are exclusive: work inside an inner scope counts for the inner one only
/// (so an operator polling a child operator's stream counts its own work, not the child's).
pub fn metered<T>(work: impl FnOnce() -> T) -> (T, DeviceCounts) {
    struct Restore(Option<Option<DeviceCounts>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(outer) = self.0.take() {
                METER.with(|m| *m.borrow_mut() = outer);
            }
        }
    }
    let mut restore = Restore(Some(
        METER.with(|m| m.replace(Some(DeviceCounts::default()))),
    ));
    let out = work();
    let mine = METER.with(|m| m.borrow_mut().take()).unwrap_or_default();
    if let Some(outer) = restore.0.take() {
        METER.with(|m| *m.borrow_mut() = outer);
    }
    (out, mine)
}

/// What a device was asked to do since it was opened, counted the same on every backend:
/// each figure is the driver calls the CUDA backend makes for the work (so a stand-in or
/// real driver counts the same), whether the device is a GPU or the emulator.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceCounts {
    /// Buffers taken from the memory pool.
    pub allocations: u64,
    /// Of those, the ones the pool had to get from the driver (`cuMemAllocAsync`).
    pub driver_allocations: u64,
    /// Blocks the pool gave back to the driver.
    pub driver_frees: u64,
    /// Kernel launches.
    pub launches: u64,
    /// Times the host waited for the device (`cuStreamSynchronize`): each read piece, each
    /// [`Device::synchronize`](crate::Device::synchronize), and each refill of an upload
    /// staging half the stream may not have passed. Launches and uploads do not wait.
    pub syncs: u64,
    /// Times one stream was made to wait, on the device, for work queued on another
    /// (`cuEventRecord` on that stream, then `cuStreamWaitEvent`): before work that uses a
    /// buffer another stream made, where that stream may still run. The host goes on.
    pub stream_waits: u64,
    /// Host-to-device copies (one per staging piece of at most [`UPLOAD_HALF_BYTES`]).
    pub h2d_copies: u64,
    /// Bytes copied host to device.
    pub h2d_bytes: u64,
    /// Device-to-host copies (one per staging piece of at most [`STAGING_BYTES`]).
    pub d2h_copies: u64,
    /// Bytes copied device to host.
    pub d2h_bytes: u64,
    /// Copies between two buffers of the device.
    pub d2d_copies: u64,
    /// Bytes copied between buffers of the device.
    pub d2d_bytes: u64,
    /// The sizes of the buffers launches were given, summed over launches: the device
    /// memory kernels may read and write (an upper bound of what they touch).
    pub device_bytes: u64,
}

impl DeviceCounts {
    /// What was counted after `earlier` (an earlier snapshot of the same counters).
    pub fn since(&self, earlier: &DeviceCounts) -> DeviceCounts {
        let mut d = DeviceCounts::default();
        macro_rules! sub {
            ($f:ident) => {
                d.$f = self.$f.saturating_sub(earlier.$f);
            };
        }
        each_count!(sub);
        d
    }

    pub(crate) fn add(&mut self, other: &DeviceCounts) {
        macro_rules! add {
            ($f:ident) => {
                self.$f += other.$f;
            };
        }
        each_count!(add);
    }
}

impl std::ops::AddAssign<&DeviceCounts> for DeviceCounts {
    fn add_assign(&mut self, other: &DeviceCounts) {
        self.add(other);
    }
}

/// Bytes of pinned host memory each read from the device is staged through; a larger read
/// goes in pieces, each a driver copy and a wait.
pub const STAGING_BYTES: usize = 16 << 20;

/// Bytes in each of the two halves of pinned memory uploads are staged through. Uploads
/// fill one half while the device copies out of the other; a larger upload goes in pieces
/// of at most this, each a driver copy. Filling a half again waits for the stream (a
/// counted sync) only where the host has not waited since that half's last copy was
/// queued: a batch's reads usually have, so batches whose uploads fit a half never wait.
pub const UPLOAD_HALF_BYTES: usize = 64 << 20;

pub(crate) use each_count;
