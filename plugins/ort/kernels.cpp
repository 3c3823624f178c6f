// kernels.cpp -- the CPU kernels of kernels.h: an AVX2/FMA path (chosen at run time where the CPU has it) and
// a portable scalar path with the same results up to float rounding; the quantized products also have VNNI
// paths (qkernels_impl.h).  On ARM64 the vector paths are NEON's (kernels_neon.h, qkernels_neon.h).  The
// instruction set: cpu_isa (kernels.h).
#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#define MTP_ORT_X86 1
#include <immintrin.h>
#else
#define MTP_ORT_X86 0
#endif
#if defined(__aarch64__)
#define MTP_ORT_NEON 1
#include <arm_neon.h>
#if defined(__linux__)
#include <sys/auxv.h>
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#endif
#else
#define MTP_ORT_NEON 0
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace mtp_ort {

namespace {

#if MTP_ORT_NEON
// The CPU's SDOT (FEAT_DotProd) and SMMLA (FEAT_I8MM): Linux's hardware capabilities, macOS's sysctl; false where
// neither says.
#if defined(__linux__)
bool arm_has_dotprod() { return (getauxval(AT_HWCAP) & (1ul << 20)) != 0; }  // HWCAP_ASIMDDP
bool arm_has_i8mm() { return (getauxval(AT_HWCAP2) & (1ul << 13)) != 0; }    // HWCAP2_I8MM
#elif defined(__APPLE__)
bool sysctl_flag(const char* name) {
    int v = 0;
    size_t size = sizeof v;
    return sysctlbyname(name, &v, &size, nullptr, 0) == 0 && v != 0;
}
bool arm_has_dotprod() { return sysctl_flag("hw.optional.arm.FEAT_DotProd"); }
bool arm_has_i8mm() { return sysctl_flag("hw.optional.arm.FEAT_I8MM"); }
#else
bool arm_has_dotprod() { return false; }
bool arm_has_i8mm() { return false; }
#endif
#endif  // MTP_ORT_NEON

// The sets of this architecture, in the order the CPU is searched for the best (the last it has).
#if MTP_ORT_X86
constexpr CpuIsa kArchIsas[] = {CpuIsa::avx2, CpuIsa::avx_vnni, CpuIsa::avx512_vnni};
#elif MTP_ORT_NEON
constexpr CpuIsa kArchIsas[] = {CpuIsa::neon, CpuIsa::neon_dotprod, CpuIsa::neon_i8mm};
#else
constexpr CpuIsa kArchIsas[] = {CpuIsa::scalar};
#endif

}  // namespace

bool cpu_has(CpuIsa isa) {
    switch (isa) {
        case CpuIsa::scalar: return true;
#if MTP_ORT_X86
        case CpuIsa::avx2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        case CpuIsa::avx_vnni:
            return cpu_has(CpuIsa::avx2) && (__builtin_cpu_supports("avxvnni") || cpu_has(CpuIsa::avx512_vnni));
        case CpuIsa::avx512_vnni:
            return cpu_has(CpuIsa::avx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                   __builtin_cpu_supports("avx512vnni");
#elif MTP_ORT_NEON
        case CpuIsa::neon: return true;  // (AdvSIMD: every ARMv8-A CPU)
        case CpuIsa::neon_dotprod: return arm_has_dotprod();
        case CpuIsa::neon_i8mm: return arm_has_dotprod() && arm_has_i8mm();
#endif
        default: return false;  // (another architecture's sets)
    }
}

namespace {

// (the set, whether MTP_TRT_CPU_ISA chose it, the refusal's text)
struct IsaChoice {
    CpuIsa isa = CpuIsa::scalar;
    bool forced = false;
    std::string error;
};

const IsaChoice& isa_choice() {
    static const IsaChoice choice = [] {
        IsaChoice c;
        for (CpuIsa isa : kArchIsas)
            if (cpu_has(isa)) c.isa = isa;
        const char* env = std::getenv("MTP_TRT_CPU_ISA");
        if (!env || !*env) return c;
        const CpuIsa best = c.isa;
        std::string names;
        for (int i = 0; i < int(std::size(kCpuIsaNames)); ++i) {
            names += (i ? ", " : "") + std::string(kCpuIsaNames[i]);
            if (std::strcmp(env, kCpuIsaNames[i]) == 0) c.isa = CpuIsa(i), c.forced = true;
        }
        if (!c.forced)
            c.error = "MTP_TRT_CPU_ISA=" + std::string(env) + " is not an instruction set of mtp-trt's CPU kernels (" +
                      names + ")";
        else if (!cpu_has(c.isa))
            c.error = "MTP_TRT_CPU_ISA=" + std::string(env) + ": this CPU lacks that instruction set (it has " +
                      kCpuIsaNames[int(best)] + ")";
        if (!c.error.empty()) c.isa = best, c.forced = false;
        return c;
    }();
    return choice;
}

}  // namespace

CpuIsa cpu_isa() { return isa_choice().isa; }
const char* cpu_isa_error() { return isa_choice().error.c_str(); }

namespace {

#if MTP_ORT_X86
// The AVX2/FMA float kernels: every x86 instruction set but scalar (kernels.h cpu_isa; ARM64: neon::use_neon).
bool use_avx2() { return cpu_isa() != CpuIsa::scalar; }
#endif

// Rows of a matrix: row t at base + t * ld (Strided), or wherever a table of row pointers says (Table: DeepSeek
// Sparse Attention's selected rows, read in place).
struct Strided {
    const float* base;
    size_t ld;
    const float* operator[](size_t t) const { return base + t * ld; }
};
struct Table {
    const float* const* rows;
    const float* operator[](size_t t) const { return rows[t]; }
};

// ------------------------------------------------------------------------------------------- scalar
template <class W>
void rows_dot_scalar(const float* x, size_t m, size_t ldx, W w, size_t n, size_t k, float* y, size_t ldy) {
    for (size_t i = 0; i < m; ++i)
        for (size_t j = 0; j < n; ++j) {
            const float* wj = w[j];
            float s = 0.f;
            for (size_t t = 0; t < k; ++t) s += x[i * ldx + t] * wj[t];
            y[i * ldy + j] = s;
        }
}

template <class V>
void rows_axpy_scalar(const float* p, size_t m, size_t ldp, V v, size_t n, size_t dv, float* y, size_t ldy) {
    for (size_t i = 0; i < m; ++i)
        for (size_t t = 0; t < n; ++t) {
            const float a = p[i * ldp + t];
            const float* vt = v[t];
            for (size_t d = 0; d < dv; ++d) y[i * ldy + d] += a * vt[d];
        }
}

#if MTP_ORT_NEON
namespace neon {
#include "kernels_neon.h"
}  // namespace neon
#endif

#if MTP_ORT_X86
// --------------------------------------------------------------------------------------- AVX2 + FMA
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// The weight rows after next (rows j + 2R .. j + 3R - 1 of w), while rows j .. j + R - 1 are read 8 values at a
// time (t): R * 8 values a step, front to back, so that R consecutive rows are fetched as one stream (rows read
// side by side at one offset are R short interleaved streams, served at about half the rate of one).  Strided
// rows only: a table's rows lie anywhere.
template <int R>
AVX2 inline void prefetch_rows_ahead(Strided w, size_t j, size_t t) {
    const char* ahead = reinterpret_cast<const char*>(w[j + 2 * R] + R * t);
#pragma GCC unroll 8
    for (size_t b = 0; b < R * 8 * sizeof(float); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
}
template <int R>
AVX2 inline void prefetch_rows_ahead(Table, size_t, size_t) {}

// R weight rows against one activation row: R independent accumulators hide the FMA latency.
// Weight rows j .. j + R - 1 of w.
template <int R, class W>
AVX2 void dot_1xr(const float* x, W w, size_t j, size_t k, float* y) {
    __m256 acc[R];
    const float* wr[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), wr[r] = w[j + r];
    size_t t = 0;
    for (; t + 8 <= k; t += 8) {
        prefetch_rows_ahead<R>(w, j, t);
        const __m256 xv = _mm256_loadu_ps(x + t);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(wr[r] + t), xv, acc[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
        float s = hsum(acc[r]);
        for (size_t u = t; u < k; ++u) s += x[u] * wr[r][u];
        y[r] = s;
    }
}

// Weight rows j .. j + R - 1 against the M activation rows x, x + ldx, .. (M x R <= 12 accumulators, one per
// pair; each weight vector loaded once for the M rows, each activation vector once for the R weight rows).
// Every pair's sum is dot_1xr's: 8 lanes accumulated in K's order, then hsum, then the tail.  Ahead: prefetch
// the weight rows after next (on the first of the passes over these rows).
template <int M, int R, bool Ahead, class W>
AVX2 void dot_mxr(const float* x, size_t ldx, W w, size_t j, size_t k, float* y, size_t ldy) {
    const float* rr[R];
    __m256 a[M][R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) rr[r] = w[j + r];
#pragma GCC unroll 4
    for (int i = 0; i < M; ++i)
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) a[i][r] = _mm256_setzero_ps();
    size_t t = 0;
    for (; t + 8 <= k; t += 8) {
        if constexpr (Ahead) prefetch_rows_ahead<R>(w, j, t);
        __m256 wv[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(rr[r] + t);
#pragma GCC unroll 4
        for (int i = 0; i < M; ++i) {
            const __m256 u = _mm256_loadu_ps(x + i * ldx + t);
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) a[i][r] = _mm256_fmadd_ps(wv[r], u, a[i][r]);
        }
    }
    for (int i = 0; i < M; ++i)
        for (int r = 0; r < R; ++r) {
            float s = hsum(a[i][r]);
            for (size_t u = t; u < k; ++u) s += x[i * ldx + u] * rr[r][u];
            y[i * ldy + r] = s;
        }
}

// Weight rows in blocks of R, the activation rows M at a time inside: a block stays in L1 while every group of M
// rows passes over it (the first pass prefetches the block after next).
template <int M, int R, class W>
AVX2 void dot_blocks(const float* x, size_t m, size_t ldx, W w, size_t n, size_t k, float* y, size_t ldy) {
    size_t j = 0;
    for (; j + R <= n; j += R) {
        size_t i = 0;
        for (; i + M <= m; i += M) {
            if (i == 0) dot_mxr<M, R, true>(x, ldx, w, j, k, y + j, ldy);
            else dot_mxr<M, R, false>(x + i * ldx, ldx, w, j, k, y + i * ldy + j, ldy);
        }
        const float* xi = x + i * ldx;
        float* yi = y + i * ldy + j;
        if constexpr (M > 3) if (m - i == 3) dot_mxr<3, R, false>(xi, ldx, w, j, k, yi, ldy);
        if constexpr (M > 2) if (m - i == 2) dot_mxr<2, R, false>(xi, ldx, w, j, k, yi, ldy);
        if (m - i == 1) dot_mxr<1, R, false>(xi, ldx, w, j, k, yi, ldy);
    }
    for (; j < n; ++j)
        for (size_t i = 0; i < m; ++i) dot_1xr<1>(x + i * ldx, w, j, k, y + i * ldy + j);
}

template <class W>
AVX2 void rows_dot_avx2(const float* x, size_t m, size_t ldx, W w, size_t n, size_t k, float* y, size_t ldy) {
    if (m == 1) {
        size_t j = 0;
        for (; j + 8 <= n; j += 8) dot_1xr<8>(x, w, j, k, y + j);
        for (; j + 4 <= n; j += 4) dot_1xr<4>(x, w, j, k, y + j);
        for (; j < n; ++j) dot_1xr<1>(x, w, j, k, y + j);
        return;
    }
    // 4 x 3 tiles where there are 4 rows or more (the attention's heads), else 2 x 4
    if (m >= 4) return dot_blocks<4, 3>(x, m, ldx, w, n, k, y, ldy);
    dot_blocks<2, 4>(x, m, ldx, w, n, k, y, ldy);
}

// y rows i .. i + H - 1, columns d .. d + 8 V - 1, += the p-weighted sum of v's rows t0 .. t1 - 1 (H x V
// accumulators, loaded from y and stored back): per key row, V vectors loaded once for the H rows.  Each value's
// sum is a chain of products added in the key rows' order, as in the scalar kernel's loop.
template <int H, int V, class Rows>
AVX2 void axpy_tile(const float* p, size_t ldp, Rows v, size_t t0, size_t t1, size_t d, float* y, size_t ldy) {
    __m256 a[H][V];
#pragma GCC unroll 4
    for (int h = 0; h < H; ++h)
#pragma GCC unroll 4
        for (int c = 0; c < V; ++c) a[h][c] = _mm256_loadu_ps(y + h * ldy + d + 8 * c);
    for (size_t t = t0; t < t1; ++t) {
        const float* vt = v[t] + d;
        if constexpr (H <= 2) {  // (the weights in registers, each value vector loaded as it is used)
            __m256 s[H];
#pragma GCC unroll 4
            for (int h = 0; h < H; ++h) s[h] = _mm256_broadcast_ss(p + h * ldp + t);
#pragma GCC unroll 4
            for (int c = 0; c < V; ++c) {
                const __m256 vv = _mm256_loadu_ps(vt + 8 * c);
#pragma GCC unroll 4
                for (int h = 0; h < H; ++h) a[h][c] = _mm256_fmadd_ps(s[h], vv, a[h][c]);
            }
            continue;
        }
        __m256 vv[V];
#pragma GCC unroll 4
        for (int c = 0; c < V; ++c) vv[c] = _mm256_loadu_ps(vt + 8 * c);
#pragma GCC unroll 4
        for (int h = 0; h < H; ++h) {
            const __m256 s = _mm256_broadcast_ss(p + h * ldp + t);
#pragma GCC unroll 4
            for (int c = 0; c < V; ++c) a[h][c] = _mm256_fmadd_ps(s, vv[c], a[h][c]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < H; ++h)
#pragma GCC unroll 4
        for (int c = 0; c < V; ++c) _mm256_storeu_ps(y + h * ldy + d + 8 * c, a[h][c]);
}

// axpy_tile over every output row, for columns d .. d + 8 V - 1: the tiles of 4 rows, then the rest.
template <int V, class Rows>
AVX2 void axpy_columns(const float* p, size_t m, size_t ldp, Rows v, size_t t0, size_t t1, size_t d, float* y,
                       size_t ldy) {
    size_t i = 0;
    for (; i + 4 <= m; i += 4) axpy_tile<4, V>(p + i * ldp, ldp, v, t0, t1, d, y + i * ldy, ldy);
    switch (m - i) {
        case 3: return axpy_tile<3, V>(p + i * ldp, ldp, v, t0, t1, d, y + i * ldy, ldy);
        case 2: return axpy_tile<2, V>(p + i * ldp, ldp, v, t0, t1, d, y + i * ldy, ldy);
        case 1: return axpy_tile<1, V>(p + i * ldp, ldp, v, t0, t1, d, y + i * ldy, ldy);
        default: return;
    }
}

// y rows += p-weighted sums of v rows: tiles of 4 output rows by 24 columns (12 accumulators; 2 rows by 32 where
// there are no more), the key rows in blocks of kAxpyRows and, inside a block, its columns 24 at a time, so that
// those columns of the block stay in L1 while every row tile passes over them.
constexpr size_t kAxpyRows = 64;

template <class V>
AVX2 void rows_axpy_avx2(const float* p, size_t m, size_t ldp, V v, size_t n, size_t dv, float* y, size_t ldy) {
    const size_t block = m <= 2 ? n : kAxpyRows;  // (one or two rows: their accumulators pass over all keys once)
    for (size_t t0 = 0; t0 < n; t0 += block) {
        const size_t t1 = std::min(n, t0 + block);
        size_t d = 0;
        if (m <= 2)  // (one or two rows: 32 columns a tile, 8 accumulators)
            for (; d + 32 <= dv; d += 32) axpy_columns<4>(p, m, ldp, v, t0, t1, d, y, ldy);
        for (; d + 24 <= dv; d += 24) axpy_columns<3>(p, m, ldp, v, t0, t1, d, y, ldy);
        if (d + 16 <= dv) axpy_columns<2>(p, m, ldp, v, t0, t1, d, y, ldy), d += 16;
        if (d + 8 <= dv) axpy_columns<1>(p, m, ldp, v, t0, t1, d, y, ldy), d += 8;
        for (size_t i = 0; i < m && d < dv; ++i)  // (dv not a multiple of 8)
            for (size_t t = t0; t < t1; ++t)
                for (size_t e = d; e < dv; ++e) y[i * ldy + e] += p[i * ldp + t] * v[t][e];
    }
}

// exp(x) for 8 floats: x = n ln2 + r, |r| <= ln2/2, e^r by a degree-6 polynomial (relative error ~2e-7);
// below -87.3 the result is 0 (as the softmax's masked entries need), above 88.7 +inf.
AVX2 inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f), hi = _mm256_set1_ps(88.72283f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);  // ln2 in two parts (Cody-Waite)
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 e = _mm256_set1_ps(1.f / 720);
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f / 120));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f / 24));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f / 6));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(0.5f));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f));
    // 2^n, split in two factors so that n = 128 (x near 88.7) does not overflow the exponent field
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i half = _mm256_srai_epi32(ni, 1);
    const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    const __m256 p2 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
    return _mm256_andnot_ps(under, _mm256_mul_ps(_mm256_mul_ps(e, p1), p2));
}

