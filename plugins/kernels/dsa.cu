// dsa.cu -- DeepSeek Sparse Attention's lightning indexer: index scores over the cached keys and the top-k
// selection.  Interface and semantics: mtp_kernels.h (section 4).  Reference: plugins/reference.py::dsa_select.
//
// Workspace, per query token: its scores as order-preserving 32-bit keys [T_max rounded up to 4] (0 marks a row the
// token does not see; every score's key is >= 1) and a state block: three radix histograms of the keys (bits
// 31..21, 20..10 and 9..0) and the per-chunk row counts of the multi-block selection.
//
// 1. dsa_zero_kernel clears the histograms the later kernels add into.
// 2. Scoring, grid (512-row chunk, query token, sequence).  fp16/bf16 with Di % 32 == 0, Di <= 128 and 16-byte
//    aligned rows: tensor cores.  8 warps; each takes 16-row tiles and loads its rows' keys straight into mma A
//    fragments (16-byte loads; each chunk of the next tile's as soon as this tile's is used), multiplied with the
//    query held in shared memory (B fragments, 16-byte loads): all Hi heads x 16 rows in 32 fp32 accumulators per
//    lane, then the weighted ReLU sum over the heads in registers and a quad shuffle.  Otherwise a SIMT kernel, one
//    thread per row.  Both write the keys and add a histogram of their top 11 bits (shared memory, then one global
//    atomic per non-empty bin) into the token's first histogram: the scores are read once.
// 3. Selection, an exact radix select of the K-th largest key from the histograms.  T_max <= 32768: one 512-thread
//    block per token (dsa_select_one_kernel) refines bits 20..10 and 9..0 among the rows of the cut bin in shared
//    memory, then writes the rows in order.  Larger: the rows are cut into chunks of >= 8192 (at most 64 per
//    token), one block each, and four launches do the same steps (dsa_select_pass_kernel: refine level 2, refine
//    level 3, count each chunk's rows above / equal to the threshold, write), each block re-deriving the
//    threshold from the global histograms.  Rows are written in ascending order: every row above the threshold and
//    the earliest rows equal to it (ties: the earlier row wins), then -1.
#include <math.h>

#include "common.cuh"

