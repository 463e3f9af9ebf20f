// Gather by an index column: out[i] = in[idx[i]], or NULL where idx[i] == NULL_INDEX.
//   gather_fixed_<bytes>     (in, idx, n, out)               values of 1, 2, 4, 8 or 16 bytes;
//                                                            a NULL index writes zero
//   gather_validity          (in_validity, idx, n, out)      output bitmap, one thread per
//                                                            output byte (no atomics);
//                                                            in_validity may be null
//   gather_string_lengths_o32/o64 (offsets, idx, n, count, lengths)
//                                                            byte length of each output string;
//                                                            with count not null only the first
//                                                            min(*count, n) indices are read
//                                                            (the rest may be unwritten) and the
//                                                            other lengths are 0
//   gather_string_lengths_many_o32/o64 (idx, flags, n, count, lengths, stride, ncols,
//                                       offsets0, … offsets3)
//                                                            the byte lengths of up to
//                                                            GATHER_STRINGS columns in one
//                                                            launch, column c's at
//                                                            lengths[c * stride + i]: with idx,
//                                                            of the strings at idx[i] (as
//                                                            gather_string_lengths, count
//                                                            included); with flags (idx null),
//                                                            of row i's where flags[i] (a u64)
//                                                            is non-zero, else 0
//   gather_many              (idx, idx2, n, kinds, in0, out0, validity_in0, validity_out0,
//                             … in5, out5, validity_in5, validity_out5)
//                                                            up to GATHER_MANY columns in one
//                                                            launch: byte k of kinds is column
//                                                            k's value width (1, 2, 4, 8, 16),
//                                                            GATHER_BITS for a bitmap of
//                                                            values, or 0 for no column, with
//                                                            GATHER_SECOND set where the column
//                                                            is gathered at idx2 (n indices
//                                                            too: a join's other side), not
//                                                            idx; a column's output validity
//                                                            (when validity_out is not null) is
//                                                            gathered as gather_validity does
//   — scan.cu turns lengths into exclusive starts —
//   gather_string_starts_many_o32/o64 (idx, flags, n, count, lead, stride, ncols, offsets0, …
//                                      offsets3, state, capacity, epoch, starts, totals)
//                                                            the lengths of
//                                                            gather_string_lengths_many and
//                                                            their scans in one launch, with no
//                                                            lengths in memory: segment s (of
//                                                            ncols, after one of the values
//                                                            `lead` holds when not null) is
//                                                            scanned into starts[s * stride ..]
//                                                            and its total written to totals[s];
//                                                            a block per tile of SCAN_TILE rows
//                                                            of a segment, chained by the
//                                                            look-back of scan.cuh
//   gather_string_copy_many_o32/o64 (idx, n, by_source, ncols, then for each of up to
//                                    GATHER_STRINGS columns: offsets, bytes, starts,
//                                    out_offsets, out_bytes, out_cap)
//                                                            gather_string_copy of each column
//                                                            in one launch
//   gather_string_copy_o32/o64 (offsets, bytes, idx, n, starts, by_source, out_offsets,
//                               out_bytes, out_cap)
//                                                            copies the bytes and writes
//                                                            out_offsets[0..=n]: output i
//                                                            starts at starts[i], or with
//                                                            by_source at starts[idx[i]] (the
//                                                            starts of flagged rows gathered in
//                                                            row order); no byte at or past
//                                                            out_cap is written (a string that
//                                                            would cross it is cut there)
#include "scan.cuh"

#define GATHER_FIXED(NAME, T)                                                              \
    FULMEN_KERNEL NAME(const T* in, const uint32_t* idx, uint64_t n, T* out) {             \
        for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {                           \
            uint32_t j = idx[i];                                                           \
            out[i] = j == NULL_INDEX ? T{} : in[j];                                        \
        }                                                                                  \
    }

GATHER_FIXED(gather_fixed_1, uint8_t)
GATHER_FIXED(gather_fixed_2, uint16_t)
GATHER_FIXED(gather_fixed_4, uint32_t)
GATHER_FIXED(gather_fixed_8, uint64_t)
GATHER_FIXED(gather_fixed_16, Word128)


// Bits of a gathered bitmap's output byte `b` (bitmap null: every row valid; a NULL index
// gives a clear bit).
__device__ __forceinline__ uint8_t gathered_bits(const uint8_t* bits, const uint32_t* idx, uint64_t n,
                                                 uint64_t b) {
    uint8_t out = 0;
    for (unsigned k = 0; k < 8; ++k) {
        uint64_t i = b * 8 + k;
        if (i >= n) break;
        uint32_t j = idx[i];
        if (j != NULL_INDEX && bit_is_set(bits, j)) out |= (uint8_t)(1u << k);
    }
    return out;
}

