// Hash aggregation: every row of a batch gets the id of its group, new groups are numbered
// in order of their first row, and the accumulators of all aggregates are updated by group
// id in one pass.
//
// The group table is an open-addressing table of 64-bit slots, linear probing, atomicCAS:
//   slot = (upper 32 bits of the row hash) << 32 | id,   EMPTY_SLOT when free
// where id is a committed group id (< 2^31) or, while a batch is being inserted, PENDING | row
// of that batch. Keys are compared for real (hashes only narrow the search): a pending id
// points at a row of the batch's own key columns, a committed id at the key store, which
// holds the keys of every committed group in chunks (one chunk per batch that added groups;
// chunk c holds groups [starts[c], starts[c + 1])). A slot is written once, whole, by CAS, so
// a reader never sees a slot whose key is not readable yet, and no thread waits for another.
//
//   agg_find_or_insert  (slots, mask, hashes, n, batch_keys, store_keys, starts, chunks,
//                        ncols, limit, inserted, refs, first, rows, rows_validity, hash_here)
//       with hash_here, each taken row's hash is computed here from batch_keys (key_row_hash,
//       as hash_many would) and written to hashes[i] for agg_resolve and any retry, where
//       the caller left them unset;
//       refs[i] = the id of row i's group, inserting PENDING | i when its key is new;
//       first[i] = the group's first row for each row i that inserted one (a row about to
//       insert writes first[i] = i before its CAS, so that a row finding its pending id
//       can only lower it after, by atomicMin: the group's first row once all ran); SKIP
//       for a row that `rows` (a boolean column, null: every row) does not take, which
//       makes no group and updates no accumulator (a filter fused into the aggregation).
//       Gives up (every thread stops inserting) once more than `limit` slots were claimed,
//       so that the table never fills: `inserted[0]` then exceeds `limit` and the host rolls
//       back, grows the table and retries. When it stays 0 every ref is a committed id (or
//       SKIP) and the host updates the accumulators by them at once.
//   agg_leader_flags    (refs, first, n, flags)  flags[i] = 1 when row i is its new group's
//                                                  first row (u64, for the scan)
//   agg_leader_ranks    (refs, first, n, state, capacity, epoch, flags, ranks, total_out,
//                        hashes, g0, leaders, group_hashes)
//       the flags above and their exclusive scan (ranks) in one launch, a block per tile of
//       SCAN_TILE rows chained by the look-back of scan.cuh; the last tile writes the
//       count of leaders at *total_out; with leaders (not null) also agg_resolve's
//       leaders[rank] = row and group_hashes[g0 + rank] = that row's hash
//   agg_resolve         (refs, first, ranks, flags, hashes, g0, leaders, group_hashes, slots,
//                        capacity, n, gids)
//       gids[i]: committed id, or g0 + rank of the group's first row; leaders[rank] = row,
//       group_hashes[g0 + rank] = that row's hash (neither where leaders is null, and then
//       flags, hashes and group_hashes are not read and may be null); and in
//       the same launch each slot's pending id becomes its committed id (g0 + rank of the
//       group's first row)
//   agg_rollback        (slots, capacity, g0)   every slot with id >= g0 (pending or this
//                                               batch's) becomes EMPTY_SLOT. Removing the
//                                               newest entries never breaks an older one's
//                                               probe chain: older entries sit before them.
//   agg_rehash          (slots, mask, group_hashes, groups)  re-inserts committed groups
//                                               into a fresh (all EMPTY_SLOT) table
//   agg_fill_u64        (buffer, n, value)
//   agg_init_state      (to, keep, locks, slots, nslots, hashes, old_hashes, state0,
//                        old_state0, op0, counts0, old_counts0, … state7, … old_counts7)
//                                               a grown table's groups of up to eight
//                                               accumulators: 0..keep copied from the old
//                                               table's buffers (hashes too, when given),
//                                               keep..to at their identity; the locks zero,
//                                               and (when slots is not null) a new table's
//                                               nslots slots EMPTY_SLOT (below)
//   agg_update          (accs, nacc, gids, n, groups, shared_groups, refs, first, ranks,
//                        flags, hashes, g0, leaders, group_hashes, slots, capacity)
//       the accumulators (see AggAcc) of every row's group; gids == null means group 0 for
//       every row; a row whose gid is SKIP is left out. With refs (not null), agg_resolve's
//       arguments but its last two after it: each row's group is resolved where it is read, not read from
//       gids, and the leaders, their hashes and the slots are written as agg_resolve
//       writes them, in the same launch. shared_groups != 0: each block first accumulates into per-block tables in
//       dynamic shared memory (the host checks the size) and merges them into global memory
//       once, so that a few groups do not serialise every row on a handful of addresses.
//   agg_exact_normalize (state, groups)        carries every group's exact float sum (below)
//   agg_exact_finish    (state, groups, out)   out[g] = group g's exact float sum, rounded
//                                               once to the nearest double (ties to even)
//
// Float sums are exact. Each group holds the sum as a fixed-point integer in units of
// 2^-1074 (the smallest subnormal), wide enough for every finite double: AGG_LIMBS signed
// 64-bit limbs of AGG_LIMB_BITS bits each (limb k weighs 2^(31k)), plus a word of flags for
// NaN, +inf and -inf. A row adds its value's 53-bit significand, shifted to its exponent,
// as three pieces below 2^31 to three limbs with integer atomics, so no carry is propagated
// while rows arrive and the result does not depend on the order in which threads, blocks
// or batches add (integer addition is associative; float addition is not). A limb takes
// fewer than 2^32 pieces before the host normalizes (carries) the sums, so it cannot
// overflow. The rounding to a double happens once, at the end: the answer is the correctly
// rounded sum of the inputs, the same on every GPU, in the emulator and run after run.
#include "agg.cuh"
#include "scan.cuh"