namespace mtp {
namespace {

constexpr int DSA_MAX_HEADS = 64;
constexpr int SC_ROWS = 512;  // rows per scoring block (both paths)
constexpr int TC_WARPS = 8;
constexpr int TC_THREADS = TC_WARPS * 32;
constexpr int TC_TILES = SC_ROWS / 16 / TC_WARPS;  // 16-row tiles per warp
constexpr int TC_MAX_KC = 4;                       // 32-value chunks of a key: Di <= 128 on the tensor-core path
constexpr int SIMT_THREADS = 128;
constexpr int SEL_THREADS = 512;
constexpr int SEL_WARPS = SEL_THREADS / 32;
constexpr int SEL_STEP = 4 * SEL_THREADS;  // rows per step of a selection pass: 4 per thread, one 16-byte load
constexpr int SEL_ONE_BLOCK_ROWS = 32768;  // T_max up to this: one block per token selects
constexpr int SEL_CHUNK = 8192;            // above: chunks of at least this many rows, one block each
constexpr int SEL_MAX_CHUNKS = 64;
constexpr int NB1 = 2048, NB2 = 2048, NB3 = 1024;  // histogram bins: key bits 31..21, 20..10, 9..0
constexpr int STATE_WORDS = NB1 + NB2 + NB3 + 2 * SEL_MAX_CHUNKS;
static_assert(STATE_WORDS * 4 == MTP_DSA_STATE_BYTES, "mtp_kernels.h documents the state size");

struct DsaParams {
    const void* q;        // [B, S, Hi, Di]
    const float* w;       // [B, S, Hi]
    const void* cache;    // [B, T_max, C], key at key_offset
    const int32_t* past_len;
    const uint8_t* mask;  // [B, S, S] or NULL (causal)
    uint32_t* keys;       // [B*S][Tp]
    uint32_t* state;      // [B*S][STATE_WORDS]: histograms 1, 2, 3, chunk counts (above, equal) x SEL_MAX_CHUNKS
    int32_t* selected;    // [B, S, K]
    int S, Hi, Di, C, key_offset, T_max, Tp, K, chunk;  // chunk: rows per selection block
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

// Score -> 32-bit key of the same order: -0 equals +0, a NaN of either sign is above +inf, and no score gives 0.
__device__ __forceinline__ uint32_t score_key(float x) {
    if (isnan(x)) return 0xffffffffu;
    if (x == 0.f) x = 0.f;
    const uint32_t u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// max(x, 0) that keeps a NaN (numpy.maximum's rule, which the reference follows; fmaxf would drop it).
__device__ __forceinline__ float relu_keep_nan(float x) { return (x > 0.f || isnan(x)) ? x : 0.f; }

__device__ __forceinline__ uint32_t* token_state(const DsaParams& p, size_t tok) { return p.state + tok * STATE_WORDS; }

// Add a block's shared histogram into a global one (the non-empty bins).
template <int NBINS, int THREADS>
__device__ __forceinline__ void flush_histogram(const uint32_t* shist, uint32_t* ghist) {
    for (int i = threadIdx.x; i < NBINS; i += THREADS)
        if (const uint32_t n = shist[i]) atomicAdd(&ghist[i], n);
}

// ---- 1. clear the histograms --------------------------------------------------------------------------------
__global__ void dsa_zero_kernel(uint32_t* state, int words) {
    uint32_t* st = state + static_cast<size_t>(blockIdx.x) * STATE_WORDS;
    for (int i = threadIdx.x; i < words; i += blockDim.x) st[i] = 0;
}

// ---- 2. scores ------------------------------------------------------------------------------------------------
// Row stride of the staged query on the tensor-core path, in elements: 64 mod 128 bytes, so the 8 lanes of each
// phase of a 16-byte load (two heads x 64 bytes) hit distinct banks.
__host__ __device__ inline int tc_q_stride(int Di) { return Di % 64 == 0 ? Di + 32 : Di; }
__host__ __device__ inline int simt_q_stride(int Di) { return (Di + 7) / 8 * 8; }

// This lane's 16 bytes of rows r and r + 8 in 32-value chunk kc of the key (zeros past row L - 1).
template <typename T>
__device__ __forceinline__ void load_key_chunk(uint4& ra, uint4& rb, const T* keys, int C, int r, int L, int kc) {
    const T* pa = keys + static_cast<size_t>(r) * C + kc * 32;
    ra = r < L ? *reinterpret_cast<const uint4*>(pa) : make_uint4(0, 0, 0, 0);
    rb = r + 8 < L ? *reinterpret_cast<const uint4*>(pa + static_cast<size_t>(8) * C) : make_uint4(0, 0, 0, 0);
}

// Tensor-core scores.  A lane (g = lane / 4, cq = lane % 4) holds values 8cq .. 8cq+7 of each 32-value chunk of its
// rows g and g + 8; two mma.m16n8k16 per chunk take its first and second halves.  The k order inside an mma is a
// permutation of the chunk's values, the same for the keys (A) and the query (B: lane g's head, the same values),
// so the products are the plain dot products.  Accumulator acc[hb] = rows (g, g + 8) x heads 8hb + 2cq, +1.
template <typename T>
__global__ void __launch_bounds__(TC_THREADS, 2) dsa_score_tc_kernel(const DsaParams p) {
    __shared__ uint32_t hist[NB1];
    __shared__ float sw[DSA_MAX_HEADS];
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sq = reinterpret_cast<T*>(smem_raw);  // [8 * nhb][QS], heads past Hi zero
    const int s = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
    const size_t tok = static_cast<size_t>(b) * p.S + s;
    int c;
    const int L = dsa_rows(p, b, c);
    const int row0 = blockIdx.x * SC_ROWS;
    if (row0 >= L) return;
    const int Hi = p.Hi, nhb = (Hi + 7) / 8, nkc = p.Di / 32, QS = tc_q_stride(p.Di), vph = p.Di / 8;
    const uint4* q = reinterpret_cast<const uint4*>(static_cast<const T*>(p.q) + tok * Hi * p.Di);
    for (int i = tid; i < nhb * 8 * vph; i += TC_THREADS) {
        const int h = i / vph, v = i - h * vph;
        *reinterpret_cast<uint4*>(sq + h * QS + v * 8) = h < Hi ? q[h * vph + v] : make_uint4(0, 0, 0, 0);
    }
    for (int j = tid; j < DSA_MAX_HEADS; j += TC_THREADS) sw[j] = j < Hi ? p.w[tok * Hi + j] : 0.f;
    for (int i = tid; i < NB1; i += TC_THREADS) hist[i] = 0;
    __syncthreads();

    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, cq = lane & 3;
    const T* keys = static_cast<const T*>(p.cache) + static_cast<size_t>(b) * p.T_max * p.C + p.key_offset + 8 * cq;
    uint32_t* out = p.keys + tok * p.Tp;
    uint4 ra[TC_MAX_KC], rb[TC_MAX_KC];  // the tile's keys; each chunk is reloaded with the next tile's once used
#pragma unroll
    for (int kc = 0; kc < TC_MAX_KC; ++kc)
        if (kc < nkc) load_key_chunk(ra[kc], rb[kc], keys, p.C, row0 + warp * 16 + g, L, kc);
#pragma unroll
    for (int i = 0; i < TC_TILES; ++i) {
        const int r0 = row0 + (warp + i * TC_WARPS) * 16;
        if (r0 >= L) break;
        float acc[8][4];
#pragma unroll
        for (int hb = 0; hb < 8; ++hb) acc[hb][0] = acc[hb][1] = acc[hb][2] = acc[hb][3] = 0.f;
#pragma unroll
        for (int kc = 0; kc < TC_MAX_KC; ++kc) {
            if (kc >= nkc) break;
#pragma unroll
            for (int hb = 0; hb < 8; ++hb) {
                if (hb >= nhb) break;
                const uint4 qv = *reinterpret_cast<const uint4*>(sq + (hb * 8 + g) * QS + kc * 32 + 8 * cq);
                Mma<T>::run(acc[hb], ra[kc].x, rb[kc].x, ra[kc].y, rb[kc].y, qv.x, qv.y);
                Mma<T>::run(acc[hb], ra[kc].z, rb[kc].z, ra[kc].w, rb[kc].w, qv.z, qv.w);
            }
            if (i + 1 < TC_TILES) load_key_chunk(ra[kc], rb[kc], keys, p.C, r0 + TC_WARPS * 16 + g, L, kc);
        }
        float s0 = 0.f, s1 = 0.f;  // rows g and g + 8, this lane's heads
#pragma unroll
        for (int hb = 0; hb < 8; ++hb) {
            if (hb >= nhb) break;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int h = hb * 8 + 2 * cq + j;
                if (h < Hi) {
                    s0 = fmaf(sw[h], relu_keep_nan(acc[hb][j] * p.scale), s0);
                    s1 = fmaf(sw[h], relu_keep_nan(acc[hb][2 + j] * p.scale), s1);
                }
            }
        }
        s0 += __shfl_xor_sync(kFullMask, s0, 1);
        s1 += __shfl_xor_sync(kFullMask, s1, 1);
        s0 += __shfl_xor_sync(kFullMask, s0, 2);
        s1 += __shfl_xor_sync(kFullMask, s1, 2);
        const int t = r0 + g + (cq & 1) * 8;  // lane cq 0 writes row g, lane 1 row g + 8
        if (cq < 2 && t < L) {
            const uint32_t key = dsa_visible(p, b, t, c, s) ? score_key(cq ? s1 : s0) : 0u;
            out[t] = key;
            if (key) atomicAdd(&hist[key >> 21], 1u);
        }
    }
    __syncthreads();
    flush_histogram<NB1, TC_THREADS>(hist, token_state(p, tok));
}

// SIMT scores (fp32, or dims / alignments the tensor-core path does not take): one thread per row, the query as
// fp32 in shared memory, one accumulator per head in registers.
template <typename T>
__global__ void __launch_bounds__(SIMT_THREADS, 1) dsa_score_simt_kernel(const DsaParams p) {
    __shared__ uint32_t hist[NB1];
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int Hi = p.Hi, Di = p.Di, QS = simt_q_stride(Di);
    float* sq = reinterpret_cast<float*>(smem_raw);  // [Hi][QS], zero-padded
    float* sw = sq + Hi * QS;                        // [Hi]
    const int s = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
    const size_t tok = static_cast<size_t>(b) * p.S + s;
    int c;
    const int L = dsa_rows(p, b, c);
    const int row0 = blockIdx.x * SC_ROWS;
    if (row0 >= L) return;
    const T* q = static_cast<const T*>(p.q) + tok * Hi * Di;
    for (int i = tid; i < Hi * QS; i += SIMT_THREADS) {
        const int j = i / QS, d = i - j * QS;
        sq[i] = d < Di ? to_f<T>(q[j * Di + d]) : 0.f;
    }
    for (int j = tid; j < Hi; j += SIMT_THREADS) sw[j] = p.w[tok * Hi + j];
    for (int i = tid; i < NB1; i += SIMT_THREADS) hist[i] = 0;
    __syncthreads();

    uint32_t* out = p.keys + tok * p.Tp;
    for (int i = 0; i < SC_ROWS / SIMT_THREADS; ++i) {
        const int t = row0 + i * SIMT_THREADS + tid;
        if (t >= L) break;
        uint32_t key = 0;
        if (dsa_visible(p, b, t, c, s)) {
            const T* k = static_cast<const T*>(p.cache) + (static_cast<size_t>(b) * p.T_max + t) * p.C + p.key_offset;
            float acc[DSA_MAX_HEADS];
#pragma unroll
            for (int j = 0; j < DSA_MAX_HEADS; ++j) acc[j] = 0.f;
            for (int d0 = 0; d0 < Di; d0 += 8) {
                float kv[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) kv[e] = d0 + e < Di ? to_f<T>(k[d0 + e]) : 0.f;
#pragma unroll
                for (int j = 0; j < DSA_MAX_HEADS; ++j) {
                    if (j < Hi) {
                        const float* qj = sq + j * QS + d0;
                        float a = acc[j];
#pragma unroll
                        for (int e = 0; e < 8; ++e) a = fmaf(qj[e], kv[e], a);
                        acc[j] = a;
                    }
                }
            }
            float score = 0.f;
#pragma unroll
            for (int j = 0; j < DSA_MAX_HEADS; ++j)
                if (j < Hi) score = fmaf(sw[j], relu_keep_nan(acc[j] * p.scale), score);
            key = score_key(score);
        }
        out[t] = key;
        if (key) atomicAdd(&hist[key >> 21], 1u);
    }
    __syncthreads();
    flush_histogram<NB1, SIMT_THREADS>(hist, token_state(p, tok));
}

// ---- 3. selection ---------------------------------------------------------------------------------------------
struct SelShared {
    uint32_t hist[NB2];
    int warp[SEL_WARPS];
    unsigned long long warp64[SEL_WARPS];
    int bin, need, total, base_above, base_equal;
};

// Among the rows counted in `hist` (NBINS bins, the highest first): the bin holding the need-th largest row
// (sh.bin) and how many of that bin's rows are still needed (sh.need, 1 .. hist[bin]); sh.total = rows counted.
// sh.bin / sh.need are meaningful when 1 <= need <= sh.total.  Called by the whole block.
template <int NBINS>
__device__ void find_cut(const uint32_t* hist, int need, SelShared& sh) {
    constexpr int PER = NBINS / SEL_THREADS;
    const int top = NBINS - 1 - static_cast<int>(threadIdx.x) * PER;  // this thread's bins: top, top - 1, ...
    int n[PER], mine = 0;
#pragma unroll
    for (int k = 0; k < PER; ++k) mine += n[k] = static_cast<int>(hist[top - k]);
    int total;
    const int before = block_exclusive_scan<SEL_THREADS>(mine, sh.warp, &total);
    if (before < need && need <= before + mine) {
        int acc = before;
        for (int k = 0; k < PER; ++k) {
            if (acc + n[k] >= need) {
                sh.bin = top - k;
                sh.need = need - acc;
                break;
            }
            acc += n[k];
        }
    }
    if (threadIdx.x == 0) sh.total = total;
    __syncthreads();
}

// Keys t0 .. t0+3 (t0 % 4 == 0), zero past `hi`.
__device__ __forceinline__ void load_keys4(const uint32_t* keys, int t0, int hi, uint32_t (&k)[4]) {
    if (t0 + 3 < hi) {
        const uint4 v = *reinterpret_cast<const uint4*>(keys + t0);
        k[0] = v.x, k[1] = v.y, k[2] = v.z, k[3] = v.w;
    } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) k[j] = t0 + j < hi ? keys[t0 + j] : 0u;
    }
}

// sh.hist = histogram of bits (bin_shift .. bin_shift + log2 NBINS - 1) of the keys of rows lo .. hi-1 whose bits
// above match_shift equal `prefix` (a prefix of a real key is never 0, so unseen rows never match).
template <int NBINS>
__device__ void refine_rows(const uint32_t* keys, int lo, int hi, uint32_t prefix, int match_shift, int bin_shift,
                            SelShared& sh) {
    for (int i = threadIdx.x; i < NBINS; i += SEL_THREADS) sh.hist[i] = 0;
    __syncthreads();
    for (int t0 = lo + 4 * static_cast<int>(threadIdx.x); t0 < hi; t0 += SEL_STEP) {
        uint32_t k[4];
        load_keys4(keys, t0, hi, k);
        int run_bin = -1;
        uint32_t run = 0;  // equal neighbours (ties) cost one shared atomic
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if ((k[j] >> match_shift) != prefix) continue;
            const int bin = static_cast<int>((k[j] >> bin_shift) & (NBINS - 1));
            if (bin != run_bin) {
                if (run) atomicAdd(&sh.hist[run_bin], run);
                run_bin = bin;
                run = 0;
            }
            ++run;
        }
        if (run) atomicAdd(&sh.hist[run_bin], run);
    }
    __syncthreads();
}