// In place: x = exp(x - max), returning the sum.
AVX2 float exp_shift_sum_avx2(float* x, size_t n, float max) {
    const __m256 mv = _mm256_set1_ps(max);
    __m256 acc = _mm256_setzero_ps();
    size_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + t), mv));
        _mm256_storeu_ps(x + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    float s = hsum(acc);
    for (; t < n; ++t) s += (x[t] = std::exp(x[t] - max));
    return s;
}

AVX2 void swiglu_pairs_avx2(const float* h, size_t m, size_t ldh, size_t units, float* a, size_t lda) {
    // de-interleave 8 (gate, up) pairs: permute each 8-float half so gates land low, ups high
    const __m256i perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (size_t i = 0; i < m; ++i) {
        const float* hi = h + i * ldh;
        float* ai = a + i * lda;
        size_t j = 0;
        for (; j + 8 <= units; j += 8) {
            const __m256 x0 = _mm256_permutevar8x32_ps(_mm256_loadu_ps(hi + 2 * j), perm);
            const __m256 x1 = _mm256_permutevar8x32_ps(_mm256_loadu_ps(hi + 2 * j + 8), perm);
            const __m256 g = _mm256_permute2f128_ps(x0, x1, 0x20), u = _mm256_permute2f128_ps(x0, x1, 0x31);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
            _mm256_storeu_ps(ai + j, _mm256_mul_ps(silu, u));
        }
        for (; j < units; ++j) {
            const float g = hi[2 * j];
            ai[j] = g / (1.f + std::exp(-g)) * hi[2 * j + 1];
        }
    }
}

