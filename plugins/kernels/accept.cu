// accept.cu -- acceptance of draft tokens: strict (greedy), relaxed (thinking phase) and
// rejection sampling.  Interface and semantics: mtp_kernels.h.  References: plugins/reference.py.
//
// A logits row (V values) is read by a cluster of up to 8 blocks (sm_90+; one block per row elsewhere), each taking
// a contiguous part with 16-byte loads; the blocks merge their partial results through distributed shared memory,
// so no workspace is needed and everything stays in one launch.  The cluster size is chosen so that the rows x
// blocks fill the GPU (at B = 1, K = 3: 4 rows x 8 blocks).
//
// Greedy family: kernel 1 writes each (sequence, position) row's argmax into out_tokens (the relaxed variant also a
// "relaxed ok" flag in bit 30): per block the argmax (ties -> lowest index, NaN first), and for the relaxed test the
// online log-sum-exp and the count of tokens ranked before the draft, merged in the cluster's first block.  Kernel 2
// has one thread per sequence, walks the K positions and rewrites out_tokens in place.
// Rejection sampling: one cluster per sequence.  Every block runs the acceptance tests (single elements of p and
// q), sums the integer weights of its part, reads the other blocks' sums, and the block whose part holds the
// threshold finds the token by an ordered scan.  Weights are exact integers (no floating-point sums), so the token
// does not depend on the split.
#include <math.h>

#include <atomic>

#include "common.cuh"

namespace mtp {
namespace {

constexpr int AC_THREADS = 256;
constexpr int AC_WARPS = AC_THREADS / 32;
constexpr int AC_MAX_CLUSTER = 8;    // the portable cluster size
constexpr int AC_MIN_VALUES = 2048;  // a row is split only into parts of at least this many values
constexpr int32_t kOkBit = 1 << 30;
constexpr int32_t kIdMask = kOkBit - 1;

// This block's part [j0, j1) of a row of V values split over the cluster (parts start at multiples of 8 values).
__device__ __forceinline__ void row_part(int V, int& j0, int& j1) {
    const int cs = static_cast<int>(cluster_size()), per = ((V + cs - 1) / cs + 7) / 8 * 8;
    j0 = min(V, static_cast<int>(cluster_rank()) * per);
    j1 = min(V, j0 + per);
}

// f(j, a[j], b[j]) for every j in [j0, j1), spread over the block (b[j] = 0 when b is null): 16-byte loads, four in
// flight per thread, where both rows are equally aligned; element loads at the ends or when they are not.
template <typename T, typename F>
__device__ __forceinline__ void for_each_value(const T* a, const T* b, int j0, int j1, F&& f) {
    constexpr int N = 16 / sizeof(T);
    const int tid = threadIdx.x;
    const unsigned ma = reinterpret_cast<uintptr_t>(a + j0) & 15u;
    const unsigned mb = b ? reinterpret_cast<uintptr_t>(b + j0) & 15u : ma;
    const int ja = ma == mb ? min(j1, j0 + static_cast<int>(((16u - ma) & 15u) / sizeof(T))) : j1;
    for (int j = j0 + tid; j < ja; j += AC_THREADS) f(j, to_f<T>(a[j]), b ? to_f<T>(b[j]) : 0.f);
    const int nvec = (j1 - ja) / N;
    const uint4* av = reinterpret_cast<const uint4*>(a + ja);
    const uint4* bv = b ? reinterpret_cast<const uint4*>(b + ja) : nullptr;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int i0 = tid; i0 < nvec; i0 += 4 * AC_THREADS) {
        uint4 ua[4], ub[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = i0 + k * AC_THREADS;
            ua[k] = i < nvec ? av[i] : zero;
            ub[k] = bv && i < nvec ? bv[i] : zero;
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = i0 + k * AC_THREADS;
            if (i >= nvec) break;
#pragma unroll
            for (int e = 0; e < N; ++e) f(ja + i * N + e, unpack16<T>(ua[k], e), unpack16<T>(ub[k], e));
        }
    }
    for (int j = ja + nvec * N + tid; j < j1; j += AC_THREADS) f(j, to_f<T>(a[j]), b ? to_f<T>(b[j]) : 0.f);
}

// ---- greedy family -------------------------------------------------------------------------------------------
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

// A part of a row: its argmax (value, index); for the relaxed test the log-sum-exp (max, sum) and the tokens
// ranked before the draft.
struct RowStats {
    float bv;
    int bi;
    float mt, st;
    int cnt;
};

template <bool RELAXED>
__device__ __forceinline__ void merge_stats(RowStats& x, float bv, int bi, float mt, float st, int cnt) {
    if (better(bv, bi, x.bv, x.bi)) {
        x.bv = bv;
        x.bi = bi;
    }
    if (RELAXED) {
        lse_merge(x.mt, x.st, mt, st);
        x.cnt += cnt;
    }
}

struct GreedyShared {
    RowStats warp[AC_WARPS];
    RowStats block;  // read by the cluster's first block
};

template <typename T, bool RELAXED>
__global__ void __launch_bounds__(AC_THREADS, 1) greedy_rows_kernel(const T* __restrict__ logits,
                                                                 const int32_t* __restrict__ drafts,
                                                                 int draft_stride,
                                                                 int32_t* __restrict__ out_tokens,
                                                                 int K, int V, int topk, float delta,
                                                                 const int32_t* __restrict__ topk_dev,
                                                                 const float* __restrict__ delta_dev) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    GreedyShared& sh = *reinterpret_cast<GreedyShared*>(smem_raw);
    if (RELAXED && topk_dev) {  // the scalars live in device memory (no host sync needed to launch)
        topk = *topk_dev;
        delta = *delta_dev;
    }
    const unsigned cs = cluster_size();
    const long long row = blockIdx.x / cs;
    const int b = static_cast<int>(row / (K + 1)), i = static_cast<int>(row % (K + 1));
    const T* x = logits + row * V;
    const int tid = threadIdx.x;

