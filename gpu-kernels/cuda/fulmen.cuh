// Shared definitions for Fulmen's kernels, compiled two ways:
//   - by NVRTC for a real GPU (no system headers there, so fixed-width types are defined here);
//   - by the host C++ compiler for the emulated device (FULMEN_EMULATOR, see emu/emu.h).
//
// Conventions every kernel follows:
//   - grid-stride loops, so any grid size is correct;
//   - validity bitmaps are Arrow's: bit i of byte i/8, least significant bit first; a null
//     bitmap pointer means "no nulls";
//   - row indices are uint32_t, and NULL_INDEX (0xFFFFFFFF) in an index column means "NULL";
//   - output sizes are computed by the host beforehand (counts → scan), never guessed.
#pragma once

#if defined(FULMEN_EMULATOR)
#include "../emu/emu.h"
#define FULMEN_KERNEL static void
#else
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#define FULMEN_KERNEL extern "C" __global__ void
#define FULMEN_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

#define NULL_INDEX 0xFFFFFFFFu

// First row of this thread and the stride of a grid-stride loop.
#define GRID_START ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x)
#define GRID_STRIDE ((uint64_t)blockDim.x * gridDim.x)

__device__ __forceinline__ bool bit_is_set(const uint8_t* bits, uint64_t i) {
    return bits == nullptr || ((bits[i >> 3] >> (i & 7)) & 1);
}

// ---- row hashes (hash.cu, and fused kernels hashing keys held in registers) ----
// The same functions are written in Rust in src/ops/hash.rs; the three must agree.

#define NULL_HASH 0x5bd1e9955bd1e995ull

__device__ __forceinline__ uint64_t fmix64(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ull;
    k ^= k >> 33;
    return k;
}

__device__ __forceinline__ uint64_t hash_combine(uint64_t seed, uint64_t h) {
    return seed ^ (h + 0x9e3779b97f4a7c15ull + (seed << 6) + (seed >> 2));
}

// A fixed-width value of `bytes` bytes (its bits zero-extended to 64).
__device__ __forceinline__ uint64_t hash_fixed(uint64_t bits, uint64_t bytes) { return fmix64(bits ^ (bytes << 56)); }

__device__ __forceinline__ uint64_t hash_decimal(uint64_t lo, uint64_t hi) {
    return hash_combine(fmix64(lo ^ (16ull << 56)), fmix64(hi));
}

// Floats: -0.0 hashes as 0.0 and every NaN as one NaN, as SQL grouping needs.
__device__ __forceinline__ uint64_t hash_f32_bits(uint32_t bits) {
    if ((bits & 0x7fffffffu) == 0) bits = 0;
    if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) bits = 0x7fc00000u;
    return fmix64((uint64_t)bits ^ (4ull << 56));
}

__device__ __forceinline__ uint64_t hash_f64_bits(uint64_t bits) {
    if ((bits & 0x7fffffffffffffffull) == 0) bits = 0;
    if ((bits & 0x7ff0000000000000ull) == 0x7ff0000000000000ull && (bits & 0x000fffffffffffffull))
        bits = 0x7ff8000000000000ull;
    return fmix64(bits ^ (8ull << 56));
}

// A string's UTF-8 bytes (FNV-1a, then mixed with the length).
__device__ __forceinline__ uint64_t hash_string(const uint8_t* bytes, int64_t len) {
    uint64_t fnv = 0xcbf29ce484222325ull;
    for (int64_t k = 0; k < len; ++k) {
        fnv ^= bytes[k];
        fnv *= 0x100000001b3ull;
    }
    return fmix64(fnv ^ (uint64_t)len);
}

// A 16-byte value (decimal128) moved as two words.
struct __attribute__((aligned(16))) Word128 {
    uint64_t lo;
    uint64_t hi;
};

// Key columns for comparing rows (GROUP BY, join keys), four words each:
// values, validity (null: no NULLs), offsets (strings), kind. Kinds (KeyCol.kind):
// KEY_DICT: u32 codes into a dictionary of strings; `offsets` then points to the
// dictionary's header (its offsets' and bytes' addresses). String kinds (S32, S64, DICT)
// compare by their bytes with one another, so a dictionary-encoded key meets the same
// string held plainly or in another dictionary.
enum KeyKind { KEY_1 = 0, KEY_2, KEY_4, KEY_8, KEY_16, KEY_F32, KEY_F64, KEY_S32, KEY_S64, KEY_DICT };

struct KeyCol {
    const uint8_t* values;
    const uint8_t* validity;  // null: no NULLs
    const uint8_t* offsets;   // strings only
    uint64_t kind;
};

// The bytes of row i of a string key column (KEY_S32, KEY_S64 or KEY_DICT), and their length.
__device__ __forceinline__ const uint8_t* key_string(const KeyCol& c, uint64_t i, int64_t* len) {
    int64_t s, e;
    const uint8_t* bytes = c.values;
    if (c.kind == KEY_S32) {
        s = ((const int32_t*)c.offsets)[i];
        e = ((const int32_t*)c.offsets)[i + 1];
    } else if (c.kind == KEY_S64) {
        s = ((const int64_t*)c.offsets)[i];
        e = ((const int64_t*)c.offsets)[i + 1];
    } else {
        const uint64_t* dict = (const uint64_t*)c.offsets;
        const int32_t* off = (const int32_t*)dict[0];
        const uint32_t code = ((const uint32_t*)c.values)[i];
        s = off[code];
        e = off[code + 1];
        bytes = (const uint8_t*)dict[1];
    }
    *len = e - s;
    return bytes + s;
}

