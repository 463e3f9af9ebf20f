//! 1. Compiles the kernel sources for the emulated device with the host C++ compiler. The
//!    emulator is always optimised: kernels run once per emulated thread, and an unoptimised
//!    build makes whole-query tests on it far slower.
//! 2. When NVRTC is present at build time, compiles every kernel source ahead for real GPUs
//!    (`EMBEDDED_ARCHS`: sm_80 and sm_90 cubins, compute_80 PTX) and embeds the images, so
//!    that a GPU of those architectures needs no NVRTC at run time (`src/images.rs`).
//!    NVRTC is looked for where `scripts/install-nvrtc.sh` puts it (`$FULMEN_NVRTC_DIR`,
//!    else `~/.cache/fulmen/nvrtc`), then in `$CUDA_HOME` and `/usr/local/cuda`;
//!    `FULMEN_EMBED_KERNELS=0` skips this step. A kernel that NVRTC cannot compile fails
//!    the build, with NVRTC's log.

use std::ffi::{CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};

include!("src/nvrtc_flags.rs");

fn main() {
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .opt_level(2)
        .warnings(true)
        .flag_if_supported("-Wno-unused-function")
        .flag_if_supported("-Wno-unused-parameter")
        .file("emu/runtime.cpp")
        .file("emu/kernels.cpp");
    build.compile("fulmen_emu");
    for dir in ["emu", "cuda", "src/nvrtc_flags.rs"] {
        println!("cargo:rerun-if-changed={dir}");
    }
    embed_kernels();
}

/// Where NVRTC is, if anywhere this script looks.
fn find_nvrtc() -> Option<PathBuf> {
    for var in [
        "FULMEN_NVRTC_DIR",
        "FULMEN_EMBED_KERNELS",
        "CUDA_HOME",
        "HOME",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if std::env::var("FULMEN_EMBED_KERNELS").is_ok_and(|v| v == "0") {
        return None;
    }
    let prefix = std::env::var_os("FULMEN_NVRTC_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/fulmen/nvrtc")));
    let mut folders: Vec<PathBuf> = prefix
        .map(|p| p.join("nvidia/cuda_nvrtc/lib"))
        .into_iter()
        .collect();
    if let Some(cuda) = std::env::var_os("CUDA_HOME") {
        folders.push(Path::new(&cuda).join("lib64"));
    }
    folders.push("/usr/local/cuda/lib64".into());
    folders
        .iter()
        .flat_map(|f| [f.join("libnvrtc.so.12"), f.join("libnvrtc.so")])
        .find(|lib| lib.is_file())
}

type Program = *mut c_void;

/// The few NVRTC entry points the build needs, from the library found.
struct Nvrtc {
    _lib: libloading::Library,
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int,
    create: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int,
    log_size: unsafe extern "C" fn(Program, *mut usize) -> c_int,
    log: unsafe extern "C" fn(Program, *mut c_char) -> c_int,
    ptx_size: unsafe extern "C" fn(Program, *mut usize) -> c_int,
    ptx: unsafe extern "C" fn(Program, *mut c_char) -> c_int,
    cubin_size: unsafe extern "C" fn(Program, *mut usize) -> c_int,
    cubin: unsafe extern "C" fn(Program, *mut c_char) -> c_int,
    destroy: unsafe extern "C" fn(*mut Program) -> c_int,
}

impl Nvrtc {
    fn load(path: &Path) -> Result<Self, String> {
        // SAFETY: loading NVRTC runs no initialisation beyond the library's own.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: each symbol has the signature NVRTC's header (nvrtc.h) declares.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{}: {e}", $name))?
            };
        }
        Ok(Self {
            version: sym!("nvrtcVersion"),
            create: sym!("nvrtcCreateProgram"),
            compile: sym!("nvrtcCompileProgram"),
            log_size: sym!("nvrtcGetProgramLogSize"),
            log: sym!("nvrtcGetProgramLog"),
            ptx_size: sym!("nvrtcGetPTXSize"),
            ptx: sym!("nvrtcGetPTX"),
            cubin_size: sym!("nvrtcGetCUBINSize"),
            cubin: sym!("nvrtcGetCUBIN"),
            destroy: sym!("nvrtcDestroyProgram"),
            _lib: lib,
        })
    }

    fn version(&self) -> (c_int, c_int) {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: writes two ints.
        unsafe { (self.version)(&mut major, &mut minor) };
        (major, minor)
    }

    /// Compiles `source` for `arch`: a cubin for `sm_*`, NUL-terminated PTX for `compute_*`.
    fn compile(&self, file: &str, source: &str, arch: &str) -> Result<Vec<u8>, String> {
        let source = CString::new(source).map_err(|_| format!("{file}: a NUL byte"))?;
        let name = CString::new(file).map_err(|_| "a NUL byte in a file name".to_string())?;
        let options: Vec<CString> = std::iter::once(format!("--gpu-architecture={arch}"))
            .chain(NVRTC_FLAGS.iter().map(|f| f.to_string()))
            .map(|o| CString::new(o).expect("flags have no NUL"))
            .collect();
        let pointers: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: NVRTC's calls as nvrtc.h documents them; every pointer outlives the
        // program, which is destroyed once below; output buffers are sized by NVRTC itself.
        unsafe {
            let code = (self.create)(
                &mut prog,
                source.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            );
            if code != 0 {
                return Err(format!("nvrtcCreateProgram({file}) returned {code}"));
            }
            let compiled = (self.compile)(prog, pointers.len() as c_int, pointers.as_ptr());
            let outcome = if compiled != 0 {
                let mut len = 0usize;
                (self.log_size)(prog, &mut len);
                let mut log = vec![0u8; len.max(1)];
                (self.log)(prog, log.as_mut_ptr().cast());
                Err(format!(
                    "NVRTC could not compile {file} for {arch}:\n{}",
                    String::from_utf8_lossy(&log).trim_end_matches('\0')
                ))
            } else {
                let ptx = arch.starts_with("compute_");
                let (size_of, get) = if ptx {
                    (self.ptx_size, self.ptx)
                } else {
                    (self.cubin_size, self.cubin)
                };
                let mut len = 0usize;
                let mut image = Vec::new();
                if size_of(prog, &mut len) == 0 {
                    image.resize(len, 0u8);
                    if get(prog, image.as_mut_ptr().cast()) != 0 {
                        image.clear();
                    }
                }
                if image.is_empty() {
                    Err(format!("NVRTC gave no image of {file} for {arch}"))
                } else {
                    // PTX must end with its NUL (cuModuleLoadData takes no length); NVRTC's
                    // size counts it.
                    if ptx && image.last() != Some(&0) {
                        image.push(0);
                    }
                    Ok(image)
                }
            };
            (self.destroy)(&mut prog);
            outcome
        }
    }
}

