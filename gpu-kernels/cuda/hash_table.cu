// An open-addressing multimap from 64-bit row hashes to build-side row indices, with linear
// probing and atomicCAS. Join and aggregation operators build on it; they compare the
// actual keys of the candidate pairs it returns, since different keys may share a hash.
//   hash_table_init        (keys, rows, capacity)             every slot EMPTY_SLOT
//   hash_table_insert      (keys, rows, mask, hashes, valid, n)  row i goes into a free slot
//                           from hashes[i] & mask on; rows whose bit in `valid` is 0 (NULL
//                           keys) are left out
//   hash_table_probe_count (keys, mask, hashes, valid, n, counts) candidates per probe row
//   — scan.cu turns counts into exclusive offsets —
//   hash_table_probe_emit  (keys, rows, mask, hashes, valid, n, offsets, out_build, out_probe,
//                           cap) each probe row's candidates at its offset, in build-row
//                           order when there are at most SORT_RUN_MAX of them; pairs at or
//                           past `cap` (the outputs' capacity) are not written
// capacity is a power of two and mask == capacity - 1; the table must keep a free slot, so
// the host sizes it above the row count (load factor at most 1/2).
#include "fulmen.cuh"

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
                                const uint8_t* valid, uint64_t n) {
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {
        if (!bit_is_set(valid, i)) continue;
        unsigned long long key = slot_key(hashes[i]);
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

FULMEN_KERNEL hash_table_probe_count(const uint64_t* keys, uint64_t mask, const uint64_t* hashes,
                                     const uint8_t* valid, uint64_t n, uint64_t* counts) {
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {
        uint64_t count = 0;
        if (bit_is_set(valid, i)) {
            uint64_t key = slot_key(hashes[i]);
            for (uint64_t slot = key & mask; keys[slot] != EMPTY_SLOT; slot = (slot + 1) & mask)
                count += keys[slot] == key;
        }
        counts[i] = count;
    }
}

FULMEN_KERNEL hash_table_probe_emit(const uint64_t* keys, const uint32_t* rows, uint64_t mask,
                                    const uint64_t* hashes, const uint8_t* valid, uint64_t n,
                                    const uint64_t* offsets, uint32_t* out_build, uint32_t* out_probe,
                                    uint64_t cap) {
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {
        if (!bit_is_set(valid, i)) continue;
        uint64_t key = slot_key(hashes[i]);
        uint64_t first = offsets[i], at = first;
        for (uint64_t slot = key & mask; keys[slot] != EMPTY_SLOT; slot = (slot + 1) & mask) {
            if (keys[slot] == key) {
                // Past the outputs' capacity the pairs are dropped: the host sees the total
                // above it and probes again with room for all.
                if (at < cap) {
                    out_build[at] = rows[slot];
                    out_probe[at] = (uint32_t)i;
                }
                ++at;
            }
        }
        // A probe row's candidates in build order (the table holds them in the order the
        // inserts won their slots): insertion sort of this thread's own short run.
        if (at - first <= SORT_RUN_MAX && at <= cap) {
            for (uint64_t a = first + 1; a < at; ++a) {
                uint32_t v = out_build[a];
                uint64_t b = a;
                for (; b > first && out_build[b - 1] > v; --b) out_build[b] = out_build[b - 1];
                out_build[b] = v;
            }
        }
    }
}

#if defined(FULMEN_EMULATOR)
FULMEN_EMU_EXPORT(hash_table_init)
FULMEN_EMU_EXPORT(hash_table_insert)
FULMEN_EMU_EXPORT(hash_table_probe_count)
FULMEN_EMU_EXPORT(hash_table_probe_emit)
#endif