// Of keys k[0 .. min(n, 4) - 1]: how many are above thr (high word) and equal to it (low word).
__device__ __forceinline__ unsigned long long above_equal(const uint32_t (&k)[4], uint32_t thr, int n) {
    unsigned long long c = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) c += (k[j] > thr ? 1ull << 32 : 0ull) + (k[j] == thr && j < n ? 1ull : 0ull);
    return c;
}

// Rows lo .. hi-1 above thr (high word) and equal to it (low word), summed over the block (every thread gets it).
__device__ unsigned long long count_rows(const uint32_t* keys, int lo, int hi, uint32_t thr, SelShared& sh) {
    unsigned long long mine = 0;
    for (int t0 = lo + 4 * static_cast<int>(threadIdx.x); t0 < hi; t0 += SEL_STEP) {
        uint32_t k[4];
        load_keys4(keys, t0, hi, k);
        mine += above_equal(k, thr, hi - t0);
    }
    unsigned long long total;
    block_exclusive_scan<SEL_THREADS>(mine, sh.warp64, &total);
    return total;
}

// Write the rows lo .. hi-1 that are taken -- every row above thr and the rows equal to it while fewer than `need`
// came before -- at their ranks in the token's ascending list.  above / equal: such rows before lo.
__device__ void emit_rows(const uint32_t* keys, int lo, int hi, uint32_t thr, int need, int above, int equal,
                          int32_t* out, int K, SelShared& sh) {
    for (int base = lo; base < hi; base += SEL_STEP) {
        const int t0 = base + 4 * static_cast<int>(threadIdx.x);
        uint32_t k[4];
        load_keys4(keys, t0, hi, k);
        unsigned long long mine = 0;
        mine += above_equal(k, thr, hi - t0);
        unsigned long long total;
        const unsigned long long before = block_exclusive_scan<SEL_THREADS>(mine, sh.warp64, &total);
        int a = above + static_cast<int>(before >> 32), e = equal + static_cast<int>(before & 0xffffffffu);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (t0 + j >= hi) break;
            if (k[j] > thr) {
                const int pos = a + min(e, need);
                if (pos < K) out[pos] = t0 + j;
                ++a;
            } else if (k[j] == thr) {
                if (e < need) out[a + e] = t0 + j;
                ++e;
            }
        }
        above += static_cast<int>(total >> 32);
        equal += static_cast<int>(total & 0xffffffffu);
    }
}

