// Concatenation of columns on one device: the host launches one kernel per piece, in
// order, on the device's stream, each appending the piece's rows after those already
// written (fixed-width values are plain device copies, no kernel).
//   append_bits          (src, n, dst, at)                  bits 0..n of src (a null src: all
//                                                           set) become bits at..at+n of dst;
//                                                           one thread per destination byte,
//                                                           which keeps the byte's bits below
//                                                           `at` (an earlier piece's rows)
//   append_string_o32/o64 (offsets, bytes, n, cap, out_offsets, out_bytes, at)
//                                                           rows 0..n of a string column
//                                                           become rows at..at+n: their bytes
//                                                           go where out_offsets[at] says (0
//                                                           when at is 0, which also writes
//                                                           out_offsets[0]), then
//                                                           out_offsets[at+1..=at+n]; cap is
//                                                           the source's byte buffer size,
//                                                           and no more than cap bytes are
//                                                           copied; the grid covers
//                                                           max(n + 1, cap) items
#include "fulmen.cuh"

FULMEN_KERNEL append_bits(const uint8_t* src, uint64_t n, uint8_t* dst, uint64_t at) {
    if (n == 0) return;
    uint64_t first = at >> 3, last = (at + n - 1) >> 3;
    for (uint64_t b = first + GRID_START; b <= last; b += GRID_STRIDE) {
        bool whole = b * 8 >= at && b * 8 + 8 <= at + n;
        uint8_t byte = whole ? (uint8_t)0 : dst[b];
        for (unsigned k = 0; k < 8; ++k) {
            uint64_t bit = b * 8 + k;
            if (bit < at || bit >= at + n) continue;
            uint8_t mask = (uint8_t)(1u << k);
            if (bit_is_set(src, bit - at)) {
                byte = (uint8_t)(byte | mask);
            } else {
                byte = (uint8_t)(byte & (uint8_t)~mask);
            }
        }
        dst[b] = byte;
    }
}

#define APPEND_STRINGS(SUFFIX, OFF)                                                                 \
    FULMEN_KERNEL append_string_##SUFFIX(const OFF* offsets, const uint8_t* bytes, uint64_t n,      \
                                         uint64_t cap, OFF* out_offsets, uint8_t* out_bytes,        \
                                         uint64_t at) {                                             \
        OFF base = at == 0 ? (OFF)0 : out_offsets[at];                                              \
        OFF first = offsets[0];                                                                     \
        uint64_t len = (uint64_t)(offsets[n] - first);                                              \
        if (len > cap) len = cap;                                                                   \
        uint64_t items = n + 1 > len ? n + 1 : len;                                                 \
        for (uint64_t i = GRID_START; i < items; i += GRID_STRIDE) {                                \
            if (i <= n && (i > 0 || at == 0)) out_offsets[at + i] = (OFF)(base + (offsets[i] - first)); \
            if (i < len) out_bytes[(uint64_t)base + i] = bytes[(uint64_t)first + i];                \
        }                                                                                           \
    }

APPEND_STRINGS(o32, int32_t)
APPEND_STRINGS(o64, int64_t)

#if defined(FULMEN_EMULATOR)
FULMEN_EMU_EXPORT(append_bits)
FULMEN_EMU_EXPORT(append_string_o32)
FULMEN_EMU_EXPORT(append_string_o64)
#endif