FULMEN_KERNEL gather_validity(const uint8_t* in_validity, const uint32_t* idx, uint64_t n, uint8_t* out) {
    uint64_t bytes = (n + 7) / 8;
    for (uint64_t b = GRID_START; b < bytes; b += GRID_STRIDE) out[b] = gathered_bits(in_validity, idx, n, b);
}

#define GATHER_MANY 6
#define GATHER_BITS 0x80u
#define GATHER_SECOND 0x40u

template <typename T>
__device__ __forceinline__ void gather_one(const uint8_t* in, uint8_t* out, uint32_t j, uint64_t i) {
    reinterpret_cast<T*>(out)[i] = j == NULL_INDEX ? T{} : reinterpret_cast<const T*>(in)[j];
}

FULMEN_KERNEL gather_many(const uint32_t* idx, const uint32_t* idx2, uint64_t n, uint64_t kinds,
                          const uint8_t* in0, uint8_t* out0, const uint8_t* vin0, uint8_t* vout0,
                          const uint8_t* in1, uint8_t* out1, const uint8_t* vin1, uint8_t* vout1,
                          const uint8_t* in2, uint8_t* out2, const uint8_t* vin2, uint8_t* vout2,
                          const uint8_t* in3, uint8_t* out3, const uint8_t* vin3, uint8_t* vout3,
                          const uint8_t* in4, uint8_t* out4, const uint8_t* vin4, uint8_t* vout4,
                          const uint8_t* in5, uint8_t* out5, const uint8_t* vin5, uint8_t* vout5) {
    const uint8_t* ins[GATHER_MANY] = {in0, in1, in2, in3, in4, in5};
    uint8_t* outs[GATHER_MANY] = {out0, out1, out2, out3, out4, out5};
    const uint8_t* vins[GATHER_MANY] = {vin0, vin1, vin2, vin3, vin4, vin5};
    uint8_t* vouts[GATHER_MANY] = {vout0, vout1, vout2, vout3, vout4, vout5};
    // Values: one thread per row, every column.
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {
        uint32_t j = idx[i], j2 = idx2 ? idx2[i] : NULL_INDEX;
        for (unsigned c = 0; c < GATHER_MANY; ++c) {
            uint64_t kind = (kinds >> (8 * c)) & 0xFF;
            uint32_t at = kind & GATHER_SECOND ? j2 : j;
            switch (kind & ~(uint64_t)GATHER_SECOND) {
                case 1: gather_one<uint8_t>(ins[c], outs[c], at, i); break;
                case 2: gather_one<uint16_t>(ins[c], outs[c], at, i); break;
                case 4: gather_one<uint32_t>(ins[c], outs[c], at, i); break;
                case 8: gather_one<uint64_t>(ins[c], outs[c], at, i); break;
                case 16: gather_one<Word128>(ins[c], outs[c], at, i); break;
                default: break;
            }
        }
    }
    // Bitmaps (boolean values and validity): one thread per output byte, every column.
    uint64_t bytes = (n + 7) / 8;
    for (uint64_t b = GRID_START; b < bytes; b += GRID_STRIDE) {
        for (unsigned c = 0; c < GATHER_MANY; ++c) {
            uint64_t kind = (kinds >> (8 * c)) & 0xFF;
            const uint32_t* at = kind & GATHER_SECOND ? idx2 : idx;
            if ((kind & ~(uint64_t)GATHER_SECOND) == GATHER_BITS) outs[c][b] = gathered_bits(ins[c], at, n, b);
            if (vouts[c] != nullptr) vouts[c][b] = gathered_bits(vins[c], at, n, b);
        }
    }
}

#define GATHER_STRINGS 4