__device__ __forceinline__ void fill_unused(int32_t* out, int taken, int K) {
    for (int i = taken + static_cast<int>(threadIdx.x); i < K; i += SEL_THREADS) out[i] = -1;
}

// The whole selection of one token in one block (T_max <= SEL_ONE_BLOCK_ROWS): grid (S, B).
__global__ void __launch_bounds__(SEL_THREADS) dsa_select_one_kernel(const DsaParams p) {
    __shared__ SelShared sh;
    const int s = blockIdx.x, b = blockIdx.y;
    const size_t tok = static_cast<size_t>(b) * p.S + s;
    int c;
    const int L = dsa_rows(p, b, c);
    const uint32_t* keys = p.keys + tok * p.Tp;
    int32_t* out = p.selected + tok * p.K;
    find_cut<NB1>(token_state(p, tok), p.K, sh);
    const bool all = sh.total <= p.K;  // at most K visible rows: take them all (thr 0 = above every unseen row)
    const int taken = all ? sh.total : p.K;
    uint32_t thr = 0;
    int need = 0;
    if (!all) {
        uint32_t prefix = static_cast<uint32_t>(sh.bin);
        need = sh.need;
        refine_rows<NB2>(keys, 0, L, prefix, 21, 10, sh);
        find_cut<NB2>(sh.hist, need, sh);
        prefix = prefix << 11 | static_cast<uint32_t>(sh.bin);
        need = sh.need;
        refine_rows<NB3>(keys, 0, L, prefix, 10, 0, sh);
        find_cut<NB3>(sh.hist, need, sh);
        thr = prefix << 10 | static_cast<uint32_t>(sh.bin);
        need = sh.need;
    }
    emit_rows(keys, 0, L, thr, need, 0, 0, out, p.K, sh);
    fill_unused(out, taken, p.K);
}

