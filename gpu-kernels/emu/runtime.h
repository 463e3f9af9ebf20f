// The emulator's launch interface, shared by the scheduler and the kernel exports.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace fulmen_emu {

// Mirrors `EmuLaunchConfig` in gpu-kernels/src/emu.rs.
struct LaunchConfig {
    uint32_t grid[3];
    uint32_t block[3];
    uint32_t shared_bytes;
    uint32_t workers;  // OS threads to spread blocks over; 0: one per core
    uint64_t seed;     // seeds the shuffled order of threads between barriers
};

typedef void (*ThreadBody)(void* ctx);

// Runs `body` once per thread of the grid. Returns 0, or 1 with a message in `error`.
int run(const LaunchConfig* cfg, ThreadBody body, void* ctx, char* error, size_t error_len);

template <typename... Args, size_t... I>
void call_kernel(void (*kernel)(Args...), void** params, std::index_sequence<I...>) {
    kernel(*static_cast<typename std::remove_reference<Args>::type*>(params[I])...);
}

// Launches `kernel` with CUDA-style parameters: params[i] points at argument i.
template <typename... Args>
int launch(void (*kernel)(Args...), const LaunchConfig* cfg, void** params, char* error, size_t error_len) {
    struct Call {
        void (*kernel)(Args...);
        void** params;
    } call{kernel, params};
    return run(
        cfg,
        [](void* c) {
            Call* x = static_cast<Call*>(c);
            call_kernel(x->kernel, x->params, std::index_sequence_for<Args...>{});
        },
        &call, error, error_len);
}

// The byte size of each of a kernel's parameters (what a driver reads from a cubin's
// parameter table to copy the arguments when a launch is queued). Writes at most `cap`
// sizes; returns how many parameters the kernel has.
template <typename... Args>
size_t param_sizes(void (*)(Args...), size_t* sizes, size_t cap) {
    const size_t all[] = {sizeof(typename std::remove_reference<Args>::type)..., 0};
    const size_t n = sizeof...(Args);
    for (size_t i = 0; i < n && i < cap; ++i) sizes[i] = all[i];
    return n;
}

}  // namespace fulmen_emu

// Exports kernel `name` to Rust as fulmen_emu_launch_<name>, and its parameters' sizes as
// fulmen_emu_params_<name>.
#define FULMEN_EMU_EXPORT(name)                                                                    \
    extern "C" int fulmen_emu_launch_##name(const fulmen_emu::LaunchConfig* cfg, void** params,   \
                                            char* error, size_t error_len) {                      \
        return fulmen_emu::launch(name, cfg, params, error, error_len);                           \
    }                                                                                              \
    extern "C" size_t fulmen_emu_params_##name(size_t* sizes, size_t cap) {                        \
        return fulmen_emu::param_sizes(name, sizes, cap);                                          \
    }
