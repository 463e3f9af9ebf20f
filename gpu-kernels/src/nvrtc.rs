//! Compiling the kernel sources with NVRTC, the CUDA runtime compiler.
//!
//! On a real GPU, kernels are compiled at run time for the device's architecture. NVRTC
//! needs no GPU, so CI compiles every kernel for compute_80 and compute_90 on machines
//! without one (`scripts/install-nvrtc.sh` fetches the library from PyPI): a kernel that
//! does not compile cannot land.

use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts, sys};

use crate::kernels::{HEADER, SOURCES};
use crate::{KernelError, Result};

/// Whether the NVRTC library can be loaded (from `LD_LIBRARY_PATH` or the system).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { sys::is_culib_present() }
}

/// A kernel file's source as NVRTC compiles it: the shared header inlined, since NVRTC
/// runs where the source tree may not be.
pub fn prepared_source(file: &str) -> Result<String> {
    let (_, source) = SOURCES
        .iter()
        .find(|(name, _)| *name == file)
        .ok_or_else(|| KernelError::Unsupported(format!("no kernel source named {file}")))?;
    let include = format!("#include \"{}\"", HEADER.0);
    Ok(source.replace(&include, HEADER.1))
}

/// Compiles one kernel file to PTX for `arch` (e.g. `compute_90`).
pub fn compile_ptx(file: &str, arch: &'static str) -> Result<String> {
    if !nvrtc_present() {
        return Err(KernelError::Driver(
            "the NVRTC library (libnvrtc.so.12) was not found: run scripts/install-nvrtc.sh and \
             add its folder to LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let source = prepared_source(file)?;
    let options = CompileOptions {
        arch: Some(arch),
        name: Some(file.to_string()),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(source, options).map_err(|e| {
        KernelError::Driver(format!("NVRTC could not compile {file} for {arch}: {e}"))
    })?;
    Ok(ptx.to_src())
}
