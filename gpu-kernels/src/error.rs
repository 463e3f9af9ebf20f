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
    /// The device can no longer be used: CUDA reported a sticky error (an illegal address,
    /// a failed or timed-out kernel, an uncorrectable ECC error), after which every call on
    /// its context fails. The device is quarantined from then on.
    #[error("device {device} is lost: {message}")]
    DeviceLost {
        /// The device.
        device: String,
        /// What the device reported.
        message: String,
    },
    /// A call on a quarantined device, answered without touching it.
    #[error("device {device} is quarantined: {reason}")]
    Quarantined {
        /// The device.
        device: String,
        /// Why it was quarantined.
        reason: String,
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

impl KernelError {
    /// The kernel the error came from, where it names one.
    pub fn kernel(&self) -> Option<&'static str> {
        match self {
            Self::LaunchFailed { kernel, .. } | Self::OutOfBounds { kernel, .. } => Some(kernel),
            _ => None,
        }
    }

    /// Whether this is an outcome the caller simply works around: the device's memory ran
    /// out (the caller splits its work or finishes on the CPU), a fault was injected on
    /// purpose, or the device was quarantined earlier (the error that quarantined it was
    /// reported then). Every other error means a defect in a kernel, the device or Fulmen.
    pub fn is_expected(&self) -> bool {
        matches!(
            self,
            Self::OutOfDeviceMemory { .. } | Self::InjectedFault { .. } | Self::Quarantined { .. }
        )
    }

    /// Whether the device's state is gone with this error (its buffers can no longer be
    /// read): the device is lost or quarantined.
    pub fn device_gone(&self) -> bool {
        matches!(self, Self::DeviceLost { .. } | Self::Quarantined { .. })
    }
}

/// Result of the device layer.
pub type Result<T, E = KernelError> = std::result::Result<T, E>;
