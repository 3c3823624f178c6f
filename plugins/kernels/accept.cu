// accept.cu -- acceptance of draft tokens: strict (greedy), relaxed (thinking phase) and
// rejection sampling.  Interface and semantics: mtp_kernels.h.  References: plugins/reference.py.
//
// Greedy family: kernel 1 has one block per (sequence, position) row of the logits and writes
// the row's argmax into out_tokens (the relaxed variant also a "relaxed ok" flag in bit 30);
// kernel 2 has one thread per sequence, walks the K positions and rewrites out_tokens in place.
// Rejection sampling: one block per sequence; thread 0 runs the acceptance tests (single elements
// of p and q), then the block samples the final token by an exact integer inverse CDF.
#include <math.h>

#include "common.cuh"

namespace mtp {
namespace {

constexpr int AR_THREADS = 512;
constexpr int32_t kOkBit = 1 << 30;
constexpr int32_t kIdMask = kOkBit - 1;

// numpy.argmax order: a NaN beats any number (first NaN wins); ties -> lowest index.
__device__ __forceinline__ bool better(float v1, int i1, float v2, int i2) {
    const bool n1 = isnan(v1), n2 = isnan(v2);
    if (n1 != n2) return n1;
    if (!n1 && v1 != v2) return v1 > v2;
    return i1 < i2;
}

// Merge two (max, sum of exp(x - max)) pairs.
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
    const float mn = fmaxf(m, m2);
    if (mn == -INFINITY) return;  // both empty
    s = (m == -INFINITY ? 0.f : s * expf(m - mn)) + (m2 == -INFINITY ? 0.f : s2 * expf(m2 - mn));
    m = mn;
}

template <typename T, bool RELAXED>
__global__ void __launch_bounds__(AR_THREADS) greedy_rows_kernel(const T* __restrict__ logits,
                                                                 const int32_t* __restrict__ drafts,
                                                                 int draft_stride,
                                                                 int32_t* __restrict__ out_tokens,
                                                                 int K, int V, int topk, float delta,
                                                                 const int32_t* __restrict__ topk_dev,
                                                                 const float* __restrict__ delta_dev) {
    if (RELAXED && topk_dev) {  // the scalars live in device memory (no host sync needed to launch)
        topk = *topk_dev;
        delta = *delta_dev;
    }
    const long long row = blockIdx.x;
    const int b = static_cast<int>(row / (K + 1)), i = static_cast<int>(row % (K + 1));
    const T* x = logits + row * V;
    const int tid = threadIdx.x;

    // Relaxed test needs the draft's logit first.
    const bool test = RELAXED && i < K && topk > 0;
    const int d = test ? drafts[static_cast<long long>(b) * draft_stride + i] : -1;
    const bool d_ok = test && d >= 0 && d < V;
    const float ld = d_ok ? to_f<T>(x[d]) : 0.f;

    float bv = -INFINITY;
    int bi = 0x7fffffff;
    float mt = -INFINITY, st = 0.f;  // online log-sum-exp
    int cnt = 0;                     // tokens ranked before d
    for (int j = tid; j < V; j += AR_THREADS) {
        const float v = to_f<T>(x[j]);
        if (better(v, j, bv, bi)) {
            bv = v;
            bi = j;
        }
        if (RELAXED && d_ok) {
            cnt += (v > ld || (v == ld && j < d)) ? 1 : 0;
            if (v > mt) {
                st = st * expf(mt - v) + 1.f;  // expf(-inf) = 0 on the first element
                mt = v;
            } else if (v != -INFINITY) {
                st += expf(v - mt);
            }
        }
    }
    // warp reduce
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v2 = __shfl_xor_sync(kFullMask, bv, o);
        const int i2 = __shfl_xor_sync(kFullMask, bi, o);
        if (better(v2, i2, bv, bi)) {
            bv = v2;
            bi = i2;
        }
        if (RELAXED) {
            const float m2 = __shfl_xor_sync(kFullMask, mt, o);
            const float s2 = __shfl_xor_sync(kFullMask, st, o);
            lse_merge(mt, st, m2, s2);
            cnt += __shfl_xor_sync(kFullMask, cnt, o);
        }
    }
    __shared__ float s_bv[AR_THREADS / 32], s_mt[AR_THREADS / 32], s_st[AR_THREADS / 32];
    __shared__ int s_bi[AR_THREADS / 32], s_cnt[AR_THREADS / 32];
    const int warp = tid >> 5, lane = tid & 31;
    if (lane == 0) {
        s_bv[warp] = bv;
        s_bi[warp] = bi;
        s_mt[warp] = mt;
        s_st[warp] = st;
        s_cnt[warp] = cnt;
    }
    __syncthreads();
    if (tid == 0) {
        for (int w = 1; w < AR_THREADS / 32; ++w) {
            if (better(s_bv[w], s_bi[w], bv, bi)) {
                bv = s_bv[w];
                bi = s_bi[w];
            }
            if (RELAXED) {
                lse_merge(mt, st, s_mt[w], s_st[w]);
                cnt += s_cnt[w];
            }
        }
        int32_t res = bi;
        if (RELAXED && d_ok && cnt < topk && st > 0.f) {
            const float pd = expf(ld - mt) / st, p1 = 1.f / st;
            if (pd >= p1 - delta) res |= kOkBit;
        }
        out_tokens[row] = res;
    }
}

