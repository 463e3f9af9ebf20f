//! Device and pinned host memory, and copies: allocations within the device's budget,
//! frees (at once or in stream order), and copies checked and counted when called, then
//! queued or made at once (see `queue.rs`).

use super::*;

fn allocate(context: &'static Context, bytes: usize) -> Result<u64, CUresult> {
    context.check()?;
    let d = driver();
    let len = bytes.max(1);
    if context.in_use.fetch_add(len, Ordering::AcqRel) + len > d.config.memory {
        context.in_use.fetch_sub(len, Ordering::AcqRel);
        return Err(OUT_OF_MEMORY);
    }
    let Ok(addr) = context.memory().alloc(len) else {
        context.in_use.fetch_sub(len, Ordering::AcqRel);
        return Err(OUT_OF_MEMORY);
    };
    lock(&context.sizes).insert(addr, len);
    d.counts.allocations.fetch_add(1, Ordering::Relaxed);
    Ok(addr)
}

/// Frees `addr`: at once after the queue has run (`cuMemFree`), or in stream order
/// (`cuMemFreeAsync`: the block stays live for the work queued before; its bytes count as
/// free at once, as the stream-ordered allocator lets later work on the stream reuse them).
fn release(context: &'static Context, addr: u64, ordered: bool) -> Result<(), CUresult> {
    // A synchronous free waits for the device first (the block is freed all the same).
    let waited = if ordered { Ok(()) } else { context.wait() };
    let len = lock(&context.sizes).remove(&addr).ok_or(INVALID_VALUE)?;
    context.in_use.fetch_sub(len, Ordering::AcqRel);
    driver().counts.frees.fetch_add(1, Ordering::Relaxed);
    if ordered {
        return context.queue.push(context, Work::Free { addr });
    }
    if context.memory().free(addr).is_err() {
        return Err(context.poison(
            ILLEGAL_ADDRESS,
            "a freed buffer's guard zone was overwritten",
        ));
    }
    waited.and_then(|()| context.check())
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAlloc_v2(dptr: *mut u64, bytes: usize) -> CUresult {
    match current().and_then(|c| allocate(c, bytes)) {
        Ok(addr) => out(dptr, addr),
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAllocAsync(dptr: *mut u64, bytes: usize, stream: *mut c_void) -> CUresult {
    match stream_context(stream).and_then(|c| allocate(c, bytes)) {
        Ok(addr) => out(dptr, addr),
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(dptr: u64) -> CUresult {
    result(current().and_then(|c| release(c, dptr, false)))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeAsync(dptr: u64, stream: *mut c_void) -> CUresult {
    result(stream_context(stream).and_then(|c| release(c, dptr, true)))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemHostAlloc(pp: *mut *mut c_void, bytes: usize, _flags: c_uint) -> CUresult {
    let Ok(layout) = std::alloc::Layout::from_size_align(bytes.max(1), 4096) else {
        return INVALID_VALUE;
    };
    // SAFETY: a non-zero size.
    let p = unsafe { std::alloc::alloc(layout) };
    if p.is_null() {
        return OUT_OF_MEMORY;
    }
    lock(&driver().host).insert(p as usize, layout);
    out(pp, p.cast())
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    // Queued copies may still read or write it: they run first.
    let _ = queue::run_all();
    match lock(&driver().host).remove(&(p as usize)) {
        // SAFETY: allocated by cuMemHostAlloc with this layout, removed so freed once.
        Some(layout) => unsafe { std::alloc::dealloc(p.cast(), layout) },
        None => return INVALID_VALUE,
    }
    SUCCESS
}

enum Transfer {
    ToDevice { dst: u64, src: *const u8 },
    ToHost { dst: *mut u8, src: u64 },
    OnDevice { dst: u64, src: u64 },
}

/// One copy of `len` bytes on `context`, checked and counted now; device ranges must lie
/// inside one allocation. `queued`: an `…Async` copy, which runs in stream order (save one
/// into pageable host memory, which waits for the stream, as a driver's does); otherwise
/// the device is waited for and the copy made at once.
fn copy(
    context: &'static Context,
    what: Transfer,
    len: usize,
    queued: bool,
) -> Result<(), CUresult> {
    context.check()?;
    let d = driver();
    let number = d.copies.fetch_add(1, Ordering::Relaxed) + 1;
    if d.config.fail_copy == Some(number) {
        return Err(UNKNOWN);
    }
    let (counter, bytes) = match &what {
        Transfer::ToDevice { .. } => (&d.counts.h2d_copies, &d.counts.h2d_bytes),
        Transfer::ToHost { .. } => (&d.counts.d2h_copies, &d.counts.d2h_bytes),
        Transfer::OnDevice { .. } => (&d.counts.d2d_copies, &d.counts.d2d_bytes),
    };
    counter.fetch_add(1, Ordering::Relaxed);
    bytes.fetch_add(len as u64, Ordering::Relaxed);
    if len == 0 {
        return Ok(());
    }
    let memory = context.memory();
    let fits = |addr: u64| {
        if memory.holds(addr, len) {
            Ok(())
        } else {
            Err(INVALID_VALUE)
        }
    };
    let null_host = match &what {
        Transfer::ToDevice { src, .. } => src.is_null(),
        Transfer::ToHost { dst, .. } => dst.is_null(),
        Transfer::OnDevice { .. } => false,
    };
    if null_host {
        return Err(INVALID_VALUE);
    }
    let work = match what {
        Transfer::ToDevice { dst, src } => {
            fits(dst)?;
            let src = if queued && queue::pinned(src as usize, len) {
                Source::Pinned(src as usize)
            } else {
                // SAFETY: the caller's host buffer holds `len` bytes.
                Source::Staged(unsafe { std::slice::from_raw_parts(src, len) }.to_vec())
            };
            Work::ToDevice { dst, src, len }
        }
        Transfer::ToHost { dst, src } => {
            fits(src)?;
            if !(queued && queue::pinned(dst as usize, len)) {
                // Into pageable memory, or a synchronous copy: the stream's work first.
                context.wait()?;
                let (block, offset) = memory.locate(src).ok_or(INVALID_VALUE)?;
                // SAFETY: the caller's host buffer holds `len` bytes.
                let out = unsafe { std::slice::from_raw_parts_mut(dst, len) };
                return memory.read(block, offset, out).map_err(|_| INVALID_VALUE);
            }
            Work::ToHost {
                dst: dst as usize,
                src,
                len,
            }
        }
        Transfer::OnDevice { dst, src } => {
            fits(dst)?;
            fits(src)?;
            Work::OnDevice { dst, src, len }
        }
    };
    context.queue.push(context, work)?;
    if queued { Ok(()) } else { context.wait() }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: u64,
    src: *const c_void,
    len: usize,
    stream: *mut c_void,
) -> CUresult {
    let what = Transfer::ToDevice {
        dst,
        src: src.cast(),
    };
    result(stream_context(stream).and_then(|c| copy(c, what, len, true)))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: u64,
    len: usize,
    stream: *mut c_void,
) -> CUresult {
    let what = Transfer::ToHost {
        dst: dst.cast(),
        src,
    };
    result(stream_context(stream).and_then(|c| copy(c, what, len, true)))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: u64,
    src: u64,
    len: usize,
    stream: *mut c_void,
) -> CUresult {
    let what = Transfer::OnDevice { dst, src };
    result(stream_context(stream).and_then(|c| copy(c, what, len, true)))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, len: usize) -> CUresult {
    let what = Transfer::ToDevice {
        dst,
        src: src.cast(),
    };
    result(current().and_then(|c| copy(c, what, len, false)))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, len: usize) -> CUresult {
    let what = Transfer::ToHost {
        dst: dst.cast(),
        src,
    };
    result(current().and_then(|c| copy(c, what, len, false)))
}
