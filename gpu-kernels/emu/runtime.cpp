// The emulated device's scheduler: runs a kernel's grid on host threads under the CUDA
// execution model (see emu.h for what kernels see).
//
//   launch ──▶ workers (OS threads) take blocks one at a time
//   block  ──▶ one fiber per CUDA thread; rounds:
//                run every READY fiber once, in a seeded shuffled order
//                (each runs until a barrier, a warp collective, or its end)
//              then release: a barrier when every live thread waits at it,
//                a warp collective when every live lane of the warp waits at it
//              no READY fiber and nothing to release ──▶ error (divergent barrier)
#include "emu.h"
#include "runtime.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace fulmen_emu {

thread_local ThreadState* current = nullptr;
thread_local unsigned char* dynamic_shared = nullptr;

namespace {

constexpr size_t kStackBytes = 64 * 1024;

enum class FiberState { Ready, AtBarrier, AtWarp, Done };

struct Worker;

struct Fiber {
    ThreadState ts;
    FiberState state = FiberState::Ready;
    unsigned linear = 0;
    // Warp collective in flight.
    WarpOp op = WARP_SYNC;
    unsigned mask = 0;
    uint64_t value = 0;
    int arg = 0;
    int width = 32;
    uint64_t result = 0;
#if defined(__x86_64__)
    void* sp = nullptr;
#else
    ucontext_t ctx;
#endif
    unsigned char* stack = nullptr;
    Worker* worker = nullptr;
};

struct Worker {
    std::vector<Fiber*> fibers;
    std::vector<unsigned char> shared;
    ThreadBody body = nullptr;
    void* body_ctx = nullptr;
    Fiber* running = nullptr;
#if defined(__x86_64__)
    void* scheduler_sp = nullptr;
#else
    ucontext_t scheduler_ctx;
#endif
    ~Worker() {
        for (Fiber* f : fibers) {
            std::free(f->stack);
            delete f;
        }
    }
};

thread_local Worker* this_worker = nullptr;

}  // namespace
}  // namespace fulmen_emu

#if defined(__x86_64__)
// switch_stack(save, next): saves the callee-saved registers and the FPU control words on
// the current stack, stores the stack pointer in *save, and resumes the stack `next`.
extern "C" void fulmen_emu_switch(void** save, void* next);
extern "C" void fulmen_emu_trampoline();
extern "C" void fulmen_emu_fiber_main(fulmen_emu::Fiber* fiber);
asm(R"(
    .text
    .globl fulmen_emu_switch
    .type fulmen_emu_switch, @function
fulmen_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size fulmen_emu_switch, .-fulmen_emu_switch

    .globl fulmen_emu_trampoline
    .type fulmen_emu_trampoline, @function
fulmen_emu_trampoline:
    movq %r12, %rdi
    call fulmen_emu_fiber_main
    ud2
    .size fulmen_emu_trampoline, .-fulmen_emu_trampoline
)");
#endif

