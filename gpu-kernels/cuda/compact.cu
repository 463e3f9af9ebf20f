// Stream compaction of a selection into the row indices it keeps, in row order.
//   select_word_counts (values, validity, n, counts): counts[w] = selected rows among rows
//                      32w .. 32w+31 (row i is selected when bit i of `values` is set and,
//                      when `validity` is given, bit i of `validity` too: NULL keeps no row)
//   — scan.cu turns counts into exclusive offsets —
//   select_scatter     (values, validity, n, offsets, out): writes each selected row index
//                      at out[offsets[w] + rank within its word]
// Bitmaps are Arrow's (LSB first) and start at bit 0. `out` holds the total of the counts.
#include "fulmen.cuh"

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

FULMEN_KERNEL select_scatter(const uint8_t* values, const uint8_t* validity, uint64_t n, const uint64_t* offsets,
                             uint32_t* out) {
    uint64_t words = (n + 31) / 32;
    for (uint64_t w = GRID_START; w < words; w += GRID_STRIDE) {
        uint32_t bits = selection_word(values, validity, n, w);
        uint64_t at = offsets[w];
        while (bits != 0) {
            int bit = __ffs((int)bits) - 1;
            out[at++] = (uint32_t)(w * 32 + (uint64_t)bit);
            bits &= bits - 1;
        }
    }
}

#if defined(FULMEN_EMULATOR)
FULMEN_EMU_EXPORT(select_word_counts)
FULMEN_EMU_EXPORT(select_scatter)
#endif
