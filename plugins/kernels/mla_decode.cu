// mla_decode.cu -- MLA generation attention over the compressed latent cache (split-KV).
// Interface and semantics: mtp_kernels.h.  Reference: plugins/reference.py::mla_decode.
//
// Grid of the attention kernels: x = tile of query rows (the S*H rows of one sequence, in
// (s, h) order), y = KV split, z = sequence.  The query tiles of one (sequence, split) are
// adjacent in launch order, so they run together and share the latent rows through L2.
// Inside a block each latent row is loaded once (16-byte cp.async) into shared memory and used
// by all the block's query rows for both products (scores with the whole row, P.V with its first
// Dl values).  Softmax is online in base 2 (scores pre-multiplied by scale * log2 e).
// Causal cut: without a tree mask a query tile stops at the last row its last query may see (cache
// length + its new-token index), so a prefill tile reads only its own prefix of the new rows (half the
// work of a long prompt); splits past it are empty and weigh nothing in the combine.
// Sparse mode (DeepSeek Sparse Attention, mtp_mla_sparse_decode): every query token is a "sequence" of its own
// (grid z = B * S, one new token, H query rows) whose rows are the K cache rows its index list names, in list
// order; a slot holding -1 (or a row outside the cache) is hidden.  The same kernels, the row loads and the
// visibility test going through the list.
// Device attributes (SM count, opt-in shared memory) are read once per device and each kernel's
// shared-memory limit is raised once per device, not on every launch.
#include <math.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "common.cuh"
#include "hopper.cuh"

namespace mtp {
namespace {

struct MlaParams {
    const void* q;
    const void* cache;
    const int32_t* past_len;
    const uint8_t* mask;
    void* out;      // written directly by a sequence's only split
    float* opart;   // fp32 partial outputs: v1 [B*M][nsplit][Dl]; v2 [slot][M][Dl]
    float2* ml;     // (max, sum) of each partial output: v1 [B*M][nsplit]; v2 [slot][M]
    int4* part_sched;  // v2 persistent grid: per part (first sequence, first tile, last sequence, end tile)
    int2* seq_sched;   // v2 persistent grid: per sequence (first part, number of parts)
    int S, H, Dl, D, T_max, nsplit;  // v2: nsplit = parts of the persistent grid (1: one block per sequence)
    int stride;          // values per cache row (D, or more: DSA rows continue with the indexer key)
    const int32_t* sel;  // sparse mode: [B*Sq][K] cache rows per query token (-1: none); NULL: dense
    int K, Sq;           // sparse mode: slots per query token, query tokens per sequence
    float scale_log2;
};

// Rows c .. of sequence b: c = clamped past_len, returns L = rows after the commit.
__device__ __forceinline__ int seq_rows(const MlaParams& p, int b, int& c) {
    if (p.sel) {  // the K slots of query token b
        c = 0;
        return p.K;
    }
    int cl = p.past_len[b];
    cl = max(0, min(cl, p.T_max));
    c = cl;
    return min(cl + p.S, p.T_max);
}

// Rows a query tile must read: the causal limit of its last query row m_last (cache length c + its new-token
// index + 1), or all L rows with a tree mask (any new row may be visible).
__device__ __forceinline__ int tile_rows(const MlaParams& p, int L, int c, int m_last) {
    return (p.mask || p.sel) ? L : min(L, c + m_last / p.H + 1);
}

// [start, end) rows of split `sp` (chunk rounded up to the tile; may be empty).
__device__ __forceinline__ void split_range(int L, int nsplit, int sp, int tile, int& start,
                                            int& end) {
    int chunk = (L + nsplit - 1) / nsplit;
    chunk = (chunk + tile - 1) / tile * tile;
    const long long s0 = static_cast<long long>(sp) * chunk;
    start = static_cast<int>(min(s0, static_cast<long long>(L)));
    end = static_cast<int>(min(s0 + chunk, static_cast<long long>(L)));
}

// May query s (new token s of sequence b) attend to cache row t (t < L)?
__device__ __forceinline__ bool visible(int t, int c, int s, int S, const uint8_t* mask_b) {
    if (t < c) return true;
    const int j = t - c;
    return mask_b ? (mask_b[s * S + j] != 0) : (j <= s);
}

// Cache row behind row (or slot) t of sequence b, -1 if it is hidden (sparse mode); dense: t itself.
__device__ __forceinline__ int cache_row(const MlaParams& p, int b, int t) {
    if (!p.sel) return t;
    const int r = p.sel[static_cast<size_t>(b) * p.K + t];
    return (r >= 0 && r < p.T_max) ? r : -1;
}

// visible() for row (or slot) t of sequence b: sparse mode: the slot names a row.
__device__ __forceinline__ bool row_visible(const MlaParams& p, int b, int t, int c, int s, const uint8_t* mask_b) {
    return p.sel ? cache_row(p, b, t) >= 0 : visible(t, c, s, p.S, mask_b);
}

// The cache rows of sequence b (sparse mode: of the sequence query token b belongs to).
template <typename T>
__device__ __forceinline__ const T* cache_of(const MlaParams& p, int b) {
    const int seq = p.sel ? b / p.Sq : b;
    return static_cast<const T*>(p.cache) + static_cast<size_t>(seq) * p.T_max * p.stride;
}

// =============================================================================================
// v2: DeepSeek's shapes (Dl = 512, Dr = 64), fp16 / bf16.  One pass over the latent cache serves R query rows.
//
// Rows are packed m = s * H + h; a block takes R = min(64, M rounded up to 16) consecutive rows (an "m-block"),
// so at H = 128 a KV tile read into shared memory serves 64 heads at once, and at H = 16 one block holds all the
// heads of up to 4 MTP tokens: the cache is read once per m-block, not once per 32 query rows.
// Block = 8 warps.  Per KV tile of KT rows:
//   scores   QK warp (rg, cg) computes S[16 rows x NW columns] over all 576 dimensions with mma.sync (Q and K
//            fragments by ldmatrix from shared memory); the scores stay in registers.
//   softmax  the row max is exchanged between the CG warps of a row through shared memory; each warp keeps the
//            running max and its own share of the running sum; P goes to shared memory rounded to T.
//   P V      every warp owns 64 of the 512 output columns for all R rows (R / 16 x 8 mma tiles: 128 fp32
//            registers per thread at R = 64).
// The P.V of tile i runs beside the scores of tile i+1 (software pipeline), so a tile costs two block barriers:
//   X  tile i landed; P(i-1) and its rescale factors visible; every read of iteration i-1 done
//      -> prefetch tile i+NS-2 (NS stages: i-1 is still read by P.V, i by the scores)
//      -> scores(i) and their row max | P(i-1).V(i-1)
//   Y  row maxes visible; P(i-1) consumed -> softmax(i): P(i), the rescale factors
// Shared memory (16-bit elements, rows padded by 8 elements: 1168 B = 292 words = 4 mod 32, so ldmatrix's eight
// 16-byte rows hit distinct banks): sQ [R][584], sK [NS][KT][584], sP [R][KT+8], fp32 sMax [CG][R], sAlpha [R],
// sL [CG][R], sM [R].  KT = 32 where shared memory allows (sm_90 / sm_100: 193 KB at R = 64, 3 stages), else 16
// (A100: 154 KB at R = 64, 4 stages; 99 KB parts: R <= 32, 95 KB, 3 stages).  Fewer query rows leave room for
// more stages (up to 5), so the memory-bound shapes (H = 16) keep more tiles in flight.
//
// Grid (m-block, part): nsplit == 1: part = sequence, one block per (m-block, sequence), output written directly.
// nsplit = P > 1 (persistent): the tiles of all sequences, in order, are cut into P equal runs by
// mla_v2_schedule_kernel on the device from past_len (so the grid does not depend on the lengths: CUDA graphs and
// TensorRT need that); part p takes run p, which may end in one sequence and go on in the next.  A sequence run
// by one part is written directly; otherwise each of its parts writes fp32 partials to slot p + b (unique,
// since parts and sequences advance together) and mla_v2_combine_kernel merges them.  The m-blocks of a part
// are adjacent in launch order (blockIdx.x), so the blocks that read a tile run together and share it in L2.
// =============================================================================================
constexpr int V2_DL = 512;
constexpr int V2_D = 576;
constexpr int V2_RS = V2_D + 8;   // row stride of sQ and sK (elements)
constexpr int V2_CHUNKS = V2_D / 8;  // 16-byte chunks per row
constexpr int V2_THREADS = 256;
constexpr int V2_MIN_TILES = 4;  // a part takes at least this many tiles: its Q load and its partials (128 KB at
                                 // R = 64) cost about as much as reading a few tiles

template <int R, int KT>
struct V2 {
    static constexpr int RG = R / 16;                                   // row groups of the scores
    static constexpr int CG = (8 / RG) < (KT / 8) ? 8 / RG : KT / 8;    // column groups of the scores
    static constexpr int NW = KT / CG;                                   // score columns per warp: 8 or 16
    static constexpr int QK_WARPS = RG * CG;
    static constexpr int RB = R / 16;                                    // row blocks of P.V
    static constexpr int PS = KT + 8;                                    // row stride of sP (elements)
    // KV stages: the scores read tile i, P.V tile i-1, so tiles i+1 .. i+NS-2 can be in flight.  As many as
    // fit beside sQ: with KT = 32 in 227 KB (sm_90, sm_100), with KT = 16 in 99 KB (R <= 32) or 163 KB (R = 64).
    static constexpr int NS = KT == 32 ? (R == 64 ? 3 : R == 32 ? 4 : 5) : (R == 32 ? 3 : 4);
    static constexpr int AHEAD = NS - 2;                                 // tiles in flight
    static constexpr size_t K_OFF = static_cast<size_t>(R) * V2_RS * 2;
    static constexpr size_t P_OFF = K_OFF + static_cast<size_t>(NS) * KT * V2_RS * 2;
    static constexpr size_t MAX_OFF = P_OFF + static_cast<size_t>(R) * PS * 2;
    static constexpr size_t ALPHA_OFF = MAX_OFF + sizeof(float) * CG * R;
    static constexpr size_t L_OFF = ALPHA_OFF + sizeof(float) * R;
    static constexpr size_t M_OFF = L_OFF + sizeof(float) * CG * R;
    static constexpr size_t BYTES = M_OFF + sizeof(float) * R;
    static_assert(NW == 8 || NW == 16, "score columns per warp");
    static_assert(QK_WARPS <= 8, "warps");
};

// Tiles of KT rows that sequence b attends over (dense: the rows after the commit; sparse: the K slots).
__device__ __forceinline__ int v2_tiles(const MlaParams& p, int b, int KT) {
    int c;
    return (seq_rows(p, b, c) + KT - 1) / KT;
}

// One block: the persistent schedule of `nseq` sequences over P parts (and nothing else).  Part p takes global
// tiles [p * payload, (p + 1) * payload), payload = max(ceil(total / P), V2_MIN_TILES); empty parts get x = -1.
__device__ void v2_schedule(const MlaParams& p, int nseq, int KT) {
    __shared__ int s_warp[32];
    __shared__ int s_carry;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const int P = p.nsplit;
    // pass 1: the total
    int local = 0;
    for (int b = tid; b < nseq; b += blockDim.x) local += v2_tiles(p, b, KT);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) local += __shfl_xor_sync(kFullMask, local, o);
    if (lane == 0) s_warp[warp] = local;
    if (tid == 0) s_carry = 0;
    __syncthreads();
    int total = 0;
    for (int w = 0; w < nwarps; ++w) total += s_warp[w];
    int payload = (total + P - 1) / P;
    payload = max(payload, V2_MIN_TILES);
    for (int q = tid; q < P; q += blockDim.x)
        if (static_cast<long long>(q) * payload >= total) p.part_sched[q] = make_int4(-1, 0, -1, 0);
    __syncthreads();  // s_warp is reused below
    // pass 2: an exclusive scan of the tile counts, chunk by chunk
    for (int b0 = 0; b0 < nseq; b0 += blockDim.x) {
        const int b = b0 + tid;
        const int n = b < nseq ? v2_tiles(p, b, KT) : 0;
        int incl = n;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(kFullMask, incl, o);
            if (lane >= o) incl += v;
        }
        if (lane == 31) s_warp[warp] = incl;
        __syncthreads();
        int before = s_carry;
        for (int w = 0; w < warp; ++w) before += s_warp[w];
        const int start = before + incl - n;
        if (b < nseq) {
            const int first = start / payload, last = (start + n - 1) / payload;
            p.seq_sched[b] = make_int2(first, last - first + 1);
            for (int q = first; q <= last; ++q) {
                const int q0 = q * payload, q1 = min((q + 1) * payload, total);
                if (q0 >= start) reinterpret_cast<int2*>(p.part_sched + q)[0] = make_int2(b, q0 - start);
                if (q1 <= start + n) reinterpret_cast<int2*>(p.part_sched + q)[1] = make_int2(b, q1 - start);
            }
        }
        __syncthreads();
        if (tid == blockDim.x - 1) s_carry = before + incl;
        __syncthreads();
    }
}

// Before the attention: the KV commit (blocks 0 .. B*S-1, rows in 16-byte units, when new_rows is given) and, in
// the last block, the persistent schedule (when P > 1).
__global__ void __launch_bounds__(128) mla_v2_prologue_kernel(const MlaParams p, uint4* cache, const uint4* new_rows,
                                                              int ncommit, int S, int units, int nseq, int KT) {
    hopper::grid_launch_dependents();  // v3's main kernel may start; it waits for this grid before reading
    if (static_cast<int>(blockIdx.x) < ncommit) {
        const int row = blockIdx.x;
        const int b = row / S, s = row - b * S;
        const int c = max(0, min(static_cast<int>(p.past_len[b]), p.T_max));
        const int t = c + s;
        if (t >= p.T_max) return;
        uint4* dst = cache + (static_cast<size_t>(b) * p.T_max + t) * units;
        const uint4* src = new_rows + static_cast<size_t>(row) * units;
        for (int i = threadIdx.x; i < units; i += blockDim.x) dst[i] = src[i];
        return;
    }
    v2_schedule(p, nseq, KT);
}

