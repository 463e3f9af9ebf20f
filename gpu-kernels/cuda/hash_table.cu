// An open-addressing multimap from 64-bit row hashes to build-side row indices, with linear
// probing and atomicCAS. Joins build on it: different keys may share a hash, so a join's
// probe also compares the actual keys of each candidate (equal hashes) it finds.
//   hash_table_init        (keys, rows, capacity)             every slot EMPTY_SLOT
//   hash_table_insert      (keys, rows, mask, hashes, valid, n, key_cols, ncols)  row i goes
//                           into a free slot from its hash & mask on: hashes[i], or, where
//                           key_cols is not null, key_row_hash over its ncols key columns
//                           (as hash_many would); rows whose bit in `valid` is 0 (NULL keys)
//                           are left out
//   hash_table_probe_count (keys, rows, mask, hashes, valid, n, counts, check…, hash_here)
//                           pairs per probe row; with hash_here (and a check) each valid
//                           probe row's hash is computed here from the check's probe keys
//                           (key_row_hash, as hash_many would) and written to hashes[i]
//                           for the emit, where the caller left them unset
//   — scan.cu turns counts into exclusive offsets —
//   hash_table_probe_emit  (keys, rows, mask, hashes, valid, n, offsets, out_build, out_probe,
//                           cap, check…) each probe row's pairs at its offset, in build-row
//                           order when there are at most SORT_RUN_MAX of them; pairs at or
//                           past `cap` (the outputs' capacity) are not written
//   hash_table_probe       (keys, rows, mask, hashes, valid, n, state, capacity, epoch,
//                           out_build, out_probe, cap, total_out, check…, hash_here) the three
//                           steps above in one launch, a block per SCAN_TILE probe rows
//                           chained by the look-back of scan.cuh (see the kernel)
//   hash_table_probe_mark  (keys, rows, mask, valid, n, marks, build_rows, check…) sets bit
//                           b of `marks` (u32 words) for every build row b that pairs with
//                           a valid probe row (hashed here from the check's probe keys): a
//                           left semi or anti join's matches, with no pairs, counts or
//                           offsets; a build row at or past build_rows is never marked
// The pairs: with `check` (build_keys, probe_keys, ncols, nulls_match; build_keys not null)
// the build rows whose hash and keys are equal to the probe row's (keys_equal over either
// side's ncols key descriptors) and, unless nulls_match, with no NULL key on either side: a
// join's matches, with no pass to verify and compact candidates. Without it (build_keys
// null) every build row with the same hash (candidates).
// capacity is a power of two and mask == capacity - 1; the table must keep a free slot, so
// the host sizes it above the row count (load factor at most 1/2).
#include "scan.cuh"

#define EMPTY_SLOT 0xFFFFFFFFFFFFFFFFull
// Longest run of one probe row's candidates that the emit kernel puts in build order.
#define SORT_RUN_MAX 64

// A real hash equal to the empty marker is stored as its neighbour.
__device__ __forceinline__ uint64_t slot_key(uint64_t h) { return h == EMPTY_SLOT ? EMPTY_SLOT - 1 : h; }

FULMEN_KERNEL hash_table_init(uint64_t* keys, uint32_t* rows, uint64_t capacity) {
    for (uint64_t i = GRID_START; i < capacity; i += GRID_STRIDE) {
        keys[i] = EMPTY_SLOT;
        rows[i] = NULL_INDEX;
    }
}

FULMEN_KERNEL hash_table_insert(unsigned long long* keys, uint32_t* rows, uint64_t mask, const uint64_t* hashes,
                                const uint8_t* valid, uint64_t n, const KeyCol* key_cols, uint32_t ncols) {
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {
        if (!bit_is_set(valid, i)) continue;
        unsigned long long key = slot_key(key_cols ? key_row_hash(key_cols, ncols, i) : hashes[i]);
        uint64_t slot = key & mask;
        for (;;) {
            unsigned long long seen = atomicCAS(&keys[slot], (unsigned long long)EMPTY_SLOT, key);
            if (seen == EMPTY_SLOT) {
                rows[slot] = (uint32_t)i;
                break;
            }
            slot = (slot + 1) & mask;
        }
    }
}

