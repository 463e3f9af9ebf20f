//! The list of kernels: each kernel's name (its `extern "C"` symbol in `cuda/*.cu`), the
//! source file that defines it, and its entry point in the emulator.

use crate::emu::EmuEntry;

/// The kernel sources, by file name, as compiled by NVRTC (their headers inlined).
pub const SOURCES: &[(&str, &str)] = &[
    ("agg.cu", include_str!("../cuda/agg.cu")),
    ("compact.cu", include_str!("../cuda/compact.cu")),
    ("concat.cu", include_str!("../cuda/concat.cu")),
    ("expr.cu", include_str!("../cuda/expr.cu")),
    ("fused.cu", include_str!("../cuda/fused.cu")),
    ("gather.cu", include_str!("../cuda/gather.cu")),
    ("hash.cu", include_str!("../cuda/hash.cu")),
    ("hash_table.cu", include_str!("../cuda/hash_table.cu")),
    ("scan.cu", include_str!("../cuda/scan.cu")),
    ("selftest.cu", include_str!("../cuda/selftest.cu")),
];

/// The headers kernel sources include, by file name (see `nvrtc_flags::HEADER_NAMES`).
pub const HEADERS: &[(&str, &str)] = &[
    ("fulmen.cuh", include_str!("../cuda/fulmen.cuh")),
    ("expr.cuh", include_str!("../cuda/expr.cuh")),
    ("agg.cuh", include_str!("../cuda/agg.cuh")),
    ("scan.cuh", include_str!("../cuda/scan.cuh")),
];

// The headers inlined at run time are those the build script embeds kernels with (the
// names are compared by `headers_are_the_build_scripts`).
const _: () = assert!(HEADERS.len() == crate::nvrtc_flags::HEADER_NAMES.len());

macro_rules! kernels {
    ($($variant:ident => $name:ident, $params:ident in $file:literal,)*) => {
        /// Every kernel Fulmen launches.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[allow(missing_docs, non_camel_case_types)]
        pub enum Kernel {
            $($variant,)*
        }

        unsafe extern "C" {
            $(fn $name(cfg: *const crate::emu::EmuLaunchConfig, params: *mut *mut std::ffi::c_void,
                        error: *mut std::ffi::c_char, error_len: usize) -> i32;)*
            $(fn $params(sizes: *mut usize, cap: usize) -> usize;)*
        }

        impl Kernel {
            /// Every kernel.
            pub const ALL: &'static [Kernel] = &[$(Kernel::$variant,)*];

            /// The kernel's place in [`Kernel::ALL`].
            pub fn index(self) -> usize {
                self as usize
            }

            /// The kernel whose symbol is `name`.
            pub fn by_name(name: &str) -> Option<Kernel> {
                Self::ALL.iter().copied().find(|k| k.name() == name)
            }

            /// The kernel's symbol in its `.cu` source.
            pub fn name(self) -> &'static str {
                match self {
                    $(Kernel::$variant => stringify!($variant),)*
                }
            }

            /// The source file that defines it.
            pub fn source_file(self) -> &'static str {
                match self {
                    $(Kernel::$variant => $file,)*
                }
            }

            /// The kernel's entry point in the emulator (what the stand-in CUDA driver
            /// runs for a launch of it).
            #[doc(hidden)]
            pub fn emu_entry(self) -> EmuEntry {
                match self {
                    $(Kernel::$variant => $name,)*
                }
            }

            /// The byte size of each of the kernel's parameters, in order, from its C++
            /// signature (what a driver learns from a cubin's parameter table, and the
            /// stand-in CUDA driver from this, to copy a launch's arguments when it is
            /// queued).
            #[doc(hidden)]
            pub fn param_sizes(self) -> &'static [usize] {
                static SIZES: std::sync::OnceLock<Vec<Vec<usize>>> = std::sync::OnceLock::new();
                let all = SIZES.get_or_init(|| {
                    Self::ALL
                        .iter()
                        .map(|&k| {
                            let query = match k {
                                $(Kernel::$variant => $params as unsafe extern "C" fn(*mut usize, usize) -> usize,)*
                            };
                            let mut sizes = vec![0usize; 64];
                            // SAFETY: the export writes at most `cap` sizes into the buffer.
                            let n = unsafe { query(sizes.as_mut_ptr(), sizes.len()) };
                            assert!(n <= sizes.len(), "{} has {n} parameters", k.name());
                            sizes.truncate(n);
                            sizes
                        })
                        .collect()
                });
                &all[self as usize]
            }
        }
    };
}

