// qkernels_neon.h -- quantize_rows' blocks and qrows_dot (kernels.h) for one ARM64 instruction set.  kernels.cpp
// includes this file once per set (aarch64 only), each time inside a namespace of its own and with these macros:
//   QN      the attribute naming the set on every function here (empty: plain NEON; or target("+dotprod"), ...)
//   QN_DOT  0: 4-byte integer dot products by SMULL + pairwise adds (any ARMv8-A);  1: by SDOT (dotprod);
//           2: pairs of activation rows by SMMLA (i8mm), a row left over by SDOT
// and, from kernels.cpp, the activation row layout (QAct) and store_lanes.  No include guard.
//
// The weights are read as stored, 32 values (a "chunk": 32 bytes at 8 bits, 16 at 4) at a time, and turned into
// signed int8: q = u - 2^(bits-1) (8 bits: the top bit flipped; 4 bits: each nibble less 8), so the products
// need no zero-point correction (QAct::corr is not read).  A chunk's integer products come out as four int32
// lanes, lane p the exact sum over its 8 values p (an activation scale's span); then, in float, lane p times its
// activation scale and weight block scale is added into a 4-lane accumulator, and the accumulator's lanes are
// summed at the end of the row.  Every path does exactly these float operations in this order, so the three
// sets give the same bits (and the same bits whatever the number of rows a call takes).

// SDOT and SMMLA: GCC's intrinsics, which a function's target attribute makes available; older clangs define them
// only where the whole file is compiled for the extension, so there the instructions are written out.
#if QN_DOT && defined(__clang__)
QN inline int32x4_t sdot(int32x4_t acc, int8x16_t a, int8x16_t b) {
    __asm__(".arch armv8.2-a+dotprod\n\tsdot %0.4s, %1.16b, %2.16b" : "+w"(acc) : "w"(a), "w"(b));
    return acc;
}
#if QN_DOT == 2
QN inline int32x4_t smmla(int32x4_t acc, int8x16_t a, int8x16_t b) {
    __asm__(".arch armv8.2-a+dotprod+i8mm\n\tsmmla %0.4s, %1.16b, %2.16b" : "+w"(acc) : "w"(a), "w"(b));
    return acc;
}
#endif
#elif QN_DOT
QN inline int32x4_t sdot(int32x4_t acc, int8x16_t a, int8x16_t b) { return vdotq_s32(acc, a, b); }
#if QN_DOT == 2
QN inline int32x4_t smmla(int32x4_t acc, int8x16_t a, int8x16_t b) { return vmmlaq_s32(acc, a, b); }
#endif
#endif

// The 4-byte dot products of a and b, added to acc lane by lane (SDOT's result).
QN inline int32x4_t dot4(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if QN_DOT
    return sdot(acc, a, b);
#else
    // |q x| <= 128 * 127: the products fit int16, their pairs' sums int32
    const int16x8_t lo = vmull_s8(vget_low_s8(a), vget_low_s8(b)), hi = vmull_high_s8(a, b);
    return vaddq_s32(acc, vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)));
#endif
}

#if QN_DOT == 0  // (one copy serves every set)
// Block kb (32 values) of a row of k values, each 8 values by their own scale = max|x| / 127:
// q = round-half-even(x / scale), zeros past k -- kernels.cpp's quantize_block_scalar's bytes (the same
// divisions and roundings), 32 values at a time.
QN void quantize_block(const float* x, size_t k, size_t kb, const QWeights& w, const QAct& a, uint8_t* row) {
    float pad[32];
    const float* src = x + 32 * kb;
    if (32 * kb + 32 > k) {
        std::fill(pad, pad + 32, 0.f);
        if (32 * kb < k) std::copy(src, x + k, pad);
        src = pad;
    }
    float32x4_t v[8];
    for (int i = 0; i < 8; ++i) v[i] = vld1q_f32(src + 4 * i);
    float s[4];
    int32_t sum[4];
    int8x8_t q8[4];
    const float32x4_t hi = vdupq_n_f32(127.f), lo = vdupq_n_f32(-127.f);
    for (int g = 0; g < 4; ++g) {
        s[g] = vmaxvq_f32(vmaxq_f32(vabsq_f32(v[2 * g]), vabsq_f32(v[2 * g + 1]))) / 127.f;
        const float32x4_t sv = vdupq_n_f32(s[g] > 0.f ? s[g] : 1.f);  // 8 zeros: any nonzero divisor gives zeros
        int32x4_t q[2];
        for (int h = 0; h < 2; ++h)
            q[h] = vcvtq_s32_f32(vminq_f32(vmaxq_f32(vrndnq_f32(vdivq_f32(v[2 * g + h], sv)), lo), hi));
        sum[g] = vaddvq_s32(vaddq_s32(q[0], q[1]));
        q8[g] = vmovn_s16(vcombine_s16(vmovn_s32(q[0]), vmovn_s32(q[1])));  // (|q| <= 127: exact)
    }
    store_lanes(s, sum, kb, w, a, row);
    const int8x16_t b0 = vcombine_s8(q8[0], q8[1]), b1 = vcombine_s8(q8[2], q8[3]);
    int8_t* out = reinterpret_cast<int8_t*>(row);
    if (w.bits == 8) {
        vst1q_s8(out + 32 * kb, b0);
        vst1q_s8(out + 32 * kb + 16, b1);
        return;
    }
    vst1q_s8(out + QAct::at(kb, 0, 4), vuzp1q_s8(b0, b1));  // the even elements
    vst1q_s8(out + QAct::at(kb, 1, 4), vuzp2q_s8(b0, b1));  // the odd ones
}
#endif