__device__ __forceinline__ bool probe_key_null(const KeyCol* keys, uint64_t row, uint32_t ncols) {
    for (uint32_t c = 0; c < ncols; ++c)
        if (!bit_is_set(keys[c].validity, row)) return true;
    return false;
}

// Whether build row b pairs with probe row p, their hashes being equal (see `check` above).
__device__ __forceinline__ bool probe_pairs(const KeyCol* build_keys, const KeyCol* probe_keys, uint32_t ncols,
                                            uint32_t nulls_match, uint32_t b, uint64_t p) {
    if (!build_keys) return true;
    if (!keys_equal(build_keys, b, probe_keys, p, ncols)) return false;
    return nulls_match || (!probe_key_null(build_keys, b, ncols) && !probe_key_null(probe_keys, p, ncols));
}

FULMEN_KERNEL hash_table_probe_count(const uint64_t* keys, const uint32_t* rows, uint64_t mask, uint64_t* hashes,
                                     const uint8_t* valid, uint64_t n, uint64_t* counts, const KeyCol* build_keys,
                                     const KeyCol* probe_keys, uint32_t ncols, uint32_t nulls_match,
                                     uint32_t hash_here) {
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {
        uint64_t count = 0;
        if (bit_is_set(valid, i)) {
            uint64_t key = slot_key(hash_here_or_read(hashes, hash_here, probe_keys, ncols, i));
            for (uint64_t slot = key & mask; keys[slot] != EMPTY_SLOT; slot = (slot + 1) & mask)
                count += keys[slot] == key && probe_pairs(build_keys, probe_keys, ncols, nulls_match, rows[slot], i);
        }
        counts[i] = count;
    }
}

// Writes probe row i's pairs (its slot key `key`) from offset `first` on; pairs at or past
// `cap` are dropped. A probe row's pairs come out in build order (the table holds them in
// the order the inserts won their slots) where they are at most SORT_RUN_MAX: an insertion
// sort of the thread's own short run.
__device__ void probe_emit_row(const uint64_t* keys, const uint32_t* rows, uint64_t mask, uint64_t key, uint64_t i,
                               uint64_t first, uint32_t* out_build, uint32_t* out_probe, uint64_t cap,
                               const KeyCol* build_keys, const KeyCol* probe_keys, uint32_t ncols,
                               uint32_t nulls_match) {
    uint64_t at = first;
    for (uint64_t slot = key & mask; keys[slot] != EMPTY_SLOT; slot = (slot + 1) & mask) {
        if (keys[slot] == key && probe_pairs(build_keys, probe_keys, ncols, nulls_match, rows[slot], i)) {
            // Past the outputs' capacity the pairs are dropped: the host sees the total
            // above it and probes again with room for all.
            if (at < cap) {
                out_build[at] = rows[slot];
                out_probe[at] = (uint32_t)i;
            }
            ++at;
        }
    }
    if (at - first <= SORT_RUN_MAX && at <= cap) {
        for (uint64_t a = first + 1; a < at; ++a) {
            uint32_t v = out_build[a];
            uint64_t b = a;
            for (; b > first && out_build[b - 1] > v; --b) out_build[b] = out_build[b - 1];
            out_build[b] = v;
        }
    }
}

FULMEN_KERNEL hash_table_probe_emit(const uint64_t* keys, const uint32_t* rows, uint64_t mask,
                                    const uint64_t* hashes, const uint8_t* valid, uint64_t n,
                                    const uint64_t* offsets, uint32_t* out_build, uint32_t* out_probe,
                                    uint64_t cap, const KeyCol* build_keys, const KeyCol* probe_keys,
                                    uint32_t ncols, uint32_t nulls_match) {
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {
        if (!bit_is_set(valid, i)) continue;
        probe_emit_row(keys, rows, mask, slot_key(hashes[i]), i, offsets[i], out_build, out_probe, cap, build_keys,
                       probe_keys, ncols, nulls_match);
    }
}

