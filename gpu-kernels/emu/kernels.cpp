// Every kernel source compiled for the emulated device, in one translation unit.
#define FULMEN_EMULATOR 1
#include "runtime.h"

#include "../cuda/agg.cu"
#include "../cuda/compact.cu"
#include "../cuda/concat.cu"
#include "../cuda/expr.cu"
#include "../cuda/fused.cu"
#include "../cuda/gather.cu"
#include "../cuda/hash.cu"
#include "../cuda/hash_table.cu"
#include "../cuda/scan.cu"
#include "../cuda/selftest.cu"
