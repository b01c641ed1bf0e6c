// A CPU emulation of CUDA's execution model, just enough to run Hearth's kernels
// (src/cuda/kernels.cu, included unchanged but for the f16 conversions) without a GPU, for
// tests/engine/cuda_emulated.rs. Not a simulator of performance or of memory ordering: it runs
// each block's threads as cooperative fibers on one OS thread, switching at
// __syncthreads() and at warp shuffles, which is where CUDA threads exchange data.
//
// * Blocks run one after another; `__shared__` becomes a function-local `static`, shared by
//   the fibers of the running block.
// * __syncthreads(): a fiber waits until every thread of its block has arrived.
// * __shfl_sync / __shfl_xor_sync: the 32 lanes of a warp deposit their value, wait for each
//   other, read their source lane's, and wait again.
// * Kernel arguments arrive as an array of pointers to their values (as cuLaunchKernel
//   takes them); device pointers are host addresses.
//
// Built by the test: g++ -std=c++20 -O2 -shared -fPIC -mf16c -DHEARTH_CPU_EMULATION.
#include <immintrin.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace emu {
struct Dim {
    unsigned x = 0, y = 0, z = 0;
};
}  // namespace emu

static emu::Dim threadIdx, blockIdx, blockDim, gridDim;

namespace emu {
struct Fiber {
    ucontext_t ctx;
    std::vector<char> stack;
    unsigned tid = 0;
    bool done = false;
};

static ucontext_t scheduler;
static Fiber* current = nullptr;
static void (*body)() = nullptr;  // the running launch's kernel call

static void yield() { swapcontext(&current->ctx, &scheduler); }

static unsigned block_arrived = 0, block_generation = 0;
constexpr int MAX_WARPS = 32;
static unsigned warp_arrived[MAX_WARPS], warp_generation[MAX_WARPS];
static float warp_values[MAX_WARPS][32];

static void warp_barrier() {
    const unsigned w = threadIdx.x / 32;
    const unsigned g = warp_generation[w];
    if (++warp_arrived[w] == 32) {
        warp_arrived[w] = 0;
        ++warp_generation[w];
    } else {
        while (warp_generation[w] == g) yield();
    }
}

static float exchange(float v, unsigned src) {
    const unsigned lane = threadIdx.x % 32, w = threadIdx.x / 32;
    warp_values[w][lane] = v;
    warp_barrier();
    const float r = warp_values[w][src & 31];
    warp_barrier();
    return r;
}

static void trampoline() {
    body();
    current->done = true;
    swapcontext(&current->ctx, &scheduler);
}
}  // namespace emu

// What kernels.cu uses of CUDA, on the CPU.
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
static inline void __syncthreads() {
    const unsigned g = emu::block_generation;
    if (++emu::block_arrived == blockDim.x) {
        emu::block_arrived = 0;
        ++emu::block_generation;
    } else {
        while (emu::block_generation == g) emu::yield();
    }
}
static inline float __shfl_xor_sync(unsigned, float v, int mask) {
    return emu::exchange(v, (threadIdx.x % 32) ^ (unsigned)mask);
}
static inline float __shfl_sync(unsigned, float v, int src) { return emu::exchange(v, (unsigned)src); }
#define __expf expf  // glibc declares its own __expf; CUDA's is a fast expf
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __int_as_float(unsigned i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
using std::min;
static inline float hearth_emu_h2f(unsigned short h) { return _cvtsh_ss(h); }
static inline unsigned short hearth_emu_f2h(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

#include "../../src/cuda/kernels.cu"

namespace emu {
template <typename... A, std::size_t... I>
static void call(void (*k)(A...), void** args, std::index_sequence<I...>) {
    k(*reinterpret_cast<A*>(args[I])...);
}

static void** launch_args;
template <typename... A>
static void (*bind(void (*k)(A...)))() {
    static void (*kernel)(A...);
    kernel = k;
    return [] { call(kernel, launch_args, std::index_sequence_for<A...>{}); };
}

static int run(void (*entry)(), unsigned gx, unsigned gy, unsigned bx) {
    if (bx == 0 || bx % 32 != 0 || bx / 32 > MAX_WARPS) return -2;
    std::vector<Fiber> fibers(bx);
    for (auto& f : fibers) f.stack.resize(256 * 1024);
    body = entry;
    gridDim = {gx, gy, 1};
    blockDim = {bx, 1, 1};
    for (unsigned by = 0; by < gy; ++by) {
        for (unsigned b = 0; b < gx; ++b) {
            blockIdx = {b, by, 0};
            block_arrived = 0;
            std::fill(std::begin(warp_arrived), std::end(warp_arrived), 0u);
            for (unsigned t = 0; t < bx; ++t) {
                Fiber& f = fibers[t];
                f.tid = t;
                f.done = false;
                getcontext(&f.ctx);
                f.ctx.uc_stack.ss_sp = f.stack.data();
                f.ctx.uc_stack.ss_size = f.stack.size();
                f.ctx.uc_link = nullptr;
                makecontext(&f.ctx, trampoline, 0);
            }
            for (bool live = true; live;) {
                live = false;
                for (auto& f : fibers) {
                    if (f.done) continue;
                    current = &f;
                    threadIdx = {f.tid, 0, 0};
                    swapcontext(&scheduler, &f.ctx);
                    live |= !f.done;
                }
            }
        }
    }
    return 0;
}
}  // namespace emu

// Runs kernel `name` over a grid of gx × gy blocks of bx threads; `args` as cuLaunchKernel
// takes them. Returns 0, -1 for an unknown kernel, -2 for an unsupported block size.
extern "C" int hearth_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned bx, void** args) {
    emu::launch_args = args;
#define KERNEL(k) \
    if (std::strcmp(name, #k) == 0) return emu::run(emu::bind(k), gx, gy, bx);
    KERNEL(embed_rows)
    KERNEL(rms_norm_f16)
    KERNEL(rope_qk)
    KERNEL(kv_write)
    KERNEL(attention)
    KERNEL(silu_mul_f16)
#undef KERNEL
    return -1;
}