#define GATHER_STRINGS_OF(SUFFIX, OFF)                                                                  \
    FULMEN_KERNEL gather_string_lengths_##SUFFIX(const OFF* offsets, const uint32_t* idx, uint64_t n, \
                                                 const uint64_t* count, uint64_t* lengths) {         \
        uint64_t real = n;                                                                           \
        if (count != nullptr && *count < real) real = *count;                                        \
        for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {                                     \
            uint32_t j = i < real ? idx[i] : NULL_INDEX;                                             \
            lengths[i] = j == NULL_INDEX ? 0 : (uint64_t)(offsets[j + 1] - offsets[j]);              \
        }                                                                                            \
    }                                                                                                \
    FULMEN_KERNEL gather_string_lengths_many_##SUFFIX(                                               \
        const uint32_t* idx, const uint64_t* flags, uint64_t n, const uint64_t* count, uint64_t* lengths, \
        uint64_t stride, uint32_t ncols, const OFF* o0, const OFF* o1, const OFF* o2, const OFF* o3) {   \
        const OFF* offsets[GATHER_STRINGS] = {o0, o1, o2, o3};                                       \
        uint64_t real = n;                                                                           \
        if (count != nullptr && *count < real) real = *count;                                        \
        for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {                                     \
            uint32_t j;                                                                              \
            if (idx == nullptr) j = flags[i] == 0 ? NULL_INDEX : (uint32_t)i;                        \
            else j = i < real ? idx[i] : NULL_INDEX;                                                 \
            for (uint32_t c = 0; c < ncols && c < GATHER_STRINGS; ++c)                               \
                lengths[c * stride + i] =                                                            \
                    j == NULL_INDEX ? 0 : (uint64_t)(offsets[c][j + 1] - offsets[c][j]);             \
        }                                                                                            \
    }                                                                                                \
    FULMEN_KERNEL gather_string_copy_##SUFFIX(const OFF* offsets, const uint8_t* bytes,              \
                                              const uint32_t* idx, uint64_t n, const uint64_t* starts, \
                                              uint32_t by_source, OFF* out_offsets, uint8_t* out_bytes, \
                                              uint64_t out_cap) {                                    \
        for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {                                     \
            uint32_t j = idx[i];                                                                     \
            uint64_t start = !by_source ? starts[i] : j == NULL_INDEX ? 0 : starts[j];               \
            uint64_t len = j == NULL_INDEX ? 0 : (uint64_t)(offsets[j + 1] - offsets[j]);            \
            const uint8_t* src = j == NULL_INDEX ? bytes : bytes + offsets[j];                       \
            uint64_t end = start + len;                                                              \
            for (uint64_t k = start; k < end && k < out_cap; ++k) out_bytes[k] = src[k - start];     \
            out_offsets[i] = (OFF)start;                                                             \
            if (i == n - 1) out_offsets[n] = (OFF)end;                                               \
        }                                                                                            \
    }

GATHER_STRINGS_OF(o32, int32_t)
GATHER_STRINGS_OF(o64, int64_t)

// The one-pass form of gather_string_lengths_many followed by a scan (see the top).
template <typename OFF>
__device__ void string_starts_many(const uint32_t* idx, const uint64_t* flags, uint64_t n, const uint64_t* count,
                                   const uint64_t* lead, uint64_t stride, uint32_t ncols,
                                   const OFF* const* offsets, unsigned long long* state, uint64_t capacity,
                                   uint64_t epoch, uint64_t* starts, uint64_t* totals) {
    uint64_t per_segment = (n + SCAN_TILE - 1) / SCAN_TILE;
    uint32_t led = lead != nullptr ? 1 : 0;
    uint64_t tile = blockIdx.x;
    if (tile >= per_segment * (led + ncols)) return;
    uint64_t segment = tile / per_segment, local = tile % per_segment;
    uint64_t real = n;
    if (count != nullptr && *count < real) real = *count;
    uint64_t at = local * SCAN_TILE + (uint64_t)threadIdx.x * SCAN_ITEMS;
    uint64_t items[SCAN_ITEMS];
    uint64_t sum = 0;
    for (unsigned k = 0; k < SCAN_ITEMS; ++k) {
        uint64_t i = at + k, value = 0;
        if (i < n) {
            if (segment < led) {
                value = lead[i];
            } else {
                const OFF* o = offsets[segment - led];
                uint32_t j;
                if (idx == nullptr) j = flags[i] == 0 ? NULL_INDEX : (uint32_t)i;
                else j = i < real ? idx[i] : NULL_INDEX;
                value = j == NULL_INDEX ? 0 : (uint64_t)(o[j + 1] - o[j]);
            }
        }
        items[k] = value;
        sum += value;
    }
    uint64_t running = scan_block_lookback(sum, tile, local, per_segment, state, capacity, epoch, totals + segment);
    for (unsigned k = 0; k < SCAN_ITEMS; ++k) {
        if (at + k < n) starts[segment * stride + at + k] = running;
        running += items[k];
    }
}

#define GATHER_STRING_STARTS_MANY(SUFFIX, OFF)                                                          \
    FULMEN_KERNEL gather_string_starts_many_##SUFFIX(                                                   \
        const uint32_t* idx, const uint64_t* flags, uint64_t n, const uint64_t* count,                  \
        const uint64_t* lead, uint64_t stride, uint32_t ncols, const OFF* o0, const OFF* o1,            \
        const OFF* o2, const OFF* o3, unsigned long long* state, uint64_t capacity, uint64_t epoch,     \
        uint64_t* starts, uint64_t* totals) {                                                           \
        const OFF* offsets[GATHER_STRINGS] = {o0, o1, o2, o3};                                          \
        string_starts_many<OFF>(idx, flags, n, count, lead, stride,                                     \
                                ncols < GATHER_STRINGS ? ncols : GATHER_STRINGS, offsets, state,        \
                                capacity, epoch, starts, totals);                                       \
    }