// One chunk of one weight row as signed int8: 8 bits, v[0] values 0..15 and v[1] 16..31; 4 bits, v[0] the even
// values (low nibbles), v[1] the odd ones.  Part: only the chunk's first 16 values are stored (the last chunk of
// a row of blocks of 16), zeros after -- the bytes past the row are not read.
template <int Bits, bool Part>
QN inline void load_chunk(const uint8_t* p, int8x16_t (&v)[2]) {
    if constexpr (Bits == 8) {
        const uint8x16_t top = vdupq_n_u8(0x80);
        v[0] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(p), top));
        v[1] = Part ? vdupq_n_s8(0) : vreinterpretq_s8_u8(veorq_u8(vld1q_u8(p + 16), top));
    } else {
        const uint8x16_t u = Part ? vcombine_u8(vld1_u8(p), vdup_n_u8(0x88)) : vld1q_u8(p);
        const int8x16_t eight = vdupq_n_s8(8);
        v[0] = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(u, vdupq_n_u8(0x0F))), eight);
        v[1] = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(u, 4)), eight);
    }
}

// The activation's values that meet load_chunk's v (QAct's order: 8 bits in x's order, 4 bits the even
// elements then the odd ones).
template <int Bits>
QN inline void load_x(const uint8_t* row, size_t kb, int8x16_t (&x)[2]) {
    const int8_t* q = reinterpret_cast<const int8_t*>(row);
    x[0] = vld1q_s8(q + QAct::at(kb, 0, Bits));
    x[1] = vld1q_s8(q + (Bits == 8 ? QAct::at(kb, 16, 8) : QAct::at(kb, 1, 4)));
}

// The exact integer sums of the chunk's four 8-value parts, lane p part p.
template <int Bits>
QN inline int32x4_t parts(const int8x16_t (&w)[2], const int8x16_t (&x)[2]) {
    const int32x4_t zero = vdupq_n_s32(0);
    if constexpr (Bits == 8) return vpaddq_s32(dot4(zero, w[0], x[0]), dot4(zero, w[1], x[1]));
    return dot4(dot4(zero, w[0], x[0]), w[1], x[1]);  // lane p: part p's even elements, then its odd ones
}

// The activation scales of chunk kb's four parts (QAct's lanes: 8 bits two a part, 4 bits one).
template <int Bits>
QN inline float32x4_t x_scales(const uint8_t* row, const QAct& a, size_t kb) {
    const float* s = reinterpret_cast<const float*>(row + a.scale_at) + kb * Bits;
    if constexpr (Bits == 8) return vld2q_f32(s).val[0];
    return vld1q_f32(s);
}

// One weight scale (float16 where Half) as a float.
template <bool Half>
QN inline float w_scale(const void* scales, size_t i) {
    if constexpr (Half) {
        uint16_t h;
        std::memcpy(&h, static_cast<const uint16_t*>(scales) + i, 2);
        return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
    }
    return static_cast<const float*>(scales)[i];
}

