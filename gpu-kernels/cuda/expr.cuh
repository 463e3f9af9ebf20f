// Expression programs (expr.cu states the kernel's contract): the stack machine that
// evaluates a compiled SQL expression program on one row, in registers. expr.cu's kernel
// writes the outputs to memory; a fused kernel (fused.cu) keeps them in registers and feeds
// them straight to what consumes them.
#pragma once
#include "fulmen.cuh"


#define EXPR_STACK 32
#define EXPR_MAX_OUTPUTS 64

enum ExprOp {
    OP_LOAD_I8 = 1, OP_LOAD_I16, OP_LOAD_I32, OP_LOAD_I64, OP_LOAD_U8, OP_LOAD_U16, OP_LOAD_U32,
    OP_LOAD_F32, OP_LOAD_F64, OP_LOAD_BOOL, OP_LOAD_DEC, OP_LOAD_DEC64, OP_LOAD_STR32, OP_LOAD_STR64,
    OP_CONST, OP_STR_CONST, OP_NULL,
    OP_ADD_I, OP_SUB_I, OP_MUL_I, OP_DIV_I, OP_MOD_I, OP_NEG_I,
    OP_ADD_F, OP_SUB_F, OP_MUL_F, OP_DIV_F, OP_MOD_F, OP_NEG_F,
    OP_ADD_D, OP_SUB_D, OP_MUL_D, OP_NEG_D, OP_DIV_D, OP_MOD_D,
    OP_CMP_I, OP_CMP_F, OP_CMP_D, OP_CMP_S,
    OP_AND, OP_OR, OP_NOT, OP_IS_NULL, OP_IS_NOT_NULL, OP_SELECT,
    OP_CAST_I_I, OP_CAST_I_F, OP_CAST_F_I, OP_CAST_F_F, OP_CAST_I_D, OP_CAST_D_D, OP_CAST_D_F, OP_CAST_F_D,
    OP_CAST_DATE_TS, OP_CAST_TS_DATE, OP_CAST_TS_TS,
    OP_STR_PREFIX, OP_STR_SUFFIX, OP_STR_CONTAINS, OP_STR_LIKE, OP_SUBSTR,
    OP_DATE_PART, OP_DATE_TRUNC,
    OP_OUT,
    OP_LOAD_DICT,
};

// Integer kinds (aux of integer ops and casts): the range a result must fit.
enum IntKind { K_I8 = 0, K_I16, K_I32, K_I64, K_U8, K_U16, K_U32 };
// Output kinds.
// O_DEC: 16 bytes; O_DEC64: a decimal of precision <= 18, held in 8 bytes (it fits: the
// op that made the value checked its precision).
enum OutKind { O_I8 = 0, O_I16, O_I32, O_I64, O_U8, O_U16, O_U32, O_F32, O_F64, O_BOOL, O_DEC, O_DEC64 };
// Comparisons (aux of OP_CMP_*); CMP_NULL_SAFE makes EQ "IS NOT DISTINCT FROM" and NE
// "IS DISTINCT FROM".
enum Cmp { CMP_EQ = 0, CMP_NE, CMP_LT, CMP_LE, CMP_GT, CMP_GE };
#define CMP_NULL_SAFE 8
enum DatePart { P_YEAR = 0, P_QUARTER, P_MONTH, P_DAY, P_HOUR, P_MINUTE, P_SECOND, P_DOY, P_DOW };
enum Trunc { T_YEAR = 0, T_QUARTER, T_MONTH, T_WEEK, T_DAY, T_HOUR, T_MINUTE, T_SECOND };

typedef __int128 i128;

struct Val {
    union {
        int64_t i;
        double f;
        const uint8_t* p;
    } a;
    int64_t b;  // decimal: high word; string: length
    bool valid;
};

__device__ __forceinline__ i128 dec_of(const Val& v) {
    return (i128)(((unsigned __int128)(uint64_t)v.b << 64) | (uint64_t)v.a.i);
}
__device__ __forceinline__ void set_dec(Val& v, i128 x) {
    v.a.i = (int64_t)(uint64_t)x;
    v.b = (int64_t)(x >> 64);
}

