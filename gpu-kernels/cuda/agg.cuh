// Hash aggregation's shared pieces (agg.cu states the contract): group ids, the key store,
// accumulators and their exact float sums, for agg.cu's kernels and the fused kernels of
// fused.cu, which feed accumulators from an expression program's registers.
#pragma once
#include "fulmen.cuh"


typedef __int128 i128;

union AggBits {
    double f;
    uint64_t u;
};

#define AGG_EMPTY 0xFFFFFFFFFFFFFFFFull
#define AGG_PENDING 0x80000000u
#define AGG_SKIP 0xFFFFFFFFu  // a row the aggregation does not take (never PENDING | row: rows < 2^31 - 1)

__device__ __forceinline__ bool agg_is_pending(uint32_t ref) { return ref != AGG_SKIP && (ref & AGG_PENDING); }

// The key columns of committed group `gid` and its row in them.
__device__ __forceinline__ const KeyCol* agg_store_row(const KeyCol* store, const uint64_t* starts,
                                                          uint32_t chunks, uint32_t ncols, uint64_t gid,
                                                          uint64_t* row) {
    uint32_t lo = 0, hi = chunks - 1;  // the last chunk c with starts[c] <= gid
    while (lo < hi) {
        uint32_t mid = (lo + hi + 1) / 2;
        if (starts[mid] <= gid) lo = mid; else hi = mid - 1;
    }
    *row = gid - starts[lo];
    return store + (uint64_t)lo * ncols;
}

// ---- accumulators ----

// What an accumulator does with each row's value (AggAcc.op).
enum AggOp { AO_COUNT = 0, AO_SUM_I, AO_SUM_F, AO_SUM_D, AO_MIN_I, AO_MAX_I, AO_MIN_F, AO_MAX_F, AO_MIN_D, AO_MAX_D };
// How input values are stored (AggAcc.in_kind); all are widened to 64 bits (or 128, DEC).
enum AggIn { AI_I8 = 0, AI_I16, AI_I32, AI_I64, AI_U8, AI_U16, AI_U32, AI_F32, AI_F64, AI_DEC, AI_NONE };

// One accumulator, eight words. Its state per group: counts[g] (rows that contributed) and,
// except for COUNT, values[g]: an int64 (SUM_I, MIN/MAX_I), an exact sum of AGG_EXACT_WORDS
// words (SUM_F, see above), an order-preserving uint64 image of a double (MIN/MAX_F), or two
// words lo, hi of an int128 (SUM_D, MIN/MAX_D). MIN/MAX_D serialise each group's update on
// locks[g].
struct AggAcc {
    uint64_t op;
    uint64_t in_kind;
    const uint8_t* values;           // null for COUNT of rows
    const uint8_t* validity;         // null: no NULLs
    const uint8_t* filter;           // FILTER (WHERE …) as a boolean bitmap, null: none
    const uint8_t* filter_validity;  // NULL filter results drop the row
    unsigned long long* state;       // values[g] (1 or 2 words per group)
    unsigned long long* counts;      // counts[g]
};

// The image of a double's bits under which unsigned order is IEEE total order.
__device__ __forceinline__ uint64_t agg_order_f64(double v) {
    AggBits b;
    b.f = v;
    uint64_t bits = b.u;
    return (bits >> 63) ? ~bits : bits | 0x8000000000000000ull;
}

__device__ __forceinline__ int64_t agg_load_i(const AggAcc& a, uint64_t i) {
    switch (a.in_kind) {
        case AI_I8: return ((const int8_t*)a.values)[i];
        case AI_I16: return ((const int16_t*)a.values)[i];
        case AI_I32: return ((const int32_t*)a.values)[i];
        case AI_I64: return ((const int64_t*)a.values)[i];
        case AI_U8: return a.values[i];
        case AI_U16: return ((const uint16_t*)a.values)[i];
        case AI_U32: return ((const uint32_t*)a.values)[i];
        default: return 0;
    }
}

__device__ __forceinline__ double agg_load_f(const AggAcc& a, uint64_t i) {
    switch (a.in_kind) {
        case AI_F32: return (double)((const float*)a.values)[i];
        case AI_F64: return ((const double*)a.values)[i];
        default: return (double)agg_load_i(a, i);
    }
}

