//! The CUDA backend's view of the machine: which NVIDIA GPUs the driver reports.
//!
//! cudarc loads `libcuda` at run time, so Fulmen builds and runs where CUDA is absent.
//! Calling into cudarc without the library panics, so every entry point here first asks
//! whether the library can be loaded; without it the device list is simply empty.

use cudarc::driver::{result, sys};

use crate::{KernelError, Result};

/// What the driver tells about one CUDA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaDeviceInfo {
    /// The device ordinal, as in `cuda:N`.
    pub ordinal: usize,
    /// The marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Compute capability (major, minor), e.g. (9, 0).
    pub compute_capability: (i32, i32),
    /// Total device memory in bytes.
    pub total_memory: usize,
    /// Number of streaming multiprocessors.
    pub multiprocessors: i32,
}

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library by its usual names; nothing is called.
    unsafe { sys::is_culib_present() }
}

/// Lists the CUDA devices of this machine. Without a driver the list is empty; a driver that
/// is present but fails (no device, broken installation) is an error the caller can show.
pub fn list_devices() -> Result<Vec<CudaDeviceInfo>> {
    if !driver_present() {
        return Ok(Vec::new());
    }
    let driver = |e: result::DriverError| KernelError::Driver(e.to_string());
    match result::init() {
        Ok(()) => {}
        // A machine with the driver library but no GPU answers "no device".
        Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NO_DEVICE => return Ok(Vec::new()),
        Err(e) => return Err(driver(e)),
    }
    let count = result::device::get_count().map_err(driver)?;
    let mut devices = Vec::with_capacity(count.max(0) as usize);
    for ordinal in 0..count {
        let dev = result::device::get(ordinal).map_err(driver)?;
        let attribute = |attr| {
            // SAFETY: `dev` was just returned by cuDeviceGet for an ordinal below the count.
            unsafe { result::device::get_attribute(dev, attr) }.map_err(driver)
        };
        use sys::CUdevice_attribute as A;
        devices.push(CudaDeviceInfo {
            ordinal: ordinal as usize,
            name: result::device::get_name(dev).map_err(driver)?,
            compute_capability: (
                attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            // SAFETY: as above, `dev` is a valid device handle.
            total_memory: unsafe { result::device::total_mem(dev) }.map_err(driver)?,
            multiprocessors: attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        });
    }
    Ok(devices)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probing_never_panics_and_agrees_with_the_driver_check() {
        let devices = list_devices();
        if !driver_present() {
            assert_eq!(devices.unwrap(), Vec::new());
        } else if let Ok(devices) = devices {
            for (i, d) in devices.iter().enumerate() {
                assert_eq!(d.ordinal, i);
                assert!(d.total_memory > 0 && d.multiprocessors > 0, "{d:?}");
            }
        }
    }
}