namespace fulmen_emu {
namespace {

void switch_to_scheduler(Fiber* f) {
    Worker* w = f->worker;
#if defined(__x86_64__)
    fulmen_emu_switch(&f->sp, w->scheduler_sp);
#else
    swapcontext(&f->ctx, &w->scheduler_ctx);
#endif
}

void resume(Worker* w, Fiber* f) {
    w->running = f;
    current = &f->ts;
#if defined(__x86_64__)
    fulmen_emu_switch(&w->scheduler_sp, f->sp);
#else
    swapcontext(&w->scheduler_ctx, &f->ctx);
#endif
    w->running = nullptr;
}

}  // namespace

void fiber_body(Fiber* f) {
    Worker* w = f->worker;
    w->body(w->body_ctx);
    f->state = FiberState::Done;
    switch_to_scheduler(f);
    std::abort();  // a finished fiber is never resumed
}

namespace {

#if !defined(__x86_64__)
void ucontext_entry(unsigned hi, unsigned lo) {
    Fiber* f = reinterpret_cast<Fiber*>((uintptr_t(hi) << 32) | uintptr_t(lo));
    fiber_body(f);
}
#endif

void start_fiber(Fiber* f) {
#if defined(__x86_64__)
    // Initial frame, from the top: return address (the trampoline), rbp, rbx, r12 (the
    // fiber), r13, r14, r15, then MXCSR and the x87 control word.
    uintptr_t top = (reinterpret_cast<uintptr_t>(f->stack) + kStackBytes) & ~uintptr_t(15);
    uint64_t* frame = reinterpret_cast<uint64_t*>(top);
    frame[-1] = reinterpret_cast<uint64_t>(&fulmen_emu_trampoline);
    frame[-2] = 0;                                   // rbp
    frame[-3] = 0;                                   // rbx
    frame[-4] = reinterpret_cast<uint64_t>(f);       // r12
    frame[-5] = 0;                                   // r13
    frame[-6] = 0;                                   // r14
    frame[-7] = 0;                                   // r15
    uint32_t* control = reinterpret_cast<uint32_t*>(&frame[-8]);
    control[0] = 0x1F80;                             // MXCSR default
    control[1] = 0x037F;                             // x87 control word default
    f->sp = &frame[-8];
#else
    getcontext(&f->ctx);
    f->ctx.uc_stack.ss_sp = f->stack;
    f->ctx.uc_stack.ss_size = kStackBytes;
    f->ctx.uc_link = nullptr;
    uintptr_t p = reinterpret_cast<uintptr_t>(f);
    makecontext(&f->ctx, reinterpret_cast<void (*)()>(ucontext_entry), 2, unsigned(p >> 32), unsigned(p));
#endif
}

struct Rng {
    uint64_t s;
    uint64_t next() {
        // splitmix64
        uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
};

uint64_t collective_result(const std::vector<Fiber*>& lanes, unsigned lane, const Fiber* f) {
    auto live = [&](unsigned l) { return l < lanes.size() && lanes[l] != nullptr; };
    unsigned width = (f->width <= 0 || f->width > 32) ? 32 : unsigned(f->width);
    unsigned base = (lane / width) * width;
    unsigned sub = lane % width;
    switch (f->op) {
        case WARP_SYNC:
            return 0;
        case WARP_BALLOT: {
            uint64_t bits = 0;
            for (unsigned l = 0; l < lanes.size(); ++l)
                if (live(l) && ((f->mask >> l) & 1u) && lanes[l]->value != 0) bits |= (1ull << l);
            return bits;
        }
        case WARP_SHFL: {
            unsigned src = base + (unsigned(f->arg) % width);
            return live(src) ? lanes[src]->value : f->value;
        }
        case WARP_SHFL_UP: {
            if (f->arg < 0 || sub < unsigned(f->arg)) return f->value;
            unsigned src = lane - unsigned(f->arg);
            return live(src) ? lanes[src]->value : f->value;
        }
        case WARP_SHFL_DOWN: {
            if (f->arg < 0 || sub + unsigned(f->arg) >= width) return f->value;
            unsigned src = lane + unsigned(f->arg);
            return live(src) ? lanes[src]->value : f->value;
        }
        case WARP_SHFL_XOR: {
            unsigned src = base + ((sub ^ unsigned(f->arg)) % width);
            return live(src) ? lanes[src]->value : f->value;
        }
    }
    return 0;
}

// Releases whatever can be released; returns false with a message on divergence.
bool release(std::vector<Fiber*>& fibers, unsigned n, bool& released, std::string& error) {
    released = false;
    unsigned live = 0, at_barrier = 0;
    for (unsigned i = 0; i < n; ++i) {
        if (fibers[i]->state != FiberState::Done) ++live;
        if (fibers[i]->state == FiberState::AtBarrier) ++at_barrier;
    }
    if (live > 0 && at_barrier == live) {
        for (unsigned i = 0; i < n; ++i) fibers[i]->state = FiberState::Ready;
        released = true;
        return true;
    }
    std::vector<Fiber*> lanes;
    for (unsigned warp = 0; warp * 32 < n; ++warp) {
        unsigned first = warp * 32, last = std::min(n, first + 32);
        unsigned waiting = 0, members = 0;
        Fiber* leader = nullptr;
        for (unsigned i = first; i < last; ++i) {
            if (fibers[i]->state == FiberState::Done) continue;
            ++members;
            if (fibers[i]->state == FiberState::AtWarp) {
                ++waiting;
                if (!leader) leader = fibers[i];
            }
        }
        if (members == 0 || waiting != members) continue;
        lanes.assign(last - first, nullptr);
        for (unsigned i = first; i < last; ++i) {
            Fiber* f = fibers[i];
            if (f->state == FiberState::Done) continue;
            if (f->op != leader->op || f->mask != leader->mask || f->width != leader->width) {
                error = "warp collective divergence: the lanes of warp " + std::to_string(warp) +
                        " called different warp operations or masks";
                return false;
            }
            lanes[i - first] = f;
        }
        for (unsigned i = first; i < last; ++i) {
            Fiber* f = fibers[i];
            if (f->state == FiberState::Done) continue;
            f->result = collective_result(lanes, i - first, f);
        }
        for (unsigned i = first; i < last; ++i)
            if (fibers[i]->state == FiberState::AtWarp) fibers[i]->state = FiberState::Ready;
        released = true;
    }
    return true;
}

bool run_block(Worker& w, const LaunchConfig& cfg, dim3 block_idx, std::string& error) {
    dim3 block_dim{cfg.block[0], cfg.block[1], cfg.block[2]};
    dim3 grid_dim{cfg.grid[0], cfg.grid[1], cfg.grid[2]};
    unsigned n = block_dim.x * block_dim.y * block_dim.z;
    while (w.fibers.size() < n) {
        Fiber* f = new Fiber();
        f->stack = static_cast<unsigned char*>(std::malloc(kStackBytes));
        if (!f->stack) {
            delete f;
            error = "out of host memory for emulated thread stacks";
            return false;
        }
        f->worker = &w;
        w.fibers.push_back(f);
    }
    // Shared memory starts as garbage, as on a GPU.
    if (cfg.shared_bytes > 0) std::fill(w.shared.begin(), w.shared.begin() + cfg.shared_bytes, 0xA5);
    for (unsigned i = 0; i < n; ++i) {
        Fiber* f = w.fibers[i];
        f->linear = i;
        f->state = FiberState::Ready;
        f->ts.thread_idx = dim3{i % block_dim.x, (i / block_dim.x) % block_dim.y, i / (block_dim.x * block_dim.y)};
        f->ts.block_idx = block_idx;
        f->ts.block_dim = block_dim;
        f->ts.grid_dim = grid_dim;
        start_fiber(f);
    }
    uint64_t linear_block = (uint64_t(block_idx.z) * grid_dim.y + block_idx.y) * grid_dim.x + block_idx.x;
    Rng rng{cfg.seed ^ (linear_block * 0xD1B54A32D192ED03ull)};
    std::vector<unsigned> order;
    order.reserve(n);
    for (;;) {
        order.clear();
        for (unsigned i = 0; i < n; ++i)
            if (w.fibers[i]->state == FiberState::Ready) order.push_back(i);
        if (order.empty()) {
            bool all_done = true;
            for (unsigned i = 0; i < n; ++i) all_done &= w.fibers[i]->state == FiberState::Done;
            if (all_done) return true;
            bool released = false;
            if (!release(w.fibers, n, released, error)) return false;
            if (!released) {
                error = "deadlock: some threads of block " + std::to_string(linear_block) +
                        " wait at __syncthreads or a warp collective that others never reach";
                return false;
            }
            continue;
        }
        for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng.next() % i]);
        for (unsigned i : order) resume(&w, w.fibers[i]);
    }
}

}  // namespace

