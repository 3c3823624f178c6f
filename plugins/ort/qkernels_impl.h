// qkernels_impl.h -- qrows_dot (kernels.h) for one x86 instruction set.  kernels.cpp includes this file once
// per set, each time inside a namespace of its own and with these macros defined:
//   QK         the attribute naming the set, on every function here (__attribute__((target(...))))
//   QK_VNNI    1: 4-byte integer dot products by vpdpbusd;  0: by vpmaddubsw + vpmaddwd (AVX2)
//   QK_DPBUSD  with QK_VNNI and 256-bit vectors, the set's vpdpbusd (AVX-VNNI's VEX form or AVX512-VNNI's EVEX)
//   QK_512     1: 512-bit vectors (AVX512-VNNI), 0: 256-bit
//   QK_MAXC    activation rows per tile (what the set's registers hold)
// and, from kernels.cpp, the activation row layout (QAct).  No include guard: it is meant to be included
// several times.
//
// A weight row is read as it is stored, one vector of bytes at a time ("a step"); each int32 lane of the
// products covers 4 of those bytes.  8-bit weights meet x's values in their order.  4-bit weights are split
// into their low nibbles (even elements) and high nibbles (odd elements), two vectors whose products with the
// two matching halves of x (QAct's order) add up lane by lane: no shuffle across the vector.  The weights are
// the unsigned u = q + z (z = 2^(bits-1)), so a block's integer dot product is sum(u * xq) - z * sum(xq): the
// second term comes with the row (QAct::corr, in the first lane of the block) and starts the accumulator.
// AVX2 has no unsigned x signed product that cannot saturate for 8-bit weights (two 255 * 127 products
// overflow int16), so there they are taken as signed q with the sign moved onto x (|q| <= 128, pairs <=
// 32512) and need no correction.  Each lane's sum is exact; it is then scaled by its activation block's and
// weight block's scales into float accumulators.

// The sums of four vectors' lanes, [sum(a), sum(b), sum(c), sum(d)]: one tile's four rows' results at once, each
// ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)); hsum_256 adds one vector's lanes in the same order, so that a row
// gets the same bits in a tile of four rows or alone.
QK inline __m128 hsum4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // each half: its 4 sums
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
QK inline float hsum_256(__m256 v) {
    const __m256 h = _mm256_hadd_ps(v, v), q = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
}

