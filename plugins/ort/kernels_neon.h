// kernels_neon.h -- the float kernels of kernels.h on ARM64 (AdvSIMD/NEON, which every ARMv8-A CPU has), and the
// target attributes of the quantized products' extensions (qkernels_neon.h; kernels.cpp cpu_has tests the CPU for
// them).  kernels.cpp includes this file once, on aarch64 only, inside namespace mtp_ort::{anonymous}::neon, after
// the scalar kernels and the row accessors (Strided, Table); <arm_neon.h> comes from kernels.cpp.
//
// Each result has the same arithmetic whatever the tiling around it, as on x86: a dot product of two rows is
// always two 4-lane accumulators over 8 values a step, summed across the lanes, then the tail in order; so a
// row's bits do not depend on how many rows come with it (a verify step's rows equal a one-token step's).

// The target attribute of the dotprod (ARMv8.2 SDOT) and i8mm (ARMv8.6 SMMLA) kernels, in each compiler's spelling.
#if defined(__clang__)
#define MTP_ORT_NEON_DOTPROD "dotprod"
#define MTP_ORT_NEON_I8MM "dotprod,i8mm"
#else
#define MTP_ORT_NEON_DOTPROD "arch=armv8.2-a+dotprod"  // (SDOT is an ARMv8.2 extension)
#define MTP_ORT_NEON_I8MM "arch=armv8.2-a+dotprod+i8mm"
#endif

// The NEON kernels on every instruction set but scalar (kernels.h cpu_isa; MTP_TRT_CPU_ISA=scalar: the tests
// compare both).
inline bool use_neon() { return cpu_isa() != CpuIsa::scalar; }

// The weight rows two tiles ahead of rows j .. j + R - 1 (which are read 8 values at a time, at t): R * 8 values a
// step, front to back, one stream (as kernels.cpp's prefetch_rows_ahead).  Strided rows only.
template <int R>
inline void prefetch_ahead(Strided w, size_t j, size_t t) {
    const char* ahead = reinterpret_cast<const char*>(w[j + 2 * R] + R * t);
#pragma GCC unroll 8
    for (size_t b = 0; b < R * 8 * sizeof(float); b += 64) __builtin_prefetch(ahead + b);
}
template <int R>
inline void prefetch_ahead(Table, size_t, size_t) {}

// R weight rows (from j) by C activation rows: acc[c][r] two 4-lane halves over 8 values a step.
template <int R, int C, class W>
inline void dot_tile(const float* const* x, W w, size_t j, size_t k, float* const* y) {
    float32x4_t lo[C][R], hi[C][R];
    const float* wr[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
        wr[r] = w[j + r];
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) lo[c][r] = hi[c][r] = vdupq_n_f32(0.f);
    }
    size_t t = 0;
    for (; t + 8 <= k; t += 8) {
        prefetch_ahead<R>(w, j, t);
        float32x4_t x0[C], x1[C];
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) x0[c] = vld1q_f32(x[c] + t), x1[c] = vld1q_f32(x[c] + t + 4);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const float32x4_t w0 = vld1q_f32(wr[r] + t), w1 = vld1q_f32(wr[r] + t + 4);
#pragma GCC unroll 4
            for (int c = 0; c < C; ++c) {
                lo[c][r] = vfmaq_f32(lo[c][r], w0, x0[c]);
                hi[c][r] = vfmaq_f32(hi[c][r], w1, x1[c]);
            }
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            float s = vaddvq_f32(vaddq_f32(lo[c][r], hi[c][r]));
            for (size_t u = t; u < k; ++u) s += x[c][u] * wr[r][u];
            y[c][r] = s;
        }
}