    // Relaxed test needs the draft's logit first.
    const bool test = RELAXED && i < K && topk > 0;
    const int d = test ? drafts[static_cast<long long>(b) * draft_stride + i] : -1;
    const bool d_ok = test && d >= 0 && d < V;
    const float ld = d_ok ? to_f<T>(x[d]) : 0.f;

    RowStats st{-INFINITY, 0x7fffffff, -INFINITY, 0.f, 0};
    int j0, j1;
    row_part(V, j0, j1);
    for_each_value<T>(x, nullptr, j0, j1, [&](int j, float v, float) {
        if (better(v, j, st.bv, st.bi)) {
            st.bv = v;
            st.bi = j;
        }
        if (RELAXED && d_ok) {
            st.cnt += (v > ld || (v == ld && j < d)) ? 1 : 0;
            if (v > st.mt) {
                st.st = st.st * expf(st.mt - v) + 1.f;  // expf(-inf) = 0 on the first element
                st.mt = v;
            } else if (v != -INFINITY) {
                st.st += expf(v - st.mt);
            }
        }
    });
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float bv = __shfl_xor_sync(kFullMask, st.bv, o);
        const int bi = __shfl_xor_sync(kFullMask, st.bi, o);
        float mt = 0.f, s2 = 0.f;
        int cnt = 0;
        if (RELAXED) {
            mt = __shfl_xor_sync(kFullMask, st.mt, o);
            s2 = __shfl_xor_sync(kFullMask, st.st, o);
            cnt = __shfl_xor_sync(kFullMask, st.cnt, o);
        }
        merge_stats<RELAXED>(st, bv, bi, mt, s2, cnt);
    }
    if ((tid & 31) == 0) sh.warp[tid >> 5] = st;
    __syncthreads();
    if (tid == 0) {
        for (int w = 1; w < AC_WARPS; ++w) merge_stats<RELAXED>(st, sh.warp[w].bv, sh.warp[w].bi, sh.warp[w].mt,
                                                                sh.warp[w].st, sh.warp[w].cnt);
        sh.block = st;
    }
    cluster_sync();
    if (cluster_rank() == 0 && tid == 0) {
        for (unsigned r = 1; r < cs; ++r) {
            const RowStats o = *cluster_peer(&sh.block, r);
            merge_stats<RELAXED>(st, o.bv, o.bi, o.mt, o.st, o.cnt);
        }
        int32_t res = st.bi;
        if (RELAXED && d_ok && st.cnt < topk && st.st > 0.f) {
            const float pd = expf(ld - st.mt) / st.st, p1 = 1.f / st.st;
            if (pd >= p1 - delta) res |= kOkBit;
        }
        out_tokens[row] = res;
    }
    cluster_sync();  // the peers' shared memory stays until the first block has read it
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