#if QK_512
struct Vec {
    using F = __m512;
    using I = __m512i;
    static constexpr int kLanes = 16;
    QK static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
    QK static I load_part(const uint8_t* p, size_t bytes) {  // the first `bytes` (< 64), zeros after
        return _mm512_maskz_loadu_epi8(_cvtu64_mask64((uint64_t(1) << bytes) - 1), p);
    }
    QK static F loadf(const float* p) { return _mm512_loadu_ps(p); }
    QK static F loadf_part(const float* p, size_t n) { return _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), p); }
    QK static F loadh_part(const uint16_t* p, size_t n) {  // n <= 8 float16 values, zeros after
        return _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_maskz_loadu_epi16(__mmask8((1u << n) - 1), p)));
    }
    QK static F set1(float f) { return _mm512_set1_ps(f); }
    QK static I set1_8(char b) { return _mm512_set1_epi8(b); }
    QK static I set1_32(int32_t v) { return _mm512_set1_epi32(v); }
    QK static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
    QK static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    QK static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
    QK static F zero() { return _mm512_setzero_ps(); }
    QK static I iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
    QK static I srl32(I v, int n) { return _mm512_srli_epi32(v, n); }
    QK static I low_nibbles(I v) { return _mm512_and_si512(v, set1_8(0x0F)); }
    QK static I high_nibbles(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), set1_8(0x0F)); }
    QK static F spread(I idx, F v) { return _mm512_permutexvar_ps(idx, v); }
    QK static I dot(I acc, I u, I x) { return _mm512_dpbusd_epi32(acc, u, x); }
    QK static F scale_add(I d, const float* xs, F ws, F acc) {
        return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d), loadf(xs)), ws, acc);
    }
    QK static __m256 halves(F v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }
    QK static float hsum(F v) { return hsum_256(halves(v)); }
    QK static __m128 hsum4(F a, F b, F c, F d) { return hsum4_256(halves(a), halves(b), halves(c), halves(d)); }
};
#else
struct Vec {
    using F = __m256;
    using I = __m256i;
    static constexpr int kLanes = 8;
    QK static __m256i lanes_mask(size_t n) {  // lanes < n all ones
        return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    }
    QK static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
    QK static I load_part(const uint8_t* p, size_t bytes) {  // (bytes: a multiple of 4 below 32)
        return _mm256_maskload_epi32(reinterpret_cast<const int*>(p), lanes_mask(bytes / 4));
    }
    QK static I load_half(const uint8_t* p) {  // the first 16 bytes, zeros after
        return _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
    QK static F loadf(const float* p) { return _mm256_loadu_ps(p); }
    // n <= 8 float32 / n <= 4 float16 values, zeros after: loads of fixed sizes (a masked load or a copy of n
    // values costs more than the rest of a step)
    QK static F loadf_part(const float* p, size_t n) {
        switch (n) {
            case 1: return _mm256_castps128_ps256(_mm_load_ss(p));
            case 2: return _mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p))));
            case 4: return _mm256_castps128_ps256(_mm_loadu_ps(p));
            case 8: return _mm256_loadu_ps(p);
            default: return _mm256_maskload_ps(p, lanes_mask(n));
        }
    }
    QK static F loadh_part(const uint16_t* p, size_t n) {
        uint64_t v = 0;
        switch (n) {
            case 1: v = p[0]; break;
            case 2: { uint32_t u; std::memcpy(&u, p, 4); v = u; break; }
            case 3: { uint32_t u; std::memcpy(&u, p, 4); v = u | uint64_t(p[2]) << 32; break; }
            default: std::memcpy(&v, p, 8);
        }
        return _mm256_cvtph_ps(_mm_cvtsi64_si128(int64_t(v)));
    }
    QK static F loadh(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
    QK static F set1(float f) { return _mm256_set1_ps(f); }
    QK static I set1_8(char b) { return _mm256_set1_epi8(b); }
    QK static I set1_32(int32_t v) { return _mm256_set1_epi32(v); }
    QK static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
    QK static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    QK static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
    QK static F zero() { return _mm256_setzero_ps(); }
    QK static I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
    QK static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
    QK static I srl32(I v, int n) { return _mm256_srli_epi32(v, n); }
    QK static I low_nibbles(I v) { return _mm256_and_si256(v, set1_8(0x0F)); }
    QK static I high_nibbles(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), set1_8(0x0F)); }
    QK static F spread(I idx, F v) { return _mm256_permutevar8x32_ps(v, idx); }
#if QK_VNNI
    QK static I dot(I acc, I u, I x) { return QK_DPBUSD(acc, u, x); }
#endif
    QK static F scale_add(I d, const float* xs, F ws, F acc) {
        return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(d), loadf(xs)), ws, acc);
    }
    QK static float hsum(F v) { return hsum_256(v); }
    QK static __m128 hsum4(F a, F b, F c, F d) { return hsum4_256(a, b, c, d); }
};
#endif

constexpr size_t kStep = 4 * Vec::kLanes;  // weight bytes per step

// How much of a step a row has left: all of it; its last kStep / 2 bytes (256-bit vectors: one 16-byte load; 4-bit
// rows of an odd number of 32-value blocks, such as the 304M checkpoint's MoE down-projections); or its last
// `bytes` < kStep otherwise (a masked load).
enum class Span { full, half, part };

constexpr size_t kAhead = 2;  // tiles of weight rows prefetched ahead

// Where one step's data lie: weights at byte `at` of the row; x's values (4 bits: the low-nibble half, the
// high-nibble half 64 bytes further) and its lanes (corr, scale) in the activation row.
struct Step {
    size_t at, x, lane;
    Step(size_t at_, int bits) : at(at_), x(bits == 4 ? at_ / 64 * 128 + at_ % 64 : at_), lane(at_ / 4) {}
};