void sync_threads() {
    Worker* w = this_worker;
    Fiber* f = w->running;
    f->state = FiberState::AtBarrier;
    switch_to_scheduler(f);
    current = &f->ts;
}

uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int arg, int width) {
    Worker* w = this_worker;
    Fiber* f = w->running;
    f->op = op;
    f->mask = mask;
    f->value = value;
    f->arg = arg;
    f->width = width;
    f->state = FiberState::AtWarp;
    switch_to_scheduler(f);
    current = &f->ts;
    return f->result;
}

int run(const LaunchConfig* cfg, ThreadBody body, void* ctx, char* error, size_t error_len) {
    auto fail = [&](const std::string& message) {
        if (error && error_len > 0) std::snprintf(error, error_len, "%s", message.c_str());
        return 1;
    };
    uint64_t threads = uint64_t(cfg->block[0]) * cfg->block[1] * cfg->block[2];
    uint64_t blocks = uint64_t(cfg->grid[0]) * cfg->grid[1] * cfg->grid[2];
    if (threads == 0 || threads > 1024) return fail("a block must have between 1 and 1024 threads");
    if (blocks == 0) return fail("a grid must have at least one block");
    if (cfg->shared_bytes > 228 * 1024) return fail("more dynamic shared memory than a multiprocessor has");
    unsigned workers = cfg->workers == 0 ? std::max(1u, std::thread::hardware_concurrency()) : cfg->workers;
    workers = unsigned(std::min<uint64_t>(workers, blocks));
    std::atomic<uint64_t> next_block{0};
    std::atomic<bool> failed{false};
    std::mutex error_mutex;
    std::string first_error;
    auto work = [&]() {
        Worker w;
        w.body = body;
        w.body_ctx = ctx;
        w.shared.assign(std::max<size_t>(cfg->shared_bytes, 1), 0);
        Worker* saved_worker = this_worker;
        unsigned char* saved_shared = dynamic_shared;
        this_worker = &w;
        dynamic_shared = w.shared.data();
        std::string message;
        for (;;) {
            uint64_t b = next_block.fetch_add(1);
            if (b >= blocks || failed.load()) break;
            dim3 idx{unsigned(b % cfg->grid[0]), unsigned((b / cfg->grid[0]) % cfg->grid[1]),
                     unsigned(b / (uint64_t(cfg->grid[0]) * cfg->grid[1]))};
            if (!run_block(w, *cfg, idx, message)) {
                failed.store(true);
                std::lock_guard<std::mutex> lock(error_mutex);
                if (first_error.empty()) first_error = message;
                break;
            }
        }
        this_worker = saved_worker;
        dynamic_shared = saved_shared;
        current = nullptr;
    };
    // Blocks always run on fresh threads, never the caller's: `__shared__` statics then
    // start each launch zeroed instead of holding the previous launch's values, which
    // would hide races that read shared memory before it is written.
    std::vector<std::thread> pool;
    for (unsigned i = 0; i < workers; ++i) pool.emplace_back(work);
    for (auto& t : pool) t.join();
    return failed.load() ? fail(first_error) : 0;
}

}  // namespace fulmen_emu

extern "C" void fulmen_emu_fiber_main(fulmen_emu::Fiber* fiber) { fulmen_emu::fiber_body(fiber); }