fn embed_kernels() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let generated = out.join("embedded_kernels.rs");
    let write = |entries: &[String], with: &str| {
        let body = format!(
            "// Generated by build.rs.\n\n/// The kernel images built ahead: (source file, \
             architecture, image).\npub(crate) static EMBEDDED: &[(&str, &str, &[u8])] = \
             &[\n{}];\n\n/// The NVRTC that built them (empty when none was found at build \
             time).\npub(crate) const EMBEDDED_WITH: &str = {with:?};\n",
            entries.concat()
        );
        std::fs::write(&generated, body).expect("OUT_DIR is writable");
    };
    let Some(lib) = find_nvrtc() else {
        println!(
            "cargo:warning=NVRTC not found at build time: no kernels embedded, so a real GPU \
             will need NVRTC at run time (scripts/install-nvrtc.sh installs it where the build \
             finds it)"
        );
        write(&[], "");
        return;
    };
    println!("cargo:rerun-if-changed={}", lib.display());
    let nvrtc = match Nvrtc::load(&lib) {
        Ok(n) => n,
        Err(e) => {
            println!(
                "cargo:warning=NVRTC at {} could not be loaded ({e}): no kernels embedded",
                lib.display()
            );
            write(&[], "");
            return;
        }
    };
    let headers: Vec<(&str, String)> = HEADER_NAMES
        .iter()
        .map(|&name| {
            let text = std::fs::read_to_string(Path::new("cuda").join(name))
                .unwrap_or_else(|e| panic!("cuda/{name}: {e}"));
            (name, text)
        })
        .collect();
    let headers: Vec<(&str, &str)> = headers.iter().map(|(n, t)| (*n, t.as_str())).collect();
    let mut files: Vec<String> = std::fs::read_dir("cuda")
        .expect("cuda/ is readable")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|name| name.ends_with(".cu"))
        .collect();
    files.sort();
    let jobs: Vec<(String, &str)> = files
        .iter()
        .flat_map(|f| EMBEDDED_ARCHS.iter().map(move |&a| (f.clone(), a)))
        .collect();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<(usize, Result<Vec<u8>, String>)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads.min(jobs.len()))
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some((file, arch)) = jobs.get(i) else {
                            return done;
                        };
                        let source = std::fs::read_to_string(Path::new("cuda").join(file))
                            .map_err(|e| format!("cuda/{file}: {e}"));
                        let image = source
                            .and_then(|s| nvrtc.compile(file, &inline_headers(&s, &headers), arch));
                        done.push((i, image));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("a compile thread panicked"))
            .collect()
    });
    let mut images: Vec<Option<Vec<u8>>> = vec![None; jobs.len()];
    for (i, image) in results {
        match image {
            Ok(bytes) => images[i] = Some(bytes),
            Err(e) => panic!("{e}"),
        }
    }
    let mut entries = Vec::new();
    for ((file, arch), image) in jobs.iter().zip(images) {
        let stem = file.trim_end_matches(".cu");
        let ext = if arch.starts_with("compute_") {
            "ptx"
        } else {
            "cubin"
        };
        let path = out.join(format!("{stem}.{arch}.{ext}"));
        std::fs::write(&path, image.expect("every job ran")).expect("OUT_DIR is writable");
        entries.push(format!(
            "    ({file:?}, {arch:?}, include_bytes!({:?})),\n",
            path.display().to_string()
        ));
    }
    let (major, minor) = nvrtc.version();
    write(&entries, &format!("NVRTC {major}.{minor}"));
}