__device__ __forceinline__ int think_update(int th, int tok, int start_id, int end_id) {
    if (tok == start_id) return 1;
    if (tok == end_id) return 0;
    return th;
}

// One thread per sequence.  src[b][i] = target argmax (| kOkBit when `relaxed`); may alias out.
// drafts of sequence b: drafts[b * draft_stride + i]; thinking_out may equal thinking_in (each
// thread reads its flag before writing it); last_index may be NULL.
__global__ void greedy_finalize_kernel(const int32_t* src, const int32_t* __restrict__ drafts, int draft_stride,
                                       int32_t* out, int32_t* __restrict__ num_accepted,
                                       int32_t* __restrict__ last_index, const int32_t* thinking_in,
                                       int32_t* thinking_out, int B, int K, int relaxed, int think_start,
                                       int think_end) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B) return;
    const int32_t* s = src + static_cast<long long>(b) * (K + 1);
    int32_t* o = out + static_cast<long long>(b) * (K + 1);
    const int32_t* d = drafts + static_cast<long long>(b) * draft_stride;
    int th = (thinking_in && thinking_in[b] != 0) ? 1 : 0;
    int n = 0;
    for (; n < K; ++n) {
        const int32_t v = s[n];
        const int32_t tgt = relaxed ? (v & kIdMask) : v;
        const bool ok = d[n] == tgt || (relaxed && th && (v & kOkBit));
        if (!ok) break;
        o[n] = d[n];
        th = think_update(th, d[n], think_start, think_end);
    }
    const int32_t bonus = relaxed ? (s[n] & kIdMask) : s[n];
    o[n] = bonus;
    th = think_update(th, bonus, think_start, think_end);
    for (int i = n + 1; i <= K; ++i) o[i] = -1;
    num_accepted[b] = n;
    if (last_index) last_index[b] = n;
    if (thinking_out) thinking_out[b] = th;
}

// ---- rejection sampling --------------------------------------------------------------------
constexpr int RS_THREADS = 512;

__device__ __forceinline__ unsigned long long quantize_w(float w) {
    w = fminf(fmaxf(w, 0.f), 1.f);  // NaN -> 0
    return static_cast<unsigned long long>(static_cast<double>(w) * 1099511627776.0);  // * 2^40
}

template <typename T>
__device__ __forceinline__ unsigned long long weight(const T* prow, const T* qrow, int j) {
    const float pv = to_f<T>(prow[j]);
    if (!qrow) return quantize_w(pv);
    const float qv = to_f<T>(qrow[j]);
    return quantize_w(pv - qv);
}

// Block-wide exclusive scan (and total) of one value per thread.
__device__ unsigned long long block_exclusive_scan(unsigned long long v, unsigned long long& total) {
    __shared__ unsigned long long s_w[RS_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned long long inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long y = __shfl_up_sync(kFullMask, inc, o);
        if (lane >= o) inc += y;
    }
    if (lane == 31) s_w[warp] = inc;
    __syncthreads();
    unsigned long long before = 0, tot = 0;
    for (int w = 0; w < RS_THREADS / 32; ++w) {
        if (w < warp) before += s_w[w];
        tot += s_w[w];
    }
    __syncthreads();  // s_w may be reused by a later call
    total = tot;
    return before + inc - v;
}

