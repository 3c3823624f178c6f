// qkernels_impl.h -- qrows_dot (kernels.h) for one x86 instruction set.  kernels.cpp includes this file once
// per set, each time inside a namespace of its own and with these macros defined:
//   QK         the attribute naming the set, on every function here (__attribute__((target(...))))
//   QK_VNNI    1: 4-byte integer dot products by vpdpbusd;  0: by vpmaddubsw + vpmaddwd (AVX2)
//   QK_DPBUSD  with QK_VNNI, the set's vpdpbusd intrinsic (AVX-VNNI's VEX form or AVX512-VNNI's EVEX form)
// and, from kernels.cpp, the activation row layout (QAct).  No include guard: it is meant to be included
// several times.
//
// Each 32-value block of an activation row (qx) meets 32 weights in one 256-bit vector of bytes: the 8-bit
// weights as stored; the 4-bit ones unpacked from their 16 bytes as [low nibbles | high nibbles], i.e. the
// even elements then the odd ones, which is why quantize_rows stores 4-bit rows' blocks in that order.
// The weights are the unsigned u = q + z (z = 2^(bits-1)), so a block's integer dot product is
// sum(u * xq) - z * sum(xq): the second term comes precomputed with the row (QAct::corr, in the lane its
// weight block's products fill) and starts the integer accumulator.  AVX2 has no unsigned x signed
// product that cannot saturate for 8-bit weights (two 255 * 127 products overflow int16), so there they are
// taken as signed q with the sign moved onto x (|q| <= 128, pairs <= 32512) and need no correction.

// 32 weights of one row at p as bytes in the activation block's order (Tail: only the first 16 exist).
template <int Bits, bool Tail>
QK inline __m256i load_weights(const uint8_t* p) {
    if constexpr (Bits == 4) {
        const __m128i b = Tail ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))
                               : _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
    } else {
        return Tail ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
                    : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    }
}

// The weight scales of activation block kb, one per int32 lane of the block's products.  Blocks of 16 put
// two scales (a, b) in one activation block: 8-bit lanes are [a a a a b b b b]; 4-bit lanes, the
// even-then-odd order, [a a b b a a b b].
template <int Bits, bool B16, bool Tail>
QK inline __m256 load_scales(const float* s, size_t kb, int shift) {
    if constexpr (!B16) {
        return _mm256_broadcast_ss(s + (kb >> shift));
    } else if constexpr (Tail) {
        return _mm256_broadcast_ss(s + 2 * kb);  // (b's lanes hold zeros)
    } else {
        double pair;
        std::memcpy(&pair, s + 2 * kb, sizeof pair);
        const __m256 ab = _mm256_castpd_ps(_mm256_set1_pd(pair));  // a b a b a b a b
        if constexpr (Bits == 4) return _mm256_unpacklo_ps(ab, ab);
        return _mm256_permutevar8x32_ps(ab, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    }
}

// The integer products of one weight vector u with one activation block (int32 lanes, exact).
template <int Bits>
QK inline __m256i block_dot(__m256i u, const uint8_t* x, const QAct& a, size_t kb) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * kb));
    const __m256i corr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + a.corr_at) + kb);
#if QK_VNNI
    return QK_DPBUSD(corr, u, xv);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (Bits == 8) {
        const __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8(char(0x80)));  // u - 128 as int8
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(xv, q)), ones);
    } else {
        return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), ones), corr);  // u <= 15: exact
    }
#endif
}

// One activation block kb for R weight rows by C activation rows.
template <int Bits, bool B16, int R, int C, bool Tail>
QK inline void tile_block(const uint8_t* w, size_t ldw, const float* ws, size_t ldws, const uint8_t* x, size_t ldx,
                          const QAct& a, size_t kb, int shift, __m256 (&acc)[R][C]) {
    __m256 xs[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
        xs[c] = _mm256_broadcast_ss(reinterpret_cast<const float*>(x + c * ldx + a.scale_at) + kb);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
        const __m256i u = load_weights<Bits, Tail>(w + r * ldw + kb * 4 * Bits);
        const __m256 s = load_scales<Bits, B16, Tail>(ws + r * ldws, kb, shift);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
            const __m256 d = _mm256_cvtepi32_ps(block_dot<Bits>(u, x + c * ldx, a, kb));
            acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(d, xs[c]), s, acc[r][c]);
        }
    }
}

QK inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// y[c * ldy + r] for R weight rows from w and C activation rows from x: one pass over K, every weight
// vector loaded once for all C rows.
template <int Bits, bool B16, int R, int C>
QK void tile(const QWeights& w, const uint8_t* x, size_t ldx, const QAct& a, float* y, size_t ldy) {
    __m256 acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    const size_t ldw = w.row_bytes(), ldws = w.blocks(), full = w.blocks() * w.block / 32;
    const int shift = B16 ? 0 : __builtin_ctzl(w.block / 32);
    for (size_t kb = 0; kb < full; ++kb)
        tile_block<Bits, B16, R, C, false>(w.data, ldw, w.scales, ldws, x, ldx, a, kb, shift, acc);
    if (B16 && full < a.n32)  // an odd number of 16-blocks: the last one alone
        tile_block<Bits, B16, R, C, true>(w.data, ldw, w.scales, ldws, x, ldx, a, full, shift, acc);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) y[c * ldy + r] = hsum8(acc[r][c]);
}

// R weight rows against all m activation rows, kMaxC at a time: the R rows stay in L1 while the groups pass.
template <int Bits, bool B16, int R>
QK void row_tiles(const QWeights& w, const uint8_t* x, size_t m, const QAct& a, float* y, size_t ldy) {
    size_t i = 0;
    for (; i + kMaxC <= m; i += kMaxC) tile<Bits, B16, R, kMaxC>(w, x + i * a.bytes, a.bytes, a, y + i * ldy, ldy);
    x += i * a.bytes, y += i * ldy;
    switch (m - i) {
        case 1: return tile<Bits, B16, R, 1>(w, x, a.bytes, a, y, ldy);
        case 2: return tile<Bits, B16, R, 2>(w, x, a.bytes, a, y, ldy);
        case 3: return tile<Bits, B16, R, 3>(w, x, a.bytes, a, y, ldy);
        default: return;
    }
}

template <int Bits, bool B16>
QK void qdot(const uint8_t* x, size_t m, const QWeights& w, size_t n, float* y, size_t ldy) {
    const QAct a(w);
    size_t j = 0;
    for (; j + kRows <= n; j += kRows) row_tiles<Bits, B16, kRows>(w.from_row(j), x, m, a, y + j, ldy);
    for (; j < n; ++j) row_tiles<Bits, B16, 1>(w.from_row(j), x, m, a, y + j, ldy);
}

QK void qrows_dot(const uint8_t* x, size_t m, const QWeights& w, size_t n, float* y, size_t ldy) {
    if (w.bits == 4) return w.block == 16 ? qdot<4, true>(x, m, w, n, y, ldy) : qdot<4, false>(x, m, w, n, y, ldy);
    return w.block == 16 ? qdot<8, true>(x, m, w, n, y, ldy) : qdot<8, false>(x, m, w, n, y, ldy);
}