// The whole probe in one launch: a block per tile of SCAN_TILE probe rows (scan.cuh), each
// thread SCAN_ITEMS consecutive rows. Each thread counts its rows' pairs (hashing them
// first with hash_here, as the count pass does), the block's look-back turns the counts
// into the rows' offsets, and each thread writes its rows' pairs there, as the emit pass
// does; the last tile writes the total at *total_out. `state`, `capacity` and `epoch` are
// the stream's look-back state (null when there is one tile).
FULMEN_KERNEL hash_table_probe(const uint64_t* keys, const uint32_t* rows, uint64_t mask, uint64_t* hashes,
                               const uint8_t* valid, uint64_t n, unsigned long long* state, uint64_t capacity,
                               uint64_t epoch, uint32_t* out_build, uint32_t* out_probe, uint64_t cap,
                               uint64_t* total_out, const KeyCol* build_keys, const KeyCol* probe_keys,
                               uint32_t ncols, uint32_t nulls_match, uint32_t hash_here) {
    uint64_t tiles = (n + SCAN_TILE - 1) / SCAN_TILE;
    uint64_t tile = blockIdx.x;
    if (tile >= tiles) return;
    uint64_t first = tile * SCAN_TILE + (uint64_t)threadIdx.x * SCAN_ITEMS;
    uint64_t slot_keys[SCAN_ITEMS];
    uint64_t counts[SCAN_ITEMS];
    uint64_t sum = 0;
    for (unsigned k = 0; k < SCAN_ITEMS; ++k) {
        uint64_t i = first + k, count = 0;
        if (i < n && bit_is_set(valid, i)) {
            uint64_t key = slot_key(hash_here_or_read(hashes, hash_here, probe_keys, ncols, i));
            for (uint64_t slot = key & mask; keys[slot] != EMPTY_SLOT; slot = (slot + 1) & mask)
                count += keys[slot] == key && probe_pairs(build_keys, probe_keys, ncols, nulls_match, rows[slot], i);
            slot_keys[k] = key;
        }
        counts[k] = count;
        sum += count;
    }
    uint64_t at = scan_block_lookback(sum, tile, tile, tiles, state, capacity, epoch, total_out);
    for (unsigned k = 0; k < SCAN_ITEMS; ++k) {
        if (counts[k] > 0)
            probe_emit_row(keys, rows, mask, slot_keys[k], first + k, at, out_build, out_probe, cap, build_keys,
                           probe_keys, ncols, nulls_match);
        at += counts[k];
    }
}

// A probe row's pairs marked in a bitmap over the build rows instead of written out, each
// bit with an atomic OR. The check is required: without keys, hashes would mark candidates.
FULMEN_KERNEL hash_table_probe_mark(const uint64_t* keys, const uint32_t* rows, uint64_t mask, const uint8_t* valid,
                                    uint64_t n, uint32_t* marks, uint64_t build_rows, const KeyCol* build_keys,
                                    const KeyCol* probe_keys, uint32_t ncols, uint32_t nulls_match) {
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {
        if (!bit_is_set(valid, i)) continue;
        uint64_t key = slot_key(key_row_hash(probe_keys, ncols, i));
        for (uint64_t slot = key & mask; keys[slot] != EMPTY_SLOT; slot = (slot + 1) & mask) {
            if (keys[slot] != key) continue;
            uint32_t b = rows[slot];
            if (b >= build_rows || !probe_pairs(build_keys, probe_keys, ncols, nulls_match, b, i)) continue;
            atomicOr(&marks[b >> 5], 1u << (b & 31));
        }
    }
}

#if defined(FULMEN_EMULATOR)
FULMEN_EMU_EXPORT(hash_table_init)
FULMEN_EMU_EXPORT(hash_table_insert)
FULMEN_EMU_EXPORT(hash_table_probe_count)
FULMEN_EMU_EXPORT(hash_table_probe_emit)
FULMEN_EMU_EXPORT(hash_table_probe)
FULMEN_EMU_EXPORT(hash_table_probe_mark)
#endif