// One step of the selection over chunks (T_max > SEL_ONE_BLOCK_ROWS): grid (chunk, S, B).  Every block finds the
// threshold as far as the histograms before its step allow.
enum SelPass { kRefine2 = 0, kRefine3 = 1, kCount = 2, kEmit = 3 };

template <int PASS>
__global__ void __launch_bounds__(SEL_THREADS) dsa_select_pass_kernel(const DsaParams p) {
    __shared__ SelShared sh;
    const int g = blockIdx.x, s = blockIdx.y, b = blockIdx.z;
    const size_t tok = static_cast<size_t>(b) * p.S + s;
    int c;
    const int L = dsa_rows(p, b, c);
    const int lo = g * p.chunk, hi = min(L, lo + p.chunk);
    const uint32_t* keys = p.keys + tok * p.Tp;
    uint32_t* h1 = token_state(p, tok);
    uint32_t *h2 = h1 + NB1, *h3 = h2 + NB2, *counts = h3 + NB3;
    find_cut<NB1>(h1, p.K, sh);
    const bool all = sh.total <= p.K;
    const int taken = all ? sh.total : p.K;
    if (all && PASS < kCount) return;  // nothing to refine
    uint32_t thr = 0;
    int need = 0;
    if (!all) {
        uint32_t prefix = static_cast<uint32_t>(sh.bin);
        need = sh.need;
        if (PASS == kRefine2) {
            refine_rows<NB2>(keys, lo, hi, prefix, 21, 10, sh);
            flush_histogram<NB2, SEL_THREADS>(sh.hist, h2);
            return;
        }
        find_cut<NB2>(h2, need, sh);
        prefix = prefix << 11 | static_cast<uint32_t>(sh.bin);
        need = sh.need;
        if (PASS == kRefine3) {
            refine_rows<NB3>(keys, lo, hi, prefix, 10, 0, sh);
            flush_histogram<NB3, SEL_THREADS>(sh.hist, h3);
            return;
        }
        find_cut<NB3>(h3, need, sh);
        thr = prefix << 10 | static_cast<uint32_t>(sh.bin);
        need = sh.need;
    }
    if (PASS == kCount) {
        const unsigned long long n = count_rows(keys, lo, hi, thr, sh);
        if (threadIdx.x == 0) {
            counts[2 * g] = static_cast<uint32_t>(n >> 32);
            counts[2 * g + 1] = static_cast<uint32_t>(n & 0xffffffffu);
        }
        return;
    }
    if (threadIdx.x == 0) {
        int above = 0, equal = 0;
        for (int j = 0; j < g; ++j) {
            above += static_cast<int>(counts[2 * j]);
            equal += static_cast<int>(counts[2 * j + 1]);
        }
        sh.base_above = above;
        sh.base_equal = equal;
    }
    __syncthreads();
    int32_t* out = p.selected + tok * p.K;
    emit_rows(keys, lo, hi, thr, need, sh.base_above, sh.base_equal, out, p.K, sh);
    if (g == 0) fill_unused(out, taken, p.K);
}