// The weight scales of one step's lanes (float16 where Half, else float32): one weight block spans `bpw` bytes; a
// block as wide as the vector or wider is one broadcast scale (N = 1), narrower ones, N = kStep / bpw to a full
// step, are spread by idx (lane l takes the block of byte 4 l).  N is the kernel's constant, so that a full step
// takes its scales without a branch.  Where blocks are a step wide or narrower (`chunks`), a row's scales are
// also read a chunk at a time: Vec::kLanes blocks (kLanes / N steps) in one load, converted once, each step's
// spread from them by idx + N * (the step in the chunk).
template <bool Half, int N>
struct Scales {
    using S = std::conditional_t<Half, uint16_t, float>;
    size_t bpw;
    int shift;  // log2(bpw)
    Vec::I idx;
    QK explicit Scales(const QWeights& w)
        : bpw(w.block * size_t(w.bits) / 8), shift(__builtin_ctzl(bpw)), idx(Vec::srl32(Vec::iota(), shift - 2)) {}
    QK static const S* row(const QWeights& w, size_t r) { return static_cast<const S*>(w.scales) + r * w.blocks(); }
#if !QK_512  // (the 256-bit paths only: tile)
    static constexpr size_t kChunk = Vec::kLanes / N * kStep;  // the weight bytes of a chunk
    QK bool chunks() const { return bpw * N == kStep; }
    QK static Vec::F chunk(const S* ws, size_t block) {  // blocks [block, block + kLanes) of a row, as float32
        if constexpr (Half) return Vec::loadh(ws + block);
        else return Vec::loadf(ws + block);
    }
#endif
    template <Span P>
    QK Vec::F at(const S* ws, size_t at, size_t bytes) const {
        if constexpr (N == 1) {
            if constexpr (Half) return Vec::set1(_cvtsh_ss(ws[at >> shift]));
            else return Vec::set1(ws[at >> shift]);
        } else {
            // only the step's own blocks: a full vector of scales would read past the last row's (the end of
            // weights.bin's mapping, for the last tensor)
            const size_t n = P == Span::part ? (bytes + bpw - 1) >> shift : P == Span::half ? size_t(N / 2) : size_t(N);
            if constexpr (Half) return Vec::spread(idx, Vec::loadh_part(ws + (at >> shift), n));
            else return Vec::spread(idx, Vec::loadf_part(ws + (at >> shift), n));
        }
    }
};

// The exact integer products of one step (weights u, or their low and high nibbles) with activation row x.
template <int Bits>
struct Dot {
    Vec::I lo, hi;
    template <Span P>
    QK void load(const uint8_t* w, size_t bytes) {
        Vec::I u;
        if constexpr (P == Span::full) u = Vec::load(w);
#if !QK_512  // (the 256-bit paths only: tile)
        else if constexpr (P == Span::half) u = Vec::load_half(w);
#endif
        else u = Vec::load_part(w, bytes);
        if constexpr (Bits == 4) {
            lo = Vec::low_nibbles(u), hi = Vec::high_nibbles(u);
        } else {
#if QK_VNNI
            lo = u;
#else
            lo = _mm256_xor_si256(u, Vec::set1_8(char(0x80)));  // q = u - 128 as int8
            hi = _mm256_abs_epi8(lo);
#endif
        }
    }
    QK Vec::I with(const uint8_t* x, const QAct& a, const Step& s) const {
        const Vec::I corr = Vec::load(x + a.corr_at + 4 * s.lane);
#if QK_VNNI
        if constexpr (Bits == 4) return Vec::dot(Vec::dot(corr, lo, Vec::load(x + s.x)), hi, Vec::load(x + s.x + 64));
        return Vec::dot(corr, lo, Vec::load(x + s.x));
#else
        const __m256i ones = _mm256_set1_epi16(1);
        if constexpr (Bits == 4) {  // nibble x int8 pairs <= 2 * 15 * 127: two such sums still fit int16
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, Vec::load(x + s.x)),
                                               _mm256_maddubs_epi16(hi, Vec::load(x + s.x + 64)));
            return _mm256_add_epi32(_mm256_madd_epi16(p, ones), corr);
        }
        return _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_sign_epi8(Vec::load(x + s.x), lo)), ones);
#endif
    }
};