template <typename T>
__global__ void __launch_bounds__(RS_THREADS) rejection_kernel(
    const T* __restrict__ p, const T* __restrict__ q, const int32_t* __restrict__ drafts,
    const float* __restrict__ uniforms, int32_t* __restrict__ out_tokens,
    int32_t* __restrict__ num_accepted, int32_t* __restrict__ last_index, int K, int V) {
    __shared__ int s_n, s_tok;
    const int b = blockIdx.x, tid = threadIdx.x;
    const float* u = uniforms + static_cast<long long>(b) * (K + 1);
    if (tid == 0) {
        int n = 0;
        for (; n < K; ++n) {
            const int d = drafts[static_cast<long long>(b) * K + n];
            if (d < 0 || d >= V) break;
            const float pd = to_f<T>(p[(static_cast<long long>(b) * (K + 1) + n) * V + d]);
            const float qd = to_f<T>(q[(static_cast<long long>(b) * K + n) * V + d]);
            const bool acc = qd > 0.f ? (u[n] < pd / qd) : (pd > 0.f);
            if (!acc) break;
        }
        s_n = n;
        s_tok = 0;  // degenerate rows (all weights 0) give token 0
    }
    __syncthreads();
    const int n = s_n;
    const T* prow = p + (static_cast<long long>(b) * (K + 1) + n) * V;
    const T* qrow = n < K ? q + (static_cast<long long>(b) * K + n) * V : nullptr;

    const int chunk = (V + RS_THREADS - 1) / RS_THREADS;
    const int j0 = min(V, tid * chunk), j1 = min(V, j0 + chunk);
    unsigned long long mine = 0, total = 0, before = 0;
    for (int pass = 0; pass < 2; ++pass) {
        mine = 0;
        for (int j = j0; j < j1; ++j) mine += weight<T>(prow, qrow, j);
        before = block_exclusive_scan(mine, total);
        if (total != 0 || !qrow) break;  // block-uniform
        qrow = nullptr;                  // residual vanished: sample from p
    }
    if (total != 0) {
        float uf = u[K];
        uf = (uf >= 0.f) ? uf : 0.f;  // also NaN -> 0
        unsigned long long U = static_cast<unsigned long long>(uf * 16777216.0f);  // floor(u * 2^24)
        U = U > 16777215ull ? 16777215ull : U;
        const unsigned long long lo = U * total, hi = __umul64hi(U, total);
        const unsigned long long thr = (hi << 40) | (lo >> 24);  // floor(U * total / 2^24)
        if (before <= thr && thr < before + mine) {  // exactly one thread
            unsigned long long cum = before;
            for (int j = j0; j < j1; ++j) {
                cum += weight<T>(prow, qrow, j);
                if (cum > thr) {
                    s_tok = j;
                    break;
                }
            }
        }
    }
    __syncthreads();
    if (tid == 0) {
        int32_t* o = out_tokens + static_cast<long long>(b) * (K + 1);
        for (int i = 0; i < n; ++i) o[i] = drafts[static_cast<long long>(b) * K + i];
        o[n] = s_tok;
        for (int i = n + 1; i <= K; ++i) o[i] = -1;
        num_accepted[b] = n;
        last_index[b] = n;
    }
}

// last_index NULL is allowed (the callers that require it check it themselves).
cudaError_t greedy_common(mtp_dtype dtype, const void* logits, const int32_t* target_ids,
                          const int32_t* drafts, int draft_stride, const int32_t* thinking_in,
                          int32_t* thinking_out, int32_t* out_tokens, int32_t* num_accepted,
                          int32_t* last_index, int B, int K, int V, bool relaxed, int topk, float delta,
                          const int32_t* topk_dev, const float* delta_dev, int think_start, int think_end,
                          cudaStream_t stream) {
    if (B < 0 || K < 0 || V < 1 || V >= kOkBit || draft_stride < K) return cudaErrorInvalidValue;
    if (B == 0) return cudaSuccess;
    if (!out_tokens || !num_accepted || (K > 0 && !drafts)) return cudaErrorInvalidValue;
    if (!logits && !target_ids) return cudaErrorInvalidValue;
    const long long rows = static_cast<long long>(B) * (K + 1);
    if (rows > 0x7fffffffLL) return cudaErrorInvalidValue;
    const int32_t* src = target_ids;
    bool flags = false;
    if (logits) {
        if (!dtype_ok(dtype)) return cudaErrorInvalidValue;
        flags = relaxed && (topk > 0 || topk_dev) && K > 0;
        if (flags) {
            MTP_DISPATCH_DTYPE(dtype, T,
                               greedy_rows_kernel<T, true><<<static_cast<unsigned>(rows), AR_THREADS, 0, stream>>>(
                                   static_cast<const T*>(logits), drafts, draft_stride, out_tokens, K, V, topk, delta, topk_dev,
                                   delta_dev));
        } else {
            MTP_DISPATCH_DTYPE(dtype, T,
                               greedy_rows_kernel<T, false><<<static_cast<unsigned>(rows), AR_THREADS, 0, stream>>>(
                                   static_cast<const T*>(logits), drafts, draft_stride, out_tokens, K, V, 0, 0.f, nullptr,
                                   nullptr));
        }
        const cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
        src = out_tokens;
    }
    const int threads = 128;
    greedy_finalize_kernel<<<(B + threads - 1) / threads, threads, 0, stream>>>(
        src, drafts, draft_stride, out_tokens, num_accepted, last_index, relaxed ? thinking_in : nullptr,
        relaxed ? thinking_out : nullptr, B, K, flags ? 1 : 0, think_start, think_end);
    return cudaGetLastError();
}

}  // namespace
}  // namespace mtp

