// Gather by an index column: out[i] = in[idx[i]], or NULL where idx[i] == NULL_INDEX.
//   gather_fixed_<bytes>     (in, idx, n, out)               values of 1, 2, 4, 8 or 16 bytes;
//                                                            a NULL index writes zero
//   gather_validity          (in_validity, idx, n, out)      output bitmap, one thread per
//                                                            output byte (no atomics);
//                                                            in_validity may be null
//   gather_string_lengths_o32/o64 (offsets, idx, n, count, lengths)
//                                                            byte length of each output string;
//                                                            with count not null only the first
//                                                            min(*count, n) indices are read
//                                                            (the rest may be unwritten) and the
//                                                            other lengths are 0
//   gather_string_lengths_flagged_o32/o64 (offsets, flags, n, lengths)
//                                                            byte length of each row's string
//                                                            where flags[row] (a u64) is
//                                                            non-zero, else 0
//   — scan.cu turns lengths into exclusive starts —
//   gather_string_copy_o32/o64 (offsets, bytes, idx, n, starts, by_source, out_offsets,
//                               out_bytes, out_cap)
//                                                            copies the bytes and writes
//                                                            out_offsets[0..=n]: output i
//                                                            starts at starts[i], or with
//                                                            by_source at starts[idx[i]] (the
//                                                            starts of flagged rows gathered in
//                                                            row order); no byte at or past
//                                                            out_cap is written (a string that
//                                                            would cross it is cut there)
#include "fulmen.cuh"

#define GATHER_FIXED(NAME, T)                                                              \
    FULMEN_KERNEL NAME(const T* in, const uint32_t* idx, uint64_t n, T* out) {             \
        for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {                           \
            uint32_t j = idx[i];                                                           \
            out[i] = j == NULL_INDEX ? T{} : in[j];                                        \
        }                                                                                  \
    }

GATHER_FIXED(gather_fixed_1, uint8_t)
GATHER_FIXED(gather_fixed_2, uint16_t)
GATHER_FIXED(gather_fixed_4, uint32_t)
GATHER_FIXED(gather_fixed_8, uint64_t)
GATHER_FIXED(gather_fixed_16, Word128)

FULMEN_KERNEL gather_validity(const uint8_t* in_validity, const uint32_t* idx, uint64_t n, uint8_t* out) {
    uint64_t bytes = (n + 7) / 8;
    for (uint64_t b = GRID_START; b < bytes; b += GRID_STRIDE) {
        uint8_t bits = 0;
        for (unsigned k = 0; k < 8; ++k) {
            uint64_t i = b * 8 + k;
            if (i >= n) break;
            uint32_t j = idx[i];
            if (j != NULL_INDEX && bit_is_set(in_validity, j)) bits |= (uint8_t)(1u << k);
        }
        out[b] = bits;
    }
}

#define GATHER_STRINGS(SUFFIX, OFF)                                                                  \
    FULMEN_KERNEL gather_string_lengths_##SUFFIX(const OFF* offsets, const uint32_t* idx, uint64_t n, \
                                                 const uint64_t* count, uint64_t* lengths) {         \
        uint64_t real = n;                                                                           \
        if (count != nullptr && *count < real) real = *count;                                        \
        for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {                                     \
            uint32_t j = i < real ? idx[i] : NULL_INDEX;                                             \
            lengths[i] = j == NULL_INDEX ? 0 : (uint64_t)(offsets[j + 1] - offsets[j]);              \
        }                                                                                            \
    }                                                                                                \
    FULMEN_KERNEL gather_string_lengths_flagged_##SUFFIX(const OFF* offsets, const uint64_t* flags,    \
                                                         uint64_t n, uint64_t* lengths) {            \
        for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE)                                       \
            lengths[i] = flags[i] == 0 ? 0 : (uint64_t)(offsets[i + 1] - offsets[i]);                \
    }                                                                                                \
    FULMEN_KERNEL gather_string_copy_##SUFFIX(const OFF* offsets, const uint8_t* bytes,              \
                                              const uint32_t* idx, uint64_t n, const uint64_t* starts, \
                                              uint32_t by_source, OFF* out_offsets, uint8_t* out_bytes, \
                                              uint64_t out_cap) {                                    \
        for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {                                     \
            uint32_t j = idx[i];                                                                     \
            uint64_t start = !by_source ? starts[i] : j == NULL_INDEX ? 0 : starts[j];               \
            uint64_t len = j == NULL_INDEX ? 0 : (uint64_t)(offsets[j + 1] - offsets[j]);            \
            const uint8_t* src = j == NULL_INDEX ? bytes : bytes + offsets[j];                       \
            uint64_t end = start + len;                                                              \
            for (uint64_t k = start; k < end && k < out_cap; ++k) out_bytes[k] = src[k - start];     \
            out_offsets[i] = (OFF)start;                                                             \
            if (i == n - 1) out_offsets[n] = (OFF)end;                                               \
        }                                                                                            \
    }

GATHER_STRINGS(o32, int32_t)
GATHER_STRINGS(o64, int64_t)

#if defined(FULMEN_EMULATOR)
FULMEN_EMU_EXPORT(gather_fixed_1)
FULMEN_EMU_EXPORT(gather_fixed_2)
FULMEN_EMU_EXPORT(gather_fixed_4)
FULMEN_EMU_EXPORT(gather_fixed_8)
FULMEN_EMU_EXPORT(gather_fixed_16)
FULMEN_EMU_EXPORT(gather_validity)
FULMEN_EMU_EXPORT(gather_string_lengths_o32)
FULMEN_EMU_EXPORT(gather_string_lengths_o64)
FULMEN_EMU_EXPORT(gather_string_lengths_flagged_o32)
FULMEN_EMU_EXPORT(gather_string_lengths_flagged_o64)
FULMEN_EMU_EXPORT(gather_string_copy_o32)
FULMEN_EMU_EXPORT(gather_string_copy_o64)
#endif