// One step (or its first `bytes`: Span) for R weight rows, whose scales are ws, by C activation rows.
template <int Bits, int R, int C, Span P>
QK inline void tile_step(const QWeights& w, size_t ldw, const Vec::F (&ws)[R], const uint8_t* x, size_t ldx,
                         const QAct& a, size_t at, size_t bytes, Vec::F (&acc)[R][C]) {
    const Step s(at, Bits);
    // The tile after next, in its memory order: its R rows are one run of R * ldw bytes, which this tile's steps
    // prefetch front to back, R * kStep bytes a step.  (Prefetching each row at the step's offset instead makes
    // R short interleaved streams, which the memory system serves at about half the rate of one stream.)
    const uint8_t* ahead = w.data + kAhead * R * ldw + R * at;
#pragma GCC unroll 8
    for (size_t b = 0; b < R * kStep; b += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + b), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
        Dot<Bits> d;
        d.template load<P>(w.data + r * ldw + at, bytes);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
            const uint8_t* xc = x + c * ldx;
            acc[r][c] = Vec::scale_add(d.with(xc, a, s), reinterpret_cast<const float*>(xc + a.scale_at) + s.lane,
                                       ws[r], acc[r][c]);
        }
    }
}

// tile_step with the R rows' scales of its own step read as it needs them
template <int Bits, bool Half, int N, int R, int C, Span P>
QK inline void scaled_step(const QWeights& w, size_t ldw, const Scales<Half, N>& sc, const uint8_t* x, size_t ldx,
                           const QAct& a, size_t at, size_t bytes, Vec::F (&acc)[R][C]) {
    Vec::F ws[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) ws[r] = sc.template at<P>(Scales<Half, N>::row(w, r), at, bytes);
    tile_step<Bits, R, C, P>(w, ldw, ws, x, ldx, a, at, bytes, acc);
}

// y[c * ldy + r] for R weight rows from w and C activation rows from x: one pass over the weight rows,
// every weight vector loaded once for all C rows.
template <int Bits, bool Half, int N, int R, int C>
QK void tile(const QWeights& w, const Scales<Half, N>& sc, const uint8_t* x, size_t ldx, const QAct& a, float* y,
             size_t ldy) {
    Vec::F acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[r][c] = Vec::zero();
    const size_t ldw = w.row_bytes(), full = ldw / kStep * kStep;
    using Sc = Scales<Half, N>;
    size_t at = 0;
#if !QK_512  // (AVX2 and AVX-VNNI, where converting each step's scales cost the most; one activation row, whose
             // accumulators leave the chunk's scales their registers)
    if (C == 1 && sc.chunks())
        for (; at + Sc::kChunk <= full; at += Sc::kChunk) {
            Vec::F chunk[R];
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) chunk[r] = Sc::chunk(Sc::row(w, r), at >> sc.shift);
            Vec::I idx = sc.idx;
#pragma GCC unroll 4
            for (size_t b = 0; b < Sc::kChunk; b += kStep, idx = Vec::add32(idx, Vec::set1_32(N))) {
                Vec::F ws[R];
#pragma GCC unroll 8
                for (int r = 0; r < R; ++r) ws[r] = Vec::spread(idx, chunk[r]);
                tile_step<Bits, R, C, Span::full>(w, ldw, ws, x, ldx, a, at + b, kStep, acc);
            }
        }
#endif
    for (; at < full; at += kStep) scaled_step<Bits, Half, N, R, C, Span::full>(w, ldw, sc, x, ldx, a, at, kStep, acc);
#if !QK_512
    if (N > 1 && ldw - full == kStep / 2)  // (N == 1: rows are whole steps)
        scaled_step<Bits, Half, N, R, C, Span::half>(w, ldw, sc, x, ldx, a, full, kStep / 2, acc);
    else
#endif
    if (full < ldw)
        scaled_step<Bits, Half, N, R, C, Span::part>(w, ldw, sc, x, ldx, a, full, ldw - full, acc);
    if constexpr (R == 4) {
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) _mm_storeu_ps(y + c * ldy, Vec::hsum4(acc[0][c], acc[1][c], acc[2][c], acc[3][c]));
    } else {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) y[c * ldy + r] = Vec::hsum(acc[r][c]);
    }
}