template <typename T, int R, int KT>
__global__ void __launch_bounds__(V2_THREADS, 1) mla_v2_kernel(const MlaParams p) {
    using C = V2<R, KT>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = reinterpret_cast<T*>(smem_raw + C::K_OFF);
    T* sP = reinterpret_cast<T*>(smem_raw + C::P_OFF);
    float* sMax = reinterpret_cast<float*>(smem_raw + C::MAX_OFF);
    float* sAlpha = reinterpret_cast<float*>(smem_raw + C::ALPHA_OFF);
    float* sL = reinterpret_cast<float*>(smem_raw + C::L_OFF);
    float* sM = reinterpret_cast<float*>(smem_raw + C::M_OFF);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, c4 = lane & 3;
    const int M = p.S * p.H;
    const int m0 = blockIdx.x * R;
    const int nq = min(R, M - m0);  // query rows of this block
    // score role: warp (rg, cg) -> rows rg*16 + {g, g+8}, columns cg*NW + 8 nb + 2 c4 + {0, 1} of each tile
    const bool qk = warp < C::QK_WARPS;
    const int rg = warp % C::RG, cg = warp / C::RG;
    const int row_of[2] = {rg * 16 + g, rg * 16 + g + 8};
    int tok_of[2];  // the new token (s) of each score row, for the causal or tree mask
#pragma unroll
    for (int h = 0; h < 2; ++h) tok_of[h] = min((m0 + row_of[h]) / p.H, p.S - 1);

    // This block's run: sequences bf .. bl, from tile tf of bf to tile tl (exclusive) of bl.
    int bf, tf, bl, tl;
    if (p.nsplit > 1) {
        const int4 run = p.part_sched[blockIdx.y];
        if (run.x < 0) return;  // an empty part: the whole block leaves
        bf = run.x, tf = run.y, bl = run.z, tl = run.w;
    } else {
        bf = bl = blockIdx.y;
        tf = 0;
        tl = v2_tiles(p, bf, KT);
    }

    for (int b = bf; b <= bl; ++b) {
        int c;
        const int L = seq_rows(p, b, c);
        const int nt = (L + KT - 1) / KT;
        const int tb = b == bf ? tf : 0;
        int te = b == bl ? tl : nt;
        const bool direct = tb == 0 && te == nt;  // the sequence's only part
        const int lim = tile_rows(p, L, c, m0 + nq - 1);  // rows this m-block may see (the causal cut)
        te = min(te, (lim + KT - 1) / KT);
        const int n = max(0, te - tb);
        const T* cache_b = cache_of<T>(p, b);
        const T* q_b = static_cast<const T*>(p.q) + (static_cast<size_t>(b) * M + m0) * V2_D;
        const uint8_t* mask_b = p.mask ? p.mask + static_cast<size_t>(b) * p.S * p.S : nullptr;

        auto load_tile = [&](int i, int stage) {  // tile tb + i into stage
            T* dst = sK + stage * KT * V2_RS;
            const int t0 = (tb + i) * KT;
            for (int e = tid; e < KT * V2_CHUNKS; e += V2_THREADS) {
                const int r = e / V2_CHUNKS, k8 = e - r * V2_CHUNKS;
                const int t = t0 + r;
                const int row = t < L ? cache_row(p, b, t) : -1;
                cp_async16(dst + r * V2_RS + k8 * 8,
                           cache_b + static_cast<size_t>(row >= 0 ? row : 0) * p.stride + k8 * 8, row >= 0);
            }
        };
        if (n > 0)
            for (int e = tid; e < R * V2_CHUNKS; e += V2_THREADS) {
                const int r = e / V2_CHUNKS, k8 = e - r * V2_CHUNKS;
                cp_async16(sQ + r * V2_RS + k8 * 8, q_b + static_cast<size_t>(r < nq ? r : 0) * V2_D + k8 * 8, r < nq);
            }
#pragma unroll
        for (int i = 0; i < C::AHEAD; ++i) {  // Q and the first tiles, a cp.async group each
            if (i < n) load_tile(i, i);
            cp_async_commit();
        }

        float acc[C::RB][8][4];
#pragma unroll
        for (int rb = 0; rb < C::RB; ++rb)
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[rb][j][e] = 0.f;
        float sc[C::NW / 8][4];
        float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

        // O = alpha * O + P . V over the tile in `stage` (every warp: its 64 columns, all R rows)
        auto pv = [&](int stage) {
            const T* sV = sK + stage * KT * V2_RS;
#pragma unroll
            for (int rb = 0; rb < C::RB; ++rb) {
                const float a0 = sAlpha[rb * 16 + g], a1 = sAlpha[rb * 16 + g + 8];
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    acc[rb][j][0] *= a0;
                    acc[rb][j][1] *= a0;
                    acc[rb][j][2] *= a1;
                    acc[rb][j][3] *= a1;
                }
            }
#pragma unroll
            for (int kk = 0; kk < KT / 16; ++kk) {
                uint32_t a[C::RB][4];
#pragma unroll
                for (int rb = 0; rb < C::RB; ++rb)
                    ldsm_x4(a[rb][0], a[rb][1], a[rb][2], a[rb][3],
                            sP + (rb * 16 + (lane & 15)) * C::PS + kk * 16 + (lane >> 4) * 8);
                const T* vrow = sV + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * V2_RS + warp * 64 + (lane >> 4) * 8;
#pragma unroll
                for (int j = 0; j < 8; j += 2) {
                    uint32_t b00, b01, b10, b11;
                    ldsm_x4_trans(b00, b01, b10, b11, vrow + j * 8);
#pragma unroll
                    for (int rb = 0; rb < C::RB; ++rb) {
                        Mma<T>::run(acc[rb][j], a[rb][0], a[rb][1], a[rb][2], a[rb][3], b00, b01);
                        Mma<T>::run(acc[rb][j + 1], a[rb][0], a[rb][1], a[rb][2], a[rb][3], b10, b11);
                    }
                }
            }
        };

        for (int i = 0; i < n; ++i) {
            const int stage = i % C::NS;
            cp_async_wait<C::AHEAD - 1>();  // tile i (group i) landed
            __syncthreads();                 // X
            if (i + C::AHEAD < n) load_tile(i + C::AHEAD, (i + C::AHEAD) % C::NS);  // its stage was last read by P.V(i-2)
            cp_async_commit();
            const int t0 = (tb + i) * KT;
            if (qk) {
                // ---- scores S = Q . K^T for 16 rows x NW columns, all 576 dimensions
#pragma unroll
                for (int nb = 0; nb < C::NW / 8; ++nb)
#pragma unroll
                    for (int e = 0; e < 4; ++e) sc[nb][e] = 0.f;
                const T* sKt = sK + stage * KT * V2_RS;
                const T* qa = sQ + (rg * 16 + (lane & 15)) * V2_RS + (lane >> 4) * 8;
                if constexpr (C::NW == 16) {
                    const T* kb = sKt + (cg * 16 + ((lane >> 4) << 3) + (lane & 7)) * V2_RS + ((lane >> 3) & 1) * 8;
#pragma unroll 4
                    for (int ks = 0; ks < V2_D / 16; ++ks) {
                        uint32_t a0, a1, a2, a3, b00, b01, b10, b11;
                        ldsm_x4(a0, a1, a2, a3, qa + ks * 16);
                        ldsm_x4(b00, b01, b10, b11, kb + ks * 16);
                        Mma<T>::run(sc[0], a0, a1, a2, a3, b00, b01);
                        Mma<T>::run(sc[1], a0, a1, a2, a3, b10, b11);
                    }
                } else {
                    const T* kb = sKt + (cg * 8 + (lane & 7)) * V2_RS + (lane >> 3) * 8;
#pragma unroll 2
                    for (int ks = 0; ks < V2_D / 16; ks += 2) {
                        uint32_t a0, a1, a2, a3, b0, b1, b2, b3;
                        ldsm_x4(b0, b1, b2, b3, kb + ks * 16);
                        ldsm_x4(a0, a1, a2, a3, qa + ks * 16);
                        Mma<T>::run(sc[0], a0, a1, a2, a3, b0, b1);
                        ldsm_x4(a0, a1, a2, a3, qa + ks * 16 + 16);
                        Mma<T>::run(sc[0], a0, a1, a2, a3, b2, b3);
                    }
                }
                // ---- scale to log2 units, hide what the row may not see, this warp's row max
                const bool all_visible = !p.sel && t0 + KT <= c;  // only cached rows: every query sees them
                float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
                for (int nb = 0; nb < C::NW / 8; ++nb)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int h = e >> 1;
                        const int t = t0 + cg * C::NW + nb * 8 + 2 * c4 + (e & 1);
                        bool ok = row_of[h] < nq;
                        if (!all_visible) ok = ok && t < L && row_visible(p, b, t, c, tok_of[h], mask_b);
                        const float x = ok ? finite_score(sc[nb][e] * p.scale_log2) : -INFINITY;
                        sc[nb][e] = x;
                        mx[h] = fmaxf(mx[h], x);
                    }
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    mx[h] = fmaxf(mx[h], __shfl_xor_sync(kFullMask, mx[h], 1));
                    mx[h] = fmaxf(mx[h], __shfl_xor_sync(kFullMask, mx[h], 2));
                    if (c4 == 0) sMax[cg * R + row_of[h]] = mx[h];
                }
            }
            if (i > 0) pv((i - 1) % C::NS);
            __syncthreads();  // Y
            if (qk) {
                // ---- online softmax: the tile's row max over the CG warps, P rounded to T, this warp's row sums
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = row_of[h];
                    float tmax = sMax[r];
#pragma unroll
                    for (int w = 1; w < C::CG; ++w) tmax = fmaxf(tmax, sMax[w * R + r]);
                    const float m_new = fmaxf(m_run[h], tmax);
                    const float alpha = m_new == -INFINITY ? 1.f : exp2f(m_run[h] - m_new);
                    float ls = 0.f;
#pragma unroll
                    for (int nb = 0; nb < C::NW / 8; ++nb) {
                        const float x0 = sc[nb][2 * h], x1 = sc[nb][2 * h + 1];
                        const float p0 = x0 == -INFINITY ? 0.f : exp2f(x0 - m_new);
                        const float p1 = x1 == -INFINITY ? 0.f : exp2f(x1 - m_new);
                        const T q0 = from_f<T>(p0), q1 = from_f<T>(p1);
                        *reinterpret_cast<uint32_t*>(sP + r * C::PS + cg * C::NW + nb * 8 + 2 * c4) = pack2_raw(q0, q1);
                        ls += to_f<T>(q0) + to_f<T>(q1);  // the denominator sums the rounded weights
                    }
                    l_run[h] = l_run[h] * alpha + ls;
                    m_run[h] = m_new;
                    if (cg == 0 && c4 == 0) sAlpha[r] = alpha;
                }
            }
        }
        if (n > 0) {
            __syncthreads();  // P of the last tile visible
            pv((n - 1) % C::NS);
        }

        // ---- epilogue: row sums over the quad and the CG warps; direct output or fp32 partials
        if (qk) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float l = l_run[h];
                l += __shfl_xor_sync(kFullMask, l, 1);
                l += __shfl_xor_sync(kFullMask, l, 2);
                if (c4 == 0) {
                    sL[cg * R + row_of[h]] = l;
                    if (cg == 0) sM[row_of[h]] = m_run[h];
                }
            }
        }
        __syncthreads();
        const int slot = blockIdx.y + b;  // persistent grid: part + sequence, unique per (sequence, part)
#pragma unroll
        for (int rb = 0; rb < C::RB; ++rb)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = rb * 16 + g + 8 * h;
                if (r >= nq) continue;
                float l = sL[r];
#pragma unroll
                for (int w = 1; w < C::CG; ++w) l += sL[w * R + r];
                const float inv = direct ? (l > 0.f ? 1.f / l : 0.f) : 1.f;
                const size_t orow = direct ? static_cast<size_t>(b) * M + m0 + r : static_cast<size_t>(slot) * M + m0 + r;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int col = warp * 64 + j * 8 + 2 * c4;
                    const float v0 = acc[rb][j][2 * h] * inv, v1 = acc[rb][j][2 * h + 1] * inv;
                    if (direct)
                        *reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + orow * V2_DL + col) = pack2<T>(v0, v1);
                    else
                        *reinterpret_cast<float2*>(p.opart + orow * V2_DL + col) = make_float2(v0, v1);
                }
                if (!direct && warp == 0 && c4 == 0) p.ml[orow] = make_float2(sM[r], l);
            }
        __syncthreads();  // sL / sM read; shared memory free for the next sequence
    }
}

// Combine of the persistent grid: a block per query row of a sequence run by several parts, each of its four warps
// taking 128 of the row's 512 output columns (one float4 per lane per part: many rows' loads in flight at batch 1).
// out = sum_k w_k O_k / sum_k w_k l_k, w_k = 2^(m_k - max m); empty parts have m = -inf, l = 0, O = 0 (weight 0).
constexpr int V2C_THREADS = 128;  // 4 warps x 128 columns = V2_DL

template <typename T>
__global__ void __launch_bounds__(V2C_THREADS) mla_v2_combine_kernel(const MlaParams p, int nseq) {
    __shared__ float sw[V2C_THREADS / 32][MTP_MLA_MAX_SPLITS];
    hopper::grid_dependency_wait();  // launched dependent on v3's main kernel: its partials complete and visible
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int M = p.S * p.H;
    const long long row = blockIdx.x;
    if (row >= static_cast<long long>(nseq) * M) return;
    const int b = static_cast<int>(row / M), m = static_cast<int>(row - static_cast<long long>(b) * M);
    const int2 ss = p.seq_sched[b];
    if (ss.y <= 1) return;  // written directly by its only part
    const size_t base = static_cast<size_t>(ss.x + b) * M + m;  // (slot of its first part, row)
    float mx = -INFINITY;
    for (int k = lane; k < ss.y; k += 32) mx = fmaxf(mx, p.ml[base + static_cast<size_t>(k) * M].x);
    mx = warp_max(mx);
    float lsum = 0.f;
    for (int k = lane; k < ss.y; k += 32) {
        const float2 v = p.ml[base + static_cast<size_t>(k) * M];
        const float w = mx == -INFINITY ? 0.f : exp2f(v.x - mx);
        sw[warp][k] = w;
        lsum += w * v.y;
    }
    lsum = warp_sum(lsum);
    __syncwarp();
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
    const float4* o = reinterpret_cast<const float4*>(p.opart + base * V2_DL) + 32 * warp + lane;
    const size_t step = static_cast<size_t>(M) * V2_DL / 4;  // float4s from one slot to the next
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int k = 0; k < ss.y; ++k) {
        const float w = sw[warp][k];
        const float4 v = o[k * step];
        a.x = fmaf(w, v.x, a.x);
        a.y = fmaf(w, v.y, a.y);
        a.z = fmaf(w, v.z, a.z);
        a.w = fmaf(w, v.w, a.w);
    }
    uint2 pk;
    pk.x = pack2<T>(a.x * inv, a.y * inv);
    pk.y = pack2<T>(a.z * inv, a.w * inv);
    *reinterpret_cast<uint2*>(static_cast<T*>(p.out) + (static_cast<size_t>(b) * M + m) * V2_DL + 128 * warp +
                              4 * lane) = pk;
}

