// Hash joins: the probe of hash_table.cu gives candidate pairs (equal row hashes); these
// kernels keep the pairs whose keys are really equal, in order.
//   join_verify  (build_keys, probe_keys, ncols, build, probe, n, nulls_match, flags, pairs)
//       flags[i] = 1 when build row build[i] and probe row probe[i] have equal keys (u64, for
//       the scan). Unless nulls_match, a NULL in either row's keys matches nothing (the
//       table usually leaves NULL build keys out already). With `pairs` (a device count,
//       from the probe's scan), only the first min(*pairs, n) pairs are real: the rest of
//       the n slots (the outputs' capacity) get flag 0 and are not read.
//   join_compact (build, probe, flags, offsets, n, out_build, out_probe)
//       the flagged pairs, in order, at their exclusive-scan offsets
#include "fulmen.cuh"

__device__ __forceinline__ bool join_key_null(const KeyCol* keys, uint64_t row, uint32_t ncols) {
    for (uint32_t c = 0; c < ncols; ++c)
        if (!bit_is_set(keys[c].validity, row)) return true;
    return false;
}

FULMEN_KERNEL join_verify(const KeyCol* build_keys, const KeyCol* probe_keys, uint32_t ncols, const uint32_t* build,
                          const uint32_t* probe, uint64_t n, uint32_t nulls_match, uint64_t* flags,
                          const uint64_t* pairs) {
    uint64_t real = pairs != nullptr && *pairs < n ? *pairs : n;
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {
        if (i >= real) {
            flags[i] = 0;
            continue;
        }
        bool equal = keys_equal(build_keys, build[i], probe_keys, probe[i], ncols);
        if (equal && !nulls_match)
            equal = !join_key_null(build_keys, build[i], ncols) && !join_key_null(probe_keys, probe[i], ncols);
        flags[i] = equal ? 1 : 0;
    }
}

FULMEN_KERNEL join_compact(const uint32_t* build, const uint32_t* probe, const uint64_t* flags,
                           const uint64_t* offsets, uint64_t n, uint32_t* out_build, uint32_t* out_probe) {
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {
        if (flags[i]) {
            out_build[offsets[i]] = build[i];
            out_probe[offsets[i]] = probe[i];
        }
    }
}

#if defined(FULMEN_EMULATOR)
FULMEN_EMU_EXPORT(join_verify)
FULMEN_EMU_EXPORT(join_compact)
#endif