// The weight scales of chunk kb's four parts for one row: one block's, or (blocks of 16) two blocks' each for two
// parts; a part chunk of blocks of 16 has one block (its other parts' products are zeros).
template <bool Half, bool Part>
QN inline float32x4_t w_scales(const QWeights& w, size_t kb) {
    if (w.block >= 32) return vdupq_n_f32(w_scale<Half>(w.scales, 32 * kb / w.block));
    const float s0 = w_scale<Half>(w.scales, 2 * kb), s1 = Part ? s0 : w_scale<Half>(w.scales, 2 * kb + 1);
    return vcombine_f32(vdup_n_f32(s0), vdup_n_f32(s1));
}

// A row's chunk (load_chunk's or load_x's) as [part 0 | part 1] and [part 2 | part 3], 8 values each (4 bits: a
// part's 4 even elements then its 4 odd ones -- the same order for weights and activations).
template <int Bits>
QN inline void halves(const int8x16_t (&v)[2], int64x2_t (&h)[2]) {
    if constexpr (Bits == 8) {
        h[0] = vreinterpretq_s64_s8(v[0]), h[1] = vreinterpretq_s64_s8(v[1]);
    } else {
        const int32x4_t e = vreinterpretq_s32_s8(v[0]), o = vreinterpretq_s32_s8(v[1]);
        h[0] = vreinterpretq_s64_s32(vzip1q_s32(e, o)), h[1] = vreinterpretq_s64_s32(vzip2q_s32(e, o));
    }
}

// The 2 x 2 products of two activation rows' and two weight rows' four parts by SMMLA, as four vectors of parts:
// out[2 c + r] lane p = part p of activation row c by weight row r (parts()'s values).
#if QN_DOT == 2
template <int Bits>
QN inline void parts_2x2(const int8x16_t (&w0)[2], const int8x16_t (&w1)[2], const int8x16_t (&x0)[2],
                         const int8x16_t (&x1)[2], int32x4_t (&out)[4]) {
    int64x2_t a[2], b[2], c[2], d[2];
    halves<Bits>(x0, a), halves<Bits>(x1, b), halves<Bits>(w0, c), halves<Bits>(w1, d);
    int32x4_t m[4];  // m[p] = [x0.w0, x0.w1, x1.w0, x1.w1] over part p
    for (int h = 0; h < 2; ++h) {
        const int8x16_t xl = vreinterpretq_s8_s64(vzip1q_s64(a[h], b[h])), xh = vreinterpretq_s8_s64(vzip2q_s64(a[h], b[h]));
        const int8x16_t wl = vreinterpretq_s8_s64(vzip1q_s64(c[h], d[h])), wh = vreinterpretq_s8_s64(vzip2q_s64(c[h], d[h]));
        m[2 * h] = smmla(vdupq_n_s32(0), xl, wl);
        m[2 * h + 1] = smmla(vdupq_n_s32(0), xh, wh);
    }
    // transpose: out[i] lane p = m[p] lane i
    const int32x4_t t0 = vtrn1q_s32(m[0], m[1]), t1 = vtrn2q_s32(m[0], m[1]);
    const int32x4_t t2 = vtrn1q_s32(m[2], m[3]), t3 = vtrn2q_s32(m[2], m[3]);
    const int32x4_t o00 = vreinterpretq_s32_s64(vzip1q_s64(vreinterpretq_s64_s32(t0), vreinterpretq_s64_s32(t2)));
    const int32x4_t o01 = vreinterpretq_s32_s64(vzip1q_s64(vreinterpretq_s64_s32(t1), vreinterpretq_s64_s32(t3)));
    const int32x4_t o10 = vreinterpretq_s32_s64(vzip2q_s64(vreinterpretq_s64_s32(t0), vreinterpretq_s64_s32(t2)));
    const int32x4_t o11 = vreinterpretq_s32_s64(vzip2q_s64(vreinterpretq_s64_s32(t1), vreinterpretq_s64_s32(t3)));
    out[0] = o00, out[1] = o01, out[2] = o10, out[3] = o11;
}
#endif

