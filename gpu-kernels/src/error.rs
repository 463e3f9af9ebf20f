//! The device layer's error type.

/// Everything that can go wrong in the device layer.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A device selection string (`VOLLEY_DEVICES`, `volley.devices`) that cannot be read.
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
    /// The CUDA driver reported an error.
    #[error("CUDA driver error: {0}")]
    Driver(String),
}

/// Result of the device layer.
pub type Result<T, E = KernelError> = std::result::Result<T, E>;