// =============================================================================================
// v3: DeepSeek's shapes on Hopper (sm_90a): warpgroup MMA and TMA (hopper.cuh).  Same grid, schedule, workspace and
// combine as v2 (the prologue cuts the tiles of KT = 64 rows); dense launches and sparse lists.
//
// A block takes 64 query rows (m = s * H + h, rows past the sequence's M are computed and dropped) and two
// warpgroups.  Per 64-row KV tile (its 576 values as 9 slices of 64, each a TMA box of 64 x 64 landing 128-byte
// swizzled, 8 KB; all 9 on one mbarrier; a 3-D tensor map [sequence][T_max][stride], so a tile never reads another
// sequence's rows), with P(i) already in shared memory:
//   barrier A     P(i), its rescale factors and tile i's rows past the sequence's end (zeroed) visible
//   warpgroup 0   issues S(i + 1) = Q . K(i + 1)^T (36 wgmma m64n64k16, Q -- loaded once per segment by TMA -- and
//                 the tile both from shared memory, K-major) and its half of P(i) . V(i), waits for S(i + 1) only,
//                 and runs the mask and online softmax of tile i + 1 (a quad holds a row) while the tensor cores do
//                 P(i) . V(i)
//   warpgroup 1   its half of P(i) . V(i)
//                 (O = alpha O + P . V: warpgroup g owns output columns 256 g .. 256 g + 255, 4 x 32 fp32 registers
//                 per thread; V is the tile's first 8 slices read MN-major, no copy)
//   barrier B     P(i) . V(i) done: sP and tile i's stage free; one thread issues the TMA of tile i + 2 into it;
//                 warpgroup 0 publishes P(i + 1) (rounded to T) and its factors, zeroes tile i + 1's rows past the
//                 sequence's end (the cache there may hold NaN, and 0 * NaN would reach O), fences for the async proxy
// Sparse lists: a tile is 64 slots of the query token's list; TMA's tiled mode cannot gather rows, so every thread
// copies 18 of its 16-byte chunks by cp.async into the positions the TMA boxes would give them (zeros for a -1 slot
// and slots past the list), its copies completing on the stage's mbarrier (cp.async.mbarrier.arrive.noinc: the stage
// barriers expect 256 arrivals); the waiting threads fence for the async proxy before wgmma reads the tile, and the
// softmax masks every slot that names no row (a ballot of the tile's 64 list entries per warp).
// Two stages: tile i + 1 lands while tile i is computed.  The prologue, this kernel and the combine are chained by
// programmatic dependent launch: each waits (griddepcontrol.wait) before reading what the previous one wrote.
// Not yet done: FlashMLA's "seesaw" (each warpgroup computing S for half the rows so that both softmaxes overlap the
// other's MMA), a producer warp with setmaxnreg, deeper stages.
// Shared memory: 1 KB alignment slack, Q 72 KB, 2 stages of 72 KB, P 8 KB, 3 mbarriers, fp32 alpha / l / m per row.
// =============================================================================================
constexpr int V3_KT = 64;
constexpr int V3_THREADS = 256;
constexpr int V3_SLICES = V2_D / 64;  // 9
constexpr int V3_CHUNKS = V2_D / 8;   // 16-byte chunks per row (sparse loads)
constexpr uint32_t V3_SLICE = 64 * 128;
constexpr uint32_t V3_TILE = V3_SLICES * V3_SLICE;  // 73728
constexpr size_t V3_Q_OFF = 0, V3_K_OFF = V3_TILE, V3_P_OFF = 3 * V3_TILE, V3_BAR_OFF = V3_P_OFF + V3_SLICE;
constexpr size_t V3_ALPHA_OFF = V3_BAR_OFF + 64, V3_L_OFF = V3_ALPHA_OFF + 256, V3_M_OFF = V3_L_OFF + 256;
constexpr size_t V3_BYTES = 1024 + V3_M_OFF + 256;  // 231,232 bytes

// ---- v3's pieces, shared by its two schedules (warpgroup 128-thread fragments: hopper.cuh)

// A block's start on both schedules: the Q mbarrier and the NKV KV ones after it initialised (kv_arrivals per phase)
// and visible to the async proxy and the block; the prologue's commit and schedule awaited (programmatic dependent
// launch); then the run of the block's part, from tile tf of sequence bf to tile tl (exclusive) of sequence bl --
// false for an empty part of the persistent grid.
template <int NKV>
__device__ __forceinline__ bool v3_begin(const MlaParams& p, uint64_t* bar_q, unsigned kv_arrivals, int& bf, int& tf,
                                         int& bl, int& tl) {
    if (threadIdx.x == 0) {
        hopper::mbar_init(bar_q, 1);
#pragma unroll
        for (int k = 1; k <= NKV; ++k) hopper::mbar_init(bar_q + k, kv_arrivals);
        hopper::mbar_init_fence();
    }
    __syncthreads();
    hopper::grid_dependency_wait();  // the prologue's commit and schedule are complete and visible
    hopper::grid_launch_dependents();
    if (p.nsplit > 1) {
        const int4 run = p.part_sched[blockIdx.y];
        if (run.x < 0) return false;
        bf = run.x, tf = run.y, bl = run.z, tl = run.w;
    } else {
        bf = bl = blockIdx.y;
        tf = 0;
        tl = v2_tiles(p, bf, V3_KT);
    }
    return true;
}

// A thread's place in both schedules: its warpgroup (warp-uniform to the compiler, so wgmma stays in uniform
// branches), its lane's column pair c4, the block's first query row m0 of M and how many of its 64 are real (nq), and
// the thread's two rows of the accumulator fragment (16 w + lane / 4 and 8 more, warp w of its warpgroup) with the new
// token each belongs to.
struct V3Thread {
    int tid, lane, wg, c4, M, m0, nq;
    int row_of[2], tok_of[2];
};
__device__ __forceinline__ V3Thread v3_thread(const MlaParams& p) {
    V3Thread t;
    t.tid = threadIdx.x;
    t.lane = t.tid & 31;
    t.wg = __shfl_sync(kFullMask, t.tid >> 7, 0);
    t.c4 = t.lane & 3;
    t.M = p.S * p.H;
    t.m0 = blockIdx.x * 64;
    t.nq = min(64, t.M - t.m0);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        t.row_of[h] = 16 * ((t.tid >> 5) & 3) + (t.lane >> 2) + 8 * h;
        t.tok_of[h] = min((t.m0 + t.row_of[h]) / p.H, p.S - 1);
    }
    return t;
}

// Sequence b's share of the run for query rows up to m_last: committed rows c, rows L after the commit, first tile
// tb, tiles n (cut at the causal limit), whether the run holds all of its tiles (direct output), its tree mask.
struct V3Segment {
    int c, L, tb, n;
    bool direct;
    const uint8_t* mask_b;
};
__device__ __forceinline__ V3Segment v3_segment(const MlaParams& p, int b, int bf, int tf, int bl, int tl, int m_last) {
    V3Segment s;
    s.L = seq_rows(p, b, s.c);
    const int nt = (s.L + V3_KT - 1) / V3_KT;
    s.tb = b == bf ? tf : 0;
    int te = b == bl ? tl : nt;
    s.direct = s.tb == 0 && te == nt;
    te = min(te, (tile_rows(p, s.L, s.c, m_last) + V3_KT - 1) / V3_KT);
    s.n = max(0, te - s.tb);
    s.mask_b = p.mask ? p.mask + static_cast<size_t>(b) * p.S * p.S : nullptr;
    return s;
}

// The part of S = Q . K^T over the tile's slices J0 .. J1 - 1 (4 wgmma m64n64k16 each; Q and the tile at kt_base both
// K-major from shared memory), added to sc unless `first` (then the first product sets it).  Not committed.
template <typename T, int J0, int J1>
__device__ __forceinline__ void v3_score_slices(float (&sc)[32], uint32_t q_base, uint32_t kt_base, bool first) {
#pragma unroll
    for (int j = J0; j < J1; ++j)
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            const uint64_t da = hopper::smem_desc(q_base + j * V3_SLICE + 32 * ks, 16, 1024, hopper::kSwizzle128B);
            const uint64_t db = hopper::smem_desc(kt_base + j * V3_SLICE + 32 * ks, 16, 1024, hopper::kSwizzle128B);
            hopper::Wgmma64<T, false>::run(sc, da, db, !first || j > J0 || ks > 0);
        }
}

// S of one tile into sc: 36 wgmma; one commit group of its own, not waited for.
template <typename T>
__device__ __forceinline__ void v3_scores(float (&sc)[32], uint32_t q_base, uint32_t kt_base) {
    v3_score_slices<T, 0, V3_SLICES>(sc, q_base, kt_base, true);
    hopper::wgmma_commit();
}

// acc += P . V over output columns 256 half .. 256 half + 255: P the 64 x 64 K-major tile at p_base, V the tile's
// slices 4 half .. 4 half + 3 read MN-major (no copy); one commit group.  WIDE: one m64n256k16 per 16 rows of V
// (the four slices 8 KB apart: LBO), else four m64n64k16.
template <typename T, bool WIDE = false>
__device__ __forceinline__ void v3_pv(float (&acc)[4][32], uint32_t p_base, uint32_t kt_base, int half) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const uint64_t da = hopper::smem_desc(p_base + 32 * kk, 16, 1024, hopper::kSwizzle128B);
        if constexpr (WIDE) {
            const uint64_t db = hopper::smem_desc(kt_base + 4 * half * V3_SLICE + 2048 * kk, V3_SLICE, 1024,
                                                  hopper::kSwizzle128B);
            hopper::Wgmma256<T, true>::run(reinterpret_cast<float(&)[128]>(acc), da, db, true);
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint64_t db = hopper::smem_desc(kt_base + (4 * half + j) * V3_SLICE + 2048 * kk, 0, 1024,
                                                      hopper::kSwizzle128B);
                hopper::Wgmma64<T, true>::run(acc[j], da, db, true);
            }
        }
    }
    hopper::wgmma_commit();
}

// The scores of the tile whose first row (sparse: slot) is t0, for this thread's two rows: scaled to base 2, -inf
// where the row is past the block's queries or may not see the column; mx = each row's max over the tile (a quad
// holds a row).  Sparse lists: a ballot of the tile's 64 list entries per warp.
__device__ __forceinline__ void v3_mask_max(const MlaParams& p, int b, int L, int c, int t0, const uint8_t* mask_b,
                                            const int (&row_of)[2], const int (&tok_of)[2], int nq, int lane,
                                            float (&sc)[32], float (&mx)[2]) {
    const int c4 = lane & 3;
    const bool all_visible = !p.sel && t0 + V3_KT <= c;
    uint32_t listed[2] = {0u, 0u};  // sparse: bit r of listed[r / 32]: slot t0 + r names a cache row
    if (p.sel)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int t = t0 + 32 * h + lane;
            listed[h] = __ballot_sync(kFullMask, t < L && cache_row(p, b, t) >= 0);
        }
    mx[0] = mx[1] = -INFINITY;
#pragma unroll
    for (int i8 = 0; i8 < 8; ++i8)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int h = e >> 1;
            const int t = t0 + 8 * i8 + 2 * c4 + (e & 1);
            bool ok = row_of[h] < nq;
            if (p.sel) {  // slot t0 + 8 i8 + 2 c4 + (e & 1)
                ok = ok && ((listed[i8 >> 2] >> (8 * (i8 & 3) + 2 * c4 + (e & 1))) & 1u);
            } else if (!all_visible) {
                ok = ok && t < L && visible(t, c, tok_of[h], p.S, mask_b);
            }
            const float x = ok ? finite_score(sc[4 * i8 + e] * p.scale_log2) : -INFINITY;
            sc[4 * i8 + e] = x;
            mx[h] = fmaxf(mx[h], x);
        }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(kFullMask, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(kFullMask, mx[h], 2));
    }
}

// P = 2^(s - m) rounded to T (0 where s = -inf), in place; ls = this thread's share of each row's sum of the rounded
// weights (the denominator sums what P . V multiplies).
template <typename T>
__device__ __forceinline__ void v3_exp(float (&sc)[32], const float (&m)[2], float (&ls)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        ls[h] = 0.f;
#pragma unroll
        for (int i8 = 0; i8 < 8; ++i8)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float x = sc[4 * i8 + 2 * h + e];
                const float q = to_f<T>(from_f<T>(x == -INFINITY ? 0.f : exp2f(x - m[h])));
                sc[4 * i8 + 2 * h + e] = q;
                ls[h] += q;
            }
    }
}

// f[row] * P (rounded to T) into the 64 x 64 K-major 128-byte-swizzled tile at dst (P . V's A operand).
template <typename T>
__device__ __forceinline__ void v3_store_p(unsigned char* dst, const float (&sc)[32], const int (&row_of)[2], int c4,
                                           const float (&f)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row_of[h];
#pragma unroll
        for (int i8 = 0; i8 < 8; ++i8)
            *reinterpret_cast<uint32_t*>(dst + hopper::swizzle128((r >> 3) * 1024 + (r & 7) * 128 + 2 * (8 * i8 + 2 * c4))) =
                pack2<T>(sc[4 * i8 + 2 * h] * f[h], sc[4 * i8 + 2 * h + 1] * f[h]);
    }
}

// The rows of the tile in sKt (first row t0) past the sequence's end (L), zeroed in V's 8 slices for P . V (their P is
// 0, but the cache there may hold NaN and 0 * NaN would reach O); by the 128 threads of a warpgroup (tw: 0 .. 127).
__device__ __forceinline__ void v3_zero_tail(unsigned char* sKt, int t0, int L, int tw) {
    if (t0 + V3_KT <= L) return;
    for (int e = tw; e < V3_KT * 8 * 8; e += 128) {  // (row, slice, 16-byte chunk)
        const int r = e >> 6, j = (e >> 3) & 7, ch = e & 7;
        if (t0 + r >= L)
            *reinterpret_cast<uint4*>(sKt + j * V3_SLICE + hopper::swizzle128(r * 128 + ch * 16)) = make_uint4(0, 0, 0, 0);
    }
}

// acc rows scaled by f (this thread's two rows).
__device__ __forceinline__ void v3_scale(float (&acc)[4][32], const float (&f)[2]) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i8 = 0; i8 < 8; ++i8) {
            acc[j][4 * i8 + 0] *= f[0];
            acc[j][4 * i8 + 1] *= f[0];
            acc[j][4 * i8 + 2] *= f[1];
            acc[j][4 * i8 + 3] *= f[1];
        }
}

