// Kernels that test the device itself (the emulator on machines without a GPU): barriers,
// warp collectives, atomics under contention, a deliberate race, an out-of-bounds write and
// a divergent barrier. They are not used by queries.
//   selftest_block_scan  (in, out)        one block: inclusive scan in shared memory
//   selftest_warp        (in, sums, ballots, rotated, all_sums, votes, ups)   per warp of 32
//   selftest_atomics     (n, counter, max, min, sum64, fsum, dsum, bits, cas_sum)
//   selftest_racy        (out, with_barrier)  reads a neighbour's shared slot, with or
//                                             without the barrier that makes it correct
//   selftest_oob         (out, n)         writes out[n]: one element past the end
//   selftest_divergent   (out)            half the block waits at __syncthreads, half at
//                                         __syncwarp: never completes on a GPU
#include "fulmen.cuh"

FULMEN_KERNEL selftest_block_scan(const uint32_t* in, uint32_t* out) {
    __shared__ uint32_t buf[1024];
    unsigned t = threadIdx.x;
    buf[t] = in[t];
    __syncthreads();
    for (unsigned offset = 1; offset < blockDim.x; offset <<= 1) {
        uint32_t add = t >= offset ? buf[t - offset] : 0;
        __syncthreads();
        buf[t] += add;
        __syncthreads();
    }
    out[t] = buf[t];
}

FULMEN_KERNEL selftest_warp(const int32_t* in, int32_t* sums, uint32_t* ballots, int32_t* rotated,
                            int32_t* all_sums, uint32_t* votes, int32_t* ups) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned lane = threadIdx.x % 32;
    int32_t v = in[i];
    // Tree reduction: lane 0 ends with the warp's sum.
    int32_t sum = v;
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
    if (lane == 0) sums[i / 32] = sum;
    unsigned ballot = __ballot_sync(0xffffffffu, v > 0);
    if (lane == 0) ballots[i / 32] = ballot;
    rotated[i] = __shfl_sync(0xffffffffu, v, (int)((lane + 1) % 32));
    // Butterfly: every lane ends with the sum.
    int32_t all = v;
    for (int mask = 16; mask > 0; mask /= 2) all += __shfl_xor_sync(0xffffffffu, all, mask);
    all_sums[i] = all;
    int any_negative = __any_sync(0xffffffffu, v < 0);
    int all_positive = __all_sync(0xffffffffu, v > 0);
    if (lane == 0) votes[i / 32] = (unsigned)any_negative | ((unsigned)all_positive << 1);
    ups[i] = __shfl_up_sync(0xffffffffu, v, 1);
}

FULMEN_KERNEL selftest_atomics(uint64_t n, uint32_t* counter, int32_t* max, int32_t* min,
                               unsigned long long* sum64, float* fsum, double* dsum, uint32_t* bits,
                               unsigned long long* cas_sum) {
    for (uint64_t i = GRID_START; i < n; i += GRID_STRIDE) {
        atomicAdd(counter, 1u);
        atomicMax(max, (int32_t)i);
        atomicMin(min, -(int32_t)i);
        atomicAdd(sum64, (unsigned long long)i);
        atomicAdd(fsum, 1.0f);
        atomicAdd(dsum, 0.5);
        atomicOr(bits, 1u << (i % 32));
        unsigned long long seen = *cas_sum;
        for (;;) {
            unsigned long long prev = atomicCAS(cas_sum, seen, seen + i);
            if (prev == seen) break;
            seen = prev;
        }
    }
}

FULMEN_KERNEL selftest_racy(uint32_t* out, uint32_t with_barrier) {
    __shared__ uint32_t slots[1024];
    unsigned t = threadIdx.x;
    slots[t] = t + 1;
    if (with_barrier) __syncthreads();
    out[t] = slots[(t + 1) % blockDim.x];
}

FULMEN_KERNEL selftest_oob(uint32_t* out, uint64_t n) {
    for (uint64_t i = GRID_START; i <= n; i += GRID_STRIDE) out[i] = 7;  // `<=`: the bug
}

FULMEN_KERNEL selftest_divergent(uint32_t* out) {
    if (threadIdx.x < 16) {
        __syncthreads();
    } else {
        __syncwarp();
    }
    out[threadIdx.x] = 1;
}

#if defined(FULMEN_EMULATOR)
FULMEN_EMU_EXPORT(selftest_block_scan)
FULMEN_EMU_EXPORT(selftest_warp)
FULMEN_EMU_EXPORT(selftest_atomics)
FULMEN_EMU_EXPORT(selftest_racy)
FULMEN_EMU_EXPORT(selftest_oob)
FULMEN_EMU_EXPORT(selftest_divergent)
#endif