// One chunk for R weight rows by C activation rows (Part: the rows' last chunk, 16 values).
template <int Bits, bool Half, int R, int C, bool Part>
QN inline void tile_chunk(const QWeights& w, size_t ldw, const uint8_t* x, size_t ldx, const QAct& a, size_t kb,
                          float32x4_t (&acc)[R][C]) {
    constexpr size_t chunk = 4 * Bits;  // weight bytes
    int8x16_t wv[R][2];
    float32x4_t ws[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
        const uint8_t* wr = w.data + r * ldw + chunk * kb;
        __builtin_prefetch(wr + 4 * chunk);
        load_chunk<Bits, Part>(wr, wv[r]);
        ws[r] = w_scales<Half, Part>(w.from_row(r), kb);
    }
    int8x16_t xv[C][2];
    float32x4_t xs[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
        load_x<Bits>(x + c * ldx, kb, xv[c]);
        xs[c] = x_scales<Bits>(x + c * ldx, a, kb);
    }
#if QN_DOT == 2
    if constexpr (R % 2 == 0 && C % 2 == 0) {
#pragma GCC unroll 4
        for (int c = 0; c < C; c += 2)
#pragma GCC unroll 8
            for (int r = 0; r < R; r += 2) {
                int32x4_t d[4];
                parts_2x2<Bits>(wv[r], wv[r + 1], xv[c], xv[c + 1], d);
                acc[r][c] = vfmaq_f32(acc[r][c], vcvtq_f32_s32(d[0]), vmulq_f32(xs[c], ws[r]));
                acc[r + 1][c] = vfmaq_f32(acc[r + 1][c], vcvtq_f32_s32(d[1]), vmulq_f32(xs[c], ws[r + 1]));
                acc[r][c + 1] = vfmaq_f32(acc[r][c + 1], vcvtq_f32_s32(d[2]), vmulq_f32(xs[c + 1], ws[r]));
                acc[r + 1][c + 1] =
                    vfmaq_f32(acc[r + 1][c + 1], vcvtq_f32_s32(d[3]), vmulq_f32(xs[c + 1], ws[r + 1]));
            }
        return;
    }
#endif
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c)
            acc[r][c] = vfmaq_f32(acc[r][c], vcvtq_f32_s32(parts<Bits>(wv[r], xv[c])), vmulq_f32(xs[c], ws[r]));
}

// y[c * ldy + r] for R weight rows from w and C activation rows from x: one pass over the weight rows, each chunk
// loaded once for all C rows.
template <int Bits, bool Half, int R, int C>
QN void tile(const QWeights& w, const uint8_t* x, size_t ldx, const QAct& a, float* y, size_t ldy) {
    float32x4_t acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) acc[r][c] = vdupq_n_f32(0.f);
    const size_t ldw = w.row_bytes(), kp = w.blocks() * w.block, full = kp / 32;
    for (size_t kb = 0; kb < full; ++kb) tile_chunk<Bits, Half, R, C, false>(w, ldw, x, ldx, a, kb, acc);
    if (kp % 32) tile_chunk<Bits, Half, R, C, true>(w, ldw, x, ldx, a, full, acc);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) y[c * ldy + r] = vaddvq_f32(acc[r][c]);
}

constexpr int kRowsN = 4;  // weight rows per tile
constexpr int kColsN = 2;  // activation rows per tile

// R weight rows against all m activation rows, kColsN at a time.
template <int Bits, bool Half, int R>
QN void row_tiles(const QWeights& w, const uint8_t* x, size_t m, const QAct& a, float* y, size_t ldy) {
    size_t i = 0;
    for (; i + kColsN <= m; i += kColsN) tile<Bits, Half, R, kColsN>(w, x + i * a.bytes, a.bytes, a, y + i * ldy, ldy);
    if (i < m) tile<Bits, Half, R, 1>(w, x + i * a.bytes, a.bytes, a, y + i * ldy, ldy);
}

template <int Bits, bool Half>
QN void qdot(const uint8_t* x, size_t m, const QWeights& w, size_t n, float* y, size_t ldy) {
    const QAct a(w);
    size_t j = 0;
    for (; j + kRowsN <= n; j += kRowsN) row_tiles<Bits, Half, kRowsN>(w.from_row(j), x, m, a, y + j, ldy);
    for (; j + 2 <= n; j += 2) row_tiles<Bits, Half, 2>(w.from_row(j), x, m, a, y + j, ldy);
    for (; j < n; ++j) row_tiles<Bits, Half, 1>(w.from_row(j), x, m, a, y + j, ldy);
}

QN void qrows_dot(const uint8_t* x, size_t m, const QWeights& w, size_t n, float* y, size_t ldy) {
    if (w.bits == 4) return w.half ? qdot<4, true>(x, m, w, n, y, ldy) : qdot<4, false>(x, m, w, n, y, ldy);
    return w.half ? qdot<8, true>(x, m, w, n, y, ldy) : qdot<8, false>(x, m, w, n, y, ldy);
}