__device__ __forceinline__ bool int_fits(int kind, int64_t v) {
    switch (kind) {
        case K_I8: return v >= -128 && v <= 127;
        case K_I16: return v >= -32768 && v <= 32767;
        case K_I32: return v >= -2147483648LL && v <= 2147483647LL;
        case K_I64: return true;
        case K_U8: return v >= 0 && v <= 255;
        case K_U16: return v >= 0 && v <= 65535;
        default: return v >= 0 && v <= 4294967295LL;
    }
}

// Powers of ten from a table: 10^0 .. 10^19 fit 64 bits, and 10^k for k up to 38 is one
// 128-bit product of two of them. k outside 0..=38 is never asked for (the compiler keeps
// precisions and scales within 38); it gives 0 here rather than reading past the table.
__constant__ uint64_t POW10_U64[20] = {
    1ull, 10ull, 100ull, 1000ull, 10000ull, 100000ull, 1000000ull, 10000000ull, 100000000ull, 1000000000ull,
    10000000000ull, 100000000000ull, 1000000000000ull, 10000000000000ull, 100000000000000ull,
    1000000000000000ull, 10000000000000000ull, 100000000000000000ull, 1000000000000000000ull,
    10000000000000000000ull,
};

__device__ __forceinline__ i128 pow10_i128(int64_t k) {
    if (k < 0 || k > 38) return 0;
    if (k <= 19) return (i128)POW10_U64[k];
    return (i128)POW10_U64[k - 19] * (i128)POW10_U64[19];
}

// Significant bits of |x| (0 for 0), from the leading zeros of its two halves.
__device__ __forceinline__ int bits_u128(unsigned __int128 x) {
    uint64_t hi = (uint64_t)(x >> 64), lo = (uint64_t)x;
    return hi ? 128 - __clzll((long long)hi) : (lo ? 64 - __clzll((long long)lo) : 0);
}

// Whether |x| < 10^precision.
__device__ __forceinline__ bool dec_fits(i128 x, int64_t precision) {
    i128 bound = pow10_i128(precision);
    return x < bound && x > -bound;
}

// DataFusion's float order as an integer key: Rust's f64::total_cmp (-NaN < -inf < … <
// inf < NaN) after -0.0 is made +0.0, as DataFusion normalises zeros before comparing.
__device__ __forceinline__ int64_t total_key(double f) {
    union {
        double f;
        int64_t i;
    } u;
    u.f = f == 0.0 ? 0.0 : f;
    int64_t k = u.i;
    return k ^ (int64_t)(((uint64_t)(k >> 63)) >> 1);
}

__device__ __forceinline__ int64_t floor_div(int64_t a, int64_t b) {
    if (b == 0) return 0;  // never asked for (the host checks divisors); never a trap
    int64_t q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
    return q;
}

// Days since 1970-01-01 → civil year, month (1-12), day (1-31) (proleptic Gregorian).
__device__ __forceinline__ void civil_from_days(int64_t z, int64_t& y, int64_t& m, int64_t& d) {
    z += 719468;
    int64_t era = floor_div(z, 146097);
    int64_t doe = z - era * 146097;
    int64_t yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    y = yoe + era * 400;
    int64_t doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    int64_t mp = (5 * doy + 2) / 153;
    d = doy - (153 * mp + 2) / 5 + 1;
    m = mp < 10 ? mp + 3 : mp - 9;
    if (m <= 2) ++y;
}

__device__ __forceinline__ int64_t days_from_civil(int64_t y, int64_t m, int64_t d) {
    if (m <= 2) --y;
    int64_t era = floor_div(y, 400);
    int64_t yoe = y - era * 400;
    int64_t mp = m > 2 ? m - 3 : m + 9;
    int64_t doy = (153 * mp + 2) / 5 + d - 1;
    int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}

__device__ __forceinline__ int compare_bytes(const uint8_t* x, int64_t xl, const uint8_t* y, int64_t yl) {
    int64_t m = xl < yl ? xl : yl;
    for (int64_t i = 0; i < m; ++i) {
        if (x[i] != y[i]) return x[i] < y[i] ? -1 : 1;
    }
    return xl < yl ? -1 : (xl > yl ? 1 : 0);
}

__device__ __forceinline__ bool cmp_result(int kind, int c) {
    switch (kind & 7) {
        case CMP_EQ: return c == 0;
        case CMP_NE: return c != 0;
        case CMP_LT: return c < 0;
        case CMP_LE: return c <= 0;
        case CMP_GT: return c > 0;
        default: return c >= 0;
    }
}

