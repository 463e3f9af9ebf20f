// Row hashes of one or several columns, NULL-aware, up to HASH_MANY columns a launch:
//   hash_many(n, hashes, combine, kinds, (a, b, validity) per column)
//     each column's h = hash of row i's value, or NULL_HASH when the row is NULL;
//     the first column's h is stored (combine == 0) or combined into hashes[i], and each
//     later column's combined in order: hashes[i] = hash_combine(hashes[i], h)
//   Kinds: fixed 1/2/4/8/16 hash the value's bytes (integers, dates, timestamps, decimals);
//   f32/f64 first make -0.0 equal to 0.0 and every NaN one NaN, as SQL grouping needs;
//   strings (32- or 64-bit offsets) hash the UTF-8 bytes between offsets[i] and
//   offsets[i + 1]; dictionary codes hash as the strings they stand for, so that they meet
//   the same strings held plainly.
// The same functions are written in Rust in src/ops/hash.rs; the two must agree.
#include "fulmen.cuh"

// `kinds` holds a byte per column: 1/2/4/8 fixed width,
// HASH_K_FIXED16, HASH_K_F32/F64, HASH_K_STR32/STR64 (a = offsets, b = bytes), HASH_K_DICT
// (a = codes, b = the dictionary's header); 0 past the last column. `a` is the values
// otherwise, and `v` each column's validity (null: no NULLs).
#define HASH_MANY 6
#define HASH_K_FIXED16 16u
#define HASH_K_F32 0x20u
#define HASH_K_F64 0x21u
#define HASH_K_STR32 0x40u
#define HASH_K_STR64 0x41u
#define HASH_K_DICT 0x50u

__device__ __forceinline__ uint64_t hash_kind(unsigned kind, const uint8_t* a, const uint8_t* b, uint64_t i) {
    switch (kind) {
        case 1: return hash_fixed((uint64_t)a[i], 1ull);
        case 2: return hash_fixed((uint64_t)reinterpret_cast<const uint16_t*>(a)[i], 2ull);
        case 4: return hash_fixed((uint64_t)reinterpret_cast<const uint32_t*>(a)[i], 4ull);
        case 8: return hash_fixed(reinterpret_cast<const uint64_t*>(a)[i], 8ull);
        case HASH_K_FIXED16: {
            Word128 v = reinterpret_cast<const Word128*>(a)[i];
            return hash_decimal(v.lo, v.hi);
        }
        case HASH_K_F32: return hash_f32_bits(reinterpret_cast<const uint32_t*>(a)[i]);
        case HASH_K_F64: return hash_f64_bits(reinterpret_cast<const uint64_t*>(a)[i]);
        case HASH_K_STR32: {
            const int32_t* off = reinterpret_cast<const int32_t*>(a);
            return hash_string(b + off[i], (int64_t)(off[i + 1] - off[i]));
        }
        case HASH_K_STR64: {
            const int64_t* off = reinterpret_cast<const int64_t*>(a);
            return hash_string(b + off[i], (int64_t)(off[i + 1] - off[i]));
        }
        case HASH_K_DICT: {
            const uint64_t* dict = reinterpret_cast<const uint64_t*>(b);
            const int32_t* off = (const int32_t*)dict[0];
            const uint8_t* bytes = (const uint8_t*)dict[1];
            const uint32_t code = reinterpret_cast<const uint32_t*>(a)[i];
            return hash_string(bytes + off[code], (int64_t)(off[code + 1] - off[code]));
        }
        default: return NULL_HASH;
    }
}

FULMEN_KERNEL hash_many(uint64_t n, uint64_t* hashes, uint32_t combine, uint64_t kinds,
                        const uint8_t* a0, const uint8_t* b0, const uint8_t* v0,
                        const uint8_t* a1, const uint8_t* b1, const uint8_t* v1,
                        const uint8_t* a2, const uint8_t* b2, const uint8_t* v2,
                        const uint8_t* a3, const uint8_t* b3, const uint8_t* v3,
                        const uint8_t* a4, const uint8_t* b4, const uint8_t* v4,
                        const uint8_t* a5, const uint8_t* b5, const uint8_t* v5) {
    const uint8_t* as[HASH_MANY] = {a0, a1, a2, a3, a4, a5};
    const uint8_t* bs[HASH_MANY] = {b0, b1, b2, b3, b4, b5};
    const uint8_t* vs[HASH_MANY] = {v0, v1, v2, v3, v4, v5};
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {
        uint64_t h = combine ? hashes[i] : 0;
        for (unsigned c = 0; c < HASH_MANY; ++c) {
            unsigned kind = (unsigned)((kinds >> (8 * c)) & 0xFF);
            if (kind == 0) break;
            uint64_t one = bit_is_set(vs[c], i) ? hash_kind(kind, as[c], bs[c], i) : NULL_HASH;
            h = (c == 0 && !combine) ? one : hash_combine(h, one);
        }
        hashes[i] = h;
    }
}

#if defined(FULMEN_EMULATOR)
FULMEN_EMU_EXPORT(hash_many)
#endif
