// Block-wide prefix sums and the decoupled look-back (Merrill & Garland 2016) that chains
// the blocks of one launch into one scan: scan.cu's scans, and the kernels that scan what
// they count in the same launch (a join probe's matches, hash_table.cu; a selection's kept
// rows, compact.cu). A block per tile of SCAN_TILE values, SCAN_ITEMS consecutive values
// per thread, blockDim.x == SCAN_THREADS.
#pragma once
#include "fulmen.cuh"

#define SCAN_THREADS 256
#define SCAN_ITEMS 4
#define SCAN_TILE (SCAN_THREADS * SCAN_ITEMS)

// Inclusive scan of one value per thread across the block (Hillis–Steele with barriers).
__device__ uint64_t block_inclusive_scan(uint64_t value, uint64_t* buf) {
    unsigned t = threadIdx.x;
    buf[t] = value;
    __syncthreads();
    for (unsigned offset = 1; offset < blockDim.x; offset <<= 1) {
        uint64_t add = t >= offset ? buf[t - offset] : 0;
        __syncthreads();
        buf[t] += add;
        __syncthreads();
    }
    uint64_t result = buf[t];
    __syncthreads();  // buf is reused by the caller's next tile
    return result;
}

// Where tile `tile` (of all segments' tiles, in order) lies: its first value's index in
// `in`/`out`, the index within its segment of this thread's first value, and its tile sum's.
struct ScanTile {
    uint64_t base, first, sum_at;
};

__device__ __forceinline__ ScanTile scan_tile(uint64_t tile, uint64_t per_segment) {
    uint64_t segment = tile / per_segment, local = tile % per_segment;
    ScanTile t;
    t.base = segment * per_segment * SCAN_TILE;
    t.first = local * SCAN_TILE + (uint64_t)threadIdx.x * SCAN_ITEMS;
    t.sum_at = segment * (per_segment + 1) + local;
    return t;
}

// `state` is three arrays of `capacity` u64 (flags, tile sums, inclusive prefixes;
// capacity at least the tiles) that the stream keeps from scan to scan, always laid out
// alike, so that a flag word only ever holds a flag: epoch << 2 | what is published (1:
// the tile's sum, 2: its inclusive prefix). A flag of another epoch (an earlier scan's, or
// the zeroes the state starts as) means nothing yet, so the state is never reset: each
// launch on the stream has a new epoch, and launches on one stream do not overlap.
// Forward progress: a block waits only on tiles of lower index, whose blocks the GPU (and
// the emulator, whose workers take blocks in order) started before it; one thread waits,
// after the block's last barrier but one.
#define SCAN_PUBLISHED_SUM 1ull
#define SCAN_PUBLISHED_PREFIX 2ull

// The published word `at` (an atomic read: it is read from L2, never a stale L1 line).
__device__ __forceinline__ uint64_t scan_read(unsigned long long* at) { return atomicAdd(at, 0ull); }

__device__ void scan_publish(unsigned long long* flags, unsigned long long* values, uint64_t tile, uint64_t value,
                             uint64_t epoch, unsigned long long what) {
    atomicExch(&values[tile], (unsigned long long)value);
    __threadfence();  // the value before its flag
    atomicExch(&flags[tile], (unsigned long long)((epoch << 2) | what));
}

// The look-back of the block that owns tile `tile` of a launch's tiles (`local`: its place
// in its segment of `per_segment` tiles), each thread holding `sum`, the sum of its
// SCAN_ITEMS values: returns the sum of every value of the segment before this thread's
// first (its exclusive prefix). The block of a segment's last tile writes the segment's
// total at *total_out, when not null. Every thread of the block calls it, once per launch
// (it has barriers); `state` as above (null where segments are one tile).
__device__ uint64_t scan_block_lookback(uint64_t sum, uint64_t tile, uint64_t local, uint64_t per_segment,
                                        unsigned long long* state, uint64_t capacity, uint64_t epoch,
                                        uint64_t* total_out) {
    __shared__ uint64_t scan_buf[SCAN_THREADS];
    __shared__ uint64_t scan_before;
    uint64_t inclusive = block_inclusive_scan(sum, scan_buf);
    if (threadIdx.x == blockDim.x - 1) {
        // `inclusive` is the tile's sum in the last thread.
        uint64_t prefix = 0;
        if (per_segment > 1) {
            unsigned long long* flags = state;
            unsigned long long* sums = state + capacity;
            unsigned long long* prefixes = state + 2 * capacity;
            if (local > 0) {
                scan_publish(flags, sums, tile, inclusive, epoch, SCAN_PUBLISHED_SUM);
                // A segment's first tile publishes its prefix at once, so the walk ends
                // at the segment's start at the latest.
                for (uint64_t p = tile - 1;; --p) {
                    uint64_t flag;
                    do {
                        flag = scan_read(&flags[p]);
                    } while ((flag >> 2) != epoch);
                    __threadfence();  // the flag before its value
                    if ((flag & 3) == SCAN_PUBLISHED_PREFIX) {
                        prefix += scan_read(&prefixes[p]);
                        break;
                    }
                    prefix += scan_read(&sums[p]);
                }
            }
            scan_publish(flags, prefixes, tile, prefix + inclusive, epoch, SCAN_PUBLISHED_PREFIX);
        }
        scan_before = prefix;
        if (local == per_segment - 1 && total_out) *total_out = prefix + inclusive;
    }
    __syncthreads();
    return scan_before + inclusive - sum;
}