// Whether `s` matches a LIKE pattern whose only wildcard is '%' (no '_', no escapes):
// the pieces between '%'s must appear in order, the first at the start unless the pattern
// starts with '%', the last at the end unless it ends with '%'. Leftmost matching of each
// middle piece is enough for patterns of '%' alone.
__device__ __forceinline__ bool like_percent(const uint8_t* s, int64_t n, const uint8_t* p, int64_t m) {
    int64_t pos = 0;  // first byte of s not yet consumed
    int64_t i = 0;    // start of the current piece in p
    bool anchored = true;
    while (true) {
        int64_t j = i;
        while (j < m && p[j] != '%') ++j;
        const int64_t len = j - i;
        const bool last = j == m;
        if (anchored && last) {
            return len == n - pos && compare_bytes(s + pos, len, p + i, len) == 0;
        }
        if (last) {
            return len <= n - pos && compare_bytes(s + n - len, len, p + i, len) == 0;
        }
        if (anchored) {
            if (len > n - pos || compare_bytes(s + pos, len, p + i, len) != 0) return false;
            pos += len;
        } else if (len > 0) {
            int64_t at = pos;
            while (at + len <= n && compare_bytes(s + at, len, p + i, len) != 0) ++at;
            if (at + len > n) return false;
            pos = at + len;
        }
        anchored = false;
        i = j + 1;
    }
}

// Byte offset of character `chars` (0-based) of a UTF-8 string, or its length.
__device__ __forceinline__ int64_t utf8_offset(const uint8_t* s, int64_t len, int64_t chars) {
    int64_t seen = 0;
    for (int64_t i = 0; i < len; ++i) {
        if ((s[i] & 0xC0) != 0x80) {
            if (seen == chars) return i;
            ++seen;
        }
    }
    return len;
}

__device__ __forceinline__ void load_string(Val& v, const uint64_t* col, uint64_t row, bool wide) {
    const uint8_t* bytes = (const uint8_t*)col[0];
    int64_t start, end;
    if (wide) {
        const int64_t* off = (const int64_t*)col[2];
        start = off[row];
        end = off[row + 1];
    } else {
        const int32_t* off = (const int32_t*)col[2];
        start = off[row];
        end = off[row + 1];
    }
    v.a.p = bytes + start;
    v.b = end - start;
}

// A program and the tables it reads, as expr_eval takes them.
struct ExprProgram {
    const int64_t* code;
    uint64_t code_len;
    const int64_t* consts;
    const uint8_t* strings;
    const uint64_t* cols;
    const uint64_t* outs;  // null for a program whose outputs stay in registers
};

