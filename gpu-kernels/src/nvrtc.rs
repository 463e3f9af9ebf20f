//! Compiling the kernel sources with NVRTC, the CUDA runtime compiler.
//!
//! On a real GPU, kernels are compiled at run time for the device's architecture. NVRTC
//! needs no GPU, so CI compiles every kernel for compute_80 and compute_90 on machines
//! without one (`scripts/install-nvrtc.sh` fetches the library from PyPI): a kernel that
//! does not compile cannot land.

use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts, sys};

use crate::kernels::{HEADERS, SOURCES};
use crate::nvrtc_flags::{NVRTC_FLAGS, inline_headers};
use crate::{KernelError, Result};

/// Whether the NVRTC library can be loaded (from `LD_LIBRARY_PATH` or the system).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { sys::is_culib_present() }
}

/// A kernel file's source as NVRTC compiles it: its headers inlined, since NVRTC runs
/// where the source tree may not be.
pub fn prepared_source(file: &str) -> Result<String> {
    let (_, source) = SOURCES
        .iter()
        .find(|(name, _)| *name == file)
        .ok_or_else(|| KernelError::Unsupported(format!("no kernel source named {file}")))?;
    Ok(inline_headers(source, HEADERS))
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
        options: NVRTC_FLAGS.iter().map(|f| f.to_string()).collect(),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(source, options).map_err(|e| {
        KernelError::Driver(format!("NVRTC could not compile {file} for {arch}: {e}"))
    })?;
    Ok(ptx.to_src())
}

/// NVRTC's version (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    if !nvrtc_present() {
        return Err(KernelError::Driver(
            "the NVRTC library was not found".into(),
        ));
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; nvrtcVersion writes two ints.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| KernelError::Driver(format!("nvrtcVersion: {e:?}")))?;
    Ok((major, minor))
}

/// Compiles one kernel file to a cubin for exactly `sm` (e.g. `sm_90`). A cubin does not
/// go through the driver's PTX JIT, so it loads even where the driver is older than NVRTC.
pub fn compile_cubin(file: &str, sm: &str) -> Result<Vec<u8>> {
    use cudarc::nvrtc::result;
    use std::ffi::CString;
    if !nvrtc_present() {
        return Err(KernelError::Driver(
            "the NVRTC library was not found".into(),
        ));
    }
    let source = CString::new(prepared_source(file)?)
        .map_err(|_| KernelError::Unsupported(format!("{file} contains a NUL byte")))?;
    let name = CString::new(file)
        .map_err(|_| KernelError::Unsupported("a file name with a NUL byte".into()))?;
    let prog = result::create_program(&source, Some(&name))
        .map_err(|e| KernelError::Driver(format!("NVRTC could not take {file}: {e:?}")))?;
    let mut options = vec![format!("--gpu-architecture={sm}")];
    options.extend(NVRTC_FLAGS.iter().map(|f| f.to_string()));
    // SAFETY: `prog` was just created and is destroyed exactly once below; `source` and
    // `name` outlive it.
    let outcome = unsafe {
        match result::compile_program(prog, &options) {
            Ok(()) => {
                let mut size = 0usize;
                let mut cubin = Vec::new();
                let r = sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .and_then(|()| {
                        cubin.resize(size, 0u8);
                        sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()).result()
                    });
                r.map(|()| cubin).map_err(|e| {
                    KernelError::Driver(format!("NVRTC gave no cubin for {file} ({sm}): {e:?}"))
                })
            }
            Err(e) => {
                let log = result::get_program_log(prog)
                    .map(|l| l.iter().map(|&c| c as u8 as char).collect::<String>())
                    .unwrap_or_default();
                Err(KernelError::Driver(format!(
                    "NVRTC could not compile {file} for {sm}: {e:?}: {}",
                    log.trim_end_matches('\0').trim()
                )))
            }
        }
    };
    // SAFETY: created above, not destroyed before.
    let _ = unsafe { result::destroy_program(prog) };
    outcome
}

/// The folder compiled kernels are cached in: `$FULMEN_KERNEL_CACHE`, else
/// `~/.cache/fulmen/kernels`.
pub fn default_cache_dir() -> Option<std::path::PathBuf> {
    std::env::var_os("FULMEN_KERNEL_CACHE")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cache/fulmen/kernels"))
        })
}

/// The cubin of `file` for compute capability `cc`, from the on-disk cache in the default
/// folder (see [`kernel_image_in`]).
pub fn kernel_image(file: &str, cc: (i32, i32)) -> Result<Vec<u8>> {
    kernel_image_in(default_cache_dir().as_deref(), file, cc)
}

/// The cubin of `file` for compute capability `cc`, cached in `dir` under a name made of the
/// source's hash, the architecture and NVRTC's version; compiled and cached on a miss. A
/// cache that cannot be written only costs a recompile next time. Without NVRTC, a cubin
/// an earlier NVRTC cached for the same source and architecture is still used.
pub fn kernel_image_in(
    dir: Option<&std::path::Path>,
    file: &str,
    cc: (i32, i32),
) -> Result<Vec<u8>> {
    let sm = format!("sm_{}{}", cc.0, cc.1);
    let source = prepared_source(file)?;
    let key = crate::ops::hash::hash_bytes(format!("{source}{NVRTC_FLAGS:?}").as_bytes());
    let stem = file.trim_end_matches(".cu");
    let (major, minor) = match nvrtc_version() {
        Ok(version) => version,
        Err(e) => {
            return dir
                .and_then(|d| cached_by_any_nvrtc(d, &format!("{stem}-{sm}-nvrtc"), key))
                .ok_or(e);
        }
    };
    let path = dir.map(|d| d.join(format!("{stem}-{sm}-nvrtc{major}.{minor}-{key:016x}.cubin")));
    if let Some(path) = &path
        && let Ok(bytes) = std::fs::read(path)
        && !bytes.is_empty()
    {
        return Ok(bytes);
    }
    let cubin = compile_cubin(file, &sm)?;
    if let (Some(dir), Some(path)) = (dir, &path)
        && std::fs::create_dir_all(dir).is_ok()
    {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, path);
        }
    }
    Ok(cubin)
}

/// The cached cubin named `{prefix}{version}-{key}.cubin` of the newest NVRTC version
/// cached, if any.
fn cached_by_any_nvrtc(dir: &std::path::Path, prefix: &str, key: u64) -> Option<Vec<u8>> {
    let suffix = format!("-{key:016x}.cubin");
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix) && n.ends_with(&suffix))
        .collect();
    names.sort();
    names
        .iter()
        .rev()
        .find_map(|n| std::fs::read(dir.join(n)).ok().filter(|b| !b.is_empty()))
}
