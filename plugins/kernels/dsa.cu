// dsa.cu -- DeepSeek Sparse Attention's lightning indexer: index scores over the cached keys and the top-k
// selection.  Interface and semantics: mtp_kernels.h (section 4).  Reference: plugins/reference.py::dsa_select.
//
// Scoring: grid (row tile, query token, sequence), one thread per cache row; the query token's Hi x Di query and
// its Hi weights sit in shared memory as fp32, the thread walks its row's key in chunks of 8 values and keeps one
// accumulator per indexer head in registers (Hi <= 64).  Scores go to the workspace, fp32 [B*S][T_max].
// Selection: one block per query token, a radix select over the scores' order-preserving 32-bit keys (four passes
// of 8 bits, MSB first) finds the K-th largest score; a last pass in row order takes every row above it and the
// earliest rows equal to it (ties: the earlier row wins), written in ascending row order, then -1.
#include <math.h>

#include "common.cuh"

namespace mtp {
namespace {

constexpr int DSA_MAX_HEADS = 64;
constexpr int SC_THREADS = 128;
constexpr int SEL_THREADS = 256;
constexpr int SEL_WARPS = SEL_THREADS / 32;

struct DsaParams {
    const void* q;        // [B, S, Hi, Di]
    const float* w;       // [B, S, Hi]
    const void* cache;    // [B, T_max, C], key at key_offset
    const int32_t* past_len;
    const uint8_t* mask;  // [B, S, S] or NULL (causal)
    float* scores;        // [B*S][T_max]
    int32_t* selected;    // [B, S, K]
    int S, Hi, Di, C, key_offset, T_max, K;
    float scale;
};

// Rows 0 .. L-1 of sequence b exist after the commit; c = clamped cache length.
__device__ __forceinline__ int dsa_rows(const DsaParams& p, int b, int& c) {
    c = max(0, min(static_cast<int>(p.past_len[b]), p.T_max));
    return min(c + p.S, p.T_max);
}

// May query token s of sequence b see row t (t < L)?  Cached rows always; new row j = t - c causally or by mask.
__device__ __forceinline__ bool dsa_visible(const DsaParams& p, int b, int t, int c, int s) {
    if (t < c) return true;
    const int j = t - c;
    return p.mask ? p.mask[(static_cast<size_t>(b) * p.S + s) * p.S + j] != 0 : j <= s;
}

// float -> uint32 with the same order (NaN above +inf).
__device__ __forceinline__ uint32_t order_key(float x) {
    const uint32_t u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__host__ __device__ inline int dsa_q_stride(int Di) { return (Di + 7) / 8 * 8; }

template <typename T>
__global__ void __launch_bounds__(SC_THREADS) dsa_score_kernel(const DsaParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int Hi = p.Hi, Di = p.Di, QS = dsa_q_stride(Di);
    float* sq = reinterpret_cast<float*>(smem_raw);  // [Hi][QS], zero-padded
    float* sw = sq + Hi * QS;                        // [Hi]
    const int s = blockIdx.y, b = blockIdx.z;
    const size_t tok = static_cast<size_t>(b) * p.S + s;
    const T* q = static_cast<const T*>(p.q) + tok * Hi * Di;
    for (int i = threadIdx.x; i < Hi * QS; i += SC_THREADS) {
        const int j = i / QS, d = i - j * QS;
        sq[i] = d < Di ? to_f<T>(q[j * Di + d]) : 0.f;
    }
    for (int j = threadIdx.x; j < Hi; j += SC_THREADS) sw[j] = p.w[tok * Hi + j];
    __syncthreads();

    int c;
    const int L = dsa_rows(p, b, c);
    const int t = blockIdx.x * SC_THREADS + threadIdx.x;
    if (t >= L || !dsa_visible(p, b, t, c, s)) return;
    const T* k = static_cast<const T*>(p.cache) + (static_cast<size_t>(b) * p.T_max + t) * p.C + p.key_offset;
    float acc[DSA_MAX_HEADS];
#pragma unroll
    for (int j = 0; j < DSA_MAX_HEADS; ++j) acc[j] = 0.f;
    for (int d0 = 0; d0 < Di; d0 += 8) {
        float kv[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) kv[i] = d0 + i < Di ? to_f<T>(k[d0 + i]) : 0.f;
#pragma unroll
        for (int j = 0; j < DSA_MAX_HEADS; ++j) {
            if (j < Hi) {
                const float* qj = sq + j * QS + d0;
                float a = acc[j];
#pragma unroll
                for (int i = 0; i < 8; ++i) a = fmaf(qj[i], kv[i], a);
                acc[j] = a;
            }
        }
    }
    float score = 0.f;
#pragma unroll
    for (int j = 0; j < DSA_MAX_HEADS; ++j)
        if (j < Hi) score = fmaf(sw[j], fmaxf(acc[j] * p.scale, 0.f), score);
    p.scores[tok * p.T_max + t] = score;
}

// Exclusive prefix sum of v over the block (SEL_THREADS threads); *total gets the block's sum.  Two barriers; the
// caller must not reuse s_warp before the next call's first barrier.
__device__ __forceinline__ int block_exclusive_scan(int v, int* s_warp, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(kFullMask, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) s_warp[warp] = x;
    __syncthreads();
    int before = 0, sum = 0;
    for (int w = 0; w < SEL_WARPS; ++w) {
        const int n = s_warp[w];
        if (w < warp) before += n;
        sum += n;
    }
    __syncthreads();
    *total = sum;
    return before + x - v;
}

__global__ void __launch_bounds__(SEL_THREADS) dsa_select_kernel(const DsaParams p) {
    __shared__ int hist[256];
    __shared__ int s_warp[SEL_WARPS];
    __shared__ uint32_t s_prefix;
    __shared__ int s_need;
    const int s = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
    const size_t tok = static_cast<size_t>(b) * p.S + s;
    const float* sc = p.scores + tok * p.T_max;
    int32_t* out = p.selected + tok * p.K;
    int c;
    const int L = dsa_rows(p, b, c);
    int nvis = c;  // visible rows: the cached ones and the visible new ones
    for (int t = c; t < L; ++t) nvis += dsa_visible(p, b, t, c, s) ? 1 : 0;
    const bool take_all = nvis <= p.K;

    // ---- the K-th largest key (thr) and how many rows equal to it are taken (need)
    uint32_t prefix = 0, pmask = 0;
    int need = p.K;
    if (!take_all) {
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int i = tid; i < 256; i += SEL_THREADS) hist[i] = 0;
            __syncthreads();
            for (int t = tid; t < L; t += SEL_THREADS) {
                if (!dsa_visible(p, b, t, c, s)) continue;
                const uint32_t key = order_key(sc[t]);
                if ((key & pmask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
            }
            __syncthreads();
            if (tid == 0) {
                int above = 0, d = 255;
                for (; d > 0 && above + hist[d] < need; --d) above += hist[d];
                s_prefix = prefix | (static_cast<uint32_t>(d) << shift);
                s_need = need - above;
            }
            __syncthreads();
            prefix = s_prefix;
            need = s_need;
            pmask |= 255u << shift;
        }
    }

    // ---- rows in order: above thr, or equal to it and among the first `need` such rows
    int eq_base = 0, sel_base = 0;
    for (int t0 = 0; t0 < L; t0 += SEL_THREADS) {
        const int t = t0 + tid;
        bool gt = false, eq = false;
        if (t < L && dsa_visible(p, b, t, c, s)) {
            if (take_all) {
                gt = true;
            } else {
                const uint32_t key = order_key(sc[t]);
                gt = key > prefix;
                eq = key == prefix;
            }
        }
        int n_eq, n_sel;
        const int eq_rank = eq_base + block_exclusive_scan(eq ? 1 : 0, s_warp, &n_eq);
        const bool take = gt || (eq && eq_rank < need);
        const int pos = sel_base + block_exclusive_scan(take ? 1 : 0, s_warp, &n_sel);
        if (take && pos < p.K) out[pos] = t;
        eq_base += n_eq;
        sel_base += n_sel;
    }
    for (int i = sel_base + tid; i < p.K; i += SEL_THREADS) out[i] = -1;
}

}  // namespace
}  // namespace mtp

using namespace mtp;

extern "C" size_t mtp_dsa_select_workspace_size(int B, int S, int T_max) {
    if (B <= 0 || S <= 0 || T_max <= 0) return 0;
    return align_up(static_cast<size_t>(B) * S * T_max * sizeof(float), 256);
}

extern "C" cudaError_t mtp_dsa_select(mtp_dtype dtype, const void* q_index, const float* weights,
                                      const void* kv_cache, const int32_t* past_len, const uint8_t* mask,
                                      int32_t* selected, void* workspace, size_t workspace_bytes, int B, int S,
                                      int Hi, int Di, int C, int key_offset, int T_max, int K, float scale,
                                      cudaStream_t stream) {
    if (!dtype_ok(dtype) || B < 0 || S <= 0 || Hi <= 0 || Hi > DSA_MAX_HEADS || Di <= 0 || key_offset < 0 ||
        key_offset + Di > C || T_max <= 0 || K <= 0 || B > 65535 || S > 65535)
        return cudaErrorInvalidValue;
    if (B == 0) return cudaSuccess;
    if (!q_index || !weights || !kv_cache || !past_len || !selected) return cudaErrorInvalidValue;
    if (!workspace || workspace_bytes < mtp_dsa_select_workspace_size(B, S, T_max)) return cudaErrorInvalidValue;
    const size_t smem = sizeof(float) * (static_cast<size_t>(Hi) * dsa_q_stride(Di) + Hi);
    if (smem > 48 * 1024) return cudaErrorInvalidValue;
    const DsaParams p{q_index, weights, kv_cache, past_len, mask, static_cast<float*>(workspace), selected,
                      S, Hi, Di, C, key_offset, T_max, K, scale};  // (in DsaParams' order)
    const dim3 grid(static_cast<unsigned>((T_max + SC_THREADS - 1) / SC_THREADS), S, B);
    MTP_DISPATCH_DTYPE(dtype, T, dsa_score_kernel<T><<<grid, SC_THREADS, smem, stream>>>(p));
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    dsa_select_kernel<<<dim3(S, B), SEL_THREADS, 0, stream>>>(p);
    return cudaGetLastError();
}
