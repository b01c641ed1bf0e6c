// Hearth's CUDA kernels for the Llama forward pass, compiled at run time by NVRTC
// (`super::compile_ptx`; CI compiles them too, so a syntax or type error cannot land).
//
// Conventions, shared with `plan.rs` and the CPU engine:
// * Activations are row-major f32 `[rows][width]`; inputs of a GEMM are f16 (`half`).
// * Weights are row-major f16 `[out][in]`; the GEMMs themselves run in cuBLAS.
// * The KV pool has the CPU pool's layout exactly (`kv.rs`), in f16, so KV blocks move
//   between CPU and GPU workers byte for byte: block b, layer l, kind k (0 keys, 1 values)
//   starts at ((b * n_layers + l) * 2 + k) * block_tokens * kv_dim; keys are stored
//   `[kv_head][head_dim][slot]`, values `[slot][kv_dim]`.
// * A row's KV slot is `slots[r]` = block * block_tokens + slot, and its attention reads
//   `positions[r] + 1` positions through `tables + r * table_width`.
// No headers: NVRTC's built-ins and inline PTX conversions only, so any NVRTC compiles this
// without a CUDA toolkit's include directory. `tests/emulator` also compiles it for the CPU
// (HEARTH_CPU_EMULATION), to run the same kernels against the CPU engine without a GPU.
typedef unsigned short half_t;  // IEEE binary16 bits
typedef unsigned long long u64;

#define WARP 32
#define NEG_INF __int_as_float(0xff800000)

#ifdef HEARTH_CPU_EMULATION
// The kernel emulator (tests/emulator) compiles this file for the CPU; it supplies these.
__device__ __forceinline__ float h2f(half_t h) { return hearth_emu_h2f(h); }
__device__ __forceinline__ half_t f2h(float f) { return hearth_emu_f2h(f); }
#else
__device__ __forceinline__ float h2f(half_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ half_t f2h(float f) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// x[r] = embedding row tokens[r] (f16 table `[vocab][d]`). Grid: rows; block: any.
extern "C" __global__ void embed_rows(const half_t* __restrict__ table, const int* __restrict__ tokens,
                                      float* __restrict__ x, int d) {
    const int r = blockIdx.x;
    const half_t* src = table + (u64)tokens[r] * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) x[(u64)r * d + i] = h2f(src[i]);
}

// out[i] (f16) = RMSNorm(x[rows[i]]) * w, for i < grid (rows == nullptr: row i itself).
// Grid: output rows; block: 256 threads.
extern "C" __global__ void rms_norm_f16(const float* __restrict__ x, const int* __restrict__ rows,
                                        const float* __restrict__ w, half_t* __restrict__ out, int d,
                                        float eps) {
    __shared__ float partial[WARP];
    const int i = blockIdx.x;
    const int r = rows ? rows[i] : i;
    const float* xr = x + (u64)r * d;
    float ss = 0.f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) ss += xr[j] * xr[j];
    ss = warp_sum(ss);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        const int nw = (blockDim.x + WARP - 1) / WARP;
        float v = lane < nw ? partial[lane] : 0.f;
        v = warp_sum(v);
        if (lane == 0) partial[0] = v;
    }
    __syncthreads();
    const float s = rsqrtf(partial[0] / d + eps);
    for (int j = threadIdx.x; j < d; j += blockDim.x) out[(u64)i * d + j] = f2h(xr[j] * s * w[j]);
}

// RoPE in place on the q and k parts of the fused QKV rows (`stride` floats a row: q at 0,
// k at `k_off`). `adjacent`: pairs (2i, 2i+1) (GGUF); else (i, i + nf) (Hugging Face).
// Grid: rows; block: any. One thread per (head, pair) of q and of k.
extern "C" __global__ void rope_qk(float* __restrict__ qkv, int stride, int k_off, const int* __restrict__ positions,
                                   const float* __restrict__ inv_freq, int nf, int n_heads, int n_kv_heads,
                                   int head_dim, int adjacent) {
    const int r = blockIdx.x;
    const float p = (float)positions[r];
    const int pairs = (n_heads + n_kv_heads) * nf;
    for (int t = threadIdx.x; t < pairs; t += blockDim.x) {
        const int head = t / nf, i = t % nf;
        float* h = head < n_heads ? qkv + (u64)r * stride + head * head_dim
                                  : qkv + (u64)r * stride + k_off + (head - n_heads) * head_dim;
        const int ia = adjacent ? 2 * i : i;
        const int ib = adjacent ? 2 * i + 1 : i + nf;
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        const float a = h[ia], b = h[ib];
        h[ia] = a * c - b * s;
        h[ib] = a * s + b * c;
    }
}

// Writes each row's K and V (from the fused QKV rows) into its slot of the pool, for one
// layer. Grid: rows; block: any.
extern "C" __global__ void kv_write(const float* __restrict__ qkv, int stride, int k_off, int v_off,
                                    const int* __restrict__ slots, half_t* __restrict__ pool, int n_layers,
                                    int layer, int kv_dim, int head_dim, int block_tokens) {
    const int r = blockIdx.x;
    const int block = slots[r] / block_tokens, slot = slots[r] % block_tokens;
    const u64 section = (u64)block_tokens * kv_dim;
    half_t* keys = pool + ((u64)block * n_layers + layer) * 2 * section;
    half_t* values = keys + section;
    const float* k = qkv + (u64)r * stride + k_off;
    const float* v = qkv + (u64)r * stride + v_off;
    for (int j = threadIdx.x; j < kv_dim; j += blockDim.x) {
        const int head = j / head_dim, i = j % head_dim;
        keys[(u64)head * head_dim * block_tokens + (u64)i * block_tokens + slot] = f2h(k[j]);
        values[(u64)slot * kv_dim + j] = f2h(v[j]);
    }
}

