// Shared by the crate (`nvrtc.rs`) and its build script (`build.rs`, through `include!`), so
// that kernels embedded at build time and kernels compiled at run time are compiled alike.

/// Flags every kernel is compiled with (besides the architecture): 128-bit integers are
/// how decimal128 values are computed (`cuda/expr.cu`).
pub const NVRTC_FLAGS: &[&str] = &["--std=c++17", "--device-int128"];

/// The architectures kernels are embedded for when NVRTC is present at build time: cubins
/// for Ampere (A100; also runs on every 8.x GPU) and Hopper (H100, H200), and PTX for
/// compute 8.0, which the driver compiles for any newer GPU.
pub const EMBEDDED_ARCHS: &[&str] = &["sm_80", "sm_90", "compute_80"];

/// The headers kernel sources include (`cuda/*.cuh`), by file name.
pub const HEADER_NAMES: &[&str] = &["fulmen.cuh", "expr.cuh", "agg.cuh", "scan.cuh"];

/// A kernel source as NVRTC compiles it: each `#include "NAME"` of a header in `headers`
/// (name, text) replaced by that header, its own includes inlined the same way, every
/// header once (as `#pragma once` makes it), since NVRTC runs where the source tree may not
/// be.
pub fn inline_headers(source: &str, headers: &[(&str, &str)]) -> String {
    fn expand<'a>(
        text: &str,
        headers: &[(&'a str, &str)],
        seen: &mut Vec<&'a str>,
        out: &mut String,
    ) {
        for line in text.split_inclusive('\n') {
            let trimmed = line.trim();
            if trimmed == "#pragma once" {
                continue;
            }
            let included = trimmed
                .strip_prefix("#include \"")
                .and_then(|rest| rest.strip_suffix('"'))
                .and_then(|name| headers.iter().find(|(n, _)| *n == name));
            match included {
                Some((name, header)) => {
                    if !seen.contains(name) {
                        seen.push(name);
                        expand(header, headers, seen, out);
                        out.push('\n');
                    }
                }
                None => out.push_str(line),
            }
        }
    }
    let mut out = String::with_capacity(source.len() * 2);
    expand(source, headers, &mut Vec::new(), &mut out);
    out
}