// R weight rows against all m activation rows, QK_MAXC at a time: the R rows stay in L1 while the groups pass.
template <int Bits, bool Half, int N, int R>
QK void row_tiles(const QWeights& w, const Scales<Half, N>& sc, const uint8_t* x, size_t m, const QAct& a, float* y,
                  size_t ldy) {
    size_t i = 0;
    for (; i + QK_MAXC <= m; i += QK_MAXC) tile<Bits, Half, N, R, QK_MAXC>(w, sc, x + i * a.bytes, a.bytes, a, y + i * ldy, ldy);
    x += i * a.bytes, y += i * ldy;
    switch (m - i) {
        case 1: return tile<Bits, Half, N, R, 1>(w, sc, x, a.bytes, a, y, ldy);
        case 2: return tile<Bits, Half, N, R, 2>(w, sc, x, a.bytes, a, y, ldy);
        case 3: return tile<Bits, Half, N, R, 3>(w, sc, x, a.bytes, a, y, ldy);
        default: return;
    }
}

template <int Bits, bool Half, int N>
QK void qdot(const uint8_t* x, size_t m, const QWeights& w, size_t n, float* y, size_t ldy) {
    const QAct a(w);
    const Scales<Half, N> sc(w);
    size_t j = 0;
    for (; j + kRows <= n; j += kRows) row_tiles<Bits, Half, N, kRows>(w.from_row(j), sc, x, m, a, y + j, ldy);
    for (; j < n; ++j) row_tiles<Bits, Half, N, 1>(w.from_row(j), sc, x, m, a, y + j, ldy);
}

// qdot for the weight blocks a full step spans: N = 1 where a block is a step or wider, else kStep / bpw, at most
// kMaxN (blocks have 16 values or more: 2 Bits bytes)
template <int Bits, bool Half>
QK void qdot_blocks(const uint8_t* x, size_t m, const QWeights& w, size_t n, float* y, size_t ldy) {
    constexpr size_t kMaxN = kStep / (2 * Bits);  // (2 on AVX2 at 8 bits, 4 at 4 bits; twice that at 512 bits)
    const size_t bpw = w.block * size_t(Bits) / 8, blocks = bpw >= kStep ? 1 : kStep / bpw;
    if (blocks == 1) return qdot<Bits, Half, 1>(x, m, w, n, y, ldy);
    if (kMaxN == 2 || blocks == 2) return qdot<Bits, Half, 2>(x, m, w, n, y, ldy);
    if constexpr (kMaxN >= 4)
        if (kMaxN == 4 || blocks == 4) return qdot<Bits, Half, 4>(x, m, w, n, y, ldy);
    if constexpr (kMaxN >= 8) return qdot<Bits, Half, 8>(x, m, w, n, y, ldy);
}

QK void qrows_dot(const uint8_t* x, size_t m, const QWeights& w, size_t n, float* y, size_t ldy) {
    if (w.bits == 4) return w.half ? qdot_blocks<4, true>(x, m, w, n, y, ldy) : qdot_blocks<4, false>(x, m, w, n, y, ldy);
    return w.half ? qdot_blocks<8, true>(x, m, w, n, y, ldy) : qdot_blocks<8, false>(x, m, w, n, y, ldy);
}

