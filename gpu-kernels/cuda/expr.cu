// Expression programs: compiled SQL expressions evaluated per row, in registers, in one
// fused pass (no intermediate column per expression node).
//
//   expr_eval(code, code_len, consts, strings, cols, outs, n, error)
//     code     code_len instructions of two int64 words: {opcode | aux << 8, arg}
//     consts   three int64 words per constant: lo, hi, valid
//     strings  the bytes of string constants (a constant's lo = offset, hi = length)
//     cols     three uint64 words per input column: values, validity (0: no NULLs),
//              offsets (strings: int32 offsets for STR32 loads, int64 for STR64);
//              decimals of precision <= 18 are 8-byte values (LOAD_DEC64), others 16
//              (LOAD_DEC); in registers every decimal is 128 bits
//     outs     the number of outputs, then three uint64 words per output: values,
//              validity, kind (OutKind)
//     n        rows
//     error    set to 1 when a row meets a case the program leaves to the CPU: integer or
//              decimal overflow, division by zero, a cast out of range, a negative substring
//              length. The outputs are then unspecified and the host redoes the batch on
//              the CPU, which gives DataFusion's exact answer or error.
//
// The program is a stack machine run by every thread on its own row. Every operand is
// evaluated (no short-circuit), so a row errs here whenever any branch could err; the
// host's CPU rerun decides. Validity and boolean outputs are Arrow bitmaps written one
// 32-bit word per warp (__ballot_sync), so those buffers hold ceil(n/32) words; a warp's
// lanes stay in step because rows are taken warp by warp. The host (ops/expr.rs) checks
// the program before launch: stack depth, column, constant and output indices, and that
// each column's layout matches the load that reads it.
#include "expr.cuh"

FULMEN_KERNEL expr_eval(const int64_t* code, uint64_t code_len, const int64_t* consts, const uint8_t* strings,
                        const uint64_t* cols, const uint64_t* outs, uint64_t n, uint32_t* error) {
    const ExprProgram prog = {code, code_len, consts, strings, cols, outs};
    const unsigned lane = threadIdx.x & 31;
    const uint64_t first = GRID_START - lane;
    for (uint64_t base = first; base < n; base += GRID_STRIDE) {
        const uint64_t row = base + lane;
        uint64_t valid_bits = 0;  // bit k: output k is valid in this row
        uint64_t true_bits = 0;   // bit k: boolean output k is true in this row
        bool failed = false;
        if (row < n) expr_row(prog, row, nullptr, valid_bits, true_bits, failed);
        if (failed) *error = 1;
        // Bitmaps: one 32-bit word per warp and output, every lane taking part.
        const uint64_t outputs = outs[0];
        for (uint64_t k = 0; k < outputs; ++k) {
            const uint64_t* out = outs + 1 + 3 * k;
            uint32_t valid_word = __ballot_sync(0xFFFFFFFFu, (uint32_t)((valid_bits >> k) & 1));
            uint32_t true_word = __ballot_sync(0xFFFFFFFFu, (uint32_t)((true_bits >> k) & 1));
            if (lane == 0) {
                ((uint32_t*)out[1])[base / 32] = valid_word;
                if (out[2] == O_BOOL) ((uint32_t*)out[0])[base / 32] = true_word;
            }
        }
    }
}

#if defined(FULMEN_EMULATOR)
FULMEN_EMU_EXPORT(expr_eval)
#endif