#endif  // MTP_ORT_X86

// In place: s[t] = s[t] * scale where visible[t] (visible == nullptr: every t), else -inf; returns the max.
float scale_visible_max_scalar(float* s, size_t n, float scale, const uint8_t* visible) {
    float mx = -std::numeric_limits<float>::infinity();
    for (size_t t = 0; t < n; ++t) {
        s[t] = !visible || visible[t] ? s[t] * scale : -std::numeric_limits<float>::infinity();
        mx = std::max(mx, s[t]);
    }
    return mx;
}

#if MTP_ORT_X86
// scale_visible_max_scalar 8 rows at a time (the same products; the max of the same values).
AVX2 float scale_visible_max_avx2(float* s, size_t n, float scale, const uint8_t* visible) {
    const __m256 sc = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 mx = ninf;
    size_t t = 0;
    for (; t + 8 <= n; t += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(s + t), sc);
        if (visible) {
            int64_t bytes;
            std::memcpy(&bytes, visible + t, 8);
            const __m256i seen = _mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes)),
                                                    _mm256_setzero_si256());
            v = _mm256_blendv_ps(ninf, v, _mm256_castsi256_ps(seen));
        }
        _mm256_storeu_ps(s + t, v);
        mx = _mm256_max_ps(mx, v);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return std::max(_mm_cvtss_f32(m), scale_visible_max_scalar(s + t, n - t, scale, visible ? visible + t : nullptr));
}

#endif

float scale_visible_max(float* s, size_t n, float scale, const uint8_t* visible) {
#if MTP_ORT_X86
    if (use_avx2()) return scale_visible_max_avx2(s, n, scale, visible);
#endif
    return scale_visible_max_scalar(s, n, scale, visible);
}

float exp_shift_sum(float* x, size_t n, float max) {
#if MTP_ORT_X86
    if (use_avx2()) return exp_shift_sum_avx2(x, n, max);
#elif MTP_ORT_NEON
    if (neon::use_neon()) return neon::exp_shift_sum(x, n, max);
#endif
    float s = 0.f;
    for (size_t t = 0; t < n; ++t) s += (x[t] = std::exp(x[t] - max));
    return s;
}

// Top k of v[0..n) by value, ties to the lower index (stable): idx [k].
void top_k(const float* v, size_t n, size_t k, int32_t* idx) {
    for (size_t r = 0; r < k; ++r) {
        int32_t best = -1;
        for (size_t e = 0; e < n; ++e) {
            bool taken = false;
            for (size_t q = 0; q < r; ++q) taken |= idx[q] == int32_t(e);
            if (!taken && (best < 0 || v[e] > v[best])) best = int32_t(e);
        }
        idx[r] = best;
    }
}

}  // namespace

void rows_dot(const float* x, size_t m, size_t ldx, const float* w, size_t ldw, size_t n, size_t k, float* y,
              size_t ldy) {
#if MTP_ORT_X86
    if (use_avx2()) return rows_dot_avx2(x, m, ldx, Strided{w, ldw}, n, k, y, ldy);
#elif MTP_ORT_NEON
    if (neon::use_neon()) return neon::rows_dot(x, m, ldx, Strided{w, ldw}, n, k, y, ldy);
#endif
    rows_dot_scalar(x, m, ldx, Strided{w, ldw}, n, k, y, ldy);
}

void rows_axpy(const float* p, size_t m, size_t ldp, const float* v, size_t ldv, size_t n, size_t dv, float* y,
               size_t ldy) {
#if MTP_ORT_X86
    if (use_avx2()) return rows_axpy_avx2(p, m, ldp, Strided{v, ldv}, n, dv, y, ldy);
#elif MTP_ORT_NEON
    if (neon::use_neon()) return neon::rows_axpy(p, m, ldp, Strided{v, ldv}, n, dv, y, ldy);
#endif
    rows_axpy_scalar(p, m, ldp, Strided{v, ldv}, n, dv, y, ldy);
}

