// Fused aggregation (Crystal's approach): an expression program, evaluated per row in
// registers, feeds the group table's accumulators in the same kernel. No argument column,
// row selection, row hash or group id goes to memory: each input column is read once.
//
//   agg_fused(code, code_len, consts, strings, cols, n, spec, accs, nacc, slots, mask,
//             store, starts, chunks, groups, status)
//     code … cols   an expression program as expr_eval takes it (expr.cu), whose outputs
//                   stay in registers: regs[k] is output k. At most FUSED_MAX_REGS.
//     spec          uint64 words: [0] the number of group keys, [1] the register of the
//                   row selection (a fused filter's predicate) or FUSED_NO_REG, then the
//                   register of each key.
//     accs          nacc FusedAcc descriptors (below); at most FUSED_MAX_ACCS.
//     slots … starts, chunks  the group table's committed slots (mask = capacity - 1) and
//                   its key store, as agg_find_or_insert reads them (agg.cu); null slots and
//                   no keys for an aggregation without GROUP BY, whose one group is 0.
//     groups        the table's groups: the per-block tables in dynamic shared memory hold
//                   groups × Σ (1 + state words) words (the host checks they fit).
//     status        two u64 words. [0] += the rows taken whose key has no group yet: they
//                   are left out, and the host discards the batch's deltas and adds the batch
//                   the ordinary way (which inserts groups). [1] = 1 when a row met a case
//                   the program leaves to the CPU: the deltas are then not to be used.
//   A row is taken when the selection (if any) is true; it then counts for accumulator k
//   when k's filter (if any) is true and its value (if any) is not NULL. Its group is found
//   by hashing its key registers exactly as hash.cu hashes key columns, and probing the
//   committed slots (a batch that inserts nothing never needs more). Updates go into
//   per-block tables after a warp-level reduction: the lanes of a warp that update one group
//   are reduced with shuffles and one lane applies the result (after FUSED_WARP_ROUNDS
//   groups in one warp the rest apply lane by lane); an aggregation without keys keeps each
//   thread's values in registers over all its rows and reduces them once. Exact float sums
//   add row by row (their limbs cannot be reduced in registers). Each block then adds its
//   tables into the accumulators' deltas: one atomic per group and word per block.
//
//   agg_merge_delta(accs, nacc, groups, apply)
//     apply != 0: adds each group's delta to the table's state and counts; then (either way)
//     sets the deltas to their identity, ready for the next batch (apply == 0 also readies
//     newly allocated deltas, which it does not read).
#include "expr.cuh"
#include "agg.cuh"

#define FUSED_NO_REG 0xFFFFFFFFFFFFFFFFull
#define FUSED_MAX_REGS 32
#define FUSED_MAX_ACCS 32
#define FUSED_WARP_ROUNDS 4
#define FUSED_FULL_MASK 0xFFFFFFFFu

// One accumulator fed from registers; eight words.
struct FusedAcc {
    uint64_t op;                       // AggOp
    uint64_t in_kind;                  // AggIn: how the value register holds its value
    uint64_t value;                    // register, or FUSED_NO_REG: COUNT of rows
    uint64_t filter;                   // register of FILTER (WHERE …), or FUSED_NO_REG
    unsigned long long* delta;         // this batch's state, groups × words
    unsigned long long* delta_counts;  // this batch's counts, groups
    unsigned long long* state;         // the table's state (agg_merge_delta only)
    unsigned long long* counts;        // the table's counts (agg_merge_delta only)
};

__device__ __forceinline__ bool fused_true(const Val* regs, uint64_t reg) {
    return reg == FUSED_NO_REG || (regs[reg].valid && regs[reg].a.i != 0);
}

// Whether row's registers count for accumulator a.
__device__ __forceinline__ bool fused_takes(const FusedAcc& a, const Val* regs) {
    return fused_true(regs, a.filter) && (a.value == FUSED_NO_REG || regs[a.value].valid);
}

