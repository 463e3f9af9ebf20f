//! The stand-in CUDA driver runs queued work late, as a GPU does: a copy out of pinned
//! memory reads it when the stream reaches the copy, and a copy into pinned memory has not
//! happened until the host waits. So the CUDA backend's tests through it fail where code
//! reads a result it did not wait for, or refills pinned memory a queued copy still reads.
//! (On a real GPU the same calls race, so this test runs its checks only on the stand-in.)

use cudarc::driver::{CudaContext, result};

use super::*;

#[test]
fn the_standin_driver_runs_queued_copies_only_when_the_host_waits() {
    let d = device();
    if d.kind() != fulmen_kernels::DeviceKind::Cuda || !d.name().starts_with("Fulmen stand-in") {
        eprintln!("not the stand-in driver ({d}): nothing to check");
        return;
    }
    let ctx = CudaContext::new(0).unwrap();
    ctx.bind_to_thread().unwrap();
    let stream = ctx.new_stream().unwrap();
    let len = 4096;
    // SAFETY: pinned and device allocations of `len` bytes, used within them, freed below
    // after the stream has been waited for.
    unsafe {
        let up = result::malloc_host(len, 0).unwrap().cast::<u8>();
        let down = result::malloc_host(len, 0).unwrap().cast::<u8>();
        let dev = result::malloc_sync(len).unwrap();
        let (up_slice, down_slice) = (
            std::slice::from_raw_parts_mut(up, len),
            std::slice::from_raw_parts_mut(down, len),
        );
        up_slice.fill(1);
        down_slice.fill(0);
        result::memcpy_htod_async(dev, &*up_slice, stream.cu_stream()).unwrap();
        // Refilled before the wait: the queued copy has not read it yet.
        up_slice.fill(2);
        result::memcpy_dtoh_async(&mut *down_slice, dev, stream.cu_stream()).unwrap();
        assert!(
            down_slice.iter().all(|&b| b == 0),
            "a queued copy wrote the host before the host waited"
        );
        stream.synchronize().unwrap();
        assert!(
            down_slice.iter().all(|&b| b == 2),
            "the copy read pinned memory when it was queued, not when it ran"
        );
        // A pageable source is taken when the call is made, as a driver stages it.
        let mut pageable = vec![3u8; len];
        result::memcpy_htod_async(dev, &pageable[..], stream.cu_stream()).unwrap();
        pageable.fill(4);
        result::memcpy_dtoh_async(&mut pageable[..], dev, stream.cu_stream()).unwrap();
        // A copy into pageable memory waits for the stream.
        assert!(pageable.iter().all(|&b| b == 3));
        result::free_sync(dev).unwrap();
        result::free_host(up.cast()).unwrap();
        result::free_host(down.cast()).unwrap();
    }
}