// ------------------------------------------------------------------------------------ packed weights (QPack)
// A tile is Vec::kLanes weight rows, row p in lane p; a group kPackTiles tiles.  For each 8 values G of K (an
// activation scale's span): 8 bits, two pieces (bytes 8G..8G+3 and 8G+4..8G+7 of each row); 4 bits, one
// (bytes 4G..4G+3: the 8 values' low nibbles are their even elements, the high nibbles the odd ones).  A piece
// is one vector, the tile's rows' 4 bytes side by side, and the group's tiles' pieces follow each other.  Their
// products with the activation's matching 4 bytes (broadcast to every lane) start from the zero-point
// correction of the 8 values (QAct::corr), are scaled by their activation scale into a per-block float sum,
// and each block's sum by the rows' block scales into the result.  On the VNNI paths the hardware prefetchers
// follow the one run of memory a group's pass reads (prefetch instructions made it slower, cached or not); the
// AVX2 kernels prefetch ahead of it (kPackAhead).
// Without VNNI (AVX2) a piece's products are vpmaddubsw's: 4 bits, the unsigned nibbles times x's signed bytes,
// the two halves' int16 pairs added (each <= 2 * 15 * 127, their sum fits) and summed to int32 by vpmaddwd,
// then the correction; 8 bits, packed as the signed q (QPack::sign) so that |q| times x with q's sign moved
// onto it cannot saturate (pairs <= 2 * 128 * 127), each half summed to int32 on its own, no correction.
constexpr size_t kPackRows = Vec::kLanes;
constexpr size_t kPackTiles = QK_512 ? 4 : 2;  // the tiles one pass takes (their accumulators fill the registers)
constexpr int kPackCols = 2;                   // activation rows per pass
// Bytes a pass prefetches ahead of what it reads (AVX2: without, a group's run of memory streams at about half
// the rate; the VNNI kernels, tuned on weights the last-level cache holds, read without).
constexpr size_t kPackAhead = QK_VNNI ? 0 : 1024;

QK inline int32_t load32(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// One piece of a tile (8 values of each of its rows): the weights, and their exact integer products with an
// activation's bytes x0 (4 bits: the even elements; 8 bits: the first 4) and x1 broadcast to every lane, plus
// corr where the path's weights need the zero-point correction (kCorr).
template <int Bits>
struct Piece {
    static constexpr bool kCorr = QK_VNNI || Bits == 4;
    Vec::I lo, hi;
    QK void load(const uint8_t* wt, size_t stride) {
        if constexpr (Bits == 8) {
            lo = Vec::load(wt), hi = Vec::load(wt + stride);
        } else {
            const Vec::I u = Vec::load(wt);
            lo = Vec::low_nibbles(u), hi = Vec::high_nibbles(u);
        }
    }
    QK Vec::I with(Vec::I corr, Vec::I x0, Vec::I x1) const {
#if QK_VNNI
        return Vec::dot(Vec::dot(corr, lo, x0), hi, x1);
#else
        const __m256i ones = _mm256_set1_epi16(1);
        if constexpr (Bits == 4) {
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
            return _mm256_add_epi32(_mm256_madd_epi16(p, ones), corr);
        }
        (void)corr;
        return _mm256_add_epi32(
            _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(lo), _mm256_sign_epi8(x0, lo)), ones),
            _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(hi), _mm256_sign_epi8(x1, hi)), ones));
#endif
    }
};

// The activation's bytes that meet piece `h` of the 8 values G (4 bits: h 0 the low nibbles' even elements,
// 1 the odd ones; 8 bits: x's order).
template <int Bits>
QK inline size_t x_piece(size_t g, int h) {
    if constexpr (Bits == 8) return 8 * g + 4 * size_t(h);
    // (block kb = g / 4: kb / 4 * 128 + h * 64 + kb % 4 * 16 + g % 4 * 4, i.e. 128 bytes a group of 16 pieces)
    return 4 * g + g / 16 * 64 + size_t(h) * 64;
}