namespace {

template <class W>
void dot_rows(const float* x, size_t m, size_t ldx, W w, size_t n, size_t k, float* y, size_t ldy) {
#if MTP_ORT_X86
    if (use_avx2()) return rows_dot_avx2(x, m, ldx, w, n, k, y, ldy);
#elif MTP_ORT_NEON
    if (neon::use_neon()) return neon::rows_dot(x, m, ldx, w, n, k, y, ldy);
#endif
    rows_dot_scalar(x, m, ldx, w, n, k, y, ldy);
}

template <class V>
void axpy_rows(const float* p, size_t m, size_t ldp, V v, size_t n, size_t dv, float* y, size_t ldy) {
#if MTP_ORT_X86
    if (use_avx2()) return rows_axpy_avx2(p, m, ldp, v, n, dv, y, ldy);
#elif MTP_ORT_NEON
    if (neon::use_neon()) return neon::rows_axpy(p, m, ldp, v, n, dv, y, ldy);
#endif
    rows_axpy_scalar(p, m, ldp, v, n, dv, y, ldy);
}

// Absorbed MLA of one query token over key rows `a` (n_a, all visible) then `b` (n_b, visible where visible[r]
// says; nullptr: all).  Each head's scores are padded with -inf to a multiple of 8 (mla_scores_stride): the
// exponentials are then summed in the same vector lanes whatever the number of keys, so a token gets the same bits
// whether the keys after its own (hidden) are there or not -- a verify step's rows equal a one-token step's.
template <class A, class B>
void attend(const float* q, size_t heads, size_t c, size_t dl, float scale, A a, size_t n_a, B b, size_t n_b,
            const uint8_t* visible, float* scores, float* out, size_t ldo) {
    const size_t n = n_a + n_b, l = mla_scores_stride(n);
    dot_rows(q, heads, c, a, n_a, c, scores, l);
    dot_rows(q, heads, c, b, n_b, c, scores + n_a, l);
    const float ninf = -std::numeric_limits<float>::infinity();
    for (size_t h = 0; h < heads; ++h) {
        float* s = scores + h * l;
        const float mx = std::max(scale_visible_max(s, n_a, scale, nullptr),
                                  scale_visible_max(s + n_a, n_b, scale, visible));
        std::fill(s + n, s + l, ninf);
        std::fill(out + h * ldo, out + h * ldo + dl, 0.f);
        if (mx == ninf) {  // no row seen (only where a selection is empty): a zero output
            std::fill(s, s + n, 0.f);
            continue;
        }
        const float inv = 1.f / exp_shift_sum(s, l, mx);
        for (size_t t = 0; t < n; ++t) s[t] *= inv;
    }
    axpy_rows(scores, heads, l, a, n_a, dl, out, ldo);
    axpy_rows(scores + n_a, heads, l, b, n_b, dl, out, ldo);
}

}  // namespace

void mla_attend_token(const float* q, size_t heads, size_t c, size_t dl, float scale, const float* cache,
                      size_t n_cache, const float* rows, size_t n_rows, size_t ld, const uint8_t* visible,
                      float* scores, float* out, size_t ldo) {
    if (visible)  // the rows after the last visible one take no part (a prompt's token: those of the tokens after it)
        while (n_rows && !visible[n_rows - 1]) --n_rows;
    attend(q, heads, c, dl, scale, Strided{cache, ld}, n_cache, Strided{rows, ld}, n_rows, visible, scores, out, ldo);
}

void mla_attend_rows(const float* q, size_t heads, size_t c, size_t dl, float scale, const float* const* keys,
                     size_t n, float* scores, float* out, size_t ldo) {
    attend(q, heads, c, dl, scale, Table{keys}, n, Table{keys + n}, 0, nullptr, scores, out, ldo);
}

// ------------------------------------------------------------------------------------- lightning indexer
namespace {

enum class IndexPath { scalar, avx2, avx512, neon };

IndexPath index_path() {
#if MTP_ORT_X86
    static const IndexPath path = [] {
        switch (cpu_isa()) {
            case CpuIsa::scalar: return IndexPath::scalar;
            case CpuIsa::avx512_vnni: return IndexPath::avx512;
            default:  // (unforced: AVX-512F without VNNI still runs the 512-bit indexer)
                return !isa_choice().forced && __builtin_cpu_supports("avx512f") ? IndexPath::avx512 : IndexPath::avx2;
        }
    }();
    return path;
#elif MTP_ORT_NEON
    return neon::use_neon() ? IndexPath::neon : IndexPath::scalar;
#else
    return IndexPath::scalar;
#endif
}

void index_scores_scalar(const float* q, const float* w, size_t heads, size_t di, float scale, const float* keys,
                         size_t ld, size_t n, float* scores) {
    for (size_t t = 0; t < n; ++t) {
        const float* k = keys + t * ld;
        float total = 0.f;
        for (size_t j = 0; j < heads; ++j) {
            float dot = 0.f;
            for (size_t d = 0; d < di; ++d) dot += q[j * di + d] * k[d];
            total += w[j] * std::max(dot * scale, 0.f);
        }
        scores[t] = total;
    }
}

#if MTP_ORT_X86
// The vector paths: a tile of L rows (one per lane) is read transposed (kt[d] = the tile's values of dim d,
// gathered; the next tile prefetched), then every head's dot products are L-wide FMAs over d, 8 heads at a time
// (8 accumulators).  A row's score is the same bits wherever it falls in a tile: the last tile's gather is masked.
#define INDEX_TILE(VEC, L, SET1, ZERO, LOAD, STORE, FMA, MUL, MAX, GATHER)                                       \
    for (size_t t0 = 0; t0 < n; t0 += L) {                                                                           \
        const size_t rows = std::min<size_t>(L, n - t0);                                                             \
        const float* base = keys + t0 * ld;                                                                          \
        for (size_t r = 0; r < L && t0 + L + r < n; ++r)                                                             \
            for (size_t d = 0; d < di; d += 16) _mm_prefetch(reinterpret_cast<const char*>(base + (L + r) * ld + d), \
                                                             _MM_HINT_T0);                                           \
        for (size_t d = 0; d < di; ++d) STORE(kt + d * L, GATHER(base + d, offsets, rows));                                   \
        VEC total = ZERO();                                                                                          \
        const VEC sc = SET1(scale), zero = ZERO();                                                                   \
        size_t j = 0;                                                                                                \
        for (; j + 8 <= heads; j += 8) {                                                                             \
            VEC acc[8];                                                                                              \
            for (int g = 0; g < 8; ++g) acc[g] = ZERO();                                                             \
            for (size_t d = 0; d < di; ++d) {                                                                        \
                const VEC kv = LOAD(kt + d * L);                                                                     \
                _Pragma("GCC unroll 8") for (int g = 0; g < 8; ++g) acc[g] = FMA(SET1(q[(j + g) * di + d]), kv, acc[g]); \
            }                                                                                                        \
            for (int g = 0; g < 8; ++g) total = FMA(SET1(w[j + g]), MAX(MUL(acc[g], sc), zero), total);             \
        }                                                                                                            \
        for (; j < heads; ++j) {                                                                                     \
            VEC acc = ZERO();                                                                                        \
            for (size_t d = 0; d < di; ++d) acc = FMA(SET1(q[j * di + d]), LOAD(kt + d * L), acc);                   \
            total = FMA(SET1(w[j]), MAX(MUL(acc, sc), zero), total);                                                 \
        }                                                                                                            \
        if (rows == L) {                                                                                             \
            STORE(scores + t0, total);                                                                               \
        } else {                                                                                                     \
            alignas(64) float tail[L];                                                                               \
            STORE(tail, total);                                                                                      \
            std::copy(tail, tail + rows, scores + t0);                                                               \
        }                                                                                                            \
    }

// The rows < `rows` of a tile's column at p (lanes `offsets` bytes / 4 apart), zeros after.
AVX2 inline __m256 gather8(const float* p, __m256i offsets, size_t rows) {
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(rows)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_mask_i32gather_ps(_mm256_setzero_ps(), p, offsets, _mm256_castsi256_ps(live), 4);
}

#define AVX512 __attribute__((target("avx2,fma,avx512f")))
AVX512 inline __m512 gather16(const float* p, __m512i offsets, size_t rows) {
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), __mmask16((1u << rows) - 1), offsets, p, 4);
}