template <class W>
void rows_dot(const float* x, size_t m, size_t ldx, W w, size_t n, size_t k, float* y, size_t ldy) {
    size_t j = 0;
    if (m == 1) {
        const float* xs[1] = {x};
        for (; j + 8 <= n; j += 8) {
            float* ys[1] = {y + j};
            dot_tile<8, 1>(xs, w, j, k, ys);
        }
        for (; j + 4 <= n; j += 4) {
            float* ys[1] = {y + j};
            dot_tile<4, 1>(xs, w, j, k, ys);
        }
        for (; j < n; ++j) {
            float* ys[1] = {y + j};
            dot_tile<1, 1>(xs, w, j, k, ys);
        }
        return;
    }
    // weight rows in blocks of 4, the activation rows in pairs inside (the block stays in L1)
    for (; j + 4 <= n; j += 4) {
        size_t i = 0;
        for (; i + 2 <= m; i += 2) {
            const float* xs[2] = {x + i * ldx, x + (i + 1) * ldx};
            float* ys[2] = {y + i * ldy + j, y + (i + 1) * ldy + j};
            dot_tile<4, 2>(xs, w, j, k, ys);
        }
        if (i < m) {
            const float* xs[1] = {x + i * ldx};
            float* ys[1] = {y + i * ldy + j};
            dot_tile<4, 1>(xs, w, j, k, ys);
        }
    }
    for (; j < n; ++j)
        for (size_t i = 0; i < m; ++i) {
            const float* xs[1] = {x + i * ldx};
            float* ys[1] = {y + i * ldy + j};
            dot_tile<1, 1>(xs, w, j, k, ys);
        }
}

// y rows += p-weighted sums of v rows: two output rows by 16 columns in 8 accumulators per pass over v; every
// output value is y + sum over t of p[t] * v[t] by fused multiply-adds in t's order.
template <class V>
void rows_axpy(const float* p, size_t m, size_t ldp, V v, size_t n, size_t dv, float* y, size_t ldy) {
    const size_t d16 = dv & ~size_t(15);
    for (size_t i = 0; i < m; i += 2) {
        const bool two = i + 1 < m;
        const float* p0 = p + i * ldp;
        const float* p1 = two ? p0 + ldp : p0;
        float* y0 = y + i * ldy;
        float* y1 = two ? y0 + ldy : nullptr;
        for (size_t d = 0; d < d16; d += 16) {
            float32x4_t a[4], b[4];
            for (int q = 0; q < 4; ++q) {
                a[q] = vld1q_f32(y0 + d + 4 * q);
                b[q] = two ? vld1q_f32(y1 + d + 4 * q) : vdupq_n_f32(0.f);
            }
            for (size_t t = 0; t < n; ++t) {
                const float* vt = v[t] + d;
                const float32x4_t s0 = vdupq_n_f32(p0[t]), s1 = vdupq_n_f32(p1[t]);
#pragma GCC unroll 4
                for (int q = 0; q < 4; ++q) {
                    const float32x4_t vv = vld1q_f32(vt + 4 * q);
                    a[q] = vfmaq_f32(a[q], s0, vv);
                    b[q] = vfmaq_f32(b[q], s1, vv);
                }
            }
            for (int q = 0; q < 4; ++q) {
                vst1q_f32(y0 + d + 4 * q, a[q]);
                if (two) vst1q_f32(y1 + d + 4 * q, b[q]);
            }
        }
        for (size_t r = i; r < std::min(i + 2, m); ++r)
            for (size_t t = 0; t < n; ++t)
                for (size_t d = d16; d < dv; ++d) y[r * ldy + d] = std::fma(p[r * ldp + t], v[t][d], y[r * ldy + d]);
    }
}

// exp(x) for 4 floats, as kernels.cpp's exp8: x = n ln2 + r, |r| <= ln2/2, e^r by a degree-6 polynomial
// (relative error ~2e-7); below -87.3 the result is 0 (the softmax's masked entries), above 88.7 +inf.
inline float32x4_t exp4(float32x4_t x) {
    const float32x4_t lo = vdupq_n_f32(-87.33654f), hi = vdupq_n_f32(88.72283f);
    const uint32x4_t under = vcltq_f32(x, lo);
    x = vminq_f32(vmaxq_f32(x, lo), hi);
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504f)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693145752f));  // ln2 in two parts (Cody-Waite)
    r = vfmsq_f32(r, n, vdupq_n_f32(1.42860677e-6f));
    float32x4_t e = vdupq_n_f32(1.f / 720);
    e = vfmaq_f32(vdupq_n_f32(1.f / 120), e, r);
    e = vfmaq_f32(vdupq_n_f32(1.f / 24), e, r);
    e = vfmaq_f32(vdupq_n_f32(1.f / 6), e, r);
    e = vfmaq_f32(vdupq_n_f32(0.5f), e, r);
    e = vfmaq_f32(vdupq_n_f32(1.f), e, r);
    e = vfmaq_f32(vdupq_n_f32(1.f), e, r);
    // 2^n in two factors, so that n = 128 (x near 88.7) does not overflow the exponent field
    const int32x4_t ni = vcvtq_s32_f32(n), half = vshrq_n_s32(ni, 1);
    const float32x4_t p1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(half, vdupq_n_s32(127)), 23));
    const float32x4_t p2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vsubq_s32(ni, half), vdupq_n_s32(127)), 23));
    const float32x4_t v = vmulq_f32(vmulq_f32(e, p1), p2);
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(v), under));
}

