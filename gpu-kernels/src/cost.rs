//! The cost model: a modelled time for counted device work ([`DeviceCounts`]) on a reference
//! GPU, which is how performance is judged where no GPU is lent. Every figure it gives is a
//! **model**, and is labelled so wherever it is printed.
//!
//! modelled time = (launches + stream waits) × launch + syncs × sync
//!               + (h2d + d2h bytes) / PCIe + device bytes / HBM
//!
//! A stream's wait for another (an event recorded and waited for on the device) is costed
//! as a launch: two driver calls the host makes without waiting, as for a launch.
//!
//! "Resident" leaves out the host-to-device copies, as for data already in device memory.
//! The constants are the one place they live; `scripts/gpu-check.sh` measures copy
//! bandwidth and kernel rates on a lent GPU, and they are recalibrated from its figures.

use crate::device::DeviceCounts;

/// A reference GPU's costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Its name.
    pub name: &'static str,
    /// Device memory bandwidth the best kernels reach, bytes per second.
    pub hbm_bytes_per_s: f64,
    /// Host ↔ device bandwidth from pinned memory, bytes per second.
    pub pcie_bytes_per_s: f64,
    /// Seconds per kernel launch.
    pub launch_s: f64,
    /// Seconds per host wait for the device.
    pub sync_s: f64,
}

/// An NVIDIA H200 (the GPU lent machines have): HBM3e 4.8 TB/s at the ~90 % the best
/// kernels reach, PCIe Gen5 x16 at 55 GB/s from pinned memory, about 4 µs per launch and
/// 10 µs per host sync (published figures; not yet measured by `scripts/gpu-check.sh`).
pub const H200: CostModel = CostModel {
    name: "H200",
    hbm_bytes_per_s: 4.8e12 * 0.9,
    pcie_bytes_per_s: 55e9,
    launch_s: 4e-6,
    sync_s: 10e-6,
};

impl CostModel {
    /// The modelled seconds of `work`, its data coming from host memory.
    pub fn seconds(&self, work: &DeviceCounts) -> f64 {
        self.resident_seconds(work) + work.h2d_bytes as f64 / self.pcie_bytes_per_s
    }

    /// The bytes PCIe copies in the time of one host wait: what a read may speculatively
    /// add to a wait it is already making before it costs more than a second wait would.
    pub fn bytes_per_sync(&self) -> u64 {
        (self.sync_s * self.pcie_bytes_per_s) as u64
    }

    /// The modelled seconds of `work` with its inputs already in device memory (no
    /// host-to-device copies).
    pub fn resident_seconds(&self, work: &DeviceCounts) -> f64 {
        (work.launches + work.stream_waits) as f64 * self.launch_s
            + work.syncs as f64 * self.sync_s
            + work.d2h_bytes as f64 / self.pcie_bytes_per_s
            + work.device_bytes as f64 / self.hbm_bytes_per_s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_term_costs_what_the_constants_say() {
        let launch = DeviceCounts {
            launches: 1,
            ..Default::default()
        };
        assert!((H200.seconds(&launch) - 4e-6).abs() < 1e-12);
        let wait = DeviceCounts {
            stream_waits: 1,
            ..Default::default()
        };
        assert!((H200.seconds(&wait) - 4e-6).abs() < 1e-12);
        let upload = DeviceCounts {
            h2d_bytes: 55_000_000_000,
            ..Default::default()
        };
        assert!((H200.seconds(&upload) - 1.0).abs() < 1e-9);
        // 10 µs of 55 GB/s.
        assert_eq!(H200.bytes_per_sync(), 550_000);
        assert_eq!(H200.resident_seconds(&upload), 0.0);
        let scan = DeviceCounts {
            device_bytes: 4_320_000_000_000,
            syncs: 100,
            ..Default::default()
        };
        assert!((H200.resident_seconds(&scan) - (1.0 + 100.0 * 10e-6)).abs() < 1e-9);
    }
}
