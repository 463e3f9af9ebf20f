//! Modules and launches: the kernels an image holds, the functions handed out, and
//! launches checked against a GPU's limits and queued (see `queue.rs`).

use super::*;

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleLoadData(module: *mut *mut c_void, image: *const c_void) -> CUresult {
    let context = match current().and_then(|c| c.check().map(|()| c)) {
        Ok(c) => c,
        Err(e) => return e,
    };
    if image.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: the driver API's contract: a whole cubin, fatbin or NUL-terminated PTX.
    let bytes = match unsafe { image::image_bytes(image.cast()) } {
        Ok(b) => b,
        Err(why) => {
            eprintln!("fulmen stand-in CUDA driver: cuModuleLoadData: {why}");
            return INVALID_IMAGE;
        }
    };
    let kernels = match image::kernel_names(bytes) {
        Ok(k) => k,
        Err(why) => {
            eprintln!("fulmen stand-in CUDA driver: cuModuleLoadData: {why}");
            return INVALID_IMAGE;
        }
    };
    let ptx = !bytes.starts_with(b"\x7fELF");
    let device = driver().config.compute;
    if let Some(built) = image::target(bytes) {
        let runs = if ptx {
            built <= device
        } else {
            built.0 == device.0 && built.1 <= device.1
        };
        if !runs {
            let kind = if ptx { "PTX" } else { "cubin" };
            eprintln!(
                "fulmen stand-in CUDA driver: cuModuleLoadData: a {kind} for sm_{}{} does not \
                 run on a compute {}.{} device",
                built.0, built.1, device.0, device.1
            );
            return if ptx { INVALID_PTX } else { NO_BINARY_FOR_GPU };
        }
    }
    driver().counts.modules.fetch_add(1, Ordering::Relaxed);
    if ptx {
        driver().counts.ptx_modules.fetch_add(1, Ordering::Relaxed);
    }
    let m = Module {
        context,
        kernels,
        functions: Mutex::new(HashMap::new()),
    };
    out(module, Box::into_raw(Box::new(m)).cast())
}

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleUnload(module: *mut c_void) -> CUresult {
    if module.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: made by cuModuleLoadData and unloaded once.
    drop(unsafe { Box::from_raw(module as *mut Module) });
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleGetFunction(
    function: *mut *mut c_void,
    module: *mut c_void,
    name: *const c_char,
) -> CUresult {
    if module.is_null() || name.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: a live module from cuModuleLoadData; a NUL-terminated name.
    let (m, name) = unsafe { (&*(module as *const Module), CStr::from_ptr(name)) };
    let name = name.to_string_lossy().into_owned();
    if let Err(e) = m.context.check() {
        return e;
    }
    if !m.kernels.contains(&name) {
        eprintln!(
            "fulmen stand-in CUDA driver: the module has no kernel {name} (it holds {})",
            m.kernels.join(", ")
        );
        return NOT_FOUND;
    }
    let Some(kernel) = Kernel::by_name(&name) else {
        eprintln!("fulmen stand-in CUDA driver: the emulator has no kernel {name}");
        return NOT_FOUND;
    };
    let mut functions = lock(&m.functions);
    let f = functions.entry(name).or_insert_with(|| {
        Box::new(Function {
            kernel,
            context: m.context,
            max_dynamic_shared: AtomicU32::new(DEFAULT_SHARED),
        })
    });
    out(function, f.as_ref() as *const Function as *mut c_void)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFuncSetAttribute(
    function: *mut c_void,
    attribute: c_uint,
    value: c_int,
) -> CUresult {
    if function.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: a function from cuModuleGetFunction, alive while its module is.
    let f = unsafe { &*(function as *const Function) };
    match attribute {
        FUNC_ATTR_MAX_DYNAMIC_SHARED if (0..=OPTIN_SHARED as c_int).contains(&value) => {
            f.max_dynamic_shared.store(value as u32, Ordering::Relaxed);
            SUCCESS
        }
        FUNC_ATTR_MAX_DYNAMIC_SHARED => INVALID_VALUE,
        _ => NOT_SUPPORTED,
    }
}

/// Whether a launch's shape is one a GPU accepts.
fn launch_shape_ok(grid: [c_uint; 3], block: [c_uint; 3]) -> bool {
    let threads = block.iter().map(|&b| b as u64).product::<u64>();
    grid.iter().chain(&block).all(|&n| n >= 1)
        && threads <= 1024
        && block[0] <= 1024
        && block[1] <= 1024
        && block[2] <= 64
        && grid[0] <= i32::MAX as c_uint
        && grid[1] <= 65535
        && grid[2] <= 65535
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel(
    function: *mut c_void,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_bytes: c_uint,
    stream: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    if function.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: a function from cuModuleGetFunction, alive while its module is.
    let f = unsafe { &*(function as *const Function) };
    let context = match stream_context(stream) {
        Ok(c) if std::ptr::eq(c, f.context) => c,
        Ok(_) => return INVALID_CONTEXT,
        Err(e) => return e,
    };
    if let Err(e) = context.check() {
        return e;
    }
    let (grid, block) = ([grid_x, grid_y, grid_z], [block_x, block_y, block_z]);
    let allowed = f.max_dynamic_shared.load(Ordering::Relaxed);
    if params.is_null() {
        // Every kernel of Fulmen's takes parameters.
        return INVALID_VALUE;
    }
    if !launch_shape_ok(grid, block) || shared_bytes > allowed || !extra.is_null() {
        eprintln!(
            "fulmen stand-in CUDA driver: {} refused: grid {grid:?}, block {block:?}, {shared_bytes} \
             bytes of dynamic shared memory (at most {allowed}){}",
            f.kernel.name(),
            if extra.is_null() {
                ""
            } else {
                ", `extra` parameters"
            }
        );
        return INVALID_VALUE;
    }
    let d = driver();
    let number = d.counts.launches.fetch_add(1, Ordering::Relaxed) + 1;
    if d.config.fail_launch == Some(number) {
        return LAUNCH_OUT_OF_RESOURCES;
    }
    let cfg = EmuLaunchConfig {
        grid,
        block,
        shared_bytes,
        workers: 0,
        seed: 0x5EED ^ number.wrapping_mul(0x9E37_79B9_7F4A_7C15),
    };
    // SAFETY: `params` is the caller's kernel parameter array, exactly as cuLaunchKernel
    // receives it: one pointer per parameter of the kernel, each read by the size of the
    // kernel's own C++ parameter, as a driver reads them by the cubin's parameter table.
    let work = unsafe { Work::launch(f.kernel, cfg, params, number) };
    result(context.queue.push(context, work))
}