// This warpgroup's half of the block's output (columns 256 wg ..) for sequence b: divided by the row sums l (direct:
// the sequence's only part) or fp32 partials with (m, l) (v2's workspace layout, slot blockIdx.y + b).
template <typename T>
__device__ __forceinline__ void v3_store_out(const MlaParams& p, const float (&acc)[4][32], int b, int m0, int nq,
                                             const int (&row_of)[2], int wg, int c4, bool direct, const float (&m)[2],
                                             const float (&l)[2]) {
    const int M = p.S * p.H;
    const int slot = blockIdx.y + b;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row_of[h];
        if (r >= nq) continue;
        const float inv = direct ? (l[h] > 0.f ? 1.f / l[h] : 0.f) : 1.f;
        const size_t orow = direct ? static_cast<size_t>(b) * M + m0 + r : static_cast<size_t>(slot) * M + m0 + r;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int i8 = 0; i8 < 8; ++i8) {
                const int col = 256 * wg + 64 * j + 8 * i8 + 2 * c4;
                const float v0 = acc[j][4 * i8 + 2 * h] * inv, v1 = acc[j][4 * i8 + 2 * h + 1] * inv;
                if (direct)
                    *reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + orow * V2_DL + col) = pack2<T>(v0, v1);
                else
                    *reinterpret_cast<float2*>(p.opart + orow * V2_DL + col) = make_float2(v0, v1);
            }
        if (!direct && wg == 0 && c4 == 0) p.ml[orow] = make_float2(m[h], l[h]);
    }
}

template <typename T>
__global__ void __launch_bounds__(V3_THREADS, 1) mla_v3_kernel(const MlaParams p, const __grid_constant__ CUtensorMap tm_q,
                                                               const __grid_constant__ CUtensorMap tm_kv) {
#if defined(MTP_HAS_WGMMA) || defined(MTP_EMULATE_DEVICE)  // code for sm_90a only (v3_serves never launches it elsewhere)
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024u - (hopper::smem_addr(smem_raw) & 1023u)) & 1023u);
    unsigned char* sQ = smem + V3_Q_OFF;
    unsigned char* sK = smem + V3_K_OFF;
    unsigned char* sP = smem + V3_P_OFF;
    uint64_t* bar_q = reinterpret_cast<uint64_t*>(smem + V3_BAR_OFF);
    uint64_t* bar_kv = bar_q + 1;  // [2]
    float* sAlpha = reinterpret_cast<float*>(smem + V3_ALPHA_OFF);
    float* sL = reinterpret_cast<float*>(smem + V3_L_OFF);
    float* sM = reinterpret_cast<float*>(smem + V3_M_OFF);

    const V3Thread th = v3_thread(p);
    const int tid = th.tid, lane = th.lane, wg = th.wg, c4 = th.c4, M = th.M, m0 = th.m0, nq = th.nq;
    const int(&row_of)[2] = th.row_of;
    const int(&tok_of)[2] = th.tok_of;

    int bf, tf, bl, tl;  // sparse: every thread's cp.async arrives on the KV barriers; dense: the TMA issuer
    if (!v3_begin<2>(p, bar_q, p.sel ? V3_THREADS : 1, bf, tf, bl, tl)) return;
    const uint32_t q_base = hopper::smem_addr(sQ), k_base = hopper::smem_addr(sK), p_base = hopper::smem_addr(sP);
    unsigned q_phase = 0, it = 0;  // Q loads so far; KV tiles so far (stage it % 2, parity (it / 2) & 1)

    for (int b = bf; b <= bl; ++b) {
        const V3Segment seg = v3_segment(p, b, bf, tf, bl, tl, m0 + nq - 1);
        const int c = seg.c, L = seg.L, tb = seg.tb, n = seg.n;
        const bool direct = seg.direct;
        const uint8_t* mask_b = seg.mask_b;

        auto issue = [&](int i, unsigned stage) {  // tile tb + i into stage (one thread)
            hopper::mbar_arrive_expect_tx(bar_kv + stage, V3_TILE);
            for (int j = 0; j < V3_SLICES; ++j)
                hopper::tma_load_3d(sK + stage * V3_TILE + j * V3_SLICE, &tm_kv, 64 * j, (tb + i) * V3_KT, b,
                                    bar_kv + stage);
        };
        // sparse: tile tb + i's 64 slots into stage (every thread, 18 chunks each): the listed rows by 16-byte
        // cp.async into the layout the TMA boxes give (slice j of row r at j * V3_SLICE + swizzle128(r * 128 + ...)),
        // zeros for a -1 slot and slots past the list; each thread's copies complete on the stage's mbarrier
        const T* rows_b = p.sel ? cache_of<T>(p, b) : nullptr;
        auto gather = [&](int i, unsigned stage) {
            unsigned char* dst = sK + stage * V3_TILE;
            const int t0 = (tb + i) * V3_KT;
#pragma unroll 2
            for (int e = tid; e < V3_KT * V3_CHUNKS; e += V3_THREADS) {
                const int r = e / V3_CHUNKS, q = e - r * V3_CHUNKS;
                const int row = t0 + r < L ? cache_row(p, b, t0 + r) : -1;
                const T* src = rows_b + static_cast<size_t>(max(row, 0)) * p.stride + 8 * q;
                cp_async16(dst + (q >> 3) * V3_SLICE + hopper::swizzle128(r * 128 + (q & 7) * 16), src, row >= 0);
            }
            hopper::cp_async_mbar_arrive(bar_kv + stage);
        };
        auto load = [&](int i, unsigned stage) {  // tile tb + i into stage: sparse every thread, dense one
            if (p.sel)
                gather(i, stage);
            else if (tid == 0)
                issue(i, stage);
        };
        if (tid == 0 && n > 0) {
            hopper::mbar_arrive_expect_tx(bar_q, V3_TILE);
            for (int j = 0; j < V3_SLICES; ++j)
                hopper::tma_load_3d(sQ + j * V3_SLICE, &tm_q, 64 * j, m0, b, bar_q);
        }
        for (int i = 0; i < 2 && i < n; ++i) load(i, (it + i) & 1);

        float acc[4][32];
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 32; ++e) acc[j][e] = 0.f;
        float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
        float sc[32];        // warpgroup 0: the scores of the next tile, then its P (rounded to T, as floats)
        float alpha_n[2];    // warpgroup 0: that tile's rescale factors

        // warpgroup 0: S of tile k (in `stage`) issued into sc (a commit group of its own; not waited for)
        auto scores = [&](unsigned stage) { v3_scores<T>(sc, q_base, k_base + stage * V3_TILE); };
        // warpgroup 0, after S of tile k is complete: mask, online softmax (a quad holds a row) -> P in sc, alpha_n
        auto softmax = [&](int k) {
            float mx[2], m_new[2], ls[2];
            v3_mask_max(p, b, L, c, (tb + k) * V3_KT, mask_b, row_of, tok_of, nq, lane, sc, mx);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                m_new[h] = fmaxf(m_run[h], mx[h]);
                alpha_n[h] = m_new[h] == -INFINITY ? 1.f : exp2f(m_run[h] - m_new[h]);
            }
            v3_exp<T>(sc, m_new, ls);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                l_run[h] = l_run[h] * alpha_n[h] + ls[h];
                m_run[h] = m_new[h];
            }
        };
        // warpgroup 0, when sP and the tile's stage are free of readers: P and alpha to shared memory, the tile's rows
        // past the sequence's end zeroed (sparse: cp.async wrote zeros there); fenced for wgmma
        auto publish = [&](int k, unsigned stage) {
            const float one[2] = {1.f, 1.f};
            v3_store_p<T>(sP, sc, row_of, c4, one);
#pragma unroll
            for (int h = 0; h < 2; ++h)
                if (c4 == 0) sAlpha[row_of[h]] = alpha_n[h];
            if (!p.sel) v3_zero_tail(sK + stage * V3_TILE, (tb + k) * V3_KT, L, tid);
            hopper::fence_proxy_async();
        };

        if (n > 0) {
            hopper::mbar_wait(bar_q, q_phase & 1);
            ++q_phase;
            hopper::mbar_wait(bar_kv + (it & 1), (it >> 1) & 1);
            if (p.sel) hopper::fence_proxy_async();  // cp.async wrote the tile through the generic proxy
            if (wg == 0) {
                hopper::wgmma_fence();
                scores(it & 1);
                hopper::wgmma_wait<0>();
                hopper::fence_regs(sc);
                softmax(0);
                publish(0, it & 1);
            }
        }
        // Tile i: P(i) is published.  Warpgroup 0 issues S(i + 1), then its half of P(i) . V(i), waits for S(i + 1) only
        // and runs the softmax of tile i + 1 while the tensor cores do P(i) . V(i); warpgroup 1 does its half of
        // P(i) . V(i).  Two block barriers per tile.
        for (int i = 0; i < n; ++i) {
            const unsigned stage = (it + i) & 1, nstage = stage ^ 1u;
            const unsigned nparity = ((it + i + 1) >> 1) & 1;
            const bool next = i + 1 < n;
            __syncthreads();  // A: P(i), alpha(i) and tile i's zeroed rows visible
            {
                const float a[2] = {sAlpha[row_of[0]], sAlpha[row_of[1]]};
                v3_scale(acc, a);
            }
            const uint32_t kt_base = k_base + stage * V3_TILE;
            auto pv = [&]() { v3_pv<T>(acc, p_base, kt_base, wg); };  // this warpgroup's half of P(i) . V(i)
            if (wg == 0 && next) {
                hopper::mbar_wait(bar_kv + nstage, nparity);
                if (p.sel) hopper::fence_proxy_async();
                hopper::wgmma_fence();
                scores(nstage);
                pv();
                hopper::wgmma_wait<1>();  // S(i + 1) complete; P(i) . V(i) may still run
                hopper::fence_regs(sc);
                softmax(i + 1);
                hopper::wgmma_wait<0>();
            } else {
                hopper::wgmma_fence();
                pv();
                hopper::wgmma_wait<0>();
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) hopper::fence_regs(acc[j]);
            if (wg == 1 && next) {  // tile i + 1's data visible here too
                hopper::mbar_wait(bar_kv + nstage, nparity);
                if (p.sel) hopper::fence_proxy_async();
            }
            __syncthreads();  // B: P(i) . V(i) done: sP and stage i free
            if (i + 2 < n) load(i + 2, stage);
            if (wg == 0 && next) publish(i + 1, nstage);
        }
        it += n;

        // ---- epilogue: row sums over the quad; direct output or fp32 partials (v2's workspace layout)
        if (wg == 0) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float l = l_run[h];
                l += __shfl_xor_sync(kFullMask, l, 1);
                l += __shfl_xor_sync(kFullMask, l, 2);
                if (c4 == 0) {
                    sL[row_of[h]] = l;
                    sM[row_of[h]] = m_run[h];
                }
            }
        }
        __syncthreads();
        {
            const float m[2] = {sM[row_of[0]], sM[row_of[1]]}, l[2] = {sL[row_of[0]], sL[row_of[1]]};
            v3_store_out<T>(p, acc, b, m0, nq, row_of, wg, c4, direct, m, l);
        }
        __syncthreads();  // sL / sM read
    }
#else
    __trap();
#endif
}


// =============================================================================================
// v3 "seesaw" (dense launches, sm_90a; chosen by MTP_MLA_SEESAW or MTP_TRT_MLA_PATH=seesaw): v3's tiles, loads,
// layouts, grid and combine with FlashMLA's seesaw schedule.  The two warpgroups take the scores and softmax of
// alternate tiles, so one warpgroup's softmax runs while the other's products keep the tensor cores busy, and each
// owns half of the output columns (O_L: warpgroup 0, O_R: warpgroup 1) throughout.  Tiles go in pairs: tile 2k in
// buffer 0 (its scores and softmax on warpgroup 0), tile 2k + 1 in buffer 1 (warpgroup 1).  The running max m is
// shared, in shared memory; scale0 and scale1 are the factors the pair's two softmaxes move it by:
//   warpgroup 0                                     warpgroup 1
//   softmax(2k): m, scale0, P0                      (waits for m, scale0)
//   O_L = scale0 O_L + P0 V0_L                      softmax(2k + 1): m, scale1, P1
//   (waits for m, scale1, P1)                       O_R = scale0 scale1 O_R + P1 V1_R
//   scale1 P0 to shared memory                      (waits for scale1 P0)  O_R += (scale1 P0) V0_R
//   O_L = scale1 O_L + P1 V1_L;  S(2k + 2)          S(2k + 3)
// which is the online softmax over the pair (O = 2^-m sum_t 2^s_t V_t, each half rescaled whenever m moves).
// Hand-offs are named barriers: S0 (0 -> 1: m, scale0), S1 (1 -> 0: m, scale1, P1 and tile 2k + 1's zeroed rows), P0
// (0 -> 1: scale1 P0); W0 / W1 sync a warpgroup's own threads before its products read what they stored, and before
// they overwrite what its products read (each warp's part of a wgmma retires on its own).  P0 lies in
// buffer 0's ninth slice and P1 in buffer 1's (the rope columns, dead once the tile's scores are done), scale1 P0 in
// an 8 KB tile of its own.  A buffer is refilled with the tile two ahead in three parts, each on its own mbarrier, as
// soon as the warpgroups that read the part are done with it: V_L (slices 0 .. 3) by warpgroup 0 after its P . V_L,
// V_R (slices 4 .. 7) by warpgroup 1 after its P . V_R, slice 8 by warpgroup 0 in buffer 0 and, in buffer 1 (P1, read
// by both), by the second warpgroup done with it (a shared counter); each warpgroup's scores take the parts its own
// releases refilled first.  P . V is one m64n256k16 per 16 rows of V (v3_pv<T, true>).  Dense launches only (sparse
// lists stay on v3's schedule).
// Shared memory: 1 KB alignment slack, Q 72 KB, 2 buffers of 72 KB, scale1 P0 8 KB, 7 mbarriers, a counter, fp32
// m / scale0 / scale1 per row, the two warpgroups' row sums.
// =============================================================================================
constexpr size_t SS_K_OFF = V3_TILE, SS_PX_OFF = 3 * V3_TILE, SS_BAR_OFF = SS_PX_OFF + V3_SLICE;
constexpr size_t SS_REL_OFF = SS_BAR_OFF + 56, SS_M_OFF = SS_BAR_OFF + 64, SS_S0_OFF = SS_M_OFF + 256;
constexpr size_t SS_S1_OFF = SS_S0_OFF + 256, SS_L_OFF = SS_S1_OFF + 256;
constexpr size_t SS_BYTES = 1024 + SS_L_OFF + 512;  // 231,744 bytes
static_assert(SS_BYTES == 231744 && SS_PX_OFF % 1024 == 0, "the seesaw's shared memory, as stated");
enum : unsigned { SS_NB_S0 = 1, SS_NB_S1 = 2, SS_NB_P0 = 3, SS_NB_W0 = 4 /* W1 = 5 */ };

