// Shared by the crate (`nvrtc.rs`) and its build script (`build.rs`, through `include!`), so
// that kernels embedded at build time and kernels compiled at run time are compiled alike.

/// Flags every kernel is compiled with (besides the architecture): 128-bit integers are
/// how decimal128 values are computed (`cuda/expr.cu`).
pub const NVRTC_FLAGS: &[&str] = &["--std=c++17", "--device-int128"];

/// The architectures kernels are embedded for when NVRTC is present at build time: cubins
/// for Ampere (A100; also runs on every 8.x GPU) and Hopper (H100, H200), and PTX for
/// compute 8.0, which the driver compiles for any newer GPU.
pub const EMBEDDED_ARCHS: &[&str] = &["sm_80", "sm_90", "compute_80"];

/// The name of the shared header, and how a kernel source includes it.
pub const HEADER_NAME: &str = "fulmen.cuh";

/// A kernel source as NVRTC compiles it: the shared header inlined, since NVRTC runs where
/// the source tree may not be.
pub fn inline_header(source: &str, header: &str) -> String {
    source.replace(&format!("#include \"{HEADER_NAME}\""), header)
}
