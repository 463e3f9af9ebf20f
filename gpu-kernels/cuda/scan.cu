// Exclusive prefix sums of uint64_t values, in three launches:
//   scan_tile_sums    (in, n, tile_sums):  sum of each tile of SCAN_TILE values
//   scan_tile_offsets (tile_sums, tiles, total_out):  one block turns tile sums into exclusive
//                                          offsets (in place) and writes the total at
//                                          tile_sums[tiles] (and at *total_out, when not null)
//   scan_tiles        (in, n, tile_sums, out): each tile scanned in shared memory, plus its offset
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

FULMEN_KERNEL scan_tile_sums(const uint64_t* in, uint64_t n, uint64_t* tile_sums) {
    __shared__ uint64_t buf[SCAN_THREADS];
    uint64_t tiles = (n + SCAN_TILE - 1) / SCAN_TILE;
    for (uint64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        uint64_t first = tile * SCAN_TILE + (uint64_t)threadIdx.x * SCAN_ITEMS;
        uint64_t sum = 0;
        for (unsigned k = 0; k < SCAN_ITEMS; ++k)
            if (first + k < n) sum += in[first + k];
        uint64_t inclusive = block_inclusive_scan(sum, buf);
        if (threadIdx.x == blockDim.x - 1) tile_sums[tile] = inclusive;
    }
}

FULMEN_KERNEL scan_tile_offsets(uint64_t* tile_sums, uint64_t tiles, uint64_t* total_out) {
    __shared__ uint64_t buf[SCAN_THREADS];
    __shared__ uint64_t carry;
    if (blockIdx.x != 0) return;
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    for (uint64_t base = 0; base < tiles; base += blockDim.x) {
        uint64_t i = base + threadIdx.x;
        uint64_t value = i < tiles ? tile_sums[i] : 0;
        uint64_t inclusive = block_inclusive_scan(value, buf);
        uint64_t start = carry;
        if (i < tiles) tile_sums[i] = start + inclusive - value;
        __syncthreads();
        if (threadIdx.x == blockDim.x - 1) carry = start + inclusive;
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        tile_sums[tiles] = carry;
        if (total_out) *total_out = carry;
    }
}

FULMEN_KERNEL scan_tiles(const uint64_t* in, uint64_t n, const uint64_t* tile_offsets, uint64_t* out) {
    __shared__ uint64_t buf[SCAN_THREADS];
    uint64_t tiles = (n + SCAN_TILE - 1) / SCAN_TILE;
    for (uint64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        uint64_t first = tile * SCAN_TILE + (uint64_t)threadIdx.x * SCAN_ITEMS;
        uint64_t items[SCAN_ITEMS];
        uint64_t sum = 0;
        for (unsigned k = 0; k < SCAN_ITEMS; ++k) {
            items[k] = first + k < n ? in[first + k] : 0;
            sum += items[k];
        }
        uint64_t running = tile_offsets[tile] + block_inclusive_scan(sum, buf) - sum;
        for (unsigned k = 0; k < SCAN_ITEMS; ++k) {
            if (first + k < n) out[first + k] = running;
            running += items[k];
        }
    }
}

#if defined(FULMEN_EMULATOR)
FULMEN_EMU_EXPORT(scan_tile_sums)
FULMEN_EMU_EXPORT(scan_tile_offsets)
FULMEN_EMU_EXPORT(scan_tiles)
#endif
