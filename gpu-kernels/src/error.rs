//! The device layer's error type. Running out of device memory and device faults are
//! ordinary, typed outcomes that callers act on (smaller chunks, or the CPU).

/// Everything that can go wrong in the device layer.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A device selection string (`FULMEN_DEVICES`, `fulmen.devices`) that cannot be read.
    #[error(
        "invalid device selection '{input}': {reason} \
         (expected auto, none, cuda:0,1 or emulated:N)"
    )]
    InvalidSelection {
        /// What the user wrote.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An allocation would take the device past its memory budget.
    #[error(
        "out of device memory on {device}: {requested} bytes requested, {in_use} of {budget} \
         bytes in use"
    )]
    OutOfDeviceMemory {
        /// The device, e.g. `emulated:0`.
        device: String,
        /// Bytes asked for.
        requested: usize,
        /// Bytes already allocated.
        in_use: usize,
        /// The device's byte budget.
        budget: usize,
    },
    /// A fault injected on purpose (emulated devices only), to test recovery paths.
    #[error("injected fault on {device}: {what} number {number} fails")]
    InjectedFault {
        /// The device.
        device: String,
        /// `allocation` or `launch`.
        what: &'static str,
        /// Which one (1-based) was made to fail.
        number: u64,
    },
    /// A kernel did not complete (a divergent barrier, a bad launch configuration, …).
    #[error("kernel {kernel} failed on {device}: {message}")]
    LaunchFailed {
        /// The kernel's name.
        kernel: &'static str,
        /// The device.
        device: String,
        /// What the device reported.
        message: String,
    },
    /// A kernel wrote outside an allocation (found by the emulator's guard zones).
    #[error("kernel {kernel} wrote out of bounds on {device}: {detail}")]
    OutOfBounds {
        /// The kernel's name.
        kernel: &'static str,
        /// The device.
        device: String,
        /// Which allocation was damaged, and where.
        detail: String,
    },
    /// A data type or operation the device layer does not handle.
    #[error("not supported on the device: {0}")]
    Unsupported(String),
    /// Arrow refused the data that came back from the device (a bug if it happens).
    #[error("invalid data from the device: {0}")]
    InvalidData(String),
    /// The CUDA driver or NVRTC reported an error.
    #[error("CUDA error: {0}")]
    Driver(String),
}

/// Result of the device layer.
pub type Result<T, E = KernelError> = std::result::Result<T, E>;