// Whether row i contributes to accumulator a.
__device__ __forceinline__ bool agg_takes(const AggAcc& a, uint64_t i) {
    if (a.filter && !(bit_is_set(a.filter, i) && bit_is_set(a.filter_validity, i))) return false;
    return a.values == nullptr || bit_is_set(a.validity, i);
}

// ---- exact float sums ----

#define AGG_LIMB_BITS 31
#define AGG_LIMB_MASK 0x7FFFFFFFull
#define AGG_LIMBS 68                    // 68 × 31 bits cover 2^-1074 .. 2^1034
#define AGG_FLAGS AGG_LIMBS             // the word after the limbs
#define AGG_EXACT_WORDS (AGG_LIMBS + 1)
#define AGG_FLAG_NAN 1ull
#define AGG_FLAG_POS_INF 2ull
#define AGG_FLAG_NEG_INF 4ull
#define AGG_TOP_LIMIT (1ll << 40)       // the top limb saturates here: far past 2^1024

// Adds the double with bits `bits` to the exact sum at `acc`.
__device__ __forceinline__ void agg_exact_add(unsigned long long* acc, uint64_t bits) {
    uint64_t e = (bits >> 52) & 0x7FF;
    uint64_t m = bits & 0xFFFFFFFFFFFFFull;
    bool negative = (bits >> 63) != 0;
    if (e == 0x7FF) {
        atomicOr(&acc[AGG_FLAGS], m ? AGG_FLAG_NAN : negative ? AGG_FLAG_NEG_INF : AGG_FLAG_POS_INF);
        return;
    }
    if (e == 0) {
        if (m == 0) return;  // ±0 adds nothing
        e = 1;               // subnormal: m × 2^-1074
    } else {
        m |= 1ull << 52;     // normal: m × 2^(e - 1075) = m × 2^(e - 1) units
    }
    uint64_t shift = e - 1;  // 0 ..= 2045
    uint32_t k = (uint32_t)(shift / AGG_LIMB_BITS);
    unsigned __int128 v = (unsigned __int128)m << (shift % AGG_LIMB_BITS);  // < 2^84
    for (uint32_t j = 0; j < 3; ++j) {
        uint64_t piece = (uint64_t)(v >> (AGG_LIMB_BITS * j)) & AGG_LIMB_MASK;
        if (piece) atomicAdd(&acc[k + j], (unsigned long long)(negative ? 0 - piece : piece));
    }
}

// Carries limbs[0 .. AGG_LIMBS) so that every limb but the top one is in [0, 2^31); the
// top one holds the signed rest, saturated at ±AGG_TOP_LIMIT (which is ±inf either way).
__device__ __forceinline__ void agg_exact_carry(long long* limbs) {
    long long carry = 0;
    for (uint32_t k = 0; k + 1 < AGG_LIMBS; ++k) {
        long long t = limbs[k] + carry;
        limbs[k] = t & (long long)AGG_LIMB_MASK;
        carry = t >> AGG_LIMB_BITS;  // arithmetic shift: floor
    }
    long long top = limbs[AGG_LIMBS - 1] + carry;
    limbs[AGG_LIMBS - 1] = top > AGG_TOP_LIMIT ? AGG_TOP_LIMIT : top < -AGG_TOP_LIMIT ? -AGG_TOP_LIMIT : top;
}