template <typename T>
__global__ void __launch_bounds__(V3_THREADS, 1) mla_seesaw_kernel(const MlaParams p,
                                                                   const __grid_constant__ CUtensorMap tm_q,
                                                                   const __grid_constant__ CUtensorMap tm_kv) {
#if defined(MTP_HAS_WGMMA) || defined(MTP_EMULATE_DEVICE)  // code for sm_90a only
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024u - (hopper::smem_addr(smem_raw) & 1023u)) & 1023u);
    unsigned char* sQ = smem;
    unsigned char* sK = smem + SS_K_OFF;  // buffer j at sK + j * V3_TILE
    unsigned char* sPx = smem + SS_PX_OFF;
    uint64_t* bar_q = reinterpret_cast<uint64_t*>(smem + SS_BAR_OFF);
    uint64_t* bar_kv = bar_q + 1;  // [buffer][part]: part 0 = slices 0 .. 3, 1 = slices 4 .. 7, 2 = slice 8
    int* rel = reinterpret_cast<int*>(smem + SS_REL_OFF);  // buffer 1's slice 8: warpgroups done with it
    float* sM = reinterpret_cast<float*>(smem + SS_M_OFF);
    float* sScale0 = reinterpret_cast<float*>(smem + SS_S0_OFF);
    float* sScale1 = reinterpret_cast<float*>(smem + SS_S1_OFF);
    float* sL = reinterpret_cast<float*>(smem + SS_L_OFF);  // [2][64]

    const V3Thread th = v3_thread(p);
    const int tid = th.tid, lane = th.lane, wg = th.wg, c4 = th.c4, M = th.M, m0 = th.m0, nq = th.nq;
    const int(&row_of)[2] = th.row_of;
    const int(&tok_of)[2] = th.tok_of;
    const int tw = tid & 127;

    if (tid == 0) *rel = 0;
    int bf, tf, bl, tl;
    if (!v3_begin<6>(p, bar_q, 1, bf, tf, bl, tl)) return;
    const uint32_t q_base = hopper::smem_addr(sQ), k_base = hopper::smem_addr(sK), px_base = hopper::smem_addr(sPx);
    const uint32_t kb0 = k_base, kb1 = k_base + V3_TILE, my_kb = k_base + wg * V3_TILE;
    const float one[2] = {1.f, 1.f};
    unsigned q_phase = 0, fills = 0;  // Q loads so far; this warpgroup's waits on its buffer (buffer wg)

    for (int b = bf; b <= bl; ++b) {
        const V3Segment seg = v3_segment(p, b, bf, tf, bl, tl, m0 + nq - 1);
        const int c = seg.c, L = seg.L, tb = seg.tb, n = seg.n;
        const bool direct = seg.direct;
        const uint8_t* mask_b = seg.mask_b;

        // part q of tile tb + i into buffer i & 1, on its own mbarrier (one thread): 0 = slices 0 .. 3 (V_L),
        // 1 = slices 4 .. 7 (V_R), 2 = slice 8 (the rope columns, then P)
        auto issue = [&](int i, int q) {
            uint64_t* bar = bar_kv + 3 * (i & 1) + q;
            const int j0 = 4 * q, j1 = q == 2 ? V3_SLICES : j0 + 4;
            hopper::mbar_arrive_expect_tx(bar, (j1 - j0) * V3_SLICE);
            for (int j = j0; j < j1; ++j)
                hopper::tma_load_3d(sK + (i & 1) * V3_TILE + j * V3_SLICE, &tm_kv, 64 * j, (tb + i) * V3_KT, b, bar);
        };
        // this warpgroup's products on tile i have retired: the parts of its buffer only this warpgroup read get tile
        // i + 2 (warpgroup 0: V_L and slice 8 of buffer 0, V_L of buffer 1; warpgroup 1: V_R of either), and the second
        // warpgroup done with buffer 1's slice 8 (P1, read by both) refills it
        auto release = [&](int i) {
            hopper::named_sync(SS_NB_W0 + wg, 128);  // every warp of the warpgroup past its wait
            if (tw != 0) return;
            const bool more = i + 2 < n;
            if (more) issue(i + 2, wg);
            if (wg == 0 && !(i & 1) && more) issue(i + 2, 2);
            if (i & 1) {
                __threadfence_block();
                if ((atomicAdd(rel, 1) & 1) && more) issue(i + 2, 2);
            }
        };
        float sc[32];  // this warpgroup's tile: its scores, then P (rounded to T, as floats)
        // S of this warpgroup's next tile (in its buffer) into sc, each part issued as it lands, the parts its own
        // releases refill first (warpgroup 0: V_L, slice 8, V_R; warpgroup 1: V_R, V_L, slice 8); one commit group
        auto scores = [&]() {
            uint64_t* bar = bar_kv + 3 * wg;
            const unsigned parity = fills++ & 1;
            auto part = [&](int q) {  // landed, then the warpgroup's registers fenced before its products
                hopper::mbar_wait(bar + q, parity);
                hopper::wgmma_fence();
            };
            if (wg == 0) {
                part(0);
                v3_score_slices<T, 0, 4>(sc, q_base, my_kb, true);
                part(2);
                v3_score_slices<T, 8, 9>(sc, q_base, my_kb, false);
                part(1);
                v3_score_slices<T, 4, 8>(sc, q_base, my_kb, false);
                hopper::wgmma_commit();
            } else {
                part(1);
                v3_score_slices<T, 4, 8>(sc, q_base, my_kb, true);
                part(0);
                v3_score_slices<T, 0, 4>(sc, q_base, my_kb, false);
                part(2);
                v3_score_slices<T, 8, 9>(sc, q_base, my_kb, false);
                hopper::wgmma_commit();  // in each branch: a commit where they join makes ptxas fence again
            }
        };

        if (tid < 64) sM[tid] = -INFINITY;
        if (tid == 0 && n > 0) {
            hopper::mbar_arrive_expect_tx(bar_q, V3_TILE);
            for (int j = 0; j < V3_SLICES; ++j)
                hopper::tma_load_3d(sQ + j * V3_SLICE, &tm_q, 64 * j, m0, b, bar_q);
            for (int i = 0; i < 2 && i < n; ++i)
                for (int q = 0; q < 3; ++q) issue(i, q);
        }
        __syncthreads();  // sM set

        float acc[4][32];
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 32; ++e) acc[j][e] = 0.f;
        float l_run[2] = {0.f, 0.f};  // this warpgroup's share of the row sums (of its tiles), at the current m
        if (n > 0) {
            hopper::mbar_wait(bar_q, q_phase & 1);
            ++q_phase;
            if (wg < n) {
                scores();
                hopper::wgmma_wait<0>();
                hopper::fence_regs(sc);
            }
        }
        for (int i0 = 0; i0 < n; i0 += 2) {
            const bool has1 = i0 + 1 < n;
            float s0[2], s1[2] = {1.f, 1.f};
            // softmax of this warpgroup's tile i against the shared max: m moves by `scale`; ls: this thread's share
            // of the tile's row sums
            auto softmax = [&](int i, float (&scale)[2], float (&ls)[2]) {
                float mx[2], m_new[2];
                v3_mask_max(p, b, L, c, (tb + i) * V3_KT, mask_b, row_of, tok_of, nq, lane, sc, mx);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float mo = sM[row_of[h]];
                    m_new[h] = fmaxf(mo, mx[h]);
                    scale[h] = m_new[h] == -INFINITY ? 1.f : exp2f(mo - m_new[h]);
                }
                __syncwarp();  // every lane of a quad has read sM before one writes it
                if (c4 == 0)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        sM[row_of[h]] = m_new[h];
                        (wg == 0 ? sScale0 : sScale1)[row_of[h]] = scale[h];
                    }
                v3_exp<T>(sc, m_new, ls);
            };
            float ls[2];
            if (wg == 0) {
                softmax(i0, s0, ls);
#pragma unroll
                for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * s0[h] + ls[h];
                hopper::named_arrive(SS_NB_S0, 256);
                v3_scale(acc, s0);
                hopper::named_sync(SS_NB_W0, 128);  // every warp's part of S(i0) has read the tile
                v3_store_p<T>(sK + 8 * V3_SLICE, sc, row_of, c4, one);  // P0 over buffer 0's rope slice
                v3_zero_tail(sK, (tb + i0) * V3_KT, L, tw);
                hopper::fence_proxy_async();
                hopper::named_sync(SS_NB_W0, 128);
                hopper::wgmma_fence();
                v3_pv<T, true>(acc, kb0 + 8 * V3_SLICE, kb0, 0);  // O_L += P0 V0_L
                hopper::named_sync(SS_NB_S1, 256);           // m, scale1, P1 (tile i0 + 1's softmax)
#pragma unroll
                for (int h = 0; h < 2; ++h) s1[h] = sScale1[row_of[h]];
                v3_store_p<T>(sPx, sc, row_of, c4, s1);  // scale1 P0 for O_R
                hopper::fence_proxy_async();
                hopper::named_arrive(SS_NB_P0, 256);
                hopper::wgmma_wait<0>();
#pragma unroll
                for (int j = 0; j < 4; ++j) hopper::fence_regs(acc[j]);
                release(i0);
                v3_scale(acc, s1);
#pragma unroll
                for (int h = 0; h < 2; ++h) l_run[h] *= s1[h];
                if (has1) {
                    hopper::wgmma_fence();
                    v3_pv<T, true>(acc, kb1 + 8 * V3_SLICE, kb1, 0);  // O_L += P1 V1_L
                }
                const bool more = i0 + 2 < n;
                if (more) scores();  // S(i0 + 2) beside P1 V1_L
                if (has1) {
                    if (more)
                        hopper::wgmma_wait<1>();
                    else
                        hopper::wgmma_wait<0>();
#pragma unroll
                    for (int j = 0; j < 4; ++j) hopper::fence_regs(acc[j]);
                    release(i0 + 1);
                }
                hopper::wgmma_wait<0>();
                hopper::fence_regs(sc);
            } else {
                hopper::named_sync(SS_NB_S0, 256);  // m, scale0 (tile i0's softmax)
#pragma unroll
                for (int h = 0; h < 2; ++h) s0[h] = sScale0[row_of[h]];
                if (has1) {
                    softmax(i0 + 1, s1, ls);
#pragma unroll
                    for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * s0[h] * s1[h] + ls[h];
                    hopper::named_sync(SS_NB_W0 + 1, 128);  // every warp's part of S(i0 + 1) has read the tile
                    v3_store_p<T>(sK + V3_TILE + 8 * V3_SLICE, sc, row_of, c4, one);  // P1 over buffer 1's rope slice
                    v3_zero_tail(sK + V3_TILE, (tb + i0 + 1) * V3_KT, L, tw);
                } else {
                    if (c4 == 0)
#pragma unroll
                        for (int h = 0; h < 2; ++h) sScale1[row_of[h]] = 1.f;
#pragma unroll
                    for (int h = 0; h < 2; ++h) l_run[h] *= s0[h];
                }
                hopper::fence_proxy_async();
                hopper::named_arrive(SS_NB_S1, 256);
                {
                    const float f[2] = {s0[0] * s1[0], s0[1] * s1[1]};
                    v3_scale(acc, f);
                }
                if (has1) {
                    hopper::named_sync(SS_NB_W0 + 1, 128);
                    hopper::wgmma_fence();
                    v3_pv<T, true>(acc, kb1 + 8 * V3_SLICE, kb1, 1);  // O_R += P1 V1_R
                }
                hopper::named_sync(SS_NB_P0, 256);  // scale1 P0
                hopper::wgmma_fence();
                v3_pv<T, true>(acc, px_base, kb0, 1);  // O_R += (scale1 P0) V0_R
                if (has1) {
                    hopper::wgmma_wait<1>();
#pragma unroll
                    for (int j = 0; j < 4; ++j) hopper::fence_regs(acc[j]);
                    release(i0 + 1);
                }
                hopper::wgmma_wait<0>();
#pragma unroll
                for (int j = 0; j < 4; ++j) hopper::fence_regs(acc[j]);
                release(i0);
                if (i0 + 3 < n) {
                    scores();  // S(i0 + 3)
                    hopper::wgmma_wait<0>();
                    hopper::fence_regs(sc);
                }
            }
        }

        // ---- epilogue: each warpgroup's row sums over the quad, added; direct output or fp32 partials
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = l_run[h];
            l += __shfl_xor_sync(kFullMask, l, 1);
            l += __shfl_xor_sync(kFullMask, l, 2);
            if (c4 == 0) sL[64 * wg + row_of[h]] = l;
        }
        __syncthreads();
        {
            const float m[2] = {sM[row_of[0]], sM[row_of[1]]};
            const float l[2] = {sL[row_of[0]] + sL[64 + row_of[0]], sL[row_of[1]] + sL[64 + row_of[1]]};
            v3_store_out<T>(p, acc, b, m0, nq, row_of, wg, c4, direct, m, l);
        }
        __syncthreads();  // sL / sM read; both buffers and sQ free
    }
#else
    __trap();
#endif
}
// =============================================================================================
// Tensor-core path (fp16 / bf16).  Block = 8 warps, 32 query rows, tiles of 32 latent rows.
//   scores S[32 x 32] = Q[32 x D] . K^T with mma.sync m16n8k16, split over k across the warps:
//     warp w owns the 16-wide k-steps w, w+8, ... of D; its Q fragments for those k-steps stay in
//     registers for the whole block (loaded once), so per tile it only reads each K element once
//     from shared memory; the 8 partial S[32 x 32] go to shared memory and the softmax sums them.
//   P V: O[32 x Dl] += P[32 x 32] . V[32 x Dl]; warp w owns the 8-column blocks w, w+8, ...
// Shared memory (16-bit elements unless noted), row strides padded so that fragment loads and
// partial-score stores are free of bank conflicts (16-bit rows: stride/2 words = 4 mod 8):
//   union { sQ [32][D+8] (until the Q fragments are in registers), sSp [8][32][40] fp32 },
//   sK [NSTAGE][32][D+8], sP [32][40], sM/sL/sA [32] fp32.
// =============================================================================================
constexpr int TC_QT = 32;
constexpr int TC_TT = 32;
constexpr int TC_THREADS = 256;
constexpr int TC_WARPS = TC_THREADS / 32;
constexpr int TC_MAXNB = 8;   // column blocks per warp: Dl <= 8 warps * 8 blocks * 8 = 512
constexpr int TC_MAXKS = 5;   // k-steps per warp: D <= 8 warps * 5 * 16 = 640
constexpr int TC_MAXD = TC_WARPS * TC_MAXKS * 16;
constexpr int TC_SS = TC_TT + 8;
constexpr int TC_PS = TC_TT + 8;