FULMEN_KERNEL agg_find_or_insert(unsigned long long* slots, uint64_t mask, uint64_t* hashes, uint64_t n,
                                 const KeyCol* batch_keys, const KeyCol* store_keys, const uint64_t* starts,
                                 uint32_t chunks, uint32_t ncols, uint64_t limit, unsigned long long* inserted,
                                 uint32_t* refs, uint32_t* first, const uint8_t* rows, const uint8_t* rows_validity,
                                 uint32_t hash_here) {
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {
        if (rows && !(bit_is_set(rows, i) && bit_is_set(rows_validity, i))) {
            refs[i] = AGG_SKIP;
            continue;
        }
        uint64_t h = hash_here_or_read(hashes, hash_here, batch_keys, ncols, i);
        uint64_t tag = h >> 32;
        unsigned long long mine = (tag << 32) | (AGG_PENDING | (uint32_t)i);
        uint64_t slot = h & mask;
        uint32_t ref = AGG_PENDING | (uint32_t)i;
        for (;;) {
            unsigned long long seen = slots[slot];
            if (seen == AGG_EMPTY) {
                if (atomicAdd(inserted, 1ull) >= limit) break;  // table too full: the host grows it
                // Row i's own entry, visible before the slot that names it: a row finding
                // PENDING | i lowers it only after (a write after that would undo its min).
                first[i] = (uint32_t)i;
                __threadfence();
                seen = atomicCAS(&slots[slot], (unsigned long long)AGG_EMPTY, mine);
                if (seen == AGG_EMPTY) break;  // a new group, first seen here
                atomicAdd(inserted, ~0ull);  // gives the claim back
            }
            if ((seen >> 32) == tag) {
                uint32_t id = (uint32_t)seen;
                bool equal;
                if (id & AGG_PENDING) {
                    equal = keys_equal(batch_keys, i, batch_keys, id & ~AGG_PENDING, ncols);
                } else {
                    uint64_t row;
                    const KeyCol* cols = agg_store_row(store_keys, starts, chunks, ncols, id, &row);
                    equal = keys_equal(batch_keys, i, cols, row, ncols);
                }
                if (equal) {
                    ref = id;
                    // A group of this batch: its first row is the least that has its key.
                    if (id & AGG_PENDING) atomicMin(&first[id & ~AGG_PENDING], (uint32_t)i);
                    break;
                }
            }
            slot = (slot + 1) & mask;
        }
        refs[i] = ref;
    }
}

__device__ __forceinline__ uint64_t agg_leader_flag(const uint32_t* refs, const uint32_t* first, uint64_t i) {
    uint32_t r = refs[i];
    return agg_is_pending(r) && first[r & ~AGG_PENDING] == (uint32_t)i ? 1 : 0;
}

