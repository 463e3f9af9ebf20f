// Exclusive prefix sums of uint64_t values, in three launches (or fewer: see
// scan_tiles_summed below), over `segments` independent
// segments of `n` values each (one scan per segment: a string column's lengths each, say).
// Segment s starts at value s * stride, stride = tiles_per_segment * SCAN_TILE with
// tiles_per_segment = ceil(n / SCAN_TILE); values past n in a segment are neither read nor
// written. Segment s owns tile sums s * (tiles_per_segment + 1) .. + tiles_per_segment.
//   scan_tile_sums    (in, n, segments, tile_sums):  sum of each tile of SCAN_TILE values
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

// Two launches instead of three, for segments of at most SCAN_SUMMED_TILES tiles (one for
// segments of one tile, which have no tile sums before their own to add up):
//   scan_tile_sums (left out for segments of one tile), then
//   scan_tiles_summed (in, n, segments, tile_sums, out, total_out): each block adds up the
//     raw tile sums before its tile itself (at most SCAN_SUMMED_TILES - 1 of them, read
//     by the whole block), then scans its tile as scan_tiles does; the block of a
//     segment's last tile writes the segment's total after its tile sums (and at
//     total_out[s], when not null). The tile sums are left as they were.
#define SCAN_SUMMED_TILES 1024

// The sum of sums[0..count) across the block (every thread gets it).
__device__ uint64_t block_sum(const uint64_t* sums, uint64_t count, uint64_t* buf) {
    uint64_t mine = 0;
    for (uint64_t i = threadIdx.x; i < count; i += blockDim.x) mine += sums[i];
    block_inclusive_scan(mine, buf);
    // buf still holds the inclusive sums (block_inclusive_scan ends with a barrier).
    uint64_t result = buf[blockDim.x - 1];
    __syncthreads();  // buf is rewritten by the block's next scan
    return result;
}

FULMEN_KERNEL scan_tiles_summed(const uint64_t* in, uint64_t n, uint64_t segments, uint64_t* tile_sums,
                                uint64_t* out, uint64_t* total_out) {
    __shared__ uint64_t buf[SCAN_THREADS];
    uint64_t per_segment = (n + SCAN_TILE - 1) / SCAN_TILE;
    uint64_t tiles = per_segment * segments;
    for (uint64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        ScanTile t = scan_tile(tile, per_segment);
        uint64_t local = tile % per_segment;
        uint64_t* sums = tile_sums + (t.sum_at - local);
        uint64_t offset = block_sum(sums, local, buf);
        uint64_t items[SCAN_ITEMS];
        uint64_t sum = 0;
        for (unsigned k = 0; k < SCAN_ITEMS; ++k) {
            items[k] = t.first + k < n ? in[t.base + t.first + k] : 0;
            sum += items[k];
        }
        uint64_t inclusive = block_inclusive_scan(sum, buf);
        uint64_t running = offset + inclusive - sum;
        for (unsigned k = 0; k < SCAN_ITEMS; ++k) {
            if (t.first + k < n) out[t.base + t.first + k] = running;
            running += items[k];
        }
        if (local == per_segment - 1 && threadIdx.x == blockDim.x - 1) {
            sums[per_segment] = running;
            if (total_out) total_out[tile / per_segment] = running;
        }
    }
}

#if defined(FULMEN_EMULATOR)
FULMEN_EMU_EXPORT(scan_tiles_summed)
FULMEN_EMU_EXPORT(scan_tile_sums)
FULMEN_EMU_EXPORT(scan_tile_offsets)
FULMEN_EMU_EXPORT(scan_tiles)
#endif