__host__ __device__ inline size_t tc_union_bytes(int D) {
    const size_t q = static_cast<size_t>(D + 8) * 2 * TC_QT;
    const size_t sp = sizeof(float) * TC_WARPS * TC_QT * TC_SS;
    return align_up(q > sp ? q : sp, 16);
}
inline size_t tc_smem_bytes(int D, int nstage) {
    const size_t row = static_cast<size_t>(D + 8) * 2;
    return tc_union_bytes(D) + row * TC_TT * nstage + 2 * TC_QT * TC_PS + sizeof(float) * 3 * TC_QT;
}

template <typename T, int NSTAGE>
__global__ void __launch_bounds__(TC_THREADS, 1) mla_tc_kernel(const MlaParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int D = p.D, Dl = p.Dl;
    const int RS = D + 8;  // row stride of sQ and sK (elements)
    T* sQ = reinterpret_cast<T*>(smem_raw);
    float* sSp = reinterpret_cast<float*>(smem_raw);  // aliases sQ once Q is in registers
    T* sK = reinterpret_cast<T*>(smem_raw + tc_union_bytes(D));
    T* sP = sK + NSTAGE * TC_TT * RS;
    float* sM = reinterpret_cast<float*>(sP + TC_QT * TC_PS);
    float* sL = sM + TC_QT;
    float* sA = sL + TC_QT;

    const int qt = blockIdx.x, sp = blockIdx.y, b = blockIdx.z;
    const int M = p.S * p.H;
    const int m0 = qt * TC_QT;
    const int nq = min(TC_QT, M - m0);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, c4 = lane & 3;

    int c;
    const int L = seq_rows(p, b, c);
    int start, end;
    split_range(L, p.nsplit, sp, TC_TT, start, end);
    end = min(end, tile_rows(p, L, c, m0 + nq - 1));
    const int ntiles = end > start ? (end - start + TC_TT - 1) / TC_TT : 0;
    const T* cache_b = cache_of<T>(p, b);
    const T* q_b = static_cast<const T*>(p.q) + static_cast<size_t>(b) * M * D;
    const uint8_t* mask_b = p.mask ? p.mask + static_cast<size_t>(b) * p.S * p.S : nullptr;
    const int D8 = D >> 3;  // 16-byte chunks per row

    if (tid < TC_QT) {
        sM[tid] = -INFINITY;
        sL[tid] = 0.f;
        sA[tid] = 1.f;
    }

    auto load_tile = [&](int tile, int stage) {
        T* dst = sK + stage * TC_TT * RS;
        const int t0 = start + tile * TC_TT;
        for (int i = tid; i < TC_TT * D8; i += TC_THREADS) {
            const int r = i / D8, k8 = i - r * D8;
            const int t = t0 + r;
            const int row = t < end ? cache_row(p, b, t) : -1;
            const bool ok = row >= 0;
            cp_async16(dst + r * RS + k8 * 8, cache_b + static_cast<size_t>(ok ? row : 0) * p.stride + k8 * 8, ok);
        }
    };

    if (ntiles > 0) {
        for (int i = tid; i < TC_QT * D8; i += TC_THREADS) {
            const int r = i / D8, k8 = i - r * D8;
            const bool ok = r < nq;
            cp_async16(sQ + r * RS + k8 * 8, q_b + static_cast<size_t>(m0 + (ok ? r : 0)) * D + k8 * 8,
                       ok);
        }
        load_tile(0, 0);
    }
    cp_async_commit();

    float acc[2][TC_MAXNB][4];
#pragma unroll
    for (int rb = 0; rb < 2; ++rb)
#pragma unroll
        for (int j = 0; j < TC_MAXNB; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[rb][j][e] = 0.f;
    const int NB = Dl >> 3;  // 8-column blocks of the output
    uint32_t qf[2][TC_MAXKS][4];  // this warp's Q fragments (k-steps warp + 8 j), set at it == 0

    for (int it = 0; it < ntiles; ++it) {
        const int stage = NSTAGE == 2 ? (it & 1) : 0;
        if (NSTAGE == 2) {
            // The buffer of tile it+1 was last read in iteration it-1, which ended with a barrier.
            if (it + 1 < ntiles) load_tile(it + 1, (it + 1) & 1);
            cp_async_commit();
            cp_async_wait<1>();  // everything but the newest group: tile it (and Q) landed
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const T* sKt = sK + stage * TC_TT * RS;
        const int t0 = start + it * TC_TT;

        // ---- partial scores: warp -> its k-steps, all 2 x 4 tiles of 16x8 of S[32 x 32]
        if (it == 0) {
            // Q has landed (barrier above): keep this warp's A fragments in registers
#pragma unroll
            for (int j = 0; j < TC_MAXKS; ++j) {
                const int k0 = (warp + TC_WARPS * j) * 16;
                if (k0 < D) {
#pragma unroll
                    for (int rb = 0; rb < 2; ++rb) {
                        const T* qa = sQ + (rb * 16 + g) * RS + k0 + 2 * c4;
                        qf[rb][j][0] = lds32(qa);
                        qf[rb][j][1] = lds32(qa + 8 * RS);
                        qf[rb][j][2] = lds32(qa + 8);
                        qf[rb][j][3] = lds32(qa + 8 * RS + 8);
                    }
                }
            }
        }
        {
            float sc[2][4][4];
#pragma unroll
            for (int rb = 0; rb < 2; ++rb)
#pragma unroll
                for (int nb = 0; nb < 4; ++nb)
#pragma unroll
                    for (int e = 0; e < 4; ++e) sc[rb][nb][e] = 0.f;
#pragma unroll
            for (int j = 0; j < TC_MAXKS; ++j) {
                const int k0 = (warp + TC_WARPS * j) * 16;
                if (k0 < D) {  // warp-uniform
#pragma unroll
                    for (int nb = 0; nb < 4; ++nb) {
                        const T* kb = sKt + (nb * 8 + g) * RS + k0 + 2 * c4;
                        const uint32_t b0 = lds32(kb), b1 = lds32(kb + 8);
#pragma unroll
                        for (int rb = 0; rb < 2; ++rb)
                            Mma<T>::run(sc[rb][nb], qf[rb][j][0], qf[rb][j][1], qf[rb][j][2], qf[rb][j][3], b0, b1);
                    }
                }
            }
            if (it == 0) __syncthreads();  // every warp has its Q fragments: sQ may be overwritten
            float* sw = sSp + warp * TC_QT * TC_SS;
#pragma unroll
            for (int rb = 0; rb < 2; ++rb)
#pragma unroll
                for (int nb = 0; nb < 4; ++nb) {
                    float* d = sw + (rb * 16 + g) * TC_SS + nb * 8 + 2 * c4;
                    *reinterpret_cast<float2*>(d) = make_float2(sc[rb][nb][0], sc[rb][nb][1]);
                    *reinterpret_cast<float2*>(d + 8 * TC_SS) = make_float2(sc[rb][nb][2], sc[rb][nb][3]);
                }
        }
        __syncthreads();

        // ---- online softmax: warp -> rows warp, warp+8, ...; lane -> column (tile row)
        for (int r = warp; r < TC_QT; r += TC_THREADS / 32) {
            if (r < nq) {  // warp-uniform
                const int s = (m0 + r) / p.H;
                const int t = t0 + lane;
                const bool ok = t < end && row_visible(p, b, t, c, s, mask_b);
                float x = -INFINITY;
                if (ok) {
                    float acc_s = 0.f;
#pragma unroll
                    for (int w = 0; w < TC_WARPS; ++w) acc_s += sSp[(w * TC_QT + r) * TC_SS + lane];
                    x = finite_score(acc_s * p.scale_log2);
                }
                const float m_old = sM[r];
                const float m_new = fmaxf(m_old, warp_max(x));
                float pv = 0.f, alpha = 1.f;
                if (m_new != -INFINITY) {
                    pv = ok ? exp2f(x - m_new) : 0.f;
                    alpha = exp2f(m_old - m_new);  // 0 when m_old == -inf
                }
                const T ph = from_f<T>(pv);
                sP[r * TC_PS + lane] = ph;
                const float ls = warp_sum(to_f<T>(ph));
                if (lane == 0) {
                    sM[r] = m_new;
                    sL[r] = sL[r] * alpha + ls;
                    sA[r] = alpha;
                }
            } else {
                sP[r * TC_PS + lane] = from_f<T>(0.f);
                if (lane == 0) sA[r] = 1.f;
            }
        }
        __syncthreads();

        // ---- O = alpha * O + P . V
        {
            float al[2][2];
#pragma unroll
            for (int rb = 0; rb < 2; ++rb) {
                al[rb][0] = sA[rb * 16 + g];
                al[rb][1] = sA[rb * 16 + g + 8];
            }
#pragma unroll
            for (int rb = 0; rb < 2; ++rb)
#pragma unroll
                for (int j = 0; j < TC_MAXNB; ++j) {
                    acc[rb][j][0] *= al[rb][0];
                    acc[rb][j][1] *= al[rb][0];
                    acc[rb][j][2] *= al[rb][1];
                    acc[rb][j][3] *= al[rb][1];
                }
#pragma unroll
            for (int k0 = 0; k0 < TC_TT; k0 += 16) {
                uint32_t a[2][4];
#pragma unroll
                for (int rb = 0; rb < 2; ++rb) {
                    const T* pa = sP + (rb * 16 + g) * TC_PS + k0 + 2 * c4;
                    a[rb][0] = lds32(pa);
                    a[rb][1] = lds32(pa + 8 * TC_PS);
                    a[rb][2] = lds32(pa + 8);
                    a[rb][3] = lds32(pa + 8 * TC_PS + 8);
                }
                // B[k][n] = V[k0 + k][n] for two column blocks at once (ldmatrix .x4 .trans):
                // matrices 0/1 = rows k0..k0+7 / k0+8..k0+15 of block nb0 (b0, b1), 2/3 = of nb1.
                const int lm = lane >> 3;
                const T* vrow = sKt + (k0 + (lm & 1) * 8 + (lane & 7)) * RS;
#pragma unroll
                for (int j = 0; j < TC_MAXNB; j += 2) {
                    const int nb0 = warp + 8 * j, nb1 = warp + 8 * (j + 1);
                    if (nb0 < NB) {  // warp-uniform
                        const bool two = nb1 < NB;
                        uint32_t b00, b01, b10, b11;
                        ldsm_x4_trans(b00, b01, b10, b11, vrow + ((lm >> 1) && two ? nb1 : nb0) * 8);
                        Mma<T>::run(acc[0][j], a[0][0], a[0][1], a[0][2], a[0][3], b00, b01);
                        Mma<T>::run(acc[1][j], a[1][0], a[1][1], a[1][2], a[1][3], b00, b01);
                        if (two) {
                            Mma<T>::run(acc[0][j + 1], a[0][0], a[0][1], a[0][2], a[0][3], b10, b11);
                            Mma<T>::run(acc[1][j + 1], a[1][0], a[1][1], a[1][2], a[1][3], b10, b11);
                        }
                    }
                }
            }
        }
        __syncthreads();  // sK[stage], sSp, sP and sA are free again
        if (NSTAGE == 1 && it + 1 < ntiles) {
            load_tile(it + 1, 0);
            cp_async_commit();
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // sM / sL visible also when ntiles == 0

    // ---- write: direct normalised output (one split) or fp32 partials
    const bool direct = p.nsplit == 1;
#pragma unroll
    for (int rb = 0; rb < 2; ++rb)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = rb * 16 + g + 8 * h;
            if (r >= nq) continue;
            const size_t row = static_cast<size_t>(b) * M + m0 + r;
            float inv = 1.f;
            if (direct) {
                const float l = sL[r];
                inv = l > 0.f ? 1.f / l : 0.f;
            }
#pragma unroll
            for (int j = 0; j < TC_MAXNB; ++j) {
                const int nb = warp + 8 * j;
                if (nb >= NB) continue;
                const int col = nb * 8 + 2 * c4;
                const float v0 = acc[rb][j][2 * h] * inv, v1 = acc[rb][j][2 * h + 1] * inv;
                if (direct) {
                    *reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + row * Dl + col) =
                        pack2<T>(v0, v1);
                } else {
                    *reinterpret_cast<float2*>(p.opart + (row * p.nsplit + sp) * Dl + col) =
                        make_float2(v0, v1);
                }
            }
        }
    if (!direct && tid < nq) {
        const size_t row = static_cast<size_t>(b) * M + m0 + tid;
        p.ml[row * p.nsplit + sp] = make_float2(sM[tid], sL[tid]);
    }
}

// =============================================================================================
// SIMT path (any dtype, any Dl <= 512, any Dr).  Block = 4 warps, 8 query rows (2 per warp),
// tiles of 32 rows converted to fp32 in shared memory (row stride odd: conflict-free when lane j
// reads row j).  Scores: lane j <-> tile row j.  P.V: lane owns output columns lane + 32 i.
// =============================================================================================
constexpr int SM_TT = 32;
constexpr int SM_THREADS = 128;
constexpr int SM_QPW = 2;
constexpr int SM_QB = SM_QPW * SM_THREADS / 32;  // 8 query rows per block
constexpr int SM_NC = 16;                        // Dl <= 32 * 16

inline int simt_stride(int D) { return (D % 2 == 0) ? D + 1 : D; }
inline size_t simt_smem_bytes(int D) {
    return sizeof(float) * (static_cast<size_t>(SM_TT) * simt_stride(D) + static_cast<size_t>(SM_QB) * D);
}

template <typename T>
__global__ void __launch_bounds__(SM_THREADS) mla_simt_kernel(const MlaParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int D = p.D, Dl = p.Dl;
    const int KS = (D % 2 == 0) ? D + 1 : D;
    float* sK = reinterpret_cast<float*>(smem_raw);
    float* sQ = sK + SM_TT * KS;

    const int qb = blockIdx.x, sp = blockIdx.y, b = blockIdx.z;
    const int M = p.S * p.H;
    const int m0 = qb * SM_QB;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int c;
    const int L = seq_rows(p, b, c);
    int start, end;
    split_range(L, p.nsplit, sp, SM_TT, start, end);
    end = min(end, tile_rows(p, L, c, min(m0 + SM_QB, M) - 1));
    const int ntiles = end > start ? (end - start + SM_TT - 1) / SM_TT : 0;
    const T* cache_b = cache_of<T>(p, b);
    const T* q_b = static_cast<const T*>(p.q) + static_cast<size_t>(b) * M * D;
    const uint8_t* mask_b = p.mask ? p.mask + static_cast<size_t>(b) * p.S * p.S : nullptr;

    for (int i = tid; i < SM_QB * D; i += SM_THREADS) {
        const int r = i / D;
        sQ[i] = (m0 + r < M) ? to_f<T>(q_b[static_cast<size_t>(m0) * D + i]) : 0.f;
    }

    float acc[SM_QPW][SM_NC];
    float mrun[SM_QPW], lrun[SM_QPW];
#pragma unroll
    for (int qi = 0; qi < SM_QPW; ++qi) {
        mrun[qi] = -INFINITY;
        lrun[qi] = 0.f;
#pragma unroll
        for (int i = 0; i < SM_NC; ++i) acc[qi][i] = 0.f;
    }

    for (int it = 0; it < ntiles; ++it) {
        const int t0 = start + it * SM_TT;
        __syncthreads();  // previous tile consumed
        for (int i = tid; i < SM_TT * D; i += SM_THREADS) {
            const int r = i / D, d = i - r * D;
            const int row = t0 + r < end ? cache_row(p, b, t0 + r) : -1;
            sK[r * KS + d] = row >= 0 ? to_f<T>(cache_b[static_cast<size_t>(row) * p.stride + d]) : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int qi = 0; qi < SM_QPW; ++qi) {
            const int r = warp * SM_QPW + qi;
            if (m0 + r >= M) continue;  // warp-uniform
            const int s = (m0 + r) / p.H;
            const int t = t0 + lane;
            const float* kr = sK + lane * KS;
            const float* qr = sQ + r * D;
            float x = 0.f;
            for (int d = 0; d < D; ++d) x = fmaf(qr[d], kr[d], x);
            const bool ok = t < end && row_visible(p, b, t, c, s, mask_b);
            x = ok ? finite_score(x * p.scale_log2) : -INFINITY;
            const float m_new = fmaxf(mrun[qi], warp_max(x));
            float pv = 0.f, alpha = 1.f;
            if (m_new != -INFINITY) {
                pv = ok ? exp2f(x - m_new) : 0.f;
                alpha = exp2f(mrun[qi] - m_new);
            }
            lrun[qi] = lrun[qi] * alpha + warp_sum(pv);
            mrun[qi] = m_new;
#pragma unroll
            for (int i = 0; i < SM_NC; ++i) acc[qi][i] *= alpha;
            for (int j = 0; j < SM_TT; ++j) {
                const float pj = __shfl_sync(kFullMask, pv, j);
                if (pj != 0.f) {  // warp-uniform
                    const float* vr = sK + j * KS;
#pragma unroll
                    for (int i = 0; i < SM_NC; ++i) {
                        const int col = lane + 32 * i;
                        if (col < Dl) acc[qi][i] = fmaf(pj, vr[col], acc[qi][i]);
                    }
                }
            }
        }
    }

    const bool direct = p.nsplit == 1;
#pragma unroll
    for (int qi = 0; qi < SM_QPW; ++qi) {
        const int r = warp * SM_QPW + qi;
        if (m0 + r >= M) continue;
        const size_t row = static_cast<size_t>(b) * M + m0 + r;
        const float inv = direct ? (lrun[qi] > 0.f ? 1.f / lrun[qi] : 0.f) : 1.f;
#pragma unroll
        for (int i = 0; i < SM_NC; ++i) {
            const int col = lane + 32 * i;
            if (col >= Dl) continue;
            if (direct)
                static_cast<T*>(p.out)[row * Dl + col] = from_f<T>(acc[qi][i] * inv);
            else
                p.opart[(row * p.nsplit + sp) * Dl + col] = acc[qi][i];
        }
        if (!direct && lane == 0) p.ml[row * p.nsplit + sp] = make_float2(mrun[qi], lrun[qi]);
    }
}

// =============================================================================================
// Combine: one warp per query row.  out = sum_i w_i O_i / sum_i w_i l_i, w_i = 2^(m_i - max m).
// =============================================================================================
constexpr int CB_THREADS = 128;

template <typename T>
__global__ void __launch_bounds__(CB_THREADS) mla_combine_kernel(const float* __restrict__ opart,
                                                                 const float2* __restrict__ ml,
                                                                 T* __restrict__ out, long long rows,
                                                                 int nsplit, int Dl) {
    __shared__ float sw[CB_THREADS / 32][MTP_MLA_MAX_SPLITS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long row = static_cast<long long>(blockIdx.x) * (CB_THREADS / 32) + warp;
    if (row >= rows) return;  // whole warp leaves; no block barrier below
    const float2* mlr = ml + row * nsplit;
    float mx = -INFINITY;
    for (int i = lane; i < nsplit; i += 32) mx = fmaxf(mx, mlr[i].x);
    mx = warp_max(mx);
    float lsum = 0.f;
    for (int i = lane; i < nsplit; i += 32) {
        const float2 v = mlr[i];
        const float w = (mx == -INFINITY) ? 0.f : exp2f(v.x - mx);
        sw[warp][i] = w;
        lsum += w * v.y;
    }
    lsum = warp_sum(lsum);
    __syncwarp();
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
    const float* o = opart + row * nsplit * Dl;
    for (int col = lane; col < Dl; col += 32) {
        float a = 0.f;
#pragma unroll 4
        for (int i = 0; i < nsplit; ++i)  // no branch: empty splits wrote O = 0 and weigh 0
            a = fmaf(sw[warp][i], o[static_cast<size_t>(i) * Dl + col], a);
        out[row * Dl + col] = from_f<T>(a * inv);
    }
}

// =============================================================================================
// KV commit: cache[b][past_len[b] + s] = new_rows[b][s], copied in units U.
// =============================================================================================
template <typename U>
__global__ void kv_commit_kernel(U* __restrict__ cache, const int32_t* __restrict__ past_len,
                                 const U* __restrict__ new_rows, int S, int units, int T_max) {
    const int row = blockIdx.x;
    const int b = row / S, s = row - b * S;
    const int c = max(0, min(static_cast<int>(past_len[b]), T_max));
    const int t = c + s;
    if (t >= T_max) return;
    U* dst = cache + (static_cast<size_t>(b) * T_max + t) * units;
    const U* src = new_rows + static_cast<size_t>(row) * units;
    for (int i = threadIdx.x; i < units; i += blockDim.x) dst[i] = src[i];
}

// Launch an attention kernel; its dynamic shared-memory limit is raised to the device's opt-in maximum the
// first time it is launched on a device (one bit per device and kernel).
template <auto Kernel>
cudaError_t launch_attn(dim3 grid, int threads, size_t smem, cudaStream_t stream, const MlaParams& p) {
    static std::atomic<unsigned long long> raised{0};
    if (smem > 48 * 1024) {
        const int dev = current_device();
        const unsigned long long bit = dev >= 0 && dev < kMaxDevices ? 1ull << dev : 0;
        if (!bit || !(raised.load(std::memory_order_relaxed) & bit)) {
            const cudaError_t e =
                cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_optin_smem());
            if (e != cudaSuccess) return e;
            raised.fetch_or(bit, std::memory_order_relaxed);
        }
    }
    Kernel<<<grid, threads, smem, stream>>>(p);
    return cudaGetLastError();
}

}  // namespace
}  // namespace mtp