// Runs `prog` on `row`. OUT k writes output k to the program's output memory (fixed-width
// values; bit k of valid_bits and true_bits for the warp's bitmaps), or, when `regs` is not
// null, to regs[k] and nowhere else. `failed` is set when the row meets a case the program
// leaves to the CPU.
__device__ __forceinline__ void expr_row(const ExprProgram& prog, uint64_t row, Val* regs, uint64_t& valid_bits,
                                         uint64_t& true_bits, bool& failed) {
    Val st[EXPR_STACK];
    int sp = 0;
    for (uint64_t pc = 0; pc < prog.code_len; ++pc) {
        const int64_t word = prog.code[2 * pc];
        const int op = (int)(word & 0xFF);
        const int64_t aux = word >> 8;
        const int64_t arg = prog.code[2 * pc + 1];
        switch (op) {
            case OP_LOAD_I8: case OP_LOAD_I16: case OP_LOAD_I32: case OP_LOAD_I64:
            case OP_LOAD_U8: case OP_LOAD_U16: case OP_LOAD_U32: case OP_LOAD_F32:
            case OP_LOAD_F64: case OP_LOAD_BOOL: case OP_LOAD_DEC: case OP_LOAD_DEC64: case OP_LOAD_STR32:
            case OP_LOAD_STR64: {
                const uint64_t* col = prog.cols + 3 * arg;
                Val& v = st[sp++];
                v.valid = bit_is_set((const uint8_t*)col[1], row);
                v.b = 0;
                const void* data = (const void*)col[0];
                switch (op) {
                    case OP_LOAD_I8: v.a.i = ((const int8_t*)data)[row]; break;
                    case OP_LOAD_I16: v.a.i = ((const int16_t*)data)[row]; break;
                    case OP_LOAD_I32: v.a.i = ((const int32_t*)data)[row]; break;
                    case OP_LOAD_I64: v.a.i = ((const int64_t*)data)[row]; break;
                    case OP_LOAD_U8: v.a.i = ((const uint8_t*)data)[row]; break;
                    case OP_LOAD_U16: v.a.i = ((const uint16_t*)data)[row]; break;
                    case OP_LOAD_U32: v.a.i = ((const uint32_t*)data)[row]; break;
                    case OP_LOAD_F32: v.a.f = (double)((const float*)data)[row]; break;
                    case OP_LOAD_F64: v.a.f = ((const double*)data)[row]; break;
                    case OP_LOAD_BOOL: v.a.i = bit_is_set((const uint8_t*)data, row) ? 1 : 0; break;
                    case OP_LOAD_DEC: {
                        const Word128 w = ((const Word128*)data)[row];
                        v.a.i = (int64_t)w.lo;
                        v.b = (int64_t)w.hi;
                        break;
                    }
                    case OP_LOAD_DEC64:
                        v.a.i = ((const int64_t*)data)[row];
                        v.b = v.a.i < 0 ? -1 : 0;
                        break;
                    case OP_LOAD_STR32: load_string(v, col, row, false); break;
                    default: load_string(v, col, row, true); break;
                }
                break;
            }
            case OP_LOAD_DICT: {
                // col: codes, validity, the dictionary's header (its offsets and bytes).
                const uint64_t* col = prog.cols + 3 * arg;
                const uint64_t* dict = (const uint64_t*)col[2];
                const int32_t* off = (const int32_t*)dict[0];
                const uint32_t code = ((const uint32_t*)col[0])[row];
                Val& v = st[sp++];
                v.valid = bit_is_set((const uint8_t*)col[1], row);
                v.a.p = (const uint8_t*)dict[1] + off[code];
                v.b = off[code + 1] - off[code];
                break;
            }
            case OP_CONST: {
                Val& v = st[sp++];
                v.a.i = prog.consts[3 * arg];
                v.b = prog.consts[3 * arg + 1];
                v.valid = prog.consts[3 * arg + 2] != 0;
                break;
            }
            case OP_STR_CONST: {
                Val& v = st[sp++];
                v.a.p = prog.strings + prog.consts[3 * arg];
                v.b = prog.consts[3 * arg + 1];
                v.valid = prog.consts[3 * arg + 2] != 0;
                break;
            }
            case OP_NULL: {
                Val& v = st[sp++];
                v.a.i = 0;
                v.b = 0;
                v.valid = false;
                break;
            }
            case OP_ADD_I: case OP_SUB_I: case OP_MUL_I: case OP_DIV_I: case OP_MOD_I: {
                Val y = st[--sp];
                Val& x = st[sp - 1];
                x.valid = x.valid && y.valid;
                if (!x.valid) {
                    x.a.i = 0;
                    break;
                }
                int64_t l = x.a.i, r = y.a.i, out = 0;
                bool bad = false;
                if (op == OP_ADD_I) {
                    out = (int64_t)((uint64_t)l + (uint64_t)r);
                    bad = ((l ^ out) & (r ^ out)) < 0;
                } else if (op == OP_SUB_I) {
                    out = (int64_t)((uint64_t)l - (uint64_t)r);
                    bad = ((l ^ r) & (l ^ out)) < 0;
                } else if (op == OP_MUL_I) {
                    i128 p = (i128)l * (i128)r;
                    out = (int64_t)p;
                    bad = (i128)out != p;
                } else {
                    bad = r == 0 || (l == (int64_t)0x8000000000000000ULL && r == -1);
                    if (!bad) out = op == OP_DIV_I ? l / r : l % r;
                }
                if (bad || !int_fits((int)aux, out)) failed = true;
                x.a.i = out;
                break;
            }
            case OP_NEG_I: {
                Val& x = st[sp - 1];
                if (x.valid) {
                    if (x.a.i == (int64_t)0x8000000000000000ULL || !int_fits((int)aux, -x.a.i)) failed = true;
                    else x.a.i = -x.a.i;
                }
                break;
            }
            case OP_ADD_F: case OP_SUB_F: case OP_MUL_F: case OP_DIV_F: case OP_MOD_F: {
                Val y = st[--sp];
                Val& x = st[sp - 1];
                x.valid = x.valid && y.valid;
                double l = x.a.f, r = y.a.f, out;
                switch (op) {
                    case OP_ADD_F: out = l + r; break;
                    case OP_SUB_F: out = l - r; break;
                    case OP_MUL_F: out = l * r; break;
                    case OP_DIV_F: out = l / r; break;
                    default: out = fmod(l, r); break;
                }
                if (aux == 1) out = (double)(float)out;
                x.a.f = x.valid ? out : 0.0;
                break;
            }
            case OP_NEG_F: {
                Val& x = st[sp - 1];
                x.a.f = -x.a.f;
                break;
            }
            case OP_ADD_D: case OP_SUB_D: case OP_MUL_D: {
                Val y = st[--sp];
                Val& x = st[sp - 1];
                x.valid = x.valid && y.valid;
                if (!x.valid) {
                    set_dec(x, 0);
                    break;
                }
                i128 l = dec_of(x), r = dec_of(y), out = 0;
                // Operands are below 10^38 < 2^127 in magnitude, so sums and
                // differences cannot overflow i128; products are checked by size.
                if (op == OP_ADD_D) {
                    out = l + r;
                } else if (op == OP_SUB_D) {
                    out = l - r;
                } else {
                    unsigned __int128 al = l < 0 ? (unsigned __int128)(-l) : (unsigned __int128)l;
                    unsigned __int128 ar = r < 0 ? (unsigned __int128)(-r) : (unsigned __int128)r;
                    // |l| < 2^a and |r| < 2^b make |l × r| < 2^(a + b): at most 126 bits
                    // leaves the product below 2^126, far inside i128.
                    if (bits_u128(al) + bits_u128(ar) > 126) failed = true;
                    else out = l * r;
                }
                if (!dec_fits(out, aux)) failed = true;
                set_dec(x, out);
                break;
            }
            case OP_DIV_D: case OP_MOD_D: {
                // Operands already scaled by the compiler (arrow's rule: the
                // dividend times 10^(s1 + 4 - s1 + s2), or both to max(s1, s2) for %);
                // truncating, as i128 division in Rust.
                Val y = st[--sp];
                Val& x = st[sp - 1];
                x.valid = x.valid && y.valid;
                if (!x.valid) {
                    set_dec(x, 0);
                    break;
                }
                i128 l = dec_of(x), r = dec_of(y);
                if (r == 0) {
                    failed = true;
                    set_dec(x, 0);
                    break;
                }
                i128 out = op == OP_DIV_D ? l / r : l % r;
                if (!dec_fits(out, aux)) failed = true;
                set_dec(x, out);
                break;
            }
            case OP_NEG_D: {
                Val& x = st[sp - 1];
                set_dec(x, -dec_of(x));
                break;
            }
            case OP_CMP_I: case OP_CMP_F: case OP_CMP_D: case OP_CMP_S: {
                Val y = st[--sp];
                Val& x = st[sp - 1];
                int c = 0;
                if (x.valid && y.valid) {
                    if (op == OP_CMP_I) {
                        c = x.a.i < y.a.i ? -1 : (x.a.i > y.a.i ? 1 : 0);
                    } else if (op == OP_CMP_F) {
                        int64_t kx = total_key(x.a.f), ky = total_key(y.a.f);
                        c = kx < ky ? -1 : (kx > ky ? 1 : 0);
                    } else if (op == OP_CMP_D) {
                        i128 dx = dec_of(x), dy = dec_of(y);
                        c = dx < dy ? -1 : (dx > dy ? 1 : 0);
                    } else {
                        c = compare_bytes(x.a.p, x.b, y.a.p, y.b);
                    }
                }
                bool result;
                bool valid = x.valid && y.valid;
                if (aux & CMP_NULL_SAFE) {
                    bool same = valid ? c == 0 : (x.valid == y.valid);
                    result = (aux & 7) == CMP_EQ ? same : !same;
                    valid = true;
                } else {
                    result = valid && cmp_result((int)aux, c);
                }
                x.a.i = result ? 1 : 0;
                x.b = 0;
                x.valid = valid;
                break;
            }
            case OP_AND: case OP_OR: {
                Val y = st[--sp];
                Val& x = st[sp - 1];
                // Kleene logic: a definite false (AND) or true (OR) decides.
                const int64_t decisive = op == OP_AND ? 0 : 1;
                if ((x.valid && x.a.i == decisive) || (y.valid && y.a.i == decisive)) {
                    x.a.i = decisive;
                    x.valid = true;
                } else if (x.valid && y.valid) {
                    x.a.i = 1 - decisive;
                } else {
                    x.a.i = 0;
                    x.valid = false;
                }
                break;
            }
            case OP_NOT: {
                Val& x = st[sp - 1];
                x.a.i = x.valid ? 1 - x.a.i : 0;
                break;
            }
            case OP_IS_NULL: case OP_IS_NOT_NULL: {
                Val& x = st[sp - 1];
                x.a.i = (op == OP_IS_NULL) != x.valid ? 1 : 0;
                x.b = 0;
                x.valid = true;
                break;
            }
            case OP_SELECT: {
                // Stack: otherwise, cond, then (CASE compiles its last branch
                // first, so the stack stays shallow however many branches).
                Val then = st[--sp];
                Val cond = st[--sp];
                if (cond.valid && cond.a.i != 0) st[sp - 1] = then;
                break;
            }
            case OP_CAST_I_I: {
                Val& x = st[sp - 1];
                if (x.valid && !int_fits((int)aux, x.a.i)) failed = true;
                break;
            }
            case OP_CAST_I_F: {
                Val& x = st[sp - 1];
                double f = (double)x.a.i;
                if (aux == 1) f = (double)(float)x.a.i;
                x.a.f = f;
                break;
            }
            case OP_CAST_F_I: {
                Val& x = st[sp - 1];
                if (!x.valid) break;
                double f = x.a.f;
                double lo, hi;  // the open interval of values whose truncation fits
                switch ((int)aux) {
                    case K_I8: lo = -129.0; hi = 128.0; break;
                    case K_I16: lo = -32769.0; hi = 32768.0; break;
                    case K_I32: lo = -2147483649.0; hi = 2147483648.0; break;
                    case K_U8: lo = -1.0; hi = 256.0; break;
                    case K_U16: lo = -1.0; hi = 65536.0; break;
                    case K_U32: lo = -1.0; hi = 4294967296.0; break;
                    default: lo = -9223372036854777856.0; hi = 9223372036854775808.0; break;
                }
                if (!(f > lo && f < hi)) {
                    failed = true;  // also NaN
                    x.a.i = 0;
                } else {
                    x.a.i = (int64_t)f;
                }
                break;
            }
            case OP_CAST_F_F: {
                Val& x = st[sp - 1];
                x.a.f = (double)(float)x.a.f;
                break;
            }
            case OP_CAST_I_D: case OP_CAST_D_D: {
                Val& x = st[sp - 1];
                if (!x.valid) {
                    set_dec(x, 0);
                    break;
                }
                i128 v = op == OP_CAST_I_D ? (i128)x.a.i : dec_of(x);
                // arg ≤ 38 and |v| < 10^38 (or 2^63): check the product's size first.
                i128 scale = pow10_i128(arg);
                i128 limit = pow10_i128(38 - (arg > 38 ? 38 : arg));
                if (arg > 38 || v >= limit || v <= -limit) {
                    failed = true;
                    set_dec(x, 0);
                    break;
                }
                i128 out = v * scale;
                if (!dec_fits(out, aux)) failed = true;
                set_dec(x, out);
                break;
            }
            case OP_CAST_D_F: {
                Val& x = st[sp - 1];
                double f = (double)dec_of(x) / (double)pow10_i128(arg);
                if (aux == 1) f = (double)(float)f;
                x.a.f = f;
                x.b = 0;
                break;
            }
            case OP_CAST_F_D: {
                // arrow: (10^scale * v).round() as i128, then the precision check;
                // 10^scale is exact for the scales the compiler allows (≤ 22).
                Val& x = st[sp - 1];
                if (!x.valid) {
                    set_dec(x, 0);
                    break;
                }
                const double mul = (double)pow10_i128(arg);  // exact: 5^22 < 2^53
                double r = round(mul * x.a.f);
                if (!(r > -1e38 && r < 1e38)) {
                    failed = true;  // also NaN and infinities
                    set_dec(x, 0);
                    break;
                }
                i128 out = (i128)r;
                if (!dec_fits(out, aux)) failed = true;
                set_dec(x, out);
                break;
            }
            case OP_CAST_DATE_TS: {
                Val& x = st[sp - 1];
                if (!x.valid) break;
                i128 t = (i128)x.a.i * (i128)arg;
                if (t != (i128)(int64_t)t) failed = true;
                x.a.i = (int64_t)t;
                break;
            }
            case OP_CAST_TS_DATE: {
                Val& x = st[sp - 1];
                if (!x.valid) break;
                x.a.i = floor_div(x.a.i, arg);
                if (!int_fits(K_I32, x.a.i)) failed = true;
                break;
            }
            case OP_CAST_TS_TS: {
                // arg > 0: multiply (to a finer unit); arg < 0: divide (coarser).
                Val& x = st[sp - 1];
                if (!x.valid) break;
                if (arg > 0) {
                    i128 t = (i128)x.a.i * (i128)arg;
                    if (t != (i128)(int64_t)t) failed = true;
                    x.a.i = (int64_t)t;
                } else {
                    x.a.i = floor_div(x.a.i, -arg);
                }
                break;
            }
            case OP_STR_PREFIX: case OP_STR_SUFFIX: case OP_STR_CONTAINS: {
                Val pat = st[--sp];
                Val& s = st[sp - 1];
                bool valid = s.valid && pat.valid;
                bool found = false;
                if (valid && pat.b <= s.b) {
                    if (op == OP_STR_PREFIX) {
                        found = compare_bytes(s.a.p, pat.b, pat.a.p, pat.b) == 0;
                    } else if (op == OP_STR_SUFFIX) {
                        found = compare_bytes(s.a.p + (s.b - pat.b), pat.b, pat.a.p, pat.b) == 0;
                    } else {
                        for (int64_t at = 0; at + pat.b <= s.b && !found; ++at) {
                            found = compare_bytes(s.a.p + at, pat.b, pat.a.p, pat.b) == 0;
                        }
                    }
                }
                s.a.i = found ? 1 : 0;
                s.b = 0;
                s.valid = valid;
                break;
            }
            case OP_STR_LIKE: {
                Val pat = st[--sp];
                Val& s = st[sp - 1];
                bool valid = s.valid && pat.valid;
                bool found = valid && like_percent(s.a.p, s.b, pat.a.p, pat.b);
                s.a.i = found ? 1 : 0;
                s.b = 0;
                s.valid = valid;
                break;
            }
            case OP_SUBSTR: {
                // aux 3: (string, start, count); aux 2: (string, start). Characters,
                // 1-based, as PostgreSQL: positions before 1 use up the count.
                Val count;
                count.valid = true;
                count.a.i = 0;
                if (aux == 3) count = st[--sp];
                Val start = st[--sp];
                Val& s = st[sp - 1];
                s.valid = s.valid && start.valid && count.valid;
                if (!s.valid) {
                    s.b = 0;
                    break;
                }
                int64_t from = start.a.i;
                int64_t to;  // exclusive, 1-based
                if (aux == 3) {
                    if (count.a.i < 0) {
                        failed = true;
                        break;
                    }
                    i128 end = (i128)from + (i128)count.a.i;
                    if (end != (i128)(int64_t)end) {
                        failed = true;
                        break;
                    }
                    to = (int64_t)end;
                } else {
                    to = (int64_t)0x7FFFFFFFFFFFFFFFLL;
                }
                if (from < 1) from = 1;
                if (to <= from) {
                    s.b = 0;
                    break;
                }
                int64_t begin = utf8_offset(s.a.p, s.b, from - 1);
                int64_t stop = (to - 1 >= s.b + 1) ? s.b : utf8_offset(s.a.p, s.b, to - 1);
                s.a.p = s.a.p + begin;
                s.b = stop - begin;
                break;
            }
            case OP_DATE_PART: {
                // arg: units per second of a timestamp, or 0 for date32 (days).
                Val& x = st[sp - 1];
                if (!x.valid) break;
                int64_t days, sod = 0;
                if (arg == 0) {
                    days = x.a.i;
                } else {
                    // Beyond the nanosecond range, leave it to DataFusion.
                    i128 ns = (i128)x.a.i * (i128)(1000000000 / arg);
                    if (ns != (i128)(int64_t)ns) failed = true;
                    int64_t secs = floor_div(x.a.i, arg);
                    days = floor_div(secs, 86400);
                    sod = secs - days * 86400;
                }
                int64_t y, m, d;
                civil_from_days(days, y, m, d);
                int64_t out;
                switch ((int)aux) {
                    case P_YEAR: out = y; break;
                    case P_QUARTER: out = (m - 1) / 3 + 1; break;
                    case P_MONTH: out = m; break;
                    case P_DAY: out = d; break;
                    case P_HOUR: out = sod / 3600; break;
                    case P_MINUTE: out = (sod / 60) % 60; break;
                    case P_SECOND: out = sod % 60; break;
                    case P_DOY: out = days - days_from_civil(y, 1, 1) + 1; break;
                    default: out = days + 4 - floor_div(days + 4, 7) * 7; break;  // Sunday 0
                }
                x.a.i = out;
                break;
            }
            case OP_DATE_TRUNC: {
                // arg: units per second of the timestamp. DataFusion truncates in
                // nanoseconds: a timestamp beyond their range is its error to give.
                Val& x = st[sp - 1];
                if (!x.valid) break;
                i128 ns = (i128)x.a.i * (i128)(1000000000 / arg);
                if (ns != (i128)(int64_t)ns) failed = true;
                int64_t secs = floor_div(x.a.i, arg);
                int64_t days = floor_div(secs, 86400);
                int64_t out_secs;
                switch ((int)aux) {
                    case T_SECOND: out_secs = secs; break;
                    case T_MINUTE: out_secs = floor_div(secs, 60) * 60; break;
                    case T_HOUR: out_secs = floor_div(secs, 3600) * 3600; break;
                    case T_DAY: out_secs = days * 86400; break;
                    case T_WEEK: {
                        int64_t monday0 = (days + 3) % 7;
                        if (monday0 < 0) monday0 += 7;
                        out_secs = (days - monday0) * 86400;
                        break;
                    }
                    default: {
                        int64_t y, m, d;
                        civil_from_days(days, y, m, d);
                        if ((int)aux == T_YEAR) m = 1;
                        else if ((int)aux == T_QUARTER) m = (m - 1) / 3 * 3 + 1;
                        out_secs = days_from_civil(y, m, 1) * 86400;
                        break;
                    }
                }
                i128 t = (i128)out_secs * (i128)arg;
                if (t != (i128)(int64_t)t) failed = true;
                x.a.i = (int64_t)t;
                break;
            }
            case OP_OUT: {
                Val v = st[--sp];
                if (regs) {
                    regs[aux] = v;
                    break;
                }
                const uint64_t* out = prog.outs + 1 + 3 * aux;
                void* data = (void*)out[0];
                if (v.valid) valid_bits |= 1ULL << aux;
                switch ((int)out[2]) {
                    case O_I8: ((int8_t*)data)[row] = v.valid ? (int8_t)v.a.i : 0; break;
                    case O_I16: ((int16_t*)data)[row] = v.valid ? (int16_t)v.a.i : 0; break;
                    case O_I32: ((int32_t*)data)[row] = v.valid ? (int32_t)v.a.i : 0; break;
                    case O_I64: ((int64_t*)data)[row] = v.valid ? v.a.i : 0; break;
                    case O_U8: ((uint8_t*)data)[row] = v.valid ? (uint8_t)v.a.i : 0; break;
                    case O_U16: ((uint16_t*)data)[row] = v.valid ? (uint16_t)v.a.i : 0; break;
                    case O_U32: ((uint32_t*)data)[row] = v.valid ? (uint32_t)v.a.i : 0; break;
                    case O_F32: ((float*)data)[row] = v.valid ? (float)v.a.f : 0.0f; break;
                    case O_F64: ((double*)data)[row] = v.valid ? v.a.f : 0.0; break;
                    case O_BOOL:
                        if (v.valid && v.a.i != 0) true_bits |= 1ULL << aux;
                        break;
                    case O_DEC64: ((int64_t*)data)[row] = v.valid ? v.a.i : 0; break;
                    default: {
                        Word128 w;
                        w.lo = v.valid ? (uint64_t)v.a.i : 0;
                        w.hi = v.valid ? (uint64_t)v.b : 0;
                        ((Word128*)data)[row] = w;
                        break;
                    }
                }
                break;
            }
            default:
                failed = true;
                break;
        }
    }
}
