// kernels.h -- the CPU kernels behind mtp-trt's ONNX Runtime operators (mtp_ort_ops.cpp), as plain functions
// over float arrays (and quantized weights' bytes): no ONNX Runtime types, so they can be read, tested and timed
// on their own.  Each has a
// NumPy reference in plugins/ort_reference.py and a test in tests/test_ort_ops.py.
//
// Every product here is a set of dot products between contiguous rows: activations x [M, K] against weights
// w [N, K] in nn.Linear's [out, in] layout, the layout the checkpoint and weights.bin store.  Decoding has
// few rows (M = 1..a few), so the kernels stream each weight row once and keep the rows of x in registers or
// L1: matrix-vector products over the one shared mapping of weights.bin (ONNX Runtime's MatMul packs a private
// copy per session).  On x86 the quantized products can also read a weight packed once per process (QPack),
// which the vector paths multiply with less float work (a third at 8 bits) and no sum across a vector.
#ifndef MTP_ORT_KERNELS_H
#define MTP_ORT_KERNELS_H

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace mtp_ort {

// ------------------------------------------------------------------------------ instruction sets
// The instruction sets the kernels are written for, by the names the environment variable MTP_TRT_CPU_ISA takes:
//   scalar        portable C++, any CPU
// x86-64:
//   avx2          AVX2 + FMA + F16C: the float kernels, and the quantized products by vpmaddubsw
//   avx-vnni      avx2's float kernels; the quantized products by 256-bit vpdpbusd: AVX-VNNI's, or on a CPU with
//                 AVX512-VNNI but no AVX-VNNI, AVX512-VNNI's 256-bit form (qpath_name "avx512-vnni-256")
//   avx512-vnni   AVX-512 (F, BW, DQ, VL) + AVX512-VNNI: 512-bit quantized products and lightning indexer
// ARM64:
//   neon          AdvSIMD (every ARMv8-A CPU): the float kernels, and the quantized products by SMULL
//   neon-dotprod  neon's float kernels; the quantized products by SDOT (FEAT_DotProd)
//   neon-i8mm     neon's float kernels; the quantized products by SMMLA (FEAT_I8MM) and SDOT
// Chosen once per process: MTP_TRT_CPU_ISA where it names a set this CPU has, else the last of its architecture's
// sets the CPU has (x86: the indexer on AVX-512F where the CPU has it).  A CPU has the sets of its own
// architecture only (cpu_has: the CPU's feature flags; on ARM64 Linux's HWCAP/HWCAP2, macOS's sysctl).
enum class CpuIsa { scalar, avx2, avx_vnni, avx512_vnni, neon, neon_dotprod, neon_i8mm };
constexpr const char* kCpuIsaNames[] = {"scalar", "avx2", "avx-vnni", "avx512-vnni", "neon", "neon-dotprod", "neon-i8mm"};
CpuIsa cpu_isa();
bool cpu_has(CpuIsa isa);
// "" where MTP_TRT_CPU_ISA is unset or names a set this CPU has; else why not, in one line (the kernels then
// run on the sets the CPU has; mtp_ort_ops.cpp refuses to register the operators).
const char* cpu_isa_error();

// y[i * ldy + j] = sum_k x[i * ldx + k] * w[j * ldw + k]   for i < m, j < n.
void rows_dot(const float* x, size_t m, size_t ldx, const float* w, size_t ldw, size_t n, size_t k, float* y,
              size_t ldy);

// y[i * ldy + d] += sum_t p[i * ldp + t] * v[t * ldv + d]   for i < m, d < dv  (t < n).
void rows_axpy(const float* p, size_t m, size_t ldp, const float* v, size_t ldv, size_t n, size_t dv, float* y,
               size_t ldy);

// Absorbed MLA attention of one query token: q [H, C] (C = latent + rope dims) against the visible key rows
// (n_cache rows of `cache` then the rows of `rows` for which visible[r] != 0; visible == nullptr: all
// n_rows; rows `ld` >= C floats apart, keys their first C values), values the first dl dims of the same rows.
// Rows after the last visible one are not read: a token gets the same bits as in a step where they are absent.
// scores: scratch of H * mla_scores_stride(n_cache + n_rows) floats.
// out [H, dl] (ldo apart).
inline size_t mla_scores_stride(size_t keys) { return (keys + 7) & ~size_t(7); }
void mla_attend_token(const float* q, size_t heads, size_t c, size_t dl, float scale, const float* cache,
                      size_t n_cache, const float* rows, size_t n_rows, size_t ld, const uint8_t* visible,
                      float* scores, float* out, size_t ldo);

// mla_attend_token over the n rows at keys[0..n) (DeepSeek Sparse Attention's selected rows, each C floats
// read), all visible.  scores: scratch of H * mla_scores_stride(n) floats.
void mla_attend_rows(const float* q, size_t heads, size_t c, size_t dl, float scale, const float* const* keys,
                     size_t n, float* scores, float* out, size_t ldo);

// RMSNorm of one row of n values: y = w * x / sqrt(mean(x^2) + eps) (y may be x).
void rms_norm_row(const float* x, size_t n, const float* w, float eps, float* y);

// RoPE in place on `heads` vectors of dr values (ld apart) at one position: cos/sin [dr / 2] the position's
// table rows; interleave: pairs (2i, 2i + 1) (DeepSeek's layout), else (i, i + dr / 2).  The products and sums of
// exporters/model.py apply_rope: (x1 cos - x2 sin, x2 cos + x1 sin).
void rope_heads(float* x, size_t heads, size_t ld, size_t dr, const float* cos, const float* sin, bool interleave);

// DeepSeek Sparse Attention's lightning indexer for one query token over n key rows (row t: di floats at
// keys + t * ld): I[t] = sum_j w[j] * max(0, scale * q[j] . k_t) for heads j < heads, q [heads, di].
// Fused: each tile of rows is scored for every head at once, no [heads, n] product is kept.
void index_scores(const float* q, const float* w, size_t heads, size_t di, float scale, const float* keys,
                  size_t ld, size_t n, float* scores);

// DSA's selection: the k rows of highest score among scores[0..n) (-inf: a row not visible, never chosen), the
// earlier row among equal scores (ONNX TopK's rule) -> their indices in ascending order in idx, and their count
// min(k, visible rows).  scratch: n floats.
size_t select_top(const float* scores, size_t n, size_t k, float* scratch, int32_t* idx);

// The instruction set of the indexer's scores: "scalar", "avx2" or "avx512"; on ARM64 "neon" (cpu_isa(): avx2 and
// avx-vnni run the AVX2 kernels, avx512-vnni the AVX-512 ones, every ARM64 set but scalar the NEON ones).
const char* index_path_name();

// SwiGLU on interleaved gate/up pairs: a[i * lda + j] = silu(h[i * ldh + 2j]) * h[i * ldh + 2j + 1], j < units.
void swiglu_pairs(const float* h, size_t m, size_t ldh, size_t units, float* a, size_t lda);

// DeepSeek-V3's router (V3 §2.1.2) for one token: scores s = sigmoid(logits) (or softmax), choice = s + bias
// (bias may be nullptr), restricted to the top `topk_group` of `n_group` groups (group score: the sum of its
// two best choices if group_top2, else its best; n_group <= 1: no groups), then the top k of choice.  Ties go
// to the lower index, as ONNX's TopK.  idx [k] the experts, weight [k] their gates: s at idx, divided by
// (sum + 1e-20) if norm_topk_prob, times scaling.  scratch: 2 * n_experts + n_group floats.
void route_token(const float* logits, size_t n_experts, bool softmax_scoring, const float* bias, size_t n_group,
                 size_t topk_group, bool group_top2, size_t k, bool norm_topk_prob, float scaling, float* scratch,
                 int32_t* idx, float* weight);

// ------------------------------------------------------------------------------ quantized weights
// IEEE float16 bits -> float (exact; scales are finite).
inline float half_to_float(uint16_t h) {
    const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    float f;
    if (exp == 0) {
        f = std::ldexp(float(man), -24);  // zero or subnormal
    } else {
        const uint32_t bits = ((exp + 112u) << 23) | (man << 13);
        std::memcpy(&f, &bits, sizeof f);
    }
    return h & 0x8000u ? -f : f;
}

// A weight W [N, K] in mtp_trt/quant.py's format (ONNX Runtime's MatMulNBits layout): each row's K values
// zero-padded to `blocks()` blocks of `block` values, a block stored as block * bits / 8 bytes of q + 2^(bits-1)
// (4 bits: element 2i in the low nibble, 2i + 1 in the high one) with one scale, float16 (`half`) or float32.
struct QWeights {
    const uint8_t* data;   // [N, blocks, block * bits / 8]
    const void* scales;    // [N, blocks]: float16 bits where `half`, else float32
    size_t k;              // the unpadded K
    size_t block;          // 16, 32, 64, 128 or 256
    int bits;              // 4 or 8
    bool half = false;

    size_t blocks() const { return (k + block - 1) / block; }
    size_t row_bytes() const { return blocks() * block * size_t(bits) / 8; }
    const void* scales_from(size_t i) const {  // &scales[i]
        return static_cast<const uint8_t*>(scales) + i * (half ? 2 : 4);
    }
    float scale(size_t i) const {  // scales[i]
        return half ? half_to_float(static_cast<const uint16_t*>(scales)[i]) : static_cast<const float*>(scales)[i];
    }
    QWeights from_row(size_t j) const {
        return {data + j * row_bytes(), scales_from(j * blocks()), k, block, bits, half};
    }
};

// Activation rows quantized to int8 for the products with one weight format: per 8 values, scale =
// max|x| / 127 and q = round-half-even(x / scale) (8 zeros: scale 0, q 0), K zero-padded to the weight's padded
// K.  A row takes qrow_bytes(w) bytes, laid out as qrows_dot wants them (kernels.cpp).
size_t qrow_bytes(const QWeights& w);
void quantize_rows(const float* x, size_t m, size_t ldx, const QWeights& w, uint8_t* qx);

// y[i * ldy + j] = sum over 8-value parts of (x's scale * w's scale * sum(xq * wq)) for i < m rows of qx
// (qrow_bytes(w) apart) and j < n rows of w; each part's sum of integer products is exact.
void qrows_dot(const uint8_t* qx, size_t m, const QWeights& w, size_t n, float* y, size_t ldy);

// A quantized weight's rows repacked for x86's vector kernels (every x86 path but scalar).  A tile is `rows` weight
// rows, one per int32 lane of the path's vectors; for every 8 values of K (an activation scale's span) a tile
// holds its rows' 4-byte pieces side by side (8 bits: two pieces, 4 bits: one), so one vector load holds the
// same piece of every row, the integer products of 8 values come out one row per lane, and the float work is
// done once per 8 values for the whole tile, not once per 4-byte lane of each row.  The `group` tiles of a
// group are interleaved piece by piece -- a pass over a group's tiles reads one run of memory -- and the scales
// are float32 [groups][blocks][group][rows].  Rows past N are zeros.
struct QPack {
    size_t n = 0, rows = 0, group = 0;  // N, rows per tile, tiles per group
    size_t k = 0, block = 0;
    int bits = 0;
    bool sign = false;           // 8 bits: the bytes hold q = u - 128 as int8 (the AVX2 kernels), else u
    std::vector<uint8_t> bytes;  // the groups, `group_bytes()` each, from `data()` (64-byte aligned)
    std::vector<float> scales;

    size_t blocks() const { return (k + block - 1) / block; }
    size_t group_rows() const { return rows * group; }
    size_t groups() const { return (n + group_rows() - 1) / group_rows(); }
    size_t group_bytes() const { return blocks() * block * size_t(bits) / 8 * group_rows(); }
    const uint8_t* data() const {
        return bytes.data() + (64 - reinterpret_cast<uintptr_t>(bytes.data()) % 64) % 64;
    }
    // the QWeights whose activation rows (qrow_bytes, quantize_rows) the packed kernels take
    QWeights format() const { return {nullptr, nullptr, k, block, bits}; }
};

// The largest weight (its bytes, scales left out) packed: 0 on the scalar path and on ARM64 (whose products read
// the weights as stored), else MTP_ORT_PACK_MAX_BYTES where set (0: never pack), else 16 MiB -- packing pays where the products are compute-bound (cached weights,
// several activation rows) and little where a weight streams from memory, and a packed copy is memory the
// weights take twice.
size_t qpack_max_bytes();

// W's first n rows packed (qpack_max_bytes() > 0).
QPack qpack(const QWeights& w, size_t n);

// qrows_dot against rows [j0, j0 + n) of a packed weight: y[i * ldy + j - j0].  Each row's result has the same
// bits whatever j0, n and m (the rows of a tile and the activation rows of a call never meet in a sum).
void qrows_dot_packed(const uint8_t* qx, size_t m, const QPack& p, size_t j0, size_t n, float* y, size_t ldy);

// The instruction set of the quantized products: cpu_isa()'s name, or "avx512-vnni-256" where avx-vnni runs in
// AVX512-VNNI's 256-bit form.
const char* qpath_name();

}  // namespace mtp_ort

#endif  // MTP_ORT_KERNELS_H