__host__ __device__ inline int round_up(int x, int a) { return (x + a - 1) / a * a; }

}  // namespace
}  // namespace mtp

using namespace mtp;

extern "C" size_t mtp_dsa_select_workspace_size(int B, int S, int T_max) {
    if (B <= 0 || S <= 0 || T_max <= 0) return 0;
    const size_t tokens = static_cast<size_t>(B) * S;
    return align_up(tokens * round_up(T_max, 4) * sizeof(uint32_t), 256) + align_up(tokens * MTP_DSA_STATE_BYTES, 256);
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
    if (!workspace || !aligned16(workspace) || workspace_bytes < mtp_dsa_select_workspace_size(B, S, T_max))
        return cudaErrorInvalidValue;
    const size_t simt_smem = sizeof(float) * (static_cast<size_t>(Hi) * simt_q_stride(Di) + Hi);
    if (simt_smem > 48 * 1024) return cudaErrorInvalidValue;

    const int Tp = round_up(T_max, 4);
    const size_t tokens = static_cast<size_t>(B) * S;
    uint32_t* keys = static_cast<uint32_t*>(workspace);
    uint32_t* state = reinterpret_cast<uint32_t*>(static_cast<char*>(workspace) + align_up(tokens * Tp * 4, 256));
    int chunk = round_up(T_max, SEL_STEP), nchunks = 1;
    if (T_max > SEL_ONE_BLOCK_ROWS) {
        chunk = max(SEL_CHUNK, round_up((T_max + SEL_MAX_CHUNKS - 1) / SEL_MAX_CHUNKS, SEL_STEP));
        nchunks = (T_max + chunk - 1) / chunk;
    }
    const DsaParams p{q_index, weights, kv_cache, past_len, mask, keys, state, selected,
                      S, Hi, Di, C, key_offset, T_max, Tp, K, chunk, scale};  // (in DsaParams' order)

    dsa_zero_kernel<<<static_cast<unsigned>(tokens), 256, 0, stream>>>(state, nchunks > 1 ? NB1 + NB2 + NB3 : NB1);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;

    const int es = dtype_size(dtype);
    const bool tc = dtype != MTP_DTYPE_F32 && Di % 32 == 0 && Di <= 32 * TC_MAX_KC && aligned16(q_index) &&
                    aligned16(kv_cache) && (static_cast<size_t>(C) * es) % 16 == 0 &&
                    (static_cast<size_t>(key_offset) * es) % 16 == 0;
    const dim3 grid(static_cast<unsigned>((T_max + SC_ROWS - 1) / SC_ROWS), S, B);
    if (tc) {
        const size_t smem = static_cast<size_t>((Hi + 7) / 8 * 8) * tc_q_stride(Di) * es;
        if (dtype == MTP_DTYPE_F16)
            dsa_score_tc_kernel<__half><<<grid, TC_THREADS, smem, stream>>>(p);
        else
            dsa_score_tc_kernel<__nv_bfloat16><<<grid, TC_THREADS, smem, stream>>>(p);
    } else {
        // the static histogram (8 KB) and the query: above the default 48 KB, ask for the rest
        if (simt_smem + NB1 * 4 > 48 * 1024) {
            MTP_DISPATCH_DTYPE(dtype, T,
                               err = cudaFuncSetAttribute(dsa_score_simt_kernel<T>,
                                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                          static_cast<int>(simt_smem)));
            if (err != cudaSuccess) return err;
        }
        MTP_DISPATCH_DTYPE(dtype, T, dsa_score_simt_kernel<T><<<grid, SIMT_THREADS, simt_smem, stream>>>(p));
    }
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;

    if (nchunks == 1) {
        dsa_select_one_kernel<<<dim3(S, B), SEL_THREADS, 0, stream>>>(p);
        return cudaGetLastError();
    }
    const dim3 sel_grid(static_cast<unsigned>(nchunks), S, B);
    dsa_select_pass_kernel<kRefine2><<<sel_grid, SEL_THREADS, 0, stream>>>(p);
    dsa_select_pass_kernel<kRefine3><<<sel_grid, SEL_THREADS, 0, stream>>>(p);
    dsa_select_pass_kernel<kCount><<<sel_grid, SEL_THREADS, 0, stream>>>(p);
    dsa_select_pass_kernel<kEmit><<<sel_grid, SEL_THREADS, 0, stream>>>(p);
    return cudaGetLastError();
}