using namespace mtp;

extern "C" cudaError_t mtp_accept_strict(mtp_dtype dtype, const void* logits, const int32_t* target_ids,
                                         const int32_t* drafts, int32_t* out_tokens, int32_t* num_accepted,
                                         int32_t* last_index, int B, int K, int V, cudaStream_t stream) {
    if (!last_index) return B == 0 ? cudaSuccess : cudaErrorInvalidValue;
    return greedy_common(dtype, logits, target_ids, drafts, K, nullptr, nullptr, out_tokens, num_accepted,
                         last_index, B, K, V, false, 0, 0.f, nullptr, nullptr, -1, -1, stream);
}

extern "C" cudaError_t mtp_accept_relaxed(mtp_dtype dtype, const void* logits, const int32_t* drafts,
                                          int32_t* thinking, int32_t* out_tokens, int32_t* num_accepted,
                                          int32_t* last_index, int B, int K, int V, int topk, float delta,
                                          int think_start_id, int think_end_id, cudaStream_t stream) {
    if (!logits || !thinking || !last_index) return B == 0 ? cudaSuccess : cudaErrorInvalidValue;
    return greedy_common(dtype, logits, nullptr, drafts, K, thinking, thinking, out_tokens, num_accepted,
                         last_index, B, K, V, true, topk, delta, nullptr, nullptr, think_start_id, think_end_id,
                         stream);
}

extern "C" cudaError_t mtp_accept_relaxed_dev(mtp_dtype dtype, const void* logits, const int32_t* drafts,
                                              int draft_stride, const int32_t* thinking_in,
                                              int32_t* thinking_out, int32_t* out_tokens, int32_t* num_accepted,
                                              int32_t* last_index, int B, int K, int V, const int32_t* topk,
                                              const float* delta, int think_start_id, int think_end_id,
                                              cudaStream_t stream) {
    if (!logits || !thinking_in || !thinking_out || !topk || !delta)
        return B == 0 ? cudaSuccess : cudaErrorInvalidValue;
    return greedy_common(dtype, logits, nullptr, drafts, draft_stride, thinking_in, thinking_out, out_tokens,
                         num_accepted, last_index, B, K, V, true, 0, 0.f, topk, delta, think_start_id,
                         think_end_id, stream);
}

extern "C" cudaError_t mtp_accept_rejection(mtp_dtype dtype, const void* p, const void* q,
                                            const int32_t* drafts, const float* uniforms,
                                            int32_t* out_tokens, int32_t* num_accepted, int32_t* last_index,
                                            int B, int K, int V, cudaStream_t stream) {
    if (!dtype_ok(dtype) || B < 0 || K < 0 || V < 1 || V > (1 << 23) || B > 0x7fffffff)
        return cudaErrorInvalidValue;
    if (B == 0) return cudaSuccess;
    if (!p || !uniforms || !out_tokens || !num_accepted || !last_index || (K > 0 && (!q || !drafts)))
        return cudaErrorInvalidValue;
    MTP_DISPATCH_DTYPE(dtype, T,
                       rejection_kernel<T><<<B, RS_THREADS, 0, stream>>>(
                           static_cast<const T*>(p), static_cast<const T*>(q), drafts, uniforms, out_tokens,
                           num_accepted, last_index, K, V));
    return cudaGetLastError();
}
