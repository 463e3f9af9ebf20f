// Exclusive prefix sums of uint64_t values over `segments` independent segments of `n`
// values each (one scan per segment: a string column's lengths each, say). Segment s
// starts at value s * stride, stride = tiles_per_segment * SCAN_TILE with
// tiles_per_segment = ceil(n / SCAN_TILE); values past n in a segment are neither read nor
// written. One launch (scan_lookback, at the end of this file) where the tiles of all
// segments fit the stream's look-back state; past that, three:
//   scan_tile_sums    (in, n, segments, tile_sums):  sum of each tile of SCAN_TILE values;
//                     segment s owns tile sums s * (tiles_per_segment + 1) .. + tiles_per_segment
//   scan_tile_offsets (tile_sums, n, segments, total_out):  a block per segment turns its
//                     tile sums into exclusive offsets (in place) and writes the segment's
//                     total after them (and at total_out[s], when not null)
//   scan_tiles        (in, n, segments, tile_sums, out): each tile scanned in shared memory,
//                     plus its offset
// Launch scan_tile_sums and scan_tiles with blockDim.x == SCAN_THREADS; any grid size works.
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

FULMEN_KERNEL scan_tile_sums(const uint64_t* in, uint64_t n, uint64_t segments, uint64_t* tile_sums) {
    __shared__ uint64_t buf[SCAN_THREADS];
    uint64_t per_segment = (n + SCAN_TILE - 1) / SCAN_TILE;
    uint64_t tiles = per_segment * segments;
    for (uint64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        ScanTile t = scan_tile(tile, per_segment);
        uint64_t sum = 0;
        for (unsigned k = 0; k < SCAN_ITEMS; ++k)
            if (t.first + k < n) sum += in[t.base + t.first + k];
        uint64_t inclusive = block_inclusive_scan(sum, buf);
        if (threadIdx.x == blockDim.x - 1) tile_sums[t.sum_at] = inclusive;
    }
}

FULMEN_KERNEL scan_tile_offsets(uint64_t* tile_sums, uint64_t n, uint64_t segments, uint64_t* total_out) {
    __shared__ uint64_t buf[SCAN_THREADS];
    __shared__ uint64_t carry;
    uint64_t tiles = (n + SCAN_TILE - 1) / SCAN_TILE;
    for (uint64_t segment = blockIdx.x; segment < segments; segment += gridDim.x) {
        uint64_t* sums = tile_sums + segment * (tiles + 1);
        if (threadIdx.x == 0) carry = 0;
        __syncthreads();
        for (uint64_t base = 0; base < tiles; base += blockDim.x) {
            uint64_t i = base + threadIdx.x;
            uint64_t value = i < tiles ? sums[i] : 0;
            uint64_t inclusive = block_inclusive_scan(value, buf);
            uint64_t start = carry;
            if (i < tiles) sums[i] = start + inclusive - value;
            __syncthreads();
            if (threadIdx.x == blockDim.x - 1) carry = start + inclusive;
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            sums[tiles] = carry;
            if (total_out) total_out[segment] = carry;
        }
        __syncthreads();  // carry is reset for the block's next segment
    }
}

FULMEN_KERNEL scan_tiles(const uint64_t* in, uint64_t n, uint64_t segments, const uint64_t* tile_offsets,
                         uint64_t* out) {
    __shared__ uint64_t buf[SCAN_THREADS];
    uint64_t per_segment = (n + SCAN_TILE - 1) / SCAN_TILE;
    uint64_t tiles = per_segment * segments;
    for (uint64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        ScanTile t = scan_tile(tile, per_segment);
        uint64_t items[SCAN_ITEMS];
        uint64_t sum = 0;
        for (unsigned k = 0; k < SCAN_ITEMS; ++k) {
            items[k] = t.first + k < n ? in[t.base + t.first + k] : 0;
            sum += items[k];
        }
        uint64_t running = tile_offsets[t.sum_at] + block_inclusive_scan(sum, buf) - sum;
        for (unsigned k = 0; k < SCAN_ITEMS; ++k) {
            if (t.first + k < n) out[t.base + t.first + k] = running;
            running += items[k];
        }
    }
}

// One launch for any scan whose tiles, over all segments, fit the stream's look-back state
// (decoupled look-back, Merrill & Garland 2016):
//   scan_lookback (in, n, segments, state, capacity, epoch, out, total_out): a block per
//     tile, tile = blockIdx.x (the grid is exactly the tiles: no grid-stride loop, unlike
//     every other kernel). Each block scans its tile, publishes the tile's sum, walks back
//     over the tiles before it in its segment, adding their sums until it meets one whose
//     inclusive prefix is published, then publishes its own inclusive prefix and writes
//     its values. The block of a segment's last tile writes the segment's total at
//     total_out[s] (when not null). Segments of one tile wait for nothing and need no
//     state (null).
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

FULMEN_KERNEL scan_lookback(const uint64_t* in, uint64_t n, uint64_t segments, unsigned long long* state,
                            uint64_t capacity, uint64_t epoch, uint64_t* out, uint64_t* total_out) {
    __shared__ uint64_t buf[SCAN_THREADS];
    __shared__ uint64_t before;
    uint64_t per_segment = (n + SCAN_TILE - 1) / SCAN_TILE;
    uint64_t tiles = per_segment * segments;
    uint64_t tile = blockIdx.x;
    if (tile >= tiles) return;
    ScanTile t = scan_tile(tile, per_segment);
    uint64_t local = tile % per_segment;
    uint64_t items[SCAN_ITEMS];
    uint64_t sum = 0;
    for (unsigned k = 0; k < SCAN_ITEMS; ++k) {
        items[k] = t.first + k < n ? in[t.base + t.first + k] : 0;
        sum += items[k];
    }
    uint64_t inclusive = block_inclusive_scan(sum, buf);
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
        before = prefix;
        if (local == per_segment - 1 && total_out) total_out[tile / per_segment] = prefix + inclusive;
    }
    __syncthreads();
    uint64_t running = before + inclusive - sum;
    for (unsigned k = 0; k < SCAN_ITEMS; ++k) {
        if (t.first + k < n) out[t.base + t.first + k] = running;
        running += items[k];
    }
}

#if defined(FULMEN_EMULATOR)
FULMEN_EMU_EXPORT(scan_lookback)
FULMEN_EMU_EXPORT(scan_tile_sums)
FULMEN_EMU_EXPORT(scan_tile_offsets)
FULMEN_EMU_EXPORT(scan_tiles)
#endif
