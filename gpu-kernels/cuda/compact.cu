// Stream compaction of a selection into the row indices it keeps, in row order.
//   select_word_counts (values, validity, n, counts): counts[w] = selected rows among rows
//                      32w .. 32w+31 (row i is selected when bit i of `values` is set and,
//                      when `validity` is given, bit i of `validity` too: NULL keeps no row)
//   — scan.cu turns counts into exclusive offsets —
//   select_scatter     (values, validity, n, offsets, out): writes each selected row index
//                      at out[offsets[w] + rank within its word]
//   select_compact     (values, validity, n, state, capacity, epoch, out, total_out): the two
//                      above and the scan between in one launch: a block per tile of
//                      SCAN_TILE words (scan.cuh), each thread SCAN_ITEMS consecutive words,
//                      chained by the look-back; the last tile writes the count at *total_out
// Bitmaps are Arrow's (LSB first) and start at bit 0. `out` holds the total of the counts.
#include "scan.cuh"

__device__ __forceinline__ uint32_t selection_word(const uint8_t* values, const uint8_t* validity, uint64_t n,
                                                   uint64_t word) {
    uint64_t first = word * 32;
    uint32_t bits = 0;
    uint64_t bytes = (n + 7) / 8;
    for (unsigned k = 0; k < 4; ++k) {
        uint64_t byte = word * 4 + k;
        if (byte >= bytes) break;
        uint32_t b = values[byte];
        if (validity != nullptr) b &= validity[byte];
        bits |= b << (8 * k);
    }
    uint64_t valid_rows = n - first;
    if (valid_rows < 32) bits &= (1u << valid_rows) - 1;
    return bits;
}

FULMEN_KERNEL select_word_counts(const uint8_t* values, const uint8_t* validity, uint64_t n, uint64_t* counts) {
    uint64_t words = (n + 31) / 32;
    for (uint64_t w = GRID_START; w < words; w += GRID_STRIDE) {
        counts[w] = (uint64_t)__popc(selection_word(values, validity, n, w));
    }
}

// Writes the index of each row set in `bits` (word w's) from out[at] on.
__device__ __forceinline__ void scatter_word(uint32_t bits, uint64_t w, uint64_t at, uint32_t* out) {
    while (bits != 0) {
        int bit = __ffs((int)bits) - 1;
        out[at++] = (uint32_t)(w * 32 + (uint64_t)bit);
        bits &= bits - 1;
    }
}

FULMEN_KERNEL select_scatter(const uint8_t* values, const uint8_t* validity, uint64_t n, const uint64_t* offsets,
                             uint32_t* out) {
    uint64_t words = (n + 31) / 32;
    for (uint64_t w = GRID_START; w < words; w += GRID_STRIDE) {
        scatter_word(selection_word(values, validity, n, w), w, offsets[w], out);
    }
}

FULMEN_KERNEL select_compact(const uint8_t* values, const uint8_t* validity, uint64_t n, unsigned long long* state,
                             uint64_t capacity, uint64_t epoch, uint32_t* out, uint64_t* total_out) {
    uint64_t words = (n + 31) / 32;
    uint64_t tiles = (words + SCAN_TILE - 1) / SCAN_TILE;
    uint64_t tile = blockIdx.x;
    if (tile >= tiles) return;
    uint64_t first = tile * SCAN_TILE + (uint64_t)threadIdx.x * SCAN_ITEMS;
    uint32_t bits[SCAN_ITEMS];
    uint64_t sum = 0;
    for (unsigned k = 0; k < SCAN_ITEMS; ++k) {
        bits[k] = first + k < words ? selection_word(values, validity, n, first + k) : 0u;
        sum += (uint64_t)__popc(bits[k]);
    }
    uint64_t at = scan_block_lookback(sum, tile, tile, tiles, state, capacity, epoch, total_out);
    for (unsigned k = 0; k < SCAN_ITEMS; ++k) {
        scatter_word(bits[k], first + k, at, out);
        at += (uint64_t)__popc(bits[k]);
    }
}

#if defined(FULMEN_EMULATOR)
FULMEN_EMU_EXPORT(select_word_counts)
FULMEN_EMU_EXPORT(select_scatter)
FULMEN_EMU_EXPORT(select_compact)
#endif