// A register's value as the two words agg_apply takes (as agg_value reads a column).
__device__ __forceinline__ void fused_value(const FusedAcc& a, const Val* regs, uint64_t* lo, uint64_t* hi) {
    *lo = 0;
    *hi = 0;
    if (a.value == FUSED_NO_REG || a.op == AO_COUNT) return;
    const Val& v = regs[a.value];
    const bool is_float = a.in_kind == AI_F32 || a.in_kind == AI_F64;
    switch (a.op) {
        case AO_SUM_F: {
            AggBits b;
            b.f = is_float ? v.a.f : (double)v.a.i;
            *lo = b.u;
            break;
        }
        case AO_MIN_F:
        case AO_MAX_F: *lo = agg_order_f64(is_float ? v.a.f : (double)v.a.i); break;
        case AO_SUM_D:
        case AO_MIN_D:
        case AO_MAX_D:
            *lo = (uint64_t)v.a.i;
            *hi = a.in_kind == AI_DEC ? (uint64_t)v.b : (v.a.i < 0 ? ~0ull : 0);
            break;
        default: *lo = (uint64_t)v.a.i; break;
    }
}

// Combines two partial values of one group (not for exact sums, which add row by row).
__device__ __forceinline__ void fused_combine(uint64_t op, uint64_t& lo, uint64_t& hi, uint64_t olo, uint64_t ohi) {
    switch (op) {
        case AO_SUM_I: lo += olo; break;
        case AO_SUM_D: {
            uint64_t s = lo + olo;
            hi = hi + ohi + (s < lo ? 1 : 0);
            lo = s;
            break;
        }
        case AO_MIN_I: if ((int64_t)olo < (int64_t)lo) lo = olo; break;
        case AO_MAX_I: if ((int64_t)olo > (int64_t)lo) lo = olo; break;
        case AO_MIN_F: if (olo < lo) lo = olo; break;
        case AO_MAX_F: if (olo > lo) lo = olo; break;
        default: break;
    }
}

// Reduces (lo, hi, count) over the warp: every lane ends with the whole warp's.
__device__ __forceinline__ void fused_warp_reduce(uint64_t op, uint64_t& lo, uint64_t& hi, uint64_t& count) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        uint64_t olo = __shfl_xor_sync(FUSED_FULL_MASK, lo, offset);
        uint64_t ohi = __shfl_xor_sync(FUSED_FULL_MASK, hi, offset);
        count += __shfl_xor_sync(FUSED_FULL_MASK, count, offset);
        fused_combine(op, lo, hi, olo, ohi);
    }
}

// The bits of a Float32 register (held widened to a double: narrowing back is exact).
__device__ __forceinline__ uint32_t fused_f32_bits(const Val& v) {
    union {
        float f;
        uint32_t u;
    } x;
    x.f = (float)v.a.f;
    return x.u;
}

// A key register's hash, as hash.cu hashes a key column of this kind.
__device__ __forceinline__ uint64_t fused_key_hash(const Val& v, uint64_t kind) {
    if (!v.valid) return NULL_HASH;
    const uint64_t bits = (uint64_t)v.a.i;
    switch (kind) {
        case KEY_1: return hash_fixed(bits & 0xFFull, 1);
        case KEY_2: return hash_fixed(bits & 0xFFFFull, 2);
        case KEY_4: return hash_fixed(bits & 0xFFFFFFFFull, 4);
        case KEY_8: return hash_fixed(bits, 8);
        case KEY_16: return hash_decimal(bits, (uint64_t)v.b);
        case KEY_F32: return hash_f32_bits(fused_f32_bits(v));
        case KEY_F64: return hash_f64_bits(bits);
        default: return hash_string(v.a.p, v.b);
    }
}

// Whether a key register equals row `row` of key column c, as keys_equal compares.
__device__ __forceinline__ bool fused_key_equal(const Val& v, const KeyCol& c, uint64_t row) {
    const bool valid = bit_is_set(c.validity, row);
    if (valid != v.valid) return false;
    if (!valid) return true;
    const uint64_t bits = (uint64_t)v.a.i;
    switch (c.kind) {
        case KEY_1: return c.values[row] == (uint8_t)bits;
        case KEY_2: return ((const uint16_t*)c.values)[row] == (uint16_t)bits;
        case KEY_4: return ((const uint32_t*)c.values)[row] == (uint32_t)bits;
        case KEY_8: return ((const uint64_t*)c.values)[row] == bits;
        case KEY_16: {
            const uint64_t* x = (const uint64_t*)c.values + 2 * row;
            return x[0] == bits && x[1] == (uint64_t)v.b;
        }
        case KEY_F32: return key_f32_canon(((const uint32_t*)c.values)[row]) == key_f32_canon(fused_f32_bits(v));
        case KEY_F64: return key_f64_canon(((const uint64_t*)c.values)[row]) == key_f64_canon(bits);
        case KEY_S32:
        case KEY_S64:
        case KEY_DICT: {
            int64_t len;
            const uint8_t* s = key_string(c, row, &len);
            if (len != v.b) return false;
            for (int64_t k = 0; k < v.b; ++k)
                if (s[k] != v.a.p[k]) return false;
            return true;
        }
        default: return false;
    }
}