AVX2 void index_scores_avx2(const float* q, const float* w, size_t heads, size_t di, float scale, const float* keys,
                            size_t ld, size_t n, float* scores, float* kt) {
    const __m256i offsets = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(int(ld)));
    INDEX_TILE(__m256, 8, _mm256_set1_ps, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_fmadd_ps,
               _mm256_mul_ps, _mm256_max_ps, gather8)
}

AVX512 void index_scores_avx512(const float* q, const float* w, size_t heads, size_t di, float scale,
                                const float* keys, size_t ld, size_t n, float* scores, float* kt) {
    const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(int(ld)));
    INDEX_TILE(__m512, 16, _mm512_set1_ps, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_fmadd_ps,
               _mm512_mul_ps, _mm512_max_ps, gather16)
}
// With heads a multiple of the lane count L, the heads lie across the lanes instead (no gathers): the queries
// transposed once (qt[g][d] = dim d of heads L g .. L g + L - 1), a row's L dot products are FMAs of qt[g][d]
// with its value d broadcast, R rows at a time sharing each qt load, two accumulators a row (even and odd d);
// then ReLU, the head weights and one sum across the lanes.  Every row goes through the same operations in the
// same order, whatever R.
#define INDEX_HEADS(NAME, ATTR, VEC, L, SET1, ZERO, LOAD, FMA, MUL, ADD, MAX, REDUCE)                                \
    template <int R>                                                                                                 \
    ATTR void index_rows_##NAME(const float* qt, const float* w, size_t groups, size_t di, VEC sc, const float* k,   \
                                size_t ld, float* scores) {                                                          \
        VEC total[R];                                                                                                \
        for (int r = 0; r < R; ++r) total[r] = ZERO();                                                               \
        for (size_t g = 0; g < groups; ++g) {                                                                        \
            const float* qg = qt + g * di * L;                                                                       \
            VEC even[R], odd[R];                                                                                     \
            for (int r = 0; r < R; ++r) even[r] = odd[r] = ZERO();                                                   \
            size_t d = 0;                                                                                            \
            for (; d + 2 <= di; d += 2) {                                                                            \
                const VEC q0 = LOAD(qg + d * L), q1 = LOAD(qg + d * L + L);                                          \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {                                                \
                    even[r] = FMA(q0, SET1(k[r * ld + d]), even[r]);                                                 \
                    odd[r] = FMA(q1, SET1(k[r * ld + d + 1]), odd[r]);                                               \
                }                                                                                                    \
            }                                                                                                        \
            if (d < di)                                                                                              \
                for (int r = 0; r < R; ++r) even[r] = FMA(LOAD(qg + d * L), SET1(k[r * ld + d]), even[r]);           \
            const VEC wv = LOAD(w + L * g);                                                                          \
            for (int r = 0; r < R; ++r) total[r] = FMA(wv, MAX(MUL(ADD(even[r], odd[r]), sc), ZERO()), total[r]);    \
        }                                                                                                            \
        for (int r = 0; r < R; ++r) scores[r] = REDUCE(total[r]);                                                    \
    }                                                                                                                \
                                                                                                                     \
    ATTR void index_scores_##NAME##_heads(const float* q, const float* w, size_t heads, size_t di, float scale,      \
                                          const float* keys, size_t ld, size_t n, float* scores, float* qt) {        \
        const size_t groups = heads / L;                                                                             \
        for (size_t g = 0; g < groups; ++g)                                                                          \
            for (size_t d = 0; d < di; ++d)                                                                          \
                for (size_t lane = 0; lane < L; ++lane) qt[(g * di + d) * L + lane] = q[(L * g + lane) * di + d];    \
        const VEC sc = SET1(scale);                                                                                  \
        constexpr size_t R = 4, ahead = 16; /* rows a pass; rows prefetched ahead */                                 \
        size_t t = 0;                                                                                                \
        for (; t + R <= n; t += R) {                                                                                 \
            for (size_t r = 0; r < R && t + ahead + r < n; ++r)                                                      \
                for (size_t d = 0; d < di; d += 16)                                                                  \
                    _mm_prefetch(reinterpret_cast<const char*>(keys + (t + ahead + r) * ld + d), _MM_HINT_T0);       \
            index_rows_##NAME<R>(qt, w, groups, di, sc, keys + t * ld, ld, scores + t);                              \
        }                                                                                                            \
        for (; t < n; ++t) index_rows_##NAME<1>(qt, w, groups, di, sc, keys + t * ld, ld, scores + t);               \
    }

INDEX_HEADS(avx2, AVX2, __m256, 8, _mm256_set1_ps, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps,
            _mm256_mul_ps, _mm256_add_ps, _mm256_max_ps, hsum)
INDEX_HEADS(avx512, AVX512, __m512, 16, _mm512_set1_ps, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps,
            _mm512_mul_ps, _mm512_add_ps, _mm512_max_ps, _mm512_reduce_add_ps)
#undef INDEX_HEADS
#undef INDEX_TILE
#undef AVX512
#endif  // MTP_ORT_X86

}  // namespace

void index_scores(const float* q, const float* w, size_t heads, size_t di, float scale, const float* keys,
                  size_t ld, size_t n, float* scores) {
    thread_local std::vector<float> kt;  // one tile, or the queries, transposed
    switch (index_path()) {
#if MTP_ORT_X86
        case IndexPath::avx512:
            if (kt.size() < std::max<size_t>(16, heads) * di) kt.resize(std::max<size_t>(16, heads) * di);
            if (heads % 16 == 0) return index_scores_avx512_heads(q, w, heads, di, scale, keys, ld, n, scores, kt.data());
            return index_scores_avx512(q, w, heads, di, scale, keys, ld, n, scores, kt.data());
        case IndexPath::avx2:
            if (kt.size() < std::max<size_t>(8, heads) * di) kt.resize(std::max<size_t>(8, heads) * di);
            if (heads % 8 == 0) return index_scores_avx2_heads(q, w, heads, di, scale, keys, ld, n, scores, kt.data());
            return index_scores_avx2(q, w, heads, di, scale, keys, ld, n, scores, kt.data());
#elif MTP_ORT_NEON
        case IndexPath::neon: return neon::index_scores(q, w, heads, di, scale, keys, ld, n, scores);
#endif
        default: return index_scores_scalar(q, w, heads, di, scale, keys, ld, n, scores);
    }
}

size_t select_top(const float* scores, size_t n, size_t k, float* scratch, int32_t* idx) {
    const float ninf = -std::numeric_limits<float>::infinity();
    size_t m = 0;
    for (size_t t = 0; t < n; ++t)
        if (scores[t] > ninf) scratch[m++] = scores[t];  // (NaN and -inf: not visible)
    if (m <= k) {
        size_t c = 0;
        for (size_t t = 0; t < n; ++t)
            if (scores[t] > ninf) idx[c++] = int32_t(t);
        return c;
    }
    if (k == 0) return 0;
    std::nth_element(scratch, scratch + (k - 1), scratch + m, std::greater<float>());
    const float v = scratch[k - 1];  // the k-th highest: all above it are chosen, then the earliest equal to it
    size_t equal = k - size_t(std::count_if(scratch, scratch + (k - 1), [v](float x) { return x > v; }));
    size_t c = 0;
    for (size_t t = 0; t < n && c < k; ++t) {
        const float x = scores[t];
        if (x > v || (x == v && equal && equal--)) idx[c++] = int32_t(t);
    }
    return c;
}