using namespace mtp;

// Parts of the persistent grid: one wave of 64-row m-blocks (floor(SMs / m-blocks)), no more parts than tiles of
// 32 rows allow at V2_MIN_TILES each, at most MTP_MLA_MAX_SPLITS; 1 (one block per sequence) when the m-blocks
// alone fill the GPU.  Depends on the shape and an upper bound of the lengths only, never on the lengths.
extern "C" int mtp_mla_decode_num_splits(int B, int S, int H, int max_len, int num_sms) {
    if (B <= 0 || S <= 0 || H <= 0 || max_len <= 0) return 1;
    if (num_sms <= 0) num_sms = current_num_sms();
    const long long mblocks = (static_cast<long long>(S) * H + 63) / 64;
    long long n = num_sms / mblocks;
    const long long by_len = (static_cast<long long>(B) * ((max_len + 31) / 32) + V2_MIN_TILES - 1) / V2_MIN_TILES;
    n = n < by_len ? n : by_len;
    n = n < MTP_MLA_MAX_SPLITS ? n : MTP_MLA_MAX_SPLITS;
    return static_cast<int>(n < 1 ? 1 : n);
}

// Workspace of P = num_splits parts over B sequences of S * H rows: P + B - 1 slots of fp32 partial outputs and
// their (max, sum), then the schedule (an int4 per part, an int2 per sequence; sparse decode: per query token).
extern "C" size_t mtp_mla_decode_workspace_size(int B, int S, int H, int Dl, int num_splits) {
    if (num_splits <= 1 || B <= 0 || S <= 0 || H <= 0 || Dl <= 0) return 0;
    const size_t rows = (static_cast<size_t>(num_splits) + B - 1) * S * H;
    return align_up(rows * Dl * sizeof(float), 256) + align_up(rows * sizeof(float2), 256) +
           align_up(static_cast<size_t>(num_splits) * sizeof(int4), 256) +
           align_up(static_cast<size_t>(B) * S * sizeof(int2), 256);
}

extern "C" cudaError_t mtp_mla_kv_commit(mtp_dtype dtype, void* kv_cache, const int32_t* past_len,
                                         const void* new_rows, int B, int S, int D, int T_max,
                                         cudaStream_t stream) {
    if (!dtype_ok(dtype) || B < 0 || S < 0 || D <= 0 || T_max <= 0) return cudaErrorInvalidValue;
    if (B == 0 || S == 0) return cudaSuccess;
    if (!kv_cache || !past_len || !new_rows) return cudaErrorInvalidValue;
    if (static_cast<long long>(B) * S > 0x7fffffffLL) return cudaErrorInvalidValue;
    const size_t bytes = static_cast<size_t>(D) * dtype_size(dtype);
    const dim3 grid(static_cast<unsigned>(B * S));
    if (bytes % 16 == 0 && aligned16(kv_cache) && aligned16(new_rows)) {
        kv_commit_kernel<uint4><<<grid, 64, 0, stream>>>(static_cast<uint4*>(kv_cache), past_len,
                                                         static_cast<const uint4*>(new_rows), S,
                                                         static_cast<int>(bytes / 16), T_max);
    } else if (bytes % 4 == 0) {
        kv_commit_kernel<uint32_t><<<grid, 128, 0, stream>>>(
            static_cast<uint32_t*>(kv_cache), past_len, static_cast<const uint32_t*>(new_rows), S,
            static_cast<int>(bytes / 4), T_max);
    } else {
        kv_commit_kernel<uint16_t><<<grid, 128, 0, stream>>>(
            static_cast<uint16_t*>(kv_cache), past_len, static_cast<const uint16_t*>(new_rows), S,
            static_cast<int>(bytes / 2), T_max);
    }
    return cudaGetLastError();
}