// The committed group of the keys in regs, or AGG_SKIP when they have none yet.
__device__ __forceinline__ uint32_t fused_find(const Val* regs, const uint64_t* key_regs, uint32_t nkeys,
                                               const unsigned long long* slots, uint64_t mask, const KeyCol* store,
                                               const uint64_t* starts, uint32_t chunks) {
    uint64_t h = 0;
    for (uint32_t k = 0; k < nkeys; ++k) {
        uint64_t hk = fused_key_hash(regs[key_regs[k]], store[k].kind);
        h = k == 0 ? hk : hash_combine(h, hk);
    }
    const uint64_t tag = h >> 32;
    for (uint64_t slot = h & mask;; slot = (slot + 1) & mask) {
        const unsigned long long seen = slots[slot];
        if (seen == AGG_EMPTY) return AGG_SKIP;  // the table is never more than half full
        if ((seen >> 32) != tag) continue;
        const uint32_t id = (uint32_t)seen;
        uint64_t row;
        const KeyCol* cols = agg_store_row(store, starts, chunks, nkeys, id, &row);
        bool equal = true;
        for (uint32_t k = 0; k < nkeys && equal; ++k) equal = fused_key_equal(regs[key_regs[k]], cols[k], row);
        if (equal) return id;
    }
}

FULMEN_KERNEL agg_fused(const int64_t* code, uint64_t code_len, const int64_t* consts, const uint8_t* strings,
                        const uint64_t* cols, uint64_t n, const uint64_t* spec, const FusedAcc* accs, uint32_t nacc,
                        const unsigned long long* slots, uint64_t mask, const KeyCol* store, const uint64_t* starts,
                        uint32_t chunks, uint64_t groups, unsigned long long* status) {
    const ExprProgram prog = {code, code_len, consts, strings, cols, nullptr};
    const uint32_t nkeys = (uint32_t)spec[0];
    const uint64_t selection = spec[1];
    const uint64_t* key_regs = spec + 2;
    const unsigned lane = threadIdx.x & 31;

    // Per-block tables: for each accumulator, counts[groups] then state[groups × words].
    FULMEN_DYNAMIC_SHARED(unsigned long long, tables);
    uint64_t bases[FUSED_MAX_ACCS];
    {
        uint64_t at = 0;
        for (uint32_t k = 0; k < nacc; ++k) {
            bases[k] = at;
            at = agg_table_identity(tables, at, accs[k].op, groups);
        }
    }
    __syncthreads();

    // Without keys: each thread's running values (exact sums excepted).
    uint64_t run_lo[FUSED_MAX_ACCS], run_hi[FUSED_MAX_ACCS], run_count[FUSED_MAX_ACCS];
    for (uint32_t k = 0; k < nacc; ++k) {
        run_lo[k] = agg_identity(accs[k].op, 0);
        run_hi[k] = agg_identity(accs[k].op, 1);
        run_count[k] = 0;
    }

    for (uint64_t base = GRID_START - lane; base < n; base += GRID_STRIDE) {
        const uint64_t row = base + lane;
        Val regs[FUSED_MAX_REGS];
        uint32_t gid = AGG_SKIP;
        bool missed = false;
        if (row < n) {
            uint64_t valid_bits = 0, true_bits = 0;
            bool failed = false;
            expr_row(prog, row, regs, valid_bits, true_bits, failed);
            if (failed) status[1] = 1;
            if (fused_true(regs, selection)) {
                gid = nkeys == 0 ? 0 : fused_find(regs, key_regs, nkeys, slots, mask, store, starts, chunks);
                missed = gid == AGG_SKIP;
            }
        }
        const unsigned missing = __ballot_sync(FUSED_FULL_MASK, missed);
        if (missing && lane == 0) atomicAdd(&status[0], (unsigned long long)__popc(missing));

        if (nkeys == 0) {
            if (gid != AGG_SKIP) {
                for (uint32_t k = 0; k < nacc; ++k) {
                    const FusedAcc& a = accs[k];
                    if (!fused_takes(a, regs)) continue;
                    uint64_t lo, hi;
                    fused_value(a, regs, &lo, &hi);
                    if (a.op == AO_SUM_F) {
                        agg_apply(a.op, &tables[bases[k] + groups], &tables[bases[k]], nullptr, lo, hi, 1);
                    } else {
                        fused_combine(a.op, run_lo[k], run_hi[k], lo, hi);
                        ++run_count[k];
                    }
                }
            }
            continue;
        }

        // With keys: the lanes of the warp updating one group, a group at a time.
        unsigned todo = __ballot_sync(FUSED_FULL_MASK, gid != AGG_SKIP);
        for (int round = 0; todo; ++round) {
            if (round == FUSED_WARP_ROUNDS) {
                // Many groups in this warp: the rest update lane by lane.
                if ((todo >> lane) & 1) {
                    for (uint32_t k = 0; k < nacc; ++k) {
                        const FusedAcc& a = accs[k];
                        if (!fused_takes(a, regs)) continue;
                        const uint64_t words = agg_state_words(a.op);
                        uint64_t lo, hi;
                        fused_value(a, regs, &lo, &hi);
                        agg_apply(a.op, &tables[bases[k] + groups + gid * words], &tables[bases[k] + gid], nullptr,
                                  lo, hi, 1);
                    }
                }
                break;
            }
            const int leader = __ffs((int)todo) - 1;
            const uint32_t g = __shfl_sync(FUSED_FULL_MASK, gid, leader);
            const bool mine = ((todo >> lane) & 1) && gid == g;
            const unsigned peers = __ballot_sync(FUSED_FULL_MASK, mine);
            for (uint32_t k = 0; k < nacc; ++k) {
                const FusedAcc& a = accs[k];
                const bool takes = mine && fused_takes(a, regs);
                const unsigned who = __ballot_sync(FUSED_FULL_MASK, takes);
                if (!who) continue;
                const uint64_t words = agg_state_words(a.op);
                unsigned long long* state = &tables[bases[k] + groups + (uint64_t)g * words];
                unsigned long long* count = &tables[bases[k] + g];
                uint64_t lo = agg_identity(a.op, 0), hi = agg_identity(a.op, 1);
                if (takes) fused_value(a, regs, &lo, &hi);
                if (a.op == AO_SUM_F) {
                    if (takes) agg_apply(a.op, state, count, nullptr, lo, hi, 1);
                    continue;
                }
                uint64_t ignored = 0;
                fused_warp_reduce(a.op, lo, hi, ignored);
                if (lane == (unsigned)leader) agg_apply(a.op, state, count, nullptr, lo, hi, (uint64_t)__popc(who));
            }
            todo &= ~peers;
        }
    }

    if (nkeys == 0) {
        // One reduction per warp, one shared update per warp and accumulator.
        for (uint32_t k = 0; k < nacc; ++k) {
            const FusedAcc& a = accs[k];
            if (a.op == AO_SUM_F) continue;
            uint64_t lo = run_lo[k], hi = run_hi[k], count = run_count[k];
            fused_warp_reduce(a.op, lo, hi, count);
            if (lane == 0 && count) agg_apply(a.op, &tables[bases[k] + groups], &tables[bases[k]], nullptr, lo, hi, count);
        }
    }
    __syncthreads();

    // The block's tables into the deltas.
    for (uint32_t k = 0; k < nacc; ++k) {
        const FusedAcc& a = accs[k];
        const uint64_t words = agg_state_words(a.op);
        for (uint64_t g = threadIdx.x; g < groups; g += blockDim.x) {
            const uint64_t count = tables[bases[k] + g];
            if (count)
                agg_merge_state(a.op, &a.delta[g * words], &a.delta_counts[g], &tables[bases[k] + groups + g * words],
                                count);
        }
    }
}

FULMEN_KERNEL agg_merge_delta(const FusedAcc* accs, uint32_t nacc, uint64_t groups, uint32_t apply) {
    for (uint64_t g = GRID_START; g < groups; g += GRID_STRIDE) {
        for (uint32_t k = 0; k < nacc; ++k) {
            const FusedAcc& a = accs[k];
            const uint64_t words = agg_state_words(a.op);
            unsigned long long* delta = &a.delta[g * words];
            const uint64_t count = apply ? a.delta_counts[g] : 0;  // fresh deltas are not read
            if (count) agg_merge_state(a.op, &a.state[g * words], &a.counts[g], delta, count);
            a.delta_counts[g] = 0;
            for (uint64_t w = 0; w < words; ++w) delta[w] = agg_identity(a.op, (uint32_t)w);
        }
    }
}

#if defined(FULMEN_EMULATOR)
FULMEN_EMU_EXPORT(agg_fused)
FULMEN_EMU_EXPORT(agg_merge_delta)
#endif