// The exact sum at `acc` rounded to the nearest double, ties to even (as bits).
__device__ __forceinline__ uint64_t agg_exact_round(const unsigned long long* acc) {
    uint64_t flags = acc[AGG_FLAGS];
    if ((flags & AGG_FLAG_NAN) || (flags & (AGG_FLAG_POS_INF | AGG_FLAG_NEG_INF)) == (AGG_FLAG_POS_INF | AGG_FLAG_NEG_INF))
        return 0x7FF8000000000000ull;
    if (flags & AGG_FLAG_POS_INF) return 0x7FF0000000000000ull;
    if (flags & AGG_FLAG_NEG_INF) return 0xFFF0000000000000ull;
    long long limbs[AGG_LIMBS + 2];
    for (uint32_t k = 0; k < AGG_LIMBS; ++k) limbs[k] = (long long)acc[k];
    agg_exact_carry(limbs);
    uint64_t sign = 0;
    if (limbs[AGG_LIMBS - 1] < 0) {  // negative: carry the negation instead
        for (uint32_t k = 0; k < AGG_LIMBS; ++k) limbs[k] = -limbs[k];
        agg_exact_carry(limbs);
        sign = 1ull << 63;
    }
    long long top = limbs[AGG_LIMBS - 1];  // >= 0: split it into limbs too
    limbs[AGG_LIMBS - 1] = top & (long long)AGG_LIMB_MASK;
    limbs[AGG_LIMBS] = (top >> AGG_LIMB_BITS) & (long long)AGG_LIMB_MASK;
    limbs[AGG_LIMBS + 1] = top >> (2 * AGG_LIMB_BITS);
    int t = AGG_LIMBS + 1;
    while (t >= 0 && limbs[t] == 0) --t;
    if (t < 0) return 0;  // +0.0, as a sum of zeros is
    uint64_t p = (uint64_t)t * AGG_LIMB_BITS + (uint64_t)(31 - __clz((int)limbs[t]));  // the top bit
    if (p <= 52) {
        // Below 2^53 units every value is a double as it stands (subnormal or the lowest
        // binade), and its bits are the integer itself.
        uint64_t m = (uint64_t)limbs[0] | ((uint64_t)limbs[1] << AGG_LIMB_BITS);
        return sign | m;
    }
    if (p >= 2098) return sign | 0x7FF0000000000000ull;  // at or past 2^1024
    // The 54 bits from p down (significand and guard bit) lie in limbs t, t-1 and t-2.
    int low = t >= 2 ? t - 2 : 0;
    unsigned __int128 w = 0;
    for (int j = t; j >= low; --j) w = (w << AGG_LIMB_BITS) | (unsigned __int128)limbs[j];
    uint32_t s = (uint32_t)(p - (uint64_t)low * AGG_LIMB_BITS - 53);  // bits below the guard
    uint64_t top54 = (uint64_t)(w >> s);
    bool sticky = (w & ((((unsigned __int128)1) << s) - 1)) != 0;
    for (int j = 0; j < low && !sticky; ++j) sticky = limbs[j] != 0;
    uint64_t m = top54 >> 1;
    if ((top54 & 1) && (sticky || (m & 1))) ++m;  // round half to even
    uint64_t bits = ((p - 52) << 52) + m;  // a carry out of m moves into the exponent
    if (bits >= 0x7FF0000000000000ull) bits = 0x7FF0000000000000ull;
    return sign | bits;
}

__device__ __forceinline__ void agg_add128(unsigned long long* at, uint64_t lo, uint64_t hi) {
    unsigned long long old = atomicAdd(&at[0], (unsigned long long)lo);
    uint64_t carry = (uint64_t)old + lo < (uint64_t)old ? 1 : 0;
    atomicAdd(&at[1], (unsigned long long)(hi + carry));
}

// Adds one row's value (or a block's partial state, when merging) to group state `at`.
// For COUNT, `lo` is the count to add.
__device__ __forceinline__ void agg_apply(uint64_t op, unsigned long long* state, unsigned long long* count,
                                          uint32_t* lock, uint64_t lo, uint64_t hi, uint64_t n) {
    atomicAdd(count, (unsigned long long)n);
    switch (op) {
        case AO_COUNT: break;
        case AO_SUM_I: atomicAdd(state, (unsigned long long)lo); break;
        case AO_SUM_F: agg_exact_add(state, lo); break;
        case AO_SUM_D: agg_add128(state, lo, hi); break;
        case AO_MIN_I: atomicMin((long long*)state, (long long)lo); break;
        case AO_MAX_I: atomicMax((long long*)state, (long long)lo); break;
        case AO_MIN_F: atomicMin(state, (unsigned long long)lo); break;
        case AO_MAX_F: atomicMax(state, (unsigned long long)lo); break;
        case AO_MIN_D:
        case AO_MAX_D: {
            i128 v = (i128)(((unsigned __int128)hi << 64) | lo);
            bool done = false;
            while (!done) {
                if (atomicCAS(lock, 0u, 1u) == 0u) {
                    volatile unsigned long long* s = state;
                    i128 cur = (i128)(((unsigned __int128)s[1] << 64) | s[0]);
                    if (op == AO_MIN_D ? v < cur : v > cur) {
                        s[0] = (uint64_t)v;
                        s[1] = (uint64_t)((unsigned __int128)v >> 64);
                    }
                    __threadfence();
                    atomicExch(lock, 0u);
                    done = true;
                }
            }
            break;
        }
    }
}