// T tiles of a group (from tile t0, all in one group) by C activation rows; rows of the tiles outside [j0, j1)
// are not stored.
template <int Bits, int T, int C>
QK void ptile(const QPack& p, size_t t0, const uint8_t* x, size_t ldx, const QAct& a, size_t j0, size_t j1,
              float* y, size_t ldy) {
    constexpr size_t P = kPackRows, piece = 4 * P, pieces = Bits == 8 ? 2 : 1;  // pieces per 8 values
    constexpr size_t stride = kPackTiles * piece;                                // from one piece to the next
    const size_t nb = p.blocks(), per_block = p.block / 8, g0 = t0 / kPackTiles, ti = t0 % kPackTiles;
    const uint8_t* w = p.data() + g0 * p.group_bytes() + ti * piece;
    const float* ws = p.scales.data() + (g0 * nb * kPackTiles + ti) * P;
    Vec::F acc[T][C];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[t][c] = Vec::zero();
    const uint8_t* xc[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) xc[c] = x + c * ldx;
    size_t g = 0;
    for (size_t b = 0; b < nb; ++b) {
        Vec::F part[T][C];
#pragma GCC unroll 8
        for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) part[t][c] = Vec::zero();
        for (size_t e = 0; e < per_block; ++e, ++g) {
            const uint8_t* wg = w + g * pieces * stride;
            if constexpr (kPackAhead > 0)
#pragma GCC unroll 2
                for (size_t h = 0; h < pieces * stride; h += 64)
                    _mm_prefetch(reinterpret_cast<const char*>(wg + h + kPackAhead), _MM_HINT_T0);
            Piece<Bits> pc[T];
#pragma GCC unroll 8
            for (int t = 0; t < T; ++t) pc[t].load(wg + t * piece, stride);
            const size_t lane = Bits == 8 ? 2 * g : g, xo = x_piece<Bits>(g, 0);  // QAct's lane of these 8 values
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) {
                const Vec::I corr = Piece<Bits>::kCorr ? Vec::set1_32(load32(xc[c] + a.corr_at + 4 * lane)) : Vec::I();
                const Vec::I x0 = Vec::set1_32(load32(xc[c] + xo));
                const Vec::I x1 = Vec::set1_32(load32(xc[c] + xo + (Bits == 8 ? 4 : 64)));
                const Vec::F xs = Vec::set1(reinterpret_cast<const float*>(xc[c] + a.scale_at)[lane]);
#pragma GCC unroll 8
                for (int t = 0; t < T; ++t) part[t][c] = Vec::fma(Vec::cvt(pc[t].with(corr, x0, x1)), xs, part[t][c]);
            }
        }
#pragma GCC unroll 8
        for (int t = 0; t < T; ++t) {
            const Vec::F s = Vec::loadf(ws + (b * kPackTiles + t) * P);
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) acc[t][c] = Vec::fma(part[t][c], s, acc[t][c]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
        const size_t r0 = (t0 + t) * P;  // the tile's first row
        if (r0 >= j0 && r0 + P <= j1) {
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) Vec::storef(y + c * ldy + (r0 - j0), acc[t][c]);
            continue;
        }
        alignas(64) float rows[P];
        for (int c = 0; c < C; ++c) {
            Vec::storef(rows, acc[t][c]);
            for (size_t r = std::max(r0, j0); r < std::min(r0 + P, j1); ++r) y[c * ldy + (r - j0)] = rows[r - r0];
        }
    }
}

// m activation rows against the tiles of rows [j0, j1), a group at a time (whole groups in one pass, the tiles
// of a group cut short one by one), each group by every kPackCols rows of x while it is in cache.
template <int Bits>
QK void pdot(const uint8_t* x, size_t m, const QPack& p, size_t j0, size_t n, float* y, size_t ldy) {
    constexpr size_t T = kPackTiles;
    const QAct a(p.format());
    const size_t j1 = j0 + n, end = (j1 + kPackRows - 1) / kPackRows;
    for (size_t t = j0 / kPackRows; t < end;) {
        const bool whole = t % T == 0 && t + T <= end;
        size_t i = 0;
        for (; i + kPackCols <= m; i += kPackCols) {
            if (whole) ptile<Bits, T, kPackCols>(p, t, x + i * a.bytes, a.bytes, a, j0, j1, y + i * ldy, ldy);
            else ptile<Bits, 1, kPackCols>(p, t, x + i * a.bytes, a.bytes, a, j0, j1, y + i * ldy, ldy);
        }
        if (i < m) {  // (kPackCols == 2: one row left)
            if (whole) ptile<Bits, T, 1>(p, t, x + i * a.bytes, a.bytes, a, j0, j1, y + i * ldy, ldy);
            else ptile<Bits, 1, 1>(p, t, x + i * a.bytes, a.bytes, a, j0, j1, y + i * ldy, ldy);
        }
        t += whole ? T : 1;
    }
}

QK void qrows_dot_packed(const uint8_t* x, size_t m, const QPack& p, size_t j0, size_t n, float* y, size_t ldy) {
    static_assert(kPackCols == 2, "pdot's remainder is one activation row");
    if (p.bits == 4) return pdot<4>(x, m, p, j0, n, y, ldy);
    return pdot<8>(x, m, p, j0, n, y, ldy);
}