__device__ __forceinline__ uint32_t key_f32_canon(uint32_t bits) { return (bits << 1) == 0 ? 0u : bits; }
__device__ __forceinline__ uint64_t key_f64_canon(uint64_t bits) { return (bits << 1) == 0 ? 0ull : bits; }

// Whether row i of columns a equals row j of columns b, as GROUP BY means it: NULL equals
// NULL, floats compare bit for bit after -0.0 becomes 0.0.
__device__ bool keys_equal(const KeyCol* a, uint64_t i, const KeyCol* b, uint64_t j, uint32_t ncols) {
    for (uint32_t c = 0; c < ncols; ++c) {
        bool va = bit_is_set(a[c].validity, i), vb = bit_is_set(b[c].validity, j);
        if (va != vb) return false;
        if (!va) continue;
        switch (a[c].kind) {
            case KEY_1: if (a[c].values[i] != b[c].values[j]) return false; break;
            case KEY_2: if (((const uint16_t*)a[c].values)[i] != ((const uint16_t*)b[c].values)[j]) return false; break;
            case KEY_4: if (((const uint32_t*)a[c].values)[i] != ((const uint32_t*)b[c].values)[j]) return false; break;
            case KEY_8: if (((const uint64_t*)a[c].values)[i] != ((const uint64_t*)b[c].values)[j]) return false; break;
            case KEY_16: {
                const uint64_t* x = (const uint64_t*)a[c].values + 2 * i;
                const uint64_t* y = (const uint64_t*)b[c].values + 2 * j;
                if (x[0] != y[0] || x[1] != y[1]) return false;
                break;
            }
            case KEY_F32:
                if (key_f32_canon(((const uint32_t*)a[c].values)[i]) != key_f32_canon(((const uint32_t*)b[c].values)[j]))
                    return false;
                break;
            case KEY_F64:
                if (key_f64_canon(((const uint64_t*)a[c].values)[i]) != key_f64_canon(((const uint64_t*)b[c].values)[j]))
                    return false;
                break;
            case KEY_S32:
            case KEY_S64:
            case KEY_DICT: {
                int64_t la, lb;
                const uint8_t* x = key_string(a[c], i, &la);
                const uint8_t* y = key_string(b[c], j, &lb);
                if (la != lb) return false;
                for (int64_t k = 0; k < la; ++k)
                    if (x[k] != y[k]) return false;
                break;
            }
            default: return false;
        }
    }
    return true;
}

// Row i's hash over key columns `cols`, as hash_many (hash.cu) hashes the same columns: each
// column's value hash (NULL_HASH where NULL), the first taken and each later one combined
// in order. A probe computes its rows' hashes with it where the build side's came from
// hash_many, so the two must agree (a kernel test compares them over every key kind).
__device__ uint64_t key_row_hash(const KeyCol* cols, uint32_t ncols, uint64_t i) {
    uint64_t h = 0;
    for (uint32_t c = 0; c < ncols; ++c) {
        const KeyCol& k = cols[c];
        uint64_t one;
        if (!bit_is_set(k.validity, i)) {
            one = NULL_HASH;
        } else {
            switch (k.kind) {
                case KEY_1: one = hash_fixed((uint64_t)k.values[i], 1ull); break;
                case KEY_2: one = hash_fixed((uint64_t)((const uint16_t*)k.values)[i], 2ull); break;
                case KEY_4: one = hash_fixed((uint64_t)((const uint32_t*)k.values)[i], 4ull); break;
                case KEY_8: one = hash_fixed(((const uint64_t*)k.values)[i], 8ull); break;
                case KEY_16: {
                    const uint64_t* x = (const uint64_t*)k.values + 2 * i;
                    one = hash_decimal(x[0], x[1]);
                    break;
                }
                case KEY_F32: one = hash_f32_bits(((const uint32_t*)k.values)[i]); break;
                case KEY_F64: one = hash_f64_bits(((const uint64_t*)k.values)[i]); break;
                case KEY_S32:
                case KEY_S64:
                case KEY_DICT: {
                    int64_t len;
                    const uint8_t* bytes = key_string(k, i, &len);
                    one = hash_string(bytes, len);
                    break;
                }
                default: one = NULL_HASH; break;
            }
        }
        h = c == 0 ? one : hash_combine(h, one);
    }
    return h;
}

// Row i's hash: computed from its key columns and kept in hashes[i] for the kernels after
// (`hash_here`), or read from there (computed before).
__device__ __forceinline__ uint64_t hash_here_or_read(uint64_t* hashes, uint32_t hash_here, const KeyCol* cols,
                                                      uint32_t ncols, uint64_t i) {
    if (!hash_here) return hashes[i];
    uint64_t h = key_row_hash(cols, ncols, i);
    hashes[i] = h;
    return h;
}