const char* index_path_name() {
    static const char* names[] = {"scalar", "avx2", "avx512", "neon"};
    return names[int(index_path())];
}

void rms_norm_row(const float* x, size_t n, const float* w, float eps, float* y) {
    constexpr size_t L = 8;  // partial sums, element i into lane i % L (the compiler keeps them in one vector)
    float part[L] = {};
    size_t i = 0;
    for (; i + L <= n; i += L)
        for (size_t l = 0; l < L; ++l) part[l] += x[i + l] * x[i + l];
    for (; i < n; ++i) part[i % L] += x[i] * x[i];
    float ss = 0.f;
    for (float p : part) ss += p;
    const float r = 1.f / std::sqrt(ss / float(n) + eps);
    for (size_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * r);
}

void rope_heads(float* x, size_t heads, size_t ld, size_t dr, const float* cos, const float* sin, bool interleave) {
    const size_t half = dr / 2, step = interleave ? 2 : 1, other = interleave ? 1 : half;
    for (size_t h = 0; h < heads; ++h)
        for (size_t i = 0; i < half; ++i) {
            float* a = x + h * ld + i * step;
            const float x1 = a[0], x2 = a[other];
            a[0] = x1 * cos[i] - x2 * sin[i];
            a[other] = x2 * cos[i] + x1 * sin[i];
        }
}

void swiglu_pairs(const float* h, size_t m, size_t ldh, size_t units, float* a, size_t lda) {
#if MTP_ORT_X86
    if (use_avx2()) return swiglu_pairs_avx2(h, m, ldh, units, a, lda);
#elif MTP_ORT_NEON
    if (neon::use_neon()) return neon::swiglu_pairs(h, m, ldh, units, a, lda);
#endif
    for (size_t i = 0; i < m; ++i)
        for (size_t j = 0; j < units; ++j) {
            const float g = h[i * ldh + 2 * j];
            a[i * lda + j] = g / (1.f + std::exp(-g)) * h[i * ldh + 2 * j + 1];
        }
}

void route_token(const float* logits, size_t n_experts, bool softmax_scoring, const float* bias, size_t n_group,
                 size_t topk_group, bool group_top2, size_t k, bool norm_topk_prob, float scaling, float* scratch,
                 int32_t* idx, float* weight) {
    float* s = scratch;               // scores [E]
    float* choice = scratch + n_experts;  // [E]
    if (softmax_scoring) {
        const float mx = *std::max_element(logits, logits + n_experts);
        float sum = 0.f;
        for (size_t e = 0; e < n_experts; ++e) sum += (s[e] = std::exp(logits[e] - mx));
        for (size_t e = 0; e < n_experts; ++e) s[e] /= sum;
    } else {
        for (size_t e = 0; e < n_experts; ++e) s[e] = 1.f / (1.f + std::exp(-logits[e]));
    }
    for (size_t e = 0; e < n_experts; ++e) choice[e] = bias ? s[e] + bias[e] : s[e];
    if (n_group > 1) {
        const size_t per = n_experts / n_group;
        float* gscore = scratch + 2 * n_experts;  // [G]
        for (size_t g = 0; g < n_group; ++g) {
            float b1 = -std::numeric_limits<float>::infinity(), b2 = b1;
            for (size_t e = g * per; e < (g + 1) * per; ++e) {
                const float v = choice[e];
                if (v > b1) b2 = b1, b1 = v;
                else if (v > b2) b2 = v;
            }
            gscore[g] = group_top2 ? b1 + b2 : b1;
        }
        int32_t kept[64];
        top_k(gscore, n_group, topk_group, kept);
        for (size_t g = 0; g < n_group; ++g) {
            bool keep = false;
            for (size_t q = 0; q < topk_group; ++q) keep |= kept[q] == int32_t(g);
            if (!keep)
                for (size_t e = g * per; e < (g + 1) * per; ++e) choice[e] = -std::numeric_limits<float>::infinity();
        }
    }
    top_k(choice, n_experts, k, idx);
    float sum = 0.f;
    for (size_t r = 0; r < k; ++r) sum += (weight[r] = s[idx[r]]);
    for (size_t r = 0; r < k; ++r) {  // the reference's order: normalized, then scaled
        if (norm_topk_prob) weight[r] /= sum + 1e-20f;
        if (scaling != 1.f) weight[r] *= scaling;
    }
}


