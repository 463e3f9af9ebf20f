// Shared definitions for Volley's kernels, compiled two ways:
//   - by NVRTC for a real GPU (no system headers there, so fixed-width types are defined here);
//   - by the host C++ compiler for the emulated device (VOLLEY_EMULATOR, see emu/emu.h).
//
// Conventions every kernel follows:
//   - grid-stride loops, so any grid size is correct;
//   - validity bitmaps are Arrow's: bit i of byte i/8, least significant bit first; a null
//     bitmap pointer means "no nulls";
//   - row indices are uint32_t, and NULL_INDEX (0xFFFFFFFF) in an index column means "NULL";
//   - output sizes are computed by the host beforehand (counts → scan), never guessed.
#pragma once

#if defined(VOLLEY_EMULATOR)
#include "../emu/emu.h"
#define VOLLEY_KERNEL static void
#else
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#define VOLLEY_KERNEL extern "C" __global__ void
#define VOLLEY_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

#define NULL_INDEX 0xFFFFFFFFu

// First row of this thread and the stride of a grid-stride loop.
#define GRID_START ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x)
#define GRID_STRIDE ((uint64_t)blockDim.x * gridDim.x)

__device__ __forceinline__ bool bit_is_set(const uint8_t* bits, uint64_t i) {
    return bits == nullptr || ((bits[i >> 3] >> (i & 7)) & 1);
}

// A 16-byte value (decimal128) moved as two words.
struct __attribute__((aligned(16))) Word128 {
    uint64_t lo;
    uint64_t hi;
};
