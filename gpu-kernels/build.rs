//! Compiles the kernel sources for the emulated device with the host C++ compiler.
//!
//! The emulator is always optimised: kernels run once per emulated thread, and an
//! unoptimised build makes whole-query tests on it far slower.

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
    for dir in ["emu", "cuda"] {
        println!("cargo:rerun-if-changed={dir}");
    }
}