// ------------------------------------------------------------------------------ quantized products
namespace {

// One activation row quantized for a weight format (quantize_rows), in groups of 4 blocks of 32 values (the
// row zero-padded to whole groups), each 8 values with a scale of their own.  A lane is 4 bytes of a
// weight row (8 values at 4 bits, 4 at 8 bits): the vector kernels' int32 products come out one per lane
// (qkernels_impl.h), so a lane never spans two activation scales or two weight blocks.
//   q      int8  [groups * 128]  8 bits: in x's order; 4 bits: each group's even elements, block by block, then
//                                its odd ones -- the order of a weight vector's low nibbles, then its high ones
//   corr   int32 [lanes]         -z * (the sum of q over each 8 values), in the first lane of those values
//                                (z = 2^(bits-1)); 0 elsewhere
//   scale  float [lanes]         the scale of each lane's 8 values
// rows `bytes` apart.  The layout and the kernels belong together.
struct QAct {
    size_t groups, lanes, corr_at, scale_at, bytes;
    explicit QAct(const QWeights& w)
        : groups((w.blocks() * w.block + 127) / 128), lanes(groups * 4 * size_t(w.bits)), corr_at(128 * groups),
          scale_at(corr_at + 4 * lanes), bytes(scale_at + 4 * lanes) {}
    size_t blocks() const { return 4 * groups; }
    // where element e < 32 of activation block kb goes in q
    static size_t at(size_t kb, size_t e, int bits) {
        return bits == 8 ? 32 * kb + e : kb / 4 * 128 + (e % 2) * 64 + kb % 4 * 16 + e / 2;
    }
};

[[maybe_unused]] constexpr int kRows = 4;  // weight rows per tile (x86)

// avx512_vnni_256: AVX512-VNNI's 256-bit form, the AVX-VNNI kernels on a CPU with AVX-512 but no AVX-VNNI
// (MTP_TRT_CPU_ISA=avx-vnni there).
enum class QPath { scalar, avx2, avx_vnni, avx512_vnni, avx512_vnni_256, neon, neon_dotprod, neon_i8mm };

QPath qpath() {
    static const QPath path = [] {
        switch (cpu_isa()) {
#if MTP_ORT_X86
            case CpuIsa::avx2: return QPath::avx2;
            case CpuIsa::avx_vnni: return __builtin_cpu_supports("avxvnni") ? QPath::avx_vnni : QPath::avx512_vnni_256;
            case CpuIsa::avx512_vnni: return QPath::avx512_vnni;
#elif MTP_ORT_NEON
            case CpuIsa::neon: return QPath::neon;
            case CpuIsa::neon_dotprod: return QPath::neon_dotprod;
            case CpuIsa::neon_i8mm: return QPath::neon_i8mm;
#endif
            default: return QPath::scalar;
        }
    }();
    return path;
}

// Block kb's lanes (`bits` of them): each 8 values' scale in their lanes, and the zero-point correction of their
// sum in the first of them.
void store_lanes(const float* scale, const int32_t* sum, size_t kb, const QWeights& w, const QAct& a,
                 uint8_t* row) {
    const int32_t z = 1 << (w.bits - 1);
    const size_t n = size_t(w.bits), lane = kb * n, per = n / 4;  // lanes per 8 values
    int32_t* corr = reinterpret_cast<int32_t*>(row + a.corr_at) + lane;
    float* scales = reinterpret_cast<float*>(row + a.scale_at) + lane;
    std::fill(corr, corr + n, 0);
    for (size_t g = 0; g < 4; ++g) {
        corr[g * per] = -z * sum[g];
        std::fill_n(scales + g * per, per, scale[g]);
    }
}

// Block kb of a row of k values, each 8 values by their own scale = max|x| / 127: q = round-half-even(x / scale),
// zeros past k.
void quantize_block_scalar(const float* x, size_t k, size_t kb, const QWeights& w, const QAct& a, uint8_t* row) {
    float v[32];
    for (size_t t = 0; t < 32; ++t) v[t] = kb * 32 + t < k ? x[kb * 32 + t] : 0.f;
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    for (size_t t = 0; t < 32; ++t) s[t / 8] = std::max(s[t / 8], std::fabs(v[t]));
    for (float& f : s) f /= 127.f;
    int32_t sum[4] = {0, 0, 0, 0};
    for (size_t t = 0; t < 32; ++t) {
        const float sh = s[t / 8];
        const int8_t q = sh > 0.f ? int8_t(std::clamp(std::nearbyint(v[t] / sh), -127.f, 127.f)) : int8_t(0);
        reinterpret_cast<int8_t*>(row)[QAct::at(kb, t, w.bits)] = q;
        sum[t / 8] += q;
    }
    store_lanes(s, sum, kb, w, a, row);
}

#if MTP_ORT_X86
// quantize_block_scalar's bytes, 32 values at a time (the same divisions and roundings).
AVX2 void quantize_block_avx2(const float* x, size_t k, size_t kb, const QWeights& w, const QAct& a,
                              uint8_t* row) {
    float pad[32];
    const float* src = x + 32 * kb;
    if (32 * kb + 32 > k) {
        std::fill(pad, pad + 32, 0.f);
        if (32 * kb < k) std::copy(src, x + k, pad);
        src = pad;
    }
    __m256 v[4], m[4];
    for (int t = 0; t < 4; ++t) v[t] = _mm256_loadu_ps(src + 8 * t), m[t] = _mm256_andnot_ps(_mm256_set1_ps(-0.f), v[t]);
    // each 8 values their own scale: the four maxima of |v| side by side, then max / 127
    const __m256 m01 = _mm256_max_ps(_mm256_unpacklo_ps(m[0], m[1]), _mm256_unpackhi_ps(m[0], m[1]));
    const __m256 m23 = _mm256_max_ps(_mm256_unpacklo_ps(m[2], m[3]), _mm256_unpackhi_ps(m[2], m[3]));
    const __m256 mm = _mm256_max_ps(_mm256_shuffle_ps(m01, m23, 0x44), _mm256_shuffle_ps(m01, m23, 0xEE));
    const __m128 s = _mm_div_ps(_mm_max_ps(_mm256_castps256_ps128(mm), _mm256_extractf128_ps(mm, 1)), _mm_set1_ps(127.f));
    // 8 zeros: any nonzero divisor gives zeros
    const __m256 sd = _mm256_castps128_ps256(_mm_blendv_ps(s, _mm_set1_ps(1.f), _mm_cmpeq_ps(s, _mm_setzero_ps())));
    const __m256 hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
    __m256i q[4];
    for (int t = 0; t < 4; ++t) {
        const __m256 sv = _mm256_permutevar8x32_ps(sd, _mm256_set1_epi32(t));
        const __m256 r = _mm256_round_ps(_mm256_div_ps(v[t], sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q[t] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    }
    // the four sums of q side by side; the lanes (store_lanes' values): -z * sum in each 8 values' first lane
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(q[0], q[1]), _mm256_hadd_epi32(q[2], q[3]));
    const __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    const __m128i corr = _mm_sub_epi32(_mm_setzero_si128(), _mm_slli_epi32(sum, w.bits - 1));
    uint8_t* corr_at = row + a.corr_at + 4 * kb * size_t(w.bits);
    uint8_t* scale_at = row + a.scale_at + 4 * kb * size_t(w.bits);
    if (w.bits == 4) {  // a lane per 8 values
        _mm_storeu_si128(reinterpret_cast<__m128i*>(corr_at), corr);
        _mm_storeu_ps(reinterpret_cast<float*>(scale_at), s);
    } else {  // two lanes per 8 values
        _mm_storeu_si128(reinterpret_cast<__m128i*>(corr_at), _mm_unpacklo_epi32(corr, _mm_setzero_si128()));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(corr_at + 16), _mm_unpackhi_epi32(corr, _mm_setzero_si128()));
        _mm_storeu_ps(reinterpret_cast<float*>(scale_at), _mm_unpacklo_ps(s, s));
        _mm_storeu_ps(reinterpret_cast<float*>(scale_at + 16), _mm_unpackhi_ps(s, s));
    }
    // packs interleave the 128-bit lanes: dwords come out as 0 2 4 6 1 3 5 7 of the natural order
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (w.bits == 8) return _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 32 * kb), p);
    // even elements, then odd ones: within each 16-byte lane, then across the lanes
    const __m256i evens_odds = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8,
                                                10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    p = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(p, evens_odds), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + QAct::at(kb, 0, 4)), _mm256_castsi256_si128(p));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + QAct::at(kb, 1, 4)), _mm256_extracti128_si256(p, 1));
}

#endif  // MTP_ORT_X86

// The integer dot product of elements [8 g, 8 g + 8) of activation block kb with weight row wr.
int32_t part_dot_scalar(const int8_t* xq, const uint8_t* wr, size_t kb, size_t g, int bits) {
    int32_t dot = 0;
    const int z = 1 << (bits - 1);
    for (size_t e = 8 * g; e < 8 * g + 8; ++e) {
        const uint8_t byte = bits == 4 ? wr[16 * kb + e / 2] : wr[32 * kb + e];
        const int u = bits == 8 ? byte : e % 2 ? byte >> 4 : byte & 15;
        dot += xq[QAct::at(kb, e, bits)] * (u - z);
    }
    return dot;
}

void qrows_dot_scalar(const uint8_t* qx, size_t m, const QWeights& w, size_t n, float* y, size_t ldy) {
    const QAct a(w);
    const size_t kp = w.blocks() * w.block, n32 = (kp + 31) / 32;
    for (size_t i = 0; i < m; ++i) {
        const uint8_t* row = qx + i * a.bytes;
        const int8_t* xq = reinterpret_cast<const int8_t*>(row);
        const float* xs = reinterpret_cast<const float*>(row + a.scale_at);
        for (size_t j = 0; j < n; ++j) {
            const uint8_t* wr = w.data + j * w.row_bytes();
            const QWeights wj = w.from_row(j);
            float acc = 0.f;
            for (size_t kb = 0; kb < n32; ++kb)
                for (size_t g = 0; g < 4 && 32 * kb + 8 * g < kp; ++g)  // (the last block of 16 may be alone)
                    acc += float(part_dot_scalar(xq, wr, kb, g, w.bits)) * xs[kb * size_t(w.bits) + g * size_t(w.bits) / 4] *
                           wj.scale((32 * kb + 8 * g) / w.block);
            y[i * ldy + j] = acc;
        }
    }
}