// ---- rejection sampling --------------------------------------------------------------------------------------
// W = floor(min(max(w, 0), 1) * 2^40), exactly, from the float's bits (NaN -> 0): w = m * 2^(e - 150) for a
// normal w with m the 24-bit significand, so W = m shifted by e - 110; w < 2^-40 gives 0.
__device__ __forceinline__ unsigned long long quantize_w(float w) {
    w = fminf(fmaxf(w, 0.f), 1.f);  // NaN -> 0
    const uint32_t u = __float_as_uint(w);
    const int e = static_cast<int>((u >> 23) & 0xffu);  // -0 has e = 0 too
    if (e == 0) return 0;
    const unsigned long long m = (u & 0x7fffffu) | 0x800000u;
    const int sh = e - 110;
    return sh >= 0 ? m << sh : (sh > -24 ? m >> -sh : 0ull);
}

struct RejectShared {
    unsigned long long warp[AC_WARPS];
    unsigned long long total[2];  // this block's weight sum, per pass (read by the other blocks)
    int n, tok;
};

// The smallest j in [j0, j1) with W_j0 + ... + W_j > target (the caller knows the part's sum exceeds target): the
// part in segments of AC_THREADS x 8 values, each thread 8 consecutive ones, a block scan per segment.
template <typename T>
__device__ int find_token(const T* prow, const T* qrow, int j0, int j1, unsigned long long target, RejectShared& sh) {
    constexpr int PER = 8;
    unsigned long long cum = 0;
    for (int s0 = j0; s0 < j1; s0 += AC_THREADS * PER) {
        const int a0 = s0 + static_cast<int>(threadIdx.x) * PER;
        unsigned long long w[PER], mine = 0;
#pragma unroll
        for (int e = 0; e < PER; ++e) {
            const int j = a0 + e;
            w[e] = j < j1 ? quantize_w(to_f<T>(prow[j]) - (qrow ? to_f<T>(qrow[j]) : 0.f)) : 0ull;
            mine += w[e];
        }
        unsigned long long seg;
        const unsigned long long before = cum + block_exclusive_scan<AC_THREADS>(mine, sh.warp, &seg);
        if (before <= target && target < before + mine) {  // exactly one thread
            unsigned long long c = before;
            for (int e = 0; e < PER; ++e) {
                c += w[e];
                if (c > target) {
                    sh.tok = a0 + e;
                    break;
                }
            }
        }
        cum += seg;
        if (cum > target) break;  // block-uniform
    }
    __syncthreads();
    return sh.tok;
}

template <typename T>
__global__ void __launch_bounds__(AC_THREADS, 1) rejection_kernel(
    const T* __restrict__ p, const T* __restrict__ q, const int32_t* __restrict__ drafts,
    const float* __restrict__ uniforms, int32_t* __restrict__ out_tokens,
    int32_t* __restrict__ num_accepted, int32_t* __restrict__ last_index, int K, int V) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    RejectShared& sh = *reinterpret_cast<RejectShared*>(smem_raw);
    const unsigned cs = cluster_size(), rank = cluster_rank();
    const int b = static_cast<int>(blockIdx.x / cs), tid = threadIdx.x;
    const float* u = uniforms + static_cast<long long>(b) * (K + 1);
    if (tid == 0) {  // every block of the cluster: the K tests are a few element reads
        int n = 0;
        for (; n < K; ++n) {
            const int d = drafts[static_cast<long long>(b) * K + n];
            if (d < 0 || d >= V) break;
            const float pd = to_f<T>(p[(static_cast<long long>(b) * (K + 1) + n) * V + d]);
            const float qd = to_f<T>(q[(static_cast<long long>(b) * K + n) * V + d]);
            const bool acc = qd > 0.f ? (u[n] < pd / qd) : (pd > 0.f);
            if (!acc) break;
        }
        sh.n = n;
    }
    __syncthreads();
    const int n = sh.n;
    const T* prow = p + (static_cast<long long>(b) * (K + 1) + n) * V;
    const T* qrow = n < K ? q + (static_cast<long long>(b) * K + n) * V : nullptr;
    int j0, j1;
    row_part(V, j0, j1);

    // Weight sums: this block's part (mine), the parts before it (before) and the row (total).
    unsigned long long mine = 0, before = 0, total = 0;
    for (int pass = 0; pass < 2; ++pass) {
        unsigned long long w = 0;
        for_each_value<T>(prow, qrow, j0, j1, [&](int, float pv, float qv) { w += quantize_w(pv - qv); });
        block_exclusive_scan<AC_THREADS>(w, sh.warp, &mine);
        if (tid == 0) sh.total[pass] = mine;
        cluster_sync();
        before = total = 0;
        for (unsigned r = 0; r < cs; ++r) {
            const unsigned long long t = *cluster_peer(&sh.total[pass], r);
            if (r < rank) before += t;
            total += t;
        }
        if (total != 0 || !qrow) break;  // the same in every block
        qrow = nullptr;                  // residual vanished: sample from p
    }
    int32_t* o = out_tokens + static_cast<long long>(b) * (K + 1);
    if (total != 0) {
        float uf = u[K];
        uf = (uf >= 0.f) ? uf : 0.f;  // also NaN -> 0
        unsigned long long U = static_cast<unsigned long long>(uf * 16777216.0f);  // floor(u * 2^24)
        U = U > 16777215ull ? 16777215ull : U;
        const unsigned long long lo = U * total, hi = __umul64hi(U, total);
        const unsigned long long thr = (hi << 40) | (lo >> 24);  // floor(U * total / 2^24) < total
        if (before <= thr && thr < before + mine) {  // exactly one block
            const int tok = find_token<T>(prow, qrow, j0, j1, thr - before, sh);
            if (tid == 0) o[n] = tok;
        }
    }
    if (rank == 0 && tid == 0) {
        for (int i = 0; i < n; ++i) o[i] = drafts[static_cast<long long>(b) * K + i];
        if (total == 0) o[n] = 0;  // degenerate rows (all weights 0) give token 0
        for (int i = n + 1; i <= K; ++i) o[i] = -1;
        num_accepted[b] = n;
        last_index[b] = n;
    }
    cluster_sync();  // the peers' sums stay until every block has read them
}