namespace mtp {
namespace {

// The rows a launch commits to the cache before attending: new_rows [nseq_commit, S, C] at past_len + s.
struct Commit {
    const void* rows;  // NULL: nothing to commit
    int B, S, C;
};

// v2's tile and block sizes for this device, or false where v2 does not serve the launch (other dims or dtypes,
// misaligned rows, MTP_MLA_FORCE_V1 / MTP_MLA_FORCE_SIMT, too little shared memory).
bool v2_config(mtp_dtype dtype, const MlaParams& p, long long M, int flags, int& R, int& KT, size_t& smem) {
    const bool ok = (dtype == MTP_DTYPE_F16 || dtype == MTP_DTYPE_BF16) && !(flags & (MTP_MLA_FORCE_SIMT | MTP_MLA_FORCE_V1)) &&
                    p.Dl == V2_DL && p.D == V2_D && (static_cast<size_t>(p.stride) * 2) % 16 == 0 && aligned16(p.q) &&
                    aligned16(p.cache) && aligned16(p.out);
    if (!ok) return false;
    const size_t optin = static_cast<size_t>(max_optin_smem());
    KT = V2<64, 32>::BYTES <= optin ? 32 : 16;
    R = M <= 16 ? 16 : M <= 32 ? 32 : 64;
    auto bytes = [&](int r) {
        if (KT == 32) return r == 64 ? V2<64, 32>::BYTES : r == 32 ? V2<32, 32>::BYTES : V2<16, 32>::BYTES;
        return r == 64 ? V2<64, 16>::BYTES : r == 32 ? V2<32, 16>::BYTES : V2<16, 16>::BYTES;
    };
    while (R > 16 && bytes(R) > optin) R /= 2;
    smem = bytes(R);
    return smem <= optin;
}

// Whether v3 serves a launch v2 serves (dense or sparse): a launch on a compute capability 9 GPU running this
// library's sm_90a code (not JIT-compiled PTX of another arch), with room for its shared memory, unless
// MTP_MLA_FORCE_V2.
// MTP_TRT_MLA_PATH (read once): "v2" keeps every launch on v2, "seesaw" takes v3's dense launches on the seesaw
// schedule (comparisons on a GPU, whole test runs); anything else: the defaults.
enum class MlaPath { kDefault, kV2, kSeesaw };
MlaPath mla_path_env() {
    static const MlaPath path = [] {
        const char* e = getenv("MTP_TRT_MLA_PATH");
        if (e && strcmp(e, "v2") == 0) return MlaPath::kV2;
        if (e && strcmp(e, "seesaw") == 0) return MlaPath::kSeesaw;
        return MlaPath::kDefault;
    }();
    return path;
}

bool v3_serves(const MlaParams& p, int flags) {
    if ((flags & MTP_MLA_FORCE_V2) || mla_path_env() == MlaPath::kV2 || compute_major() != 9 ||
        static_cast<size_t>(max_optin_smem()) < V3_BYTES)
        return false;
    static const int binary = [] {
        cudaFuncAttributes a = {};
        if (cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(mla_v3_kernel<__nv_bfloat16>)) != cudaSuccess) {
            cudaGetLastError();
            return 0;
        }
        return a.binaryVersion;
    }();
    return binary == 90;
}

// v3's tensor maps: q as [nseq][M rows][576], the cache as [nseq][T_max rows][stride] (so a tile never reads past
// its sequence's T_max rows); false where the driver cannot encode them (v2 serves the launch then).
bool v3_maps(const MlaParams& p, int nseq, CUtensorMap& tm_q, CUtensorMap& tm_kv) {
    const uint64_t M = static_cast<uint64_t>(p.S) * p.H;
    const uint64_t cache_seqs = p.sel ? nseq / p.Sq : nseq;  // sparse: the cache's B sequences (not read by TMA)
    return hopper::encode_tensor_map_3d(&tm_q, p.q, V2_D, M, nseq, V2_D * 2, 64) &&
           hopper::encode_tensor_map_3d(&tm_kv, p.cache, p.stride, p.T_max, cache_seqs,
                                        static_cast<uint64_t>(p.stride) * 2, V3_KT);
}

// The opt-in shared memory of `kernel` raised to `bytes`, once per device (`raised`: a bit per device done).
template <typename K>
cudaError_t raise_smem_once(K kernel, size_t bytes, std::atomic<unsigned long long>& raised) {
    const int dev = current_device();
    const unsigned long long bit = dev >= 0 && dev < kMaxDevices ? 1ull << dev : 0;
    if (bit && (raised.load(std::memory_order_relaxed) & bit)) return cudaSuccess;
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (e == cudaSuccess) raised.fetch_or(bit, std::memory_order_relaxed);
    return e;
}

// v3: dense launches on the seesaw schedule with MTP_MLA_SEESAW or MTP_TRT_MLA_PATH=seesaw, else (and sparse lists)
// on v3's.
template <typename T>
cudaError_t launch_v3(MlaParams& p, int nseq, const CUtensorMap& tm_q, const CUtensorMap& tm_kv, int flags,
                      cudaStream_t stream) {
    const long long M = static_cast<long long>(p.S) * p.H;
    const dim3 grid(static_cast<unsigned>((M + 63) / 64), static_cast<unsigned>(p.nsplit > 1 ? p.nsplit : nseq));
    if (!p.sel && ((flags & MTP_MLA_SEESAW) || mla_path_env() == MlaPath::kSeesaw)) {
        static std::atomic<unsigned long long> raised{0};
        const cudaError_t e = raise_smem_once(mla_seesaw_kernel<T>, SS_BYTES, raised);
        if (e != cudaSuccess) return e;
        return hopper::launch_pdl(mla_seesaw_kernel<T>, grid, V3_THREADS, SS_BYTES, stream, p, tm_q, tm_kv);
    }
    static std::atomic<unsigned long long> raised{0};
    const cudaError_t e = raise_smem_once(mla_v3_kernel<T>, V3_BYTES, raised);
    if (e != cudaSuccess) return e;
    return hopper::launch_pdl(mla_v3_kernel<T>, grid, V3_THREADS, V3_BYTES, stream, p, tm_q, tm_kv);
}

template <typename T>
cudaError_t launch_v2(MlaParams& p, int nseq, int R, int KT, size_t smem, cudaStream_t stream) {
    const dim3 grid(static_cast<unsigned>((static_cast<long long>(p.S) * p.H + R - 1) / R),
                    static_cast<unsigned>(p.nsplit > 1 ? p.nsplit : nseq));
#define MTP_V2_CASE(r, kt) \
    if (R == r && KT == kt) return launch_attn<mla_v2_kernel<T, r, kt>>(grid, V2_THREADS, smem, stream, p);
    MTP_V2_CASE(64, 32) MTP_V2_CASE(32, 32) MTP_V2_CASE(16, 32) MTP_V2_CASE(64, 16) MTP_V2_CASE(32, 16)
    MTP_V2_CASE(16, 16)
#undef MTP_V2_CASE
    return cudaErrorInvalidValue;
}

// The attention launch of both entry points, p filled but for the workspace: `nseq` sequences of p.S * p.H query
// rows each, after committing `commit`.  v2 where it serves the launch (DeepSeek's dims, fp16 / bf16), else the
// general kernels (tensor-core, SIMT) with ceil((P + nseq - 1) / nseq) KV splits per sequence, which fit the same
// workspace.
cudaError_t launch_mla(mtp_dtype dtype, MlaParams& p, int nseq, const Commit& commit, void* workspace, int flags,
                       cudaStream_t stream) {
    const long long M = static_cast<long long>(p.S) * p.H;
    const int D = p.D, Dl = p.Dl, Dr = p.D - p.Dl;
    p.scale_log2 *= 1.4426950408889634f;
    p.opart = nullptr;
    p.ml = nullptr;
    p.part_sched = nullptr;
    p.seq_sched = nullptr;
    const int parts = p.nsplit;
    cudaError_t err = cudaSuccess;

    int R = 0, KT = 0;
    size_t smem = 0;
    if (v2_config(dtype, p, M, flags, R, KT, smem)) {
        CUtensorMap tm_q, tm_kv;
        const bool v3 = v3_serves(p, flags) && v3_maps(p, nseq, tm_q, tm_kv);
        if (v3) KT = V3_KT;
        if (parts > 1) {
            const size_t rows = (static_cast<size_t>(parts) + nseq - 1) * M;
            char* ws = static_cast<char*>(workspace);
            p.opart = reinterpret_cast<float*>(ws);
            ws += align_up(rows * Dl * sizeof(float), 256);
            p.ml = reinterpret_cast<float2*>(ws);
            ws += align_up(rows * sizeof(float2), 256);
            p.part_sched = reinterpret_cast<int4*>(ws);
            ws += align_up(static_cast<size_t>(parts) * sizeof(int4), 256);
            p.seq_sched = reinterpret_cast<int2*>(ws);
        }
        const size_t row_bytes = static_cast<size_t>(commit.C) * dtype_size(dtype);
        const bool fused = commit.rows && row_bytes % 16 == 0 && aligned16(commit.rows);
        if (commit.rows && !fused) {
            err = mtp_mla_kv_commit(dtype, const_cast<void*>(p.cache), p.past_len, commit.rows, commit.B, commit.S,
                                    commit.C, p.T_max, stream);
            if (err != cudaSuccess) return err;
        }
        const int ncommit = fused ? commit.B * commit.S : 0;
        if (ncommit > 0 || parts > 1) {
            mla_v2_prologue_kernel<<<ncommit + (parts > 1 ? 1 : 0), 128, 0, stream>>>(
                p, static_cast<uint4*>(const_cast<void*>(p.cache)), static_cast<const uint4*>(commit.rows), ncommit,
                commit.S, static_cast<int>(row_bytes / 16), nseq, KT);
            if ((err = cudaGetLastError()) != cudaSuccess) return err;
        }
        if (v3)
            err = dtype == MTP_DTYPE_F16 ? launch_v3<__half>(p, nseq, tm_q, tm_kv, flags, stream)
                                         : launch_v3<__nv_bfloat16>(p, nseq, tm_q, tm_kv, flags, stream);
        else if (dtype == MTP_DTYPE_F16)
            err = launch_v2<__half>(p, nseq, R, KT, smem, stream);
        else
            err = launch_v2<__nv_bfloat16>(p, nseq, R, KT, smem, stream);
        if (err != cudaSuccess || parts <= 1) return err;
        const long long rows = static_cast<long long>(nseq) * M;
        const unsigned blocks = static_cast<unsigned>(rows);  // one per query row
        if (v3)
            return dtype == MTP_DTYPE_F16
                       ? hopper::launch_pdl(mla_v2_combine_kernel<__half>, dim3(blocks), V2C_THREADS, 0, stream, p, nseq)
                       : hopper::launch_pdl(mla_v2_combine_kernel<__nv_bfloat16>, dim3(blocks), V2C_THREADS, 0, stream,
                                            p, nseq);
        if (dtype == MTP_DTYPE_F16)
            mla_v2_combine_kernel<__half><<<blocks, V2C_THREADS, 0, stream>>>(p, nseq);
        else
            mla_v2_combine_kernel<__nv_bfloat16><<<blocks, V2C_THREADS, 0, stream>>>(p, nseq);
        return cudaGetLastError();
    }

    // ---- the general kernels
    if (commit.rows) {
        err = mtp_mla_kv_commit(dtype, const_cast<void*>(p.cache), p.past_len, commit.rows, commit.B, commit.S,
                                commit.C, p.T_max, stream);
        if (err != cudaSuccess) return err;
    }
    p.nsplit = parts > 1 ? min((parts + nseq - 1) / nseq, MTP_MLA_MAX_SPLITS) : 1;
    if (p.nsplit > 1) {
        const size_t rows = static_cast<size_t>(nseq) * M * p.nsplit;
        p.opart = static_cast<float*>(workspace);
        p.ml = reinterpret_cast<float2*>(static_cast<char*>(workspace) + align_up(rows * Dl * sizeof(float), 256));
    }
    const int smem_max = max_optin_smem();
    const bool row_ok = p.stride == D || (static_cast<size_t>(p.stride) * dtype_size(dtype)) % 16 == 0;
    const bool tc_ok = (dtype == MTP_DTYPE_F16 || dtype == MTP_DTYPE_BF16) && !(flags & MTP_MLA_FORCE_SIMT) &&
                       Dl % 16 == 0 && Dr % 16 == 0 && Dl >= 16 && Dl <= 8 * TC_MAXNB * 8 && D <= TC_MAXD &&
                       row_ok && aligned16(p.q) && aligned16(p.cache) && aligned16(p.out);
    if (tc_ok && tc_smem_bytes(D, 1) <= static_cast<size_t>(smem_max)) {
        const bool two = !(flags & MTP_MLA_SINGLE_STAGE) && tc_smem_bytes(D, 2) <= static_cast<size_t>(smem_max);
        const dim3 grid(static_cast<unsigned>((M + TC_QT - 1) / TC_QT), p.nsplit, nseq);
        const size_t tsmem = tc_smem_bytes(D, two ? 2 : 1);
        if (dtype == MTP_DTYPE_F16)
            err = two ? launch_attn<mla_tc_kernel<__half, 2>>(grid, TC_THREADS, tsmem, stream, p)
                      : launch_attn<mla_tc_kernel<__half, 1>>(grid, TC_THREADS, tsmem, stream, p);
        else
            err = two ? launch_attn<mla_tc_kernel<__nv_bfloat16, 2>>(grid, TC_THREADS, tsmem, stream, p)
                      : launch_attn<mla_tc_kernel<__nv_bfloat16, 1>>(grid, TC_THREADS, tsmem, stream, p);
    } else {
        const size_t ssmem = simt_smem_bytes(D);
        if (ssmem > static_cast<size_t>(smem_max)) return cudaErrorInvalidValue;
        const dim3 grid(static_cast<unsigned>((M + SM_QB - 1) / SM_QB), p.nsplit, nseq);
        MTP_DISPATCH_DTYPE(dtype, T, err = launch_attn<mla_simt_kernel<T>>(grid, SM_THREADS, ssmem, stream, p));
    }
    if (err != cudaSuccess) return err;

    if (p.nsplit > 1) {
        const long long rows = static_cast<long long>(nseq) * M;
        const unsigned blocks = static_cast<unsigned>((rows + CB_THREADS / 32 - 1) / (CB_THREADS / 32));
        const float* opart = p.opart;
        const float2* ml = p.ml;
        void* out = p.out;
        const int nsplit = p.nsplit;
        MTP_DISPATCH_DTYPE(dtype, T,
                           mla_combine_kernel<T><<<blocks, CB_THREADS, 0, stream>>>(
                               opart, ml, static_cast<T*>(out), rows, nsplit, Dl));
        err = cudaGetLastError();
    }
    return err;
}

MlaParams mla_params(const void* q, const void* kv_cache, const int32_t* past_len, void* out, int S, int H, int Dl,
                     int Dr, int stride, int T_max, float scale, int num_splits) {
    MlaParams p;
    p.q = q;
    p.cache = kv_cache;
    p.past_len = past_len;
    p.mask = nullptr;
    p.out = out;
    p.S = S;
    p.H = H;
    p.Dl = Dl;
    p.D = Dl + Dr;
    p.T_max = T_max;
    p.nsplit = num_splits;
    p.stride = stride;
    p.sel = nullptr;
    p.K = 0;
    p.Sq = 1;
    p.scale_log2 = scale;  // times log2 e in launch_mla
    return p;
}

}  // namespace
}  // namespace mtp

extern "C" cudaError_t mtp_mla_decode(mtp_dtype dtype, const void* q, void* kv_cache,
                                      const int32_t* past_len, const void* new_rows,
                                      const uint8_t* mask, void* out, void* workspace,
                                      size_t workspace_bytes, int B, int S, int H, int Dl, int Dr,
                                      int T_max, float scale, int num_splits, int flags,
                                      cudaStream_t stream) {
    if (!dtype_ok(dtype) || B < 0 || S <= 0 || H <= 0 || Dl <= 0 || Dl > 32 * SM_NC || Dr < 0 ||
        T_max <= 0 || num_splits < 1 || num_splits > MTP_MLA_MAX_SPLITS || B > 65535)
        return cudaErrorInvalidValue;
    if (B == 0) return cudaSuccess;
    if (!q || !kv_cache || !past_len || !out) return cudaErrorInvalidValue;
    const long long M = static_cast<long long>(S) * H;
    const int D = Dl + Dr;
    if (M > (1LL << 24) || static_cast<long long>(S) * S > (1LL << 30)) return cudaErrorInvalidValue;
    if (num_splits > 1) {
        // the partial outputs are read as float4 and their (max, sum) as float2: 16-byte aligned workspace
        if (!workspace || !aligned16(workspace) ||
            workspace_bytes < mtp_mla_decode_workspace_size(B, S, H, Dl, num_splits))
            return cudaErrorInvalidValue;
    }

    MlaParams p = mla_params(q, kv_cache, past_len, out, S, H, Dl, Dr, D, T_max, scale, num_splits);
    p.mask = mask;
    return launch_mla(static_cast<mtp_dtype>(dtype), p, B, Commit{new_rows, B, S, D}, workspace, flags, stream);
}

extern "C" cudaError_t mtp_mla_sparse_decode(mtp_dtype dtype, const void* q, void* kv_cache,
                                             const int32_t* past_len, const void* new_rows,
                                             const int32_t* selected, void* out, void* workspace,
                                             size_t workspace_bytes, int B, int S, int H, int Dl, int Dr,
                                             int C, int T_max, int K, float scale, int num_splits,
                                             int flags, cudaStream_t stream) {
    if (!dtype_ok(dtype) || B < 0 || S <= 0 || H <= 0 || Dl <= 0 || Dl > 32 * SM_NC || Dr < 0 ||
        C < Dl + Dr || T_max <= 0 || K <= 0 || num_splits < 1 || num_splits > MTP_MLA_MAX_SPLITS)
        return cudaErrorInvalidValue;
    if (B == 0) return cudaSuccess;
    if (!q || !kv_cache || !past_len || !selected || !out) return cudaErrorInvalidValue;
    if (static_cast<long long>(B) * S > 65535 || static_cast<long long>(B) * S * K > (1LL << 31) - 1 ||
        H > (1 << 24))
        return cudaErrorInvalidValue;
    if (num_splits > 1 &&
        (!workspace || !aligned16(workspace) ||
         workspace_bytes < mtp_mla_decode_workspace_size(B * S, 1, H, Dl, num_splits)))
        return cudaErrorInvalidValue;
    MlaParams p = mla_params(q, kv_cache, past_len, out, 1, H, Dl, Dr, C, T_max, scale, num_splits);
    p.sel = selected;
    p.K = K;
    p.Sq = S;
    return launch_mla(static_cast<mtp_dtype>(dtype), p, B * S, Commit{new_rows, B, S, C}, workspace, flags, stream);
}