// The vector paths: qkernels_impl.h once per x86 instruction set, qkernels_neon.h once per ARM one.
#if MTP_ORT_X86
#define QK __attribute__((target("avx2,fma,f16c")))
#define QK_VNNI 0
#define QK_512 0
#define QK_MAXC 2
namespace q_avx2 {
#include "qkernels_impl.h"
}  // namespace q_avx2
#undef QK
#undef QK_VNNI

#define QK __attribute__((target("avx2,fma,f16c,avxvnni")))
#define QK_VNNI 1
#define QK_DPBUSD _mm256_dpbusd_avx_epi32
namespace q_avx_vnni {
#include "qkernels_impl.h"
}  // namespace q_avx_vnni
#undef QK
#undef QK_DPBUSD

#define QK __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))
#define QK_DPBUSD _mm256_dpbusd_epi32
namespace q_avx512_vnni_256 {
#include "qkernels_impl.h"
}  // namespace q_avx512_vnni_256
#undef QK
#undef QK_DPBUSD

#undef QK_512
#define QK __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))
#define QK_DPBUSD _mm256_dpbusd_epi32
#define QK_512 1
#undef QK_MAXC
#define QK_MAXC 4
namespace q_avx512_vnni {
#include "qkernels_impl.h"
}  // namespace q_avx512_vnni
#undef QK
#undef QK_VNNI
#undef QK_DPBUSD
#undef QK_512
#undef QK_MAXC
#endif  // MTP_ORT_X86

#if MTP_ORT_NEON
#define QN
#define QN_DOT 0
namespace q_neon {
#include "qkernels_neon.h"
}  // namespace q_neon
#undef QN
#undef QN_DOT

#define QN __attribute__((target(MTP_ORT_NEON_DOTPROD)))
#define QN_DOT 1
namespace q_neon_dotprod {
#include "qkernels_neon.h"
}  // namespace q_neon_dotprod
#undef QN
#undef QN_DOT

#define QN __attribute__((target(MTP_ORT_NEON_I8MM)))
#define QN_DOT 2
namespace q_neon_i8mm {
#include "qkernels_neon.h"
}  // namespace q_neon_i8mm
#undef QN
#undef QN_DOT
#endif  // MTP_ORT_NEON

}  // namespace

size_t qrow_bytes(const QWeights& w) { return QAct(w).bytes; }

void quantize_rows(const float* x, size_t m, size_t ldx, const QWeights& w, uint8_t* qx) {
    const QAct a(w);
    [[maybe_unused]] const bool vec = qpath() != QPath::scalar;
    for (size_t i = 0; i < m; ++i)
        for (size_t kb = 0; kb < a.blocks(); ++kb) {
#if MTP_ORT_X86
            if (vec) {
                quantize_block_avx2(x + i * ldx, w.k, kb, w, a, qx + i * a.bytes);
                continue;
            }
#elif MTP_ORT_NEON
            if (vec) {
                q_neon::quantize_block(x + i * ldx, w.k, kb, w, a, qx + i * a.bytes);
                continue;
            }
#endif
            quantize_block_scalar(x + i * ldx, w.k, kb, w, a, qx + i * a.bytes);
        }
}

void qrows_dot(const uint8_t* qx, size_t m, const QWeights& w, size_t n, float* y, size_t ldy) {
    switch (qpath()) {
#if MTP_ORT_NEON
        case QPath::neon_i8mm: return q_neon_i8mm::qrows_dot(qx, m, w, n, y, ldy);
        case QPath::neon_dotprod: return q_neon_dotprod::qrows_dot(qx, m, w, n, y, ldy);
        case QPath::neon: return q_neon::qrows_dot(qx, m, w, n, y, ldy);
#elif MTP_ORT_X86
        case QPath::avx512_vnni: return q_avx512_vnni::qrows_dot(qx, m, w, n, y, ldy);
        case QPath::avx_vnni: return q_avx_vnni::qrows_dot(qx, m, w, n, y, ldy);
        case QPath::avx512_vnni_256: return q_avx512_vnni_256::qrows_dot(qx, m, w, n, y, ldy);
        case QPath::avx2: return q_avx2::qrows_dot(qx, m, w, n, y, ldy);
#endif
        default: return qrows_dot_scalar(qx, m, w, n, y, ldy);
    }
}

size_t qpack_max_bytes() {
    static const size_t limit = [] {
        // (the packed kernels: x86's vector paths; ARM64's products read the weights as stored)
        if (!MTP_ORT_X86 || qpath() == QPath::scalar) return size_t(0);
        const char* env = std::getenv("MTP_ORT_PACK_MAX_BYTES");
        return env && *env ? size_t(std::strtoull(env, nullptr, 10)) : size_t(16) << 20;
    }();
    return limit;
}

QPack qpack(const QWeights& w, size_t n) {
    QPack p;
#if MTP_ORT_X86
    const bool wide = qpath() == QPath::avx512_vnni;  // (the 256-bit paths' shapes are the same)
    p.n = n, p.k = w.k, p.block = w.block, p.bits = w.bits;
    p.sign = w.bits == 8 && qpath() == QPath::avx2;
    p.rows = wide ? q_avx512_vnni::kPackRows : q_avx_vnni::kPackRows;
    p.group = wide ? q_avx512_vnni::kPackTiles : q_avx_vnni::kPackTiles;
    const size_t P = p.rows, G = p.group, nb = w.blocks(), pieces = w.row_bytes() / 4;
    p.bytes.assign(p.groups() * p.group_bytes() + 64, 0);
    p.scales.assign(p.groups() * nb * G * P, 0.f);
    uint8_t* out = const_cast<uint8_t*>(p.data());
    for (size_t j = 0; j < n; ++j) {
        const size_t g = j / (P * G), t = j / P % G, r = j % P;  // group, its tile, the tile's row
        const uint8_t* row = w.data + j * w.row_bytes();
        uint8_t* to = out + g * p.group_bytes() + (t * P + r) * 4;
        for (size_t i = 0; i < pieces; ++i) std::memcpy(to + i * G * P * 4, row + 4 * i, 4);
        if (p.sign)
            for (size_t i = 0; i < pieces; ++i)
                for (size_t b = 0; b < 4; ++b) to[i * G * P * 4 + b] ^= 0x80;
        for (size_t b = 0; b < nb; ++b) p.scales[((g * nb + b) * G + t) * P + r] = w.scale(j * nb + b);
    }
#else
    (void)w, (void)n;  // (never called: qpack_max_bytes() is 0 off x86)
#endif
    return p;
}

void qrows_dot_packed(const uint8_t* qx, size_t m, const QPack& p, size_t j0, size_t n, float* y, size_t ldy) {
#if MTP_ORT_X86
    switch (qpath()) {
        case QPath::avx512_vnni: return q_avx512_vnni::qrows_dot_packed(qx, m, p, j0, n, y, ldy);
        case QPath::avx512_vnni_256: return q_avx512_vnni_256::qrows_dot_packed(qx, m, p, j0, n, y, ldy);
        case QPath::avx2: return q_avx2::qrows_dot_packed(qx, m, p, j0, n, y, ldy);
        default: return q_avx_vnni::qrows_dot_packed(qx, m, p, j0, n, y, ldy);
    }
#else
    (void)qx, (void)m, (void)p, (void)j0, (void)n, (void)y, (void)ldy;  // (never called, as qpack)
#endif
}

const char* qpath_name() {
    static const char* names[] = {"scalar",      "avx2", "avx-vnni",     "avx512-vnni", "avx512-vnni-256",
                                  "neon", "neon-dotprod", "neon-i8mm"};
    return names[int(qpath())];
}

}  // namespace mtp_ort