FULMEN_KERNEL agg_leader_flags(const uint32_t* refs, const uint32_t* first, uint64_t n, uint64_t* flags) {
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) flags[i] = agg_leader_flag(refs, first, i);
}

FULMEN_KERNEL agg_leader_ranks(const uint32_t* refs, const uint32_t* first, uint64_t n, unsigned long long* state,
                               uint64_t capacity, uint64_t epoch, uint64_t* flags, uint64_t* ranks,
                               uint64_t* total_out, const uint64_t* hashes, uint64_t g0, uint32_t* leaders,
                               uint64_t* group_hashes) {
    uint64_t tiles = (n + SCAN_TILE - 1) / SCAN_TILE;
    uint64_t tile = blockIdx.x;
    if (tile >= tiles) return;
    uint64_t at = tile * SCAN_TILE + (uint64_t)threadIdx.x * SCAN_ITEMS;
    uint64_t items[SCAN_ITEMS];
    uint64_t sum = 0;
    for (unsigned k = 0; k < SCAN_ITEMS; ++k) {
        items[k] = at + k < n ? agg_leader_flag(refs, first, at + k) : 0;
        sum += items[k];
    }
    uint64_t rank = scan_block_lookback(sum, tile, tile, tiles, state, capacity, epoch, total_out);
    for (unsigned k = 0; k < SCAN_ITEMS; ++k) {
        if (at + k < n) {
            flags[at + k] = items[k];
            ranks[at + k] = rank;
            if (leaders && items[k]) {
                leaders[rank] = (uint32_t)(at + k);
                group_hashes[g0 + rank] = hashes[at + k];
            }
        }
        rank += items[k];
    }
}

// What agg_resolve does, for agg_update to do it in the same launch (`refs` not null).
struct AggResolve {
    const uint32_t* refs;
    const uint32_t* first;
    const uint64_t* ranks;
    const uint64_t* flags;
    const uint64_t* hashes;
    uint64_t g0;
    uint32_t* leaders;
    uint64_t* group_hashes;
    unsigned long long* slots;
    uint64_t capacity;
};

// Row i's group id (committed, or g0 + the rank of its group's first row; SKIP stays
// SKIP); a leader row also writes itself to leaders and its hash to its group's, unless
// leaders is null (agg_leader_ranks wrote them).
__device__ __forceinline__ uint32_t agg_resolve_row(const AggResolve& r, uint64_t i) {
    uint32_t ref = r.refs[i];
    if (r.leaders && r.flags[i]) {
        r.leaders[r.ranks[i]] = (uint32_t)i;
        r.group_hashes[r.g0 + r.ranks[i]] = r.hashes[i];
    }
    return agg_is_pending(ref) ? (uint32_t)(r.g0 + r.ranks[r.first[ref & ~AGG_PENDING]]) : ref;
}

// Slot s's pending id made the committed one.
__device__ __forceinline__ void agg_resolve_slot(const AggResolve& r, uint64_t s) {
    unsigned long long v = r.slots[s];
    uint32_t id = (uint32_t)v;
    if (v != AGG_EMPTY && (id & AGG_PENDING))
        r.slots[s] = (v & 0xFFFFFFFF00000000ull) | (uint32_t)(r.g0 + r.ranks[r.first[id & ~AGG_PENDING]]);
}

FULMEN_KERNEL agg_resolve(const uint32_t* refs, const uint32_t* first, const uint64_t* ranks, const uint64_t* flags,
                          const uint64_t* hashes, uint64_t g0, uint32_t* leaders, uint64_t* group_hashes,
                          unsigned long long* slots, uint64_t capacity, uint64_t n, uint32_t* gids) {
    const AggResolve r{refs, first, ranks, flags, hashes, g0, leaders, group_hashes, slots, capacity};
    const uint64_t items = n > capacity ? n : capacity;
    for (uint64_t i = GRID_START; i < items; i += GRID_STRIDE) {
        if (i < n) gids[i] = agg_resolve_row(r, i);
        if (i < capacity) agg_resolve_slot(r, i);
    }
}

FULMEN_KERNEL agg_rollback(unsigned long long* slots, uint64_t capacity, uint64_t g0) {
    for (uint64_t s = GRID_START; s < capacity; s += GRID_STRIDE) {
        unsigned long long v = slots[s];
        if (v != AGG_EMPTY && (uint32_t)v >= g0) slots[s] = AGG_EMPTY;
    }
}