kernels! {
    agg_find_or_insert => fulmen_emu_launch_agg_find_or_insert, fulmen_emu_params_agg_find_or_insert in "agg.cu",
    agg_leader_flags => fulmen_emu_launch_agg_leader_flags, fulmen_emu_params_agg_leader_flags in "agg.cu",
    agg_leader_ranks => fulmen_emu_launch_agg_leader_ranks, fulmen_emu_params_agg_leader_ranks in "agg.cu",
    agg_resolve => fulmen_emu_launch_agg_resolve, fulmen_emu_params_agg_resolve in "agg.cu",
    agg_rollback => fulmen_emu_launch_agg_rollback, fulmen_emu_params_agg_rollback in "agg.cu",
    agg_rehash => fulmen_emu_launch_agg_rehash, fulmen_emu_params_agg_rehash in "agg.cu",
    agg_fill_u64 => fulmen_emu_launch_agg_fill_u64, fulmen_emu_params_agg_fill_u64 in "agg.cu",
    agg_init_state => fulmen_emu_launch_agg_init_state, fulmen_emu_params_agg_init_state in "agg.cu",
    agg_update => fulmen_emu_launch_agg_update, fulmen_emu_params_agg_update in "agg.cu",
    agg_exact_normalize => fulmen_emu_launch_agg_exact_normalize, fulmen_emu_params_agg_exact_normalize in "agg.cu",
    agg_exact_finish => fulmen_emu_launch_agg_exact_finish, fulmen_emu_params_agg_exact_finish in "agg.cu",
    agg_fused => fulmen_emu_launch_agg_fused, fulmen_emu_params_agg_fused in "fused.cu",
    agg_merge_delta => fulmen_emu_launch_agg_merge_delta, fulmen_emu_params_agg_merge_delta in "fused.cu",
    select_word_counts => fulmen_emu_launch_select_word_counts, fulmen_emu_params_select_word_counts in "compact.cu",
    select_scatter => fulmen_emu_launch_select_scatter, fulmen_emu_params_select_scatter in "compact.cu",
    select_compact => fulmen_emu_launch_select_compact, fulmen_emu_params_select_compact in "compact.cu",
    expr_eval => fulmen_emu_launch_expr_eval, fulmen_emu_params_expr_eval in "expr.cu",
    append_bits => fulmen_emu_launch_append_bits, fulmen_emu_params_append_bits in "concat.cu",
    append_string_o32 => fulmen_emu_launch_append_string_o32, fulmen_emu_params_append_string_o32 in "concat.cu",
    append_string_o64 => fulmen_emu_launch_append_string_o64, fulmen_emu_params_append_string_o64 in "concat.cu",
    gather_fixed_1 => fulmen_emu_launch_gather_fixed_1, fulmen_emu_params_gather_fixed_1 in "gather.cu",
    gather_fixed_2 => fulmen_emu_launch_gather_fixed_2, fulmen_emu_params_gather_fixed_2 in "gather.cu",
    gather_fixed_4 => fulmen_emu_launch_gather_fixed_4, fulmen_emu_params_gather_fixed_4 in "gather.cu",
    gather_fixed_8 => fulmen_emu_launch_gather_fixed_8, fulmen_emu_params_gather_fixed_8 in "gather.cu",
    gather_fixed_16 => fulmen_emu_launch_gather_fixed_16, fulmen_emu_params_gather_fixed_16 in "gather.cu",
    gather_validity => fulmen_emu_launch_gather_validity, fulmen_emu_params_gather_validity in "gather.cu",
    gather_many => fulmen_emu_launch_gather_many, fulmen_emu_params_gather_many in "gather.cu",
    gather_string_lengths_o32 => fulmen_emu_launch_gather_string_lengths_o32, fulmen_emu_params_gather_string_lengths_o32 in "gather.cu",
    gather_string_lengths_o64 => fulmen_emu_launch_gather_string_lengths_o64, fulmen_emu_params_gather_string_lengths_o64 in "gather.cu",
    gather_string_lengths_many_o32 => fulmen_emu_launch_gather_string_lengths_many_o32, fulmen_emu_params_gather_string_lengths_many_o32 in "gather.cu",
    gather_string_lengths_many_o64 => fulmen_emu_launch_gather_string_lengths_many_o64, fulmen_emu_params_gather_string_lengths_many_o64 in "gather.cu",
    gather_string_starts_many_o32 => fulmen_emu_launch_gather_string_starts_many_o32, fulmen_emu_params_gather_string_starts_many_o32 in "gather.cu",
    gather_string_starts_many_o64 => fulmen_emu_launch_gather_string_starts_many_o64, fulmen_emu_params_gather_string_starts_many_o64 in "gather.cu",
    gather_string_copy_many_o32 => fulmen_emu_launch_gather_string_copy_many_o32, fulmen_emu_params_gather_string_copy_many_o32 in "gather.cu",
    gather_string_copy_many_o64 => fulmen_emu_launch_gather_string_copy_many_o64, fulmen_emu_params_gather_string_copy_many_o64 in "gather.cu",
    gather_string_copy_o32 => fulmen_emu_launch_gather_string_copy_o32, fulmen_emu_params_gather_string_copy_o32 in "gather.cu",
    gather_string_copy_o64 => fulmen_emu_launch_gather_string_copy_o64, fulmen_emu_params_gather_string_copy_o64 in "gather.cu",
    hash_many => fulmen_emu_launch_hash_many, fulmen_emu_params_hash_many in "hash.cu",
    hash_table_init => fulmen_emu_launch_hash_table_init, fulmen_emu_params_hash_table_init in "hash_table.cu",
    hash_table_insert => fulmen_emu_launch_hash_table_insert, fulmen_emu_params_hash_table_insert in "hash_table.cu",
    hash_table_probe_count => fulmen_emu_launch_hash_table_probe_count, fulmen_emu_params_hash_table_probe_count in "hash_table.cu",
    hash_table_probe_emit => fulmen_emu_launch_hash_table_probe_emit, fulmen_emu_params_hash_table_probe_emit in "hash_table.cu",
    hash_table_probe => fulmen_emu_launch_hash_table_probe, fulmen_emu_params_hash_table_probe in "hash_table.cu",
    hash_table_probe_mark => fulmen_emu_launch_hash_table_probe_mark, fulmen_emu_params_hash_table_probe_mark in "hash_table.cu",
    scan_tile_sums => fulmen_emu_launch_scan_tile_sums, fulmen_emu_params_scan_tile_sums in "scan.cu",
    scan_tile_offsets => fulmen_emu_launch_scan_tile_offsets, fulmen_emu_params_scan_tile_offsets in "scan.cu",
    scan_tiles => fulmen_emu_launch_scan_tiles, fulmen_emu_params_scan_tiles in "scan.cu",
    scan_lookback => fulmen_emu_launch_scan_lookback, fulmen_emu_params_scan_lookback in "scan.cu",
    selftest_block_scan => fulmen_emu_launch_selftest_block_scan, fulmen_emu_params_selftest_block_scan in "selftest.cu",
    selftest_warp => fulmen_emu_launch_selftest_warp, fulmen_emu_params_selftest_warp in "selftest.cu",
    selftest_atomics => fulmen_emu_launch_selftest_atomics, fulmen_emu_params_selftest_atomics in "selftest.cu",
    selftest_racy => fulmen_emu_launch_selftest_racy, fulmen_emu_params_selftest_racy in "selftest.cu",
    selftest_oob => fulmen_emu_launch_selftest_oob, fulmen_emu_params_selftest_oob in "selftest.cu",
    selftest_divergent => fulmen_emu_launch_selftest_divergent, fulmen_emu_params_selftest_divergent in "selftest.cu",
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_the_build_scripts() {
        let names: Vec<&str> = HEADERS.iter().map(|(name, _)| *name).collect();
        assert_eq!(names, crate::nvrtc_flags::HEADER_NAMES);
        // Every header a source includes is inlined, once (the emulator's own header, in
        // the emulator's branch, is the one include NVRTC never compiles).
        for (file, source) in SOURCES {
            let inlined = crate::nvrtc_flags::inline_headers(source, HEADERS);
            for (name, _) in HEADERS {
                let include = format!("#include \"{name}\"");
                assert!(!inlined.contains(&include), "{file} keeps {include}");
            }
            assert!(!inlined.contains("#pragma once"), "{file}");
            assert_eq!(inlined.matches("struct KeyCol {").count(), 1, "{file}");
        }
    }

    /// Every parameter travels in an 8-byte slot (`Device::launch`'s `Arg`), so none may be
    /// larger; and the sizes come from the kernels' own signatures.
    #[test]
    fn every_parameter_fits_an_eight_byte_slot() {
        for &k in Kernel::ALL {
            let sizes = k.param_sizes();
            assert!(!sizes.is_empty(), "{}", k.name());
            assert!(
                sizes.iter().all(|&s| s == 4 || s == 8),
                "{}: {sizes:?}",
                k.name()
            );
        }
        // `agg_fill_u64(uint64_t* out, uint64_t n, uint64_t value)`.
        assert_eq!(Kernel::agg_fill_u64.param_sizes(), &[8, 8, 8]);
    }
}
