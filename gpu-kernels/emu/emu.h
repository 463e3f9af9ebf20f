// The CUDA execution model on the host: what kernel sources see when they are compiled
// by the host C++ compiler for the emulated device (FULMEN_EMULATOR is defined).
//
// Each block's threads run as fibers on one OS thread. A thread runs until it reaches a
// barrier (__syncthreads), a warp collective (__ballot_sync, __shfl_sync, …) or its end;
// between those points the runnable threads go in a seeded, shuffled order, so a kernel
// that relies on an unspecified order gives wrong answers here too. A thread that meets no
// barrier runs to completion without a context switch.
//
// Shared memory: `__shared__` variables are per-OS-thread statics, and an OS thread runs
// one block at a time, so every block sees its own. Dynamic shared memory is reached with
// FULMEN_DYNAMIC_SHARED(type, name), which works under NVRTC as well.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <cmath>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __shared__ static thread_local
#define __constant__ static const

struct dim3 {
    unsigned int x, y, z;
};

namespace fulmen_emu {

struct ThreadState {
    dim3 thread_idx;
    dim3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
};

// The running thread's indices (set by the scheduler before each switch).
extern thread_local ThreadState* current;
// The current block's dynamic shared memory.
extern thread_local unsigned char* dynamic_shared;

// Block barrier.
void sync_threads();
// Warp collectives; `value` is the raw bits of the operand, the result likewise.
enum WarpOp : int { WARP_SYNC = 0, WARP_BALLOT, WARP_SHFL, WARP_SHFL_UP, WARP_SHFL_DOWN, WARP_SHFL_XOR };
uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int arg, int width);

template <typename T>
inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8, "warp shuffles move at most 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    return bits;
}
template <typename T>
inline T from_bits(uint64_t bits) {
    T v;
    std::memcpy(&v, &bits, sizeof(T));
    return v;
}

}  // namespace fulmen_emu

#define threadIdx (fulmen_emu::current->thread_idx)
#define blockIdx (fulmen_emu::current->block_idx)
#define blockDim (fulmen_emu::current->block_dim)
#define gridDim (fulmen_emu::current->grid_dim)
#define warpSize 32

#define FULMEN_DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(fulmen_emu::dynamic_shared)

inline void __syncthreads() { fulmen_emu::sync_threads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    fulmen_emu::warp_collective(fulmen_emu::WARP_SYNC, mask, 0, 0, 32);
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

inline unsigned __ballot_sync(unsigned mask, int predicate) {
    return (unsigned)fulmen_emu::warp_collective(fulmen_emu::WARP_BALLOT, mask, predicate != 0, 0, 32);
}
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) {
    // Every participating lane must vote yes.
    return __ballot_sync(mask, !predicate) == 0;
}
template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
    return fulmen_emu::from_bits<T>(
        fulmen_emu::warp_collective(fulmen_emu::WARP_SHFL, mask, fulmen_emu::to_bits(var), src_lane, width));
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
    return fulmen_emu::from_bits<T>(
        fulmen_emu::warp_collective(fulmen_emu::WARP_SHFL_UP, mask, fulmen_emu::to_bits(var), (int)delta, width));
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
    return fulmen_emu::from_bits<T>(
        fulmen_emu::warp_collective(fulmen_emu::WARP_SHFL_DOWN, mask, fulmen_emu::to_bits(var), (int)delta, width));
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
    return fulmen_emu::from_bits<T>(
        fulmen_emu::warp_collective(fulmen_emu::WARP_SHFL_XOR, mask, fulmen_emu::to_bits(var), lane_mask, width));
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
template <typename T>
inline T __ldg(const T* p) { return *p; }

// Atomics: real atomics, since blocks of one launch may run on several OS threads.
#define FULMEN_EMU_ATOMIC_INT(T)                                                                          \
    inline T atomicAdd(T* a, T v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }                  \
    inline T atomicSub(T* a, T v) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }                  \
    inline T atomicOr(T* a, T v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }                    \
    inline T atomicAnd(T* a, T v) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }                  \
    inline T atomicXor(T* a, T v) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); }                  \
    inline T atomicExch(T* a, T v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }                \
    inline T atomicCAS(T* a, T expected, T desired) {                                                     \
        __atomic_compare_exchange_n(a, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);    \
        return expected;                                                                                  \
    }                                                                                                     \
    inline T atomicMin(T* a, T v) {                                                                       \
        T old = __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                     \
        while (v < old && !__atomic_compare_exchange_n(a, &old, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) { \
        }                                                                                                 \
        return old;                                                                                       \
    }                                                                                                     \
    inline T atomicMax(T* a, T v) {                                                                       \
        T old = __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                     \
        while (v > old && !__atomic_compare_exchange_n(a, &old, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) { \
        }                                                                                                 \
        return old;                                                                                       \
    }
FULMEN_EMU_ATOMIC_INT(int)
FULMEN_EMU_ATOMIC_INT(unsigned int)
FULMEN_EMU_ATOMIC_INT(long long)
FULMEN_EMU_ATOMIC_INT(unsigned long long)
#undef FULMEN_EMU_ATOMIC_INT

#define FULMEN_EMU_ATOMIC_FLOAT(T, BITS)                                                                  \
    inline T atomicAdd(T* a, T v) {                                                                       \
        BITS* p = reinterpret_cast<BITS*>(a);                                                             \
        BITS old = __atomic_load_n(p, __ATOMIC_SEQ_CST);                                                  \
        for (;;) {                                                                                        \
            T cur;                                                                                        \
            std::memcpy(&cur, &old, sizeof(T));                                                           \
            T next = cur + v;                                                                             \
            BITS next_bits;                                                                               \
            std::memcpy(&next_bits, &next, sizeof(T));                                                    \
            if (__atomic_compare_exchange_n(p, &old, next_bits, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) \
                return cur;                                                                               \
        }                                                                                                 \
    }                                                                                                     \
    inline T atomicExch(T* a, T v) {                                                                      \
        BITS bits;                                                                                        \
        std::memcpy(&bits, &v, sizeof(T));                                                                \
        BITS old = __atomic_exchange_n(reinterpret_cast<BITS*>(a), bits, __ATOMIC_SEQ_CST);               \
        T out;                                                                                            \
        std::memcpy(&out, &old, sizeof(T));                                                               \
        return out;                                                                                       \
    }
FULMEN_EMU_ATOMIC_FLOAT(float, uint32_t)
FULMEN_EMU_ATOMIC_FLOAT(double, uint64_t)
#undef FULMEN_EMU_ATOMIC_FLOAT