FULMEN_KERNEL agg_rehash(unsigned long long* slots, uint64_t mask, const uint64_t* group_hashes, uint64_t groups) {
    for (uint64_t g = GRID_START; g < groups; g += GRID_STRIDE) {
        uint64_t h = group_hashes[g];
        unsigned long long entry = ((h >> 32) << 32) | (uint32_t)g;
        for (uint64_t slot = h & mask;; slot = (slot + 1) & mask)
            if (atomicCAS(&slots[slot], (unsigned long long)AGG_EMPTY, entry) == AGG_EMPTY) break;
    }
}

FULMEN_KERNEL agg_fill_u64(uint64_t* buffer, uint64_t n, uint64_t value) {
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) buffer[i] = value;
}

// Groups 0..to of up to four accumulators at their identity, in one launch: accumulator
// k's state words (when state_k is not null) and its counts of values (zero, when counts_k
// is not null), the groups' locks (zero, when `locks` is not null), and a new keyed
// table's first `nslots` hash slots empty (when `slots` is not null), so that a table
// starts in one launch. A table's accumulators past the fourth take another launch;
// unused slots pass nulls.
// Group g of one accumulator in a grown table: the old table's (g < keep) or the
// identity; nothing where the accumulator slot is unused (counts null).
__device__ __forceinline__ void agg_init_one(unsigned long long* state, const unsigned long long* old_state,
                                             uint64_t op, unsigned long long* counts,
                                             const unsigned long long* old_counts, uint64_t g, uint64_t keep) {
    if (!counts) return;
    uint64_t words = state ? agg_state_words(op) : 0;
    if (g < keep) {
        for (uint64_t w = 0; w < words; ++w) state[g * words + w] = old_state[g * words + w];
        counts[g] = old_counts[g];
    } else {
        for (uint64_t w = 0; w < words; ++w) state[g * words + w] = agg_identity(op, (uint32_t)w);
        counts[g] = 0;
    }
}

#define AGG_INIT_SLOT(K)                                                                     \
    unsigned long long *state##K, const unsigned long long *old_state##K, uint64_t op##K,    \
        unsigned long long *counts##K, const unsigned long long *old_counts##K

FULMEN_KERNEL agg_init_state(uint64_t to, uint64_t keep, uint32_t* locks, unsigned long long* slots, uint64_t nslots,
                             uint64_t* hashes, const uint64_t* old_hashes, AGG_INIT_SLOT(0), AGG_INIT_SLOT(1),
                             AGG_INIT_SLOT(2), AGG_INIT_SLOT(3), AGG_INIT_SLOT(4), AGG_INIT_SLOT(5),
                             AGG_INIT_SLOT(6), AGG_INIT_SLOT(7)) {
    uint64_t end = slots && nslots > to ? nslots : to;
    for (uint64_t g = GRID_START; g < end; g += GRID_STRIDE) {
        if (slots && g < nslots) slots[g] = (unsigned long long)AGG_EMPTY;
        if (g >= to) continue;
        agg_init_one(state0, old_state0, op0, counts0, old_counts0, g, keep);
        agg_init_one(state1, old_state1, op1, counts1, old_counts1, g, keep);
        agg_init_one(state2, old_state2, op2, counts2, old_counts2, g, keep);
        agg_init_one(state3, old_state3, op3, counts3, old_counts3, g, keep);
        agg_init_one(state4, old_state4, op4, counts4, old_counts4, g, keep);
        agg_init_one(state5, old_state5, op5, counts5, old_counts5, g, keep);
        agg_init_one(state6, old_state6, op6, counts6, old_counts6, g, keep);
        agg_init_one(state7, old_state7, op7, counts7, old_counts7, g, keep);
        if (hashes && g < keep) hashes[g] = old_hashes[g];
        if (locks) locks[g] = 0;
    }
}