// ---- launch shape --------------------------------------------------------------------------------------------
std::atomic<int> g_clusters[kMaxDevices];  // per device: 0 not asked yet, 1 no clusters, 2 clusters

// Blocks per row: 1 where clusters cannot be launched (before sm_90, or code JIT-compiled from older PTX), else the
// smallest power of two that gives the SMs a block each, at most 8 and no part under AC_MIN_VALUES values.
int blocks_per_row(long long rows, int V) {
    const int dev = current_device();
    if (dev < 0 || dev >= kMaxDevices) return 1;
    if (g_clusters[dev].load(std::memory_order_relaxed) == 0) {
        cudaFuncAttributes attr{};
        const bool ok = cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(greedy_rows_kernel<float, false>)) ==
                            cudaSuccess && attr.ptxVersion >= 90;
        cudaGetLastError();
        g_clusters[dev].store(ok ? 2 : 1, std::memory_order_relaxed);
    }
    if (g_clusters[dev].load(std::memory_order_relaxed) != 2) return 1;
    const int sms = current_num_sms();
    int cs = 1;
    while (cs < AC_MAX_CLUSTER && rows * cs < sms && static_cast<long long>(V) >= 2LL * cs * AC_MIN_VALUES) cs *= 2;
    return cs;
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
        const int cs = blocks_per_row(rows, V);
        if (rows * cs > 0x7fffffffLL) return cudaErrorInvalidValue;
        const unsigned blocks = static_cast<unsigned>(rows * cs);
        cudaError_t e = cudaSuccess;
        if (flags) {
            MTP_DISPATCH_DTYPE(dtype, T,
                               e = launch_clusters(greedy_rows_kernel<T, true>, blocks, AC_THREADS,
                                                   sizeof(GreedyShared), stream, cs, static_cast<const T*>(logits),
                                                   drafts, draft_stride, out_tokens, K, V, topk, delta, topk_dev,
                                                   delta_dev));
        } else {
            MTP_DISPATCH_DTYPE(dtype, T,
                               e = launch_clusters(greedy_rows_kernel<T, false>, blocks, AC_THREADS,
                                                   sizeof(GreedyShared), stream, cs, static_cast<const T*>(logits),
                                                   drafts, draft_stride, out_tokens, K, V, 0, 0.f,
                                                   static_cast<const int32_t*>(nullptr),
                                                   static_cast<const float*>(nullptr)));
        }
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
    const int cs = blocks_per_row(B, V);
    if (static_cast<long long>(B) * cs > 0x7fffffffLL) return cudaErrorInvalidValue;
    cudaError_t e = cudaSuccess;
    MTP_DISPATCH_DTYPE(dtype, T,
                       e = launch_clusters(rejection_kernel<T>, static_cast<unsigned>(B * cs), AC_THREADS,
                                           sizeof(RejectShared), stream, cs, static_cast<const T*>(p),
                                           static_cast<const T*>(q), drafts, uniforms, out_tokens, num_accepted,
                                           last_index, K, V));
    return e;
}
