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
    ("join.cu", include_str!("../cuda/join.cu")),
    ("scan.cu", include_str!("../cuda/scan.cu")),
    ("selftest.cu", include_str!("../cuda/selftest.cu")),
];

/// The headers kernel sources include, by file name (see `nvrtc_flags::HEADER_NAMES`).
pub const HEADERS: &[(&str, &str)] = &[
    ("fulmen.cuh", include_str!("../cuda/fulmen.cuh")),
    ("expr.cuh", include_str!("../cuda/expr.cuh")),
    ("agg.cuh", include_str!("../cuda/agg.cuh")),
];

// The headers inlined at run time are those the build script embeds kernels with (the
// names are compared by `headers_are_the_build_scripts`).
const _: () = assert!(HEADERS.len() == crate::nvrtc_flags::HEADER_NAMES.len());

macro_rules! kernels {
    ($($variant:ident => $name:ident in $file:literal,)*) => {
        /// Every kernel Fulmen launches.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[allow(missing_docs, non_camel_case_types)]
        pub enum Kernel {
            $($variant,)*
        }

        unsafe extern "C" {
            $(fn $name(cfg: *const crate::emu::EmuLaunchConfig, params: *mut *mut std::ffi::c_void,
                        error: *mut std::ffi::c_char, error_len: usize) -> i32;)*
        }

        impl Kernel {
            /// Every kernel.
            pub const ALL: &'static [Kernel] = &[$(Kernel::$variant,)*];

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
        }
    };
}

kernels! {
    join_verify => fulmen_emu_launch_join_verify in "join.cu",
    join_compact => fulmen_emu_launch_join_compact in "join.cu",
    agg_find_or_insert => fulmen_emu_launch_agg_find_or_insert in "agg.cu",
    agg_first_rows => fulmen_emu_launch_agg_first_rows in "agg.cu",
    agg_leader_flags => fulmen_emu_launch_agg_leader_flags in "agg.cu",
    agg_resolve => fulmen_emu_launch_agg_resolve in "agg.cu",
    agg_fix_slots => fulmen_emu_launch_agg_fix_slots in "agg.cu",
    agg_rollback => fulmen_emu_launch_agg_rollback in "agg.cu",
    agg_rehash => fulmen_emu_launch_agg_rehash in "agg.cu",
    agg_fill_u64 => fulmen_emu_launch_agg_fill_u64 in "agg.cu",
    agg_init_state => fulmen_emu_launch_agg_init_state in "agg.cu",
    agg_update => fulmen_emu_launch_agg_update in "agg.cu",
    agg_exact_normalize => fulmen_emu_launch_agg_exact_normalize in "agg.cu",
    agg_exact_finish => fulmen_emu_launch_agg_exact_finish in "agg.cu",
    agg_fused => fulmen_emu_launch_agg_fused in "fused.cu",
    agg_merge_delta => fulmen_emu_launch_agg_merge_delta in "fused.cu",
    select_word_counts => fulmen_emu_launch_select_word_counts in "compact.cu",
    select_scatter => fulmen_emu_launch_select_scatter in "compact.cu",
    expr_eval => fulmen_emu_launch_expr_eval in "expr.cu",
    append_bits => fulmen_emu_launch_append_bits in "concat.cu",
    append_string_o32 => fulmen_emu_launch_append_string_o32 in "concat.cu",
    append_string_o64 => fulmen_emu_launch_append_string_o64 in "concat.cu",
    gather_fixed_1 => fulmen_emu_launch_gather_fixed_1 in "gather.cu",
    gather_fixed_2 => fulmen_emu_launch_gather_fixed_2 in "gather.cu",
    gather_fixed_4 => fulmen_emu_launch_gather_fixed_4 in "gather.cu",
    gather_fixed_8 => fulmen_emu_launch_gather_fixed_8 in "gather.cu",
    gather_fixed_16 => fulmen_emu_launch_gather_fixed_16 in "gather.cu",
    gather_validity => fulmen_emu_launch_gather_validity in "gather.cu",
    gather_string_lengths_o32 => fulmen_emu_launch_gather_string_lengths_o32 in "gather.cu",
    gather_string_lengths_o64 => fulmen_emu_launch_gather_string_lengths_o64 in "gather.cu",
    gather_string_lengths_flagged_o32 => fulmen_emu_launch_gather_string_lengths_flagged_o32 in "gather.cu",
    gather_string_lengths_flagged_o64 => fulmen_emu_launch_gather_string_lengths_flagged_o64 in "gather.cu",
    gather_string_copy_o32 => fulmen_emu_launch_gather_string_copy_o32 in "gather.cu",
    gather_string_copy_o64 => fulmen_emu_launch_gather_string_copy_o64 in "gather.cu",
    hash_fixed_1 => fulmen_emu_launch_hash_fixed_1 in "hash.cu",
    hash_fixed_2 => fulmen_emu_launch_hash_fixed_2 in "hash.cu",
    hash_fixed_4 => fulmen_emu_launch_hash_fixed_4 in "hash.cu",
    hash_fixed_8 => fulmen_emu_launch_hash_fixed_8 in "hash.cu",
    hash_fixed_16 => fulmen_emu_launch_hash_fixed_16 in "hash.cu",
    hash_f32 => fulmen_emu_launch_hash_f32 in "hash.cu",
    hash_f64 => fulmen_emu_launch_hash_f64 in "hash.cu",
    hash_string_o32 => fulmen_emu_launch_hash_string_o32 in "hash.cu",
    hash_string_o64 => fulmen_emu_launch_hash_string_o64 in "hash.cu",
    hash_dict => fulmen_emu_launch_hash_dict in "hash.cu",
    hash_table_init => fulmen_emu_launch_hash_table_init in "hash_table.cu",
    hash_table_insert => fulmen_emu_launch_hash_table_insert in "hash_table.cu",
    hash_table_probe_count => fulmen_emu_launch_hash_table_probe_count in "hash_table.cu",
    hash_table_probe_emit => fulmen_emu_launch_hash_table_probe_emit in "hash_table.cu",
    scan_tile_sums => fulmen_emu_launch_scan_tile_sums in "scan.cu",
    scan_tile_offsets => fulmen_emu_launch_scan_tile_offsets in "scan.cu",
    scan_tiles => fulmen_emu_launch_scan_tiles in "scan.cu",
    selftest_block_scan => fulmen_emu_launch_selftest_block_scan in "selftest.cu",
    selftest_warp => fulmen_emu_launch_selftest_warp in "selftest.cu",
    selftest_atomics => fulmen_emu_launch_selftest_atomics in "selftest.cu",
    selftest_racy => fulmen_emu_launch_selftest_racy in "selftest.cu",
    selftest_oob => fulmen_emu_launch_selftest_oob in "selftest.cu",
    selftest_divergent => fulmen_emu_launch_selftest_divergent in "selftest.cu",
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
}