// In place: x = exp(x - max), returning the sum (two 4-lane accumulators, 8 values a step, as exp_shift_sum_avx2's
// one 8-lane accumulator: the sum of a head's scores does not depend on the -inf padding after them).
inline float exp_shift_sum(float* x, size_t n, float max) {
    const float32x4_t mv = vdupq_n_f32(max);
    float32x4_t a0 = vdupq_n_f32(0.f), a1 = a0;
    size_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const float32x4_t e0 = exp4(vsubq_f32(vld1q_f32(x + t), mv)), e1 = exp4(vsubq_f32(vld1q_f32(x + t + 4), mv));
        vst1q_f32(x + t, e0), vst1q_f32(x + t + 4, e1);
        a0 = vaddq_f32(a0, e0), a1 = vaddq_f32(a1, e1);
    }
    float s = vaddvq_f32(vaddq_f32(a0, a1));
    for (; t < n; ++t) s += (x[t] = std::exp(x[t] - max));
    return s;
}

// SwiGLU on interleaved (gate, up) pairs: vld2 de-interleaves 4 pairs.
inline void swiglu_pairs(const float* h, size_t m, size_t ldh, size_t units, float* a, size_t lda) {
    for (size_t i = 0; i < m; ++i) {
        const float* hi = h + i * ldh;
        float* ai = a + i * lda;
        size_t j = 0;
        for (; j + 4 <= units; j += 4) {
            const float32x4x2_t gu = vld2q_f32(hi + 2 * j);
            const float32x4_t e = exp4(vnegq_f32(gu.val[0]));
            const float32x4_t silu = vdivq_f32(gu.val[0], vaddq_f32(vdupq_n_f32(1.f), e));
            vst1q_f32(ai + j, vmulq_f32(silu, gu.val[1]));
        }
        for (; j < units; ++j) {
            const float g = hi[2 * j];
            ai[j] = g / (1.f + std::exp(-g)) * hi[2 * j + 1];
        }
    }
}

// One head's dot product q . k over di values: two 4-lane accumulators (8 a step), the tail in order.
inline float head_dot(const float* q, const float* k, size_t di) {
    float32x4_t a0 = vdupq_n_f32(0.f), a1 = a0;
    size_t d = 0;
    for (; d + 8 <= di; d += 8) {
        a0 = vfmaq_f32(a0, vld1q_f32(q + d), vld1q_f32(k + d));
        a1 = vfmaq_f32(a1, vld1q_f32(q + d + 4), vld1q_f32(k + d + 4));
    }
    float s = vaddvq_f32(vaddq_f32(a0, a1));
    for (; d < di; ++d) s += q[d] * k[d];
    return s;
}

// The lightning indexer: each key row read once (the next rows prefetched), every head's dot product with it,
// then ReLU, the head weights and their sum in the heads' order.
inline void index_scores(const float* q, const float* w, size_t heads, size_t di, float scale, const float* keys,
                         size_t ld, size_t n, float* scores) {
    constexpr size_t ahead = 8;
    for (size_t t = 0; t < n; ++t) {
        if (t + ahead < n)
            for (size_t d = 0; d < di; d += 16) __builtin_prefetch(keys + (t + ahead) * ld + d);
        const float* k = keys + t * ld;
        float total = 0.f;
        for (size_t j = 0; j < heads; ++j) total += w[j] * std::max(head_dot(q + j * di, k, di) * scale, 0.f);
        scores[t] = total;
    }
}
