// Row hashes of one or several columns, NULL-aware.
//   hash_<kind>(values…, validity, n, hashes, combine)
//     h = hash of row i's value, or NULL_HASH when the row is NULL;
//     combine == 0: hashes[i] = h;  combine != 0: hashes[i] = hash_combine(hashes[i], h)
//   Kinds: fixed_1/2/4/8/16 hash the value's bytes (integers, dates, timestamps, decimals);
//   f32/f64 first make -0.0 equal to 0.0 and every NaN one NaN, as SQL grouping needs;
//   string_o32/o64 hash the UTF-8 bytes between offsets[i] and offsets[i + 1].
// The same functions are written in Rust in src/ops/hash.rs; the two must agree.
#include "fulmen.cuh"

__device__ __forceinline__ void store_hash(uint64_t* hashes, uint64_t i, uint64_t h, uint32_t combine) {
    hashes[i] = combine ? hash_combine(hashes[i], h) : h;
}

#define HASH_FIXED(NAME, T, BYTES)                                                                  \
    FULMEN_KERNEL NAME(const T* values, const uint8_t* validity, uint64_t n, uint64_t* hashes,      \
                       uint32_t combine) {                                                          \
        for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {                                    \
            uint64_t h = bit_is_set(validity, i) ? hash_fixed((uint64_t)values[i], BYTES##ull)      \
                                                 : NULL_HASH;                                       \
            store_hash(hashes, i, h, combine);                                                      \
        }                                                                                           \
    }

HASH_FIXED(hash_fixed_1, uint8_t, 1)
HASH_FIXED(hash_fixed_2, uint16_t, 2)
HASH_FIXED(hash_fixed_4, uint32_t, 4)
HASH_FIXED(hash_fixed_8, uint64_t, 8)

FULMEN_KERNEL hash_fixed_16(const Word128* values, const uint8_t* validity, uint64_t n, uint64_t* hashes,
                            uint32_t combine) {
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {
        uint64_t h = NULL_HASH;
        if (bit_is_set(validity, i)) {
            Word128 v = values[i];
            h = hash_decimal(v.lo, v.hi);
        }
        store_hash(hashes, i, h, combine);
    }
}

FULMEN_KERNEL hash_f32(const uint32_t* values, const uint8_t* validity, uint64_t n, uint64_t* hashes,
                       uint32_t combine) {
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {
        uint64_t h = NULL_HASH;
        if (bit_is_set(validity, i)) {
            h = hash_f32_bits(values[i]);
        }
        store_hash(hashes, i, h, combine);
    }
}

FULMEN_KERNEL hash_f64(const uint64_t* values, const uint8_t* validity, uint64_t n, uint64_t* hashes,
                       uint32_t combine) {
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {
        uint64_t h = NULL_HASH;
        if (bit_is_set(validity, i)) {
            h = hash_f64_bits(values[i]);
        }
        store_hash(hashes, i, h, combine);
    }
}

#define HASH_STRINGS(SUFFIX, OFF)                                                                  \
    FULMEN_KERNEL hash_string_##SUFFIX(const OFF* offsets, const uint8_t* bytes, const uint8_t* validity, \
                                       uint64_t n, uint64_t* hashes, uint32_t combine) {            \
        for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {                                   \
            uint64_t h = NULL_HASH;                                                                \
            if (bit_is_set(validity, i))                                                           \
                h = hash_string(bytes + offsets[i], (int64_t)(offsets[i + 1] - offsets[i]));       \
            store_hash(hashes, i, h, combine);                                                     \
        }                                                                                          \
    }

HASH_STRINGS(o32, int32_t)
HASH_STRINGS(o64, int64_t)

// Dictionary-encoded strings hash as the strings their codes stand for (`dict`: the
// dictionary's header, its offsets' and bytes' addresses), so that they meet the same
// strings held plainly.
FULMEN_KERNEL hash_dict(const uint32_t* codes, const uint64_t* dict, const uint8_t* validity, uint64_t n,
                        uint64_t* hashes, uint32_t combine) {
    const int32_t* off = (const int32_t*)dict[0];
    const uint8_t* bytes = (const uint8_t*)dict[1];
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {
        uint64_t h = NULL_HASH;
        if (bit_is_set(validity, i)) {
            const uint32_t code = codes[i];
            h = hash_string(bytes + off[code], (int64_t)(off[code + 1] - off[code]));
        }
        store_hash(hashes, i, h, combine);
    }
}

#if defined(FULMEN_EMULATOR)
FULMEN_EMU_EXPORT(hash_fixed_1)
FULMEN_EMU_EXPORT(hash_fixed_2)
FULMEN_EMU_EXPORT(hash_fixed_4)
FULMEN_EMU_EXPORT(hash_fixed_8)
FULMEN_EMU_EXPORT(hash_fixed_16)
FULMEN_EMU_EXPORT(hash_f32)
FULMEN_EMU_EXPORT(hash_f64)
FULMEN_EMU_EXPORT(hash_string_o32)
FULMEN_EMU_EXPORT(hash_string_o64)
FULMEN_EMU_EXPORT(hash_dict)
#endif
