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
#include "scan.cuh"

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
// (`state`, the epoch and forward progress: scan.cuh.)
FULMEN_KERNEL scan_lookback(const uint64_t* in, uint64_t n, uint64_t segments, unsigned long long* state,
                            uint64_t capacity, uint64_t epoch, uint64_t* out, uint64_t* total_out) {
    uint64_t per_segment = (n + SCAN_TILE - 1) / SCAN_TILE;
    uint64_t tiles = per_segment * segments;
    uint64_t tile = blockIdx.x;
    if (tile >= tiles) return;
    ScanTile t = scan_tile(tile, per_segment);
    uint64_t items[SCAN_ITEMS];
    uint64_t sum = 0;
    for (unsigned k = 0; k < SCAN_ITEMS; ++k) {
        items[k] = t.first + k < n ? in[t.base + t.first + k] : 0;
        sum += items[k];
    }
    uint64_t running = scan_block_lookback(sum, tile, tile % per_segment, per_segment, state, capacity, epoch,
                                           total_out ? total_out + tile / per_segment : nullptr);
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