// One row's value of accumulator a as the two words agg_apply takes.
__device__ __forceinline__ void agg_value(const AggAcc& a, uint64_t i, uint64_t* lo, uint64_t* hi) {
    *hi = 0;
    switch (a.op) {
        case AO_COUNT: *lo = 0; break;
        case AO_SUM_F: {
            AggBits b;
            b.f = agg_load_f(a, i);
            *lo = b.u;
            break;
        }
        case AO_MIN_F:
        case AO_MAX_F: *lo = agg_order_f64(agg_load_f(a, i)); break;
        case AO_SUM_D:
        case AO_MIN_D:
        case AO_MAX_D:
            if (a.in_kind == AI_DEC) {
                *lo = ((const uint64_t*)a.values)[2 * i];
                *hi = ((const uint64_t*)a.values)[2 * i + 1];
            } else {
                int64_t v = agg_load_i(a, i);
                *lo = (uint64_t)v;
                *hi = v < 0 ? ~0ull : 0;
            }
            break;
        default: *lo = (uint64_t)agg_load_i(a, i); break;
    }
}

__device__ __forceinline__ uint64_t agg_state_words(uint64_t op) {
    if (op == AO_SUM_F) return AGG_EXACT_WORDS;
    return op == AO_COUNT ? 0 : (op == AO_SUM_D || op == AO_MIN_D || op == AO_MAX_D) ? 2 : 1;
}

// The identity of an accumulator's state (what a group that saw nothing holds).
__device__ __forceinline__ uint64_t agg_identity(uint64_t op, uint32_t word) {
    switch (op) {
        case AO_MIN_I: return 0x7FFFFFFFFFFFFFFFull;
        case AO_MAX_I: return 0x8000000000000000ull;
        case AO_MIN_F: return ~0ull;
        case AO_MAX_F: return 0;
        case AO_MIN_D: return word == 0 ? ~0ull : 0x7FFFFFFFFFFFFFFFull;
        case AO_MAX_D: return word == 0 ? 0 : 0x8000000000000000ull;
        default: return 0;
    }
}

// ---- per-block tables in shared memory ----
// For each accumulator: counts[groups], then state[groups × words]; a block accumulates
// into them and adds them into global state once (agg_update's few-groups path, and the
// fused kernel's).

// Sets one accumulator's per-block table at `tables + at` to its identity (the block's
// threads share the work); returns where the next accumulator's table starts.
__device__ __forceinline__ uint64_t agg_table_identity(unsigned long long* tables, uint64_t at, uint64_t op,
                                                       uint64_t groups) {
    const uint64_t words = agg_state_words(op);
    for (uint64_t g = threadIdx.x; g < groups; g += blockDim.x) {
        tables[at + g] = 0;
        for (uint64_t w = 0; w < words; ++w) tables[at + groups + g * words + w] = agg_identity(op, (uint32_t)w);
    }
    return at + groups * (1 + words);
}

// Adds a group's partial state (`count` rows; `from`, its words) into the group's state
// `to` and count `to_count`: an exact sum limb by limb (still exact, in any order), others
// as agg_apply combines a value. Not for the locked decimal minimum and maximum.
__device__ __forceinline__ void agg_merge_state(uint64_t op, unsigned long long* to, unsigned long long* to_count,
                                                const unsigned long long* from, uint64_t count) {
    if (op == AO_SUM_F) {
        atomicAdd(to_count, (unsigned long long)count);
        for (uint32_t w = 0; w < AGG_LIMBS; ++w)
            if (from[w]) atomicAdd(&to[w], from[w]);
        if (from[AGG_FLAGS]) atomicOr(&to[AGG_FLAGS], from[AGG_FLAGS]);
        return;
    }
    const uint64_t words = agg_state_words(op);
    agg_apply(op, to, to_count, nullptr, words ? from[0] : 0, words == 2 ? from[1] : 0, count);
}