GATHER_STRING_STARTS_MANY(o32, int32_t)
GATHER_STRING_STARTS_MANY(o64, int64_t)

// One column's copy of gather_string_copy_many: row i from source row j.
template <typename OFF>
__device__ __forceinline__ void copy_string(const OFF* offsets, const uint8_t* bytes, const uint64_t* starts,
                                            uint32_t by_source, OFF* out_offsets, uint8_t* out_bytes,
                                            uint64_t out_cap, uint32_t j, uint64_t i, uint64_t n) {
    uint64_t start = !by_source ? starts[i] : j == NULL_INDEX ? 0 : starts[j];
    uint64_t len = j == NULL_INDEX ? 0 : (uint64_t)(offsets[j + 1] - offsets[j]);
    const uint8_t* src = j == NULL_INDEX ? bytes : bytes + offsets[j];
    uint64_t end = start + len;
    for (uint64_t k = start; k < end && k < out_cap; ++k) out_bytes[k] = src[k - start];
    out_offsets[i] = (OFF)start;
    if (i == n - 1) out_offsets[n] = (OFF)end;
}

#define GATHER_STRING_COPY_MANY(SUFFIX, OFF)                                                            \
    FULMEN_KERNEL gather_string_copy_many_##SUFFIX(                                                     \
        const uint32_t* idx, uint64_t n, uint32_t by_source, uint32_t ncols,                            \
        const OFF* o0, const uint8_t* b0, const uint64_t* s0, OFF* oo0, uint8_t* ob0, uint64_t cap0,    \
        const OFF* o1, const uint8_t* b1, const uint64_t* s1, OFF* oo1, uint8_t* ob1, uint64_t cap1,    \
        const OFF* o2, const uint8_t* b2, const uint64_t* s2, OFF* oo2, uint8_t* ob2, uint64_t cap2,    \
        const OFF* o3, const uint8_t* b3, const uint64_t* s3, OFF* oo3, uint8_t* ob3, uint64_t cap3) {  \
        const OFF* offsets[GATHER_STRINGS] = {o0, o1, o2, o3};                                          \
        const uint8_t* bytes[GATHER_STRINGS] = {b0, b1, b2, b3};                                        \
        const uint64_t* starts[GATHER_STRINGS] = {s0, s1, s2, s3};                                      \
        OFF* out_offsets[GATHER_STRINGS] = {oo0, oo1, oo2, oo3};                                        \
        uint8_t* out_bytes[GATHER_STRINGS] = {ob0, ob1, ob2, ob3};                                      \
        const uint64_t caps[GATHER_STRINGS] = {cap0, cap1, cap2, cap3};                                 \
        for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {                                        \
            uint32_t j = idx[i];                                                                        \
            for (uint32_t c = 0; c < ncols && c < GATHER_STRINGS; ++c)                                  \
                copy_string<OFF>(offsets[c], bytes[c], starts[c], by_source, out_offsets[c],            \
                                 out_bytes[c], caps[c], j, i, n);                                       \
        }                                                                                               \
    }

GATHER_STRING_COPY_MANY(o32, int32_t)
GATHER_STRING_COPY_MANY(o64, int64_t)

#if defined(FULMEN_EMULATOR)
FULMEN_EMU_EXPORT(gather_fixed_1)
FULMEN_EMU_EXPORT(gather_fixed_2)
FULMEN_EMU_EXPORT(gather_fixed_4)
FULMEN_EMU_EXPORT(gather_fixed_8)
FULMEN_EMU_EXPORT(gather_fixed_16)
FULMEN_EMU_EXPORT(gather_validity)
FULMEN_EMU_EXPORT(gather_many)
FULMEN_EMU_EXPORT(gather_string_lengths_o32)
FULMEN_EMU_EXPORT(gather_string_lengths_o64)
FULMEN_EMU_EXPORT(gather_string_lengths_many_o32)
FULMEN_EMU_EXPORT(gather_string_lengths_many_o64)
FULMEN_EMU_EXPORT(gather_string_starts_many_o32)
FULMEN_EMU_EXPORT(gather_string_starts_many_o64)
FULMEN_EMU_EXPORT(gather_string_copy_many_o32)
FULMEN_EMU_EXPORT(gather_string_copy_many_o64)
FULMEN_EMU_EXPORT(gather_string_copy_o32)
FULMEN_EMU_EXPORT(gather_string_copy_o64)
#endif