FULMEN_KERNEL agg_update(const AggAcc* accs, uint32_t nacc, const uint32_t* gids, uint64_t n, uint32_t* locks,
                         uint64_t groups, uint32_t shared_groups, const uint32_t* refs, const uint32_t* first,
                         const uint64_t* ranks, const uint64_t* flags, const uint64_t* hashes, uint64_t g0,
                         uint32_t* leaders, uint64_t* group_hashes, unsigned long long* slots, uint64_t capacity) {
    // With refs: agg_resolve's work in this launch, each row's group resolved where it is
    // read (gids unused).
    const AggResolve r{refs, first, ranks, flags, hashes, g0, leaders, group_hashes, slots, capacity};
    if (refs)
        for (uint64_t s = GRID_START; s < capacity; s += GRID_STRIDE) agg_resolve_slot(r, s);
    auto group_of = [&](uint64_t i) -> uint64_t { return refs ? agg_resolve_row(r, i) : gids ? gids[i] : 0; };
    if (shared_groups) {
        // Per-block tables: for each accumulator, counts[groups] then state[groups × words].
        FULMEN_DYNAMIC_SHARED(unsigned long long, tables);
        uint64_t at = 0;
        for (uint32_t k = 0; k < nacc; ++k) at = agg_table_identity(tables, at, accs[k].op, groups);
        __syncthreads();
        uint64_t start = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
        for (uint64_t i = start; i < n; i += GRID_STRIDE) {
            uint64_t g = group_of(i);
            if (g == AGG_SKIP) continue;
            uint64_t base = 0;
            for (uint32_t k = 0; k < nacc; ++k) {
                const AggAcc& a = accs[k];
                uint64_t words = agg_state_words(a.op);
                if (agg_takes(a, i)) {
                    uint64_t lo, hi;
                    agg_value(a, i, &lo, &hi);
                    agg_apply(a.op, &tables[base + groups + g * words], &tables[base + g], nullptr, lo, hi, 1);
                }
                base += groups * (1 + words);
            }
        }
        __syncthreads();
        uint64_t base = 0;
        for (uint32_t k = 0; k < nacc; ++k) {
            const AggAcc& a = accs[k];
            uint64_t words = agg_state_words(a.op);
            for (uint64_t g = threadIdx.x; g < groups; g += blockDim.x) {
                uint64_t count = tables[base + g];
                if (count) agg_merge_state(a.op, &a.state[g * words], &a.counts[g], &tables[base + groups + g * words], count);
            }
            base += groups * (1 + words);
        }
        return;
    }
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {
        uint64_t g = group_of(i);
        if (g == AGG_SKIP) continue;
        for (uint32_t k = 0; k < nacc; ++k) {
            const AggAcc& a = accs[k];
            if (!agg_takes(a, i)) continue;
            uint64_t lo, hi;
            agg_value(a, i, &lo, &hi);
            agg_apply(a.op, &a.state[g * agg_state_words(a.op)], &a.counts[g], locks ? &locks[g] : nullptr, lo, hi,
                      1);
        }
    }
}

FULMEN_KERNEL agg_exact_normalize(unsigned long long* state, uint64_t groups) {
    for (uint64_t g = GRID_START; g < groups; g += GRID_STRIDE) {
        long long limbs[AGG_LIMBS];
        unsigned long long* acc = &state[g * AGG_EXACT_WORDS];
        for (uint32_t k = 0; k < AGG_LIMBS; ++k) limbs[k] = (long long)acc[k];
        agg_exact_carry(limbs);
        for (uint32_t k = 0; k < AGG_LIMBS; ++k) acc[k] = (unsigned long long)limbs[k];
    }
}

FULMEN_KERNEL agg_exact_finish(const unsigned long long* state, uint64_t groups, uint64_t* out) {
    for (uint64_t g = GRID_START; g < groups; g += GRID_STRIDE) out[g] = agg_exact_round(&state[g * AGG_EXACT_WORDS]);
}

#if defined(FULMEN_EMULATOR)
FULMEN_EMU_EXPORT(agg_exact_normalize)
FULMEN_EMU_EXPORT(agg_exact_finish)
FULMEN_EMU_EXPORT(agg_find_or_insert)
FULMEN_EMU_EXPORT(agg_leader_flags)
FULMEN_EMU_EXPORT(agg_leader_ranks)
FULMEN_EMU_EXPORT(agg_resolve)
FULMEN_EMU_EXPORT(agg_rollback)
FULMEN_EMU_EXPORT(agg_rehash)
FULMEN_EMU_EXPORT(agg_fill_u64)
FULMEN_EMU_EXPORT(agg_init_state)
FULMEN_EMU_EXPORT(agg_update)
#endif