// Attention over the paged cache: out[r][head] = softmax(q·Kᵀ/√d)·V over positions
// 0..=positions[r] of row r's sequence. Grid: (rows, n_heads); block: ATT_WARPS warps.
// Each warp takes chunks of 32 positions (a lane per position: the transposed keys make
// that read coalesced), keeps an online softmax, and accumulates head_dim/32 output
// elements a lane; the warps' partial results are merged at the end. head_dim must be a
// multiple of 32, at most 128.
#define ATT_WARPS 4
#define MAX_PER_LANE 4
extern "C" __global__ void attention(const float* __restrict__ qkv, int stride, const int* __restrict__ positions,
                                     const int* __restrict__ tables, int table_width, const half_t* __restrict__ pool,
                                     half_t* __restrict__ out, int n_layers, int layer, int n_heads, int n_kv_heads,
                                     int head_dim, int block_tokens) {
    __shared__ float q[128];
    __shared__ float m_w[ATT_WARPS], l_w[ATT_WARPS];
    __shared__ float acc_w[ATT_WARPS][128];
    const int r = blockIdx.x, head = blockIdx.y;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int kv_dim = n_kv_heads * head_dim;
    const int kv_head = head / (n_heads / n_kv_heads);
    const float scale = rsqrtf((float)head_dim);
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) q[i] = qkv[(u64)r * stride + head * head_dim + i] * scale;
    __syncthreads();
    const int n = positions[r] + 1;
    const int* table = tables + (u64)r * table_width;
    const u64 section = (u64)block_tokens * kv_dim;
    const int per_lane = head_dim / WARP;
    float m = NEG_INF, l = 0.f;
    float acc[MAX_PER_LANE] = {0.f, 0.f, 0.f, 0.f};
    for (int c0 = warp * WARP; c0 < n; c0 += ATT_WARPS * WARP) {
        const int p = c0 + lane;
        float s = NEG_INF;
        if (p < n) {
            const int block = table[p / block_tokens], slot = p % block_tokens;
            const half_t* keys = pool + ((u64)block * n_layers + layer) * 2 * section +
                                 (u64)kv_head * head_dim * block_tokens + slot;
            float dot = 0.f;
            for (int i = 0; i < head_dim; ++i) dot += q[i] * h2f(keys[(u64)i * block_tokens]);
            s = dot;
        }
        const float m_new = fmaxf(m, warp_max(s));
        const float e = p < n ? __expf(s - m_new) : 0.f;
        const float correction = __expf(m - m_new);  // 0 on the first chunk (m = -inf)
        l = l * correction + warp_sum(e);
        for (int k = 0; k < per_lane; ++k) acc[k] *= correction;
        const int count = min(WARP, n - c0);
        for (int j = 0; j < count; ++j) {
            const float pj = __shfl_sync(0xffffffffu, e, j);
            const int pos = c0 + j;
            const int block = table[pos / block_tokens], slot = pos % block_tokens;
            const half_t* values = pool + ((u64)block * n_layers + layer) * 2 * section + section +
                                   (u64)slot * kv_dim + (u64)kv_head * head_dim;
            for (int k = 0; k < per_lane; ++k) acc[k] += pj * h2f(values[lane + k * WARP]);
        }
        m = m_new;
    }
    if (lane == 0) {
        m_w[warp] = m;
        l_w[warp] = l;
    }
    for (int k = 0; k < per_lane; ++k) acc_w[warp][lane + k * WARP] = acc[k];
    __syncthreads();
    if (warp == 0) {
        float mt = NEG_INF;
        for (int w = 0; w < ATT_WARPS; ++w) mt = fmaxf(mt, m_w[w]);
        float lt = 0.f;
        float o[MAX_PER_LANE] = {0.f, 0.f, 0.f, 0.f};
        for (int w = 0; w < ATT_WARPS; ++w) {
            if (m_w[w] == NEG_INF) continue;  // a warp that saw no position
            const float f = __expf(m_w[w] - mt);
            lt += l_w[w] * f;
            for (int k = 0; k < per_lane; ++k) o[k] += acc_w[w][lane + k * WARP] * f;
        }
        half_t* dst = out + (u64)r * n_heads * head_dim + (u64)head * head_dim;
        for (int k = 0; k < per_lane; ++k) dst[lane + k * WARP] = f2h(o[k] / lt);
    }
}

// out (f16 `[rows][n_ff]`) = silu(gate) * up, from the fused gate|up rows (`2 * n_ff` floats).
// Grid: rows; block: any.
extern "C" __global__ void silu_mul_f16(const float* __restrict__ gate_up, half_t* __restrict__ out, int n_ff) {
    const int r = blockIdx.x;
    const float* g = gate_up + (u64)r * 2 * n_ff;
    const float* u = g + n_ff;
    for (int j = threadIdx.x; j < n_ff; j += blockDim.x) {
        const float a = g[j];
        out[(u64)r * n_ff + j] = f2h(a / (1.f + __expf(-a)) * u[j]);
    }
}
