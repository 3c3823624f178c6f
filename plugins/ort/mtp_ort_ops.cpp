// mtp_ort_ops.cpp -- mtp-trt's CPU operators for ONNX Runtime: a custom-op library (domain "mtp_trt.cpu") that
// SessionOptions.register_custom_ops_library loads (plugins/ort_lib.py builds and finds it).  The onnx lowering
// uses them in the decode-step graphs (exporters/ort_ops.py), where few rows pass through each layer:
//
//   MoE(x [..., D], gate [E, D]?, bias [E]?, fc1 [E, 2I, D]?, fc2 [E, D, I]?, shared_fc1 [2Is, D]?, shared_fc2 [D, Is]?)
//                                                                   -> [..., D]       (DeepSeekMoE, router included;
//                                                                      without gate, fc1, fc2: a dense SwiGLU MLP)
//   MlaAttention(q_lat [B, S, H*Dl], q_pe [B, S, H*Dr], rows [B, R, C], cache [B, T, C], past_len [B] int32,
//                visible [B|1, S, R] bool?, selected [B, S, K] int32?)
//                                                                   -> [B, S, H*Dl]   (absorbed MLA, C >= Dl + Dr)
//   MlaSelfAttention(q [B, S, H*F + H*Dr], kv [B, S, Dl+Dr], kv_norm [Dl], positions [B, S] int64, cos [P, Dr/2],
//                    sin [P, Dr/2], cache [B, T, Dl+Dr], past_len [B] int32, extra [B, R, Dl+Dr]?,
//                    visible [B|1, S, R+S] bool?, w_uk [H, Dn, Dl]?, w_uv [H, Dv, Dl]?,
//                    w_uk_q uint8 [H, Dl, Dn/bs, bs]?, w_uk_scales [H, Dl, Dn/bs]?,
//                    w_uv_q uint8 [H, Dv, Dl/bs, bs]?, w_uv_scales [H, Dv, Dl/bs]?)
//                                                                   -> [B, S, H*Dv or H*Dl], new rows [B, S, Dl+Dr]
//                                                                      (MLA from the projections to W^UV; W^UK
//                                                                      and W^UV in float32 or as int8 blocks)
//   MtpAccept(logits [B, S, V], input_ids [B, S] int32, thinking [B] int32, relaxed_topk [] int32?,
//             relaxed_delta [] float?)  -> accepted_tokens [B, S], num_accepted [B], thinking_out [B] (int32)
//                                                                      (draft acceptance, exporters/lowering.py's)
//   LightningIndexer(q [B, S, Hi*Di], weights [B, S, Hi], rows [B, R, C], cache [B, T, C], past_len [B] int32,
//                    visible [B|1, S, R] bool?)                    -> [B, S, K] int32 (DSA's top-k rows)
//   RmsNorm(x [..., D], weight [D], skip [..., D]?)                -> y [..., D], x + skip [..., D]?
//                                                                      (RMSNorm of x or of x + skip)
//   QMatMul(x [..., K], w uint8 [N, K/bs, blob], scales [N, K/bs]) -> [..., N]       (x W^T, W quantized)
//   QMoE(x, gate, bias?, fc1 uint8 [E, 2I, D/bs, blob], fc1_scales [E, 2I, D/bs], fc2 uint8 [E, D, I/bs, blob],
//        fc2_scales [E, D, I/bs], shared_fc1 [2Is, D/bs, blob]?, shared_fc1_scales?, shared_fc2 [D, Is/bs, blob]?,
//        shared_fc2_scales?)                                        -> [..., D]       (MoE, experts quantized;
//                                                                      routed ones optional as MoE's)
//
// fc1 holds each expert's gate and up rows interleaved (row 2j = gate_j, 2j + 1 = up_j); all weights are in
// nn.Linear's [out, in] layout and are read in place.  Quantized weights are mtp_trt/quant.py's format
// (MatMulNBits' layout: K/bs = ceil(K / block_size) blocks of blob = block_size * bits / 8 bytes, no zero
// points; float16 scales, or float32); their products take int8 activations, quantized per 8 values (MatMulNBits' accuracy_level 4 takes 32).  Attributes and semantics: docs/architecture.md ("CPU
// operators").  The arithmetic is in kernels.cpp; this file checks shapes, splits the work over ONNX Runtime's
// intra-op threads (KernelContext_ParallelFor) and reports bad input as an ONNX Runtime error naming the op,
// input and shape.
#include <onnxruntime_c_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace mtp_ort {
namespace {

constexpr uint32_t kApiVersion = 18;  // ONNX Runtime >= 1.18 (KernelContext_ParallelFor: 1.17)
constexpr char kDomain[] = "mtp_trt.cpu";
const OrtApi* g_api24 = nullptr;         // API 24 (ONNX Runtime >= 1.24) where the runtime has it, else nullptr

// API 24 where ONNX Runtime has it (asking an older one for it prints an error).
const OrtApi* api24(const OrtApiBase* base) {
    unsigned major = 0, minor = 0;
    if (std::sscanf(base->GetVersionString(), "%u.%u", &major, &minor) != 2 || (major == 1 && minor < 24))
        return nullptr;
    return base->GetApi(24);
}

#define MTP_RETURN_IF(expr)                       \
    do {                                          \
        if (OrtStatus* status_ = (expr)) return status_; \
    } while (0)

// A tensor's dimensions, held in place (no allocation per call): rank kMaxRank at most.
constexpr size_t kMaxRank = 8;
struct Dims {
    int64_t d[kMaxRank] = {};
    size_t n = 0;

    Dims() = default;
    Dims(std::initializer_list<int64_t> v) : n(std::min(v.size(), kMaxRank)) { std::copy_n(v.begin(), n, d); }
    size_t size() const { return n; }
    bool empty() const { return n == 0; }
    int64_t* data() { return d; }
    const int64_t* data() const { return d; }
    int64_t& operator[](size_t i) { return d[i]; }
    int64_t operator[](size_t i) const { return d[i]; }
    int64_t& back() { return d[n - 1]; }
    void pop_back() { --n; }
    const int64_t* begin() const { return d; }
    const int64_t* end() const { return d + n; }
    bool operator==(const Dims& o) const { return n == o.n && std::equal(d, d + n, o.d); }
    bool operator!=(const Dims& o) const { return !(*this == o); }
};

// A tensor of the kernel context: data and shape (absent: an optional input left out).
struct View {
    bool present = false;
    ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    void* data = nullptr;
    Dims shape;

    const float* f() const { return static_cast<const float*>(data); }
    int64_t dim(int i) const { return shape[i < 0 ? int(shape.size()) + i : i]; }
    int64_t size() const {
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        return n;
    }
    std::string str() const {
        std::string s = "[";
        for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
        return s + "]";
    }
};

// The least work (multiply-adds, roughly) that a Compute call splits over ONNX Runtime's intra-op threads.
// Handing parts to another thread and waiting for them costs about a microsecond, more than a smaller call
// gains: on a 2-core AMD EPYC a chain of QMatMul nodes took 1.12-1.45x the time split over 2 threads as on
// one at 16K-65K multiply-adds, the same at 147K, and 0.53-0.87x from 262K.  MTP_ORT_MIN_PARALLEL_WORK overrides
// it when a session makes its kernels (0: split every call, as the tests of thread-count independence do).
constexpr double kMinParallelWork = 1e5;

double min_parallel_work() {
    const char* env = std::getenv("MTP_ORT_MIN_PARALLEL_WORK");
    return env && *env ? std::atof(env) : kMinParallelWork;
}

// The largest weight a session's kernels pack (kernels.h qpack_max_bytes): the session's config entry
// kPackMaxBytesKey where ONNX Runtime (>= 1.24) hands kernels their session's entries and it is set, at most the
// process's limit.  Every kernel of a session, so of an OrtBackend, reads a given weight the same way.
constexpr const char* kPackMaxBytesKey = "mtp_trt.cpu.pack_max_bytes";

// The session's intra-op thread count, where whoever made the session says it (OrtBackend does): the config entry
// kThreadsKey.  A kernel that knows it runs on one thread cuts its work in fewer, larger items.
constexpr const char* kThreadsKey = "mtp_trt.cpu.intra_op_threads";

// The session's config entry `key` as a number (ONNX Runtime >= 1.24 hands kernels their session's entries);
// `otherwise` where it is absent or cannot be read.
size_t config_number(const OrtKernelInfo* info, const char* key, size_t otherwise) {
    const OrtApi* api = g_api24;  // (KernelInfo_GetConfigEntries)
    OrtKeyValuePairs* entries = nullptr;
    if (!api) return otherwise;
    if (OrtStatus* s = api->KernelInfo_GetConfigEntries(info, &entries)) {
        api->ReleaseStatus(s);
        return otherwise;
    }
    size_t value = otherwise;
    if (const char* v = api->GetKeyValue(entries, key); v && *v) value = std::strtoull(v, nullptr, 10);
    api->ReleaseKeyValuePairs(entries);
    return value;
}

size_t pack_max_bytes(const OrtKernelInfo* info) {
    const size_t limit = qpack_max_bytes();
    return limit ? std::min(limit, config_number(info, kPackMaxBytesKey, limit)) : 0;
}

// `value`'s type, shape and data into v (present).
OrtStatus* view_of(const OrtApi* api, const OrtValue* value, View& v) {
    if (g_api24) {  // the value's own shape, nothing allocated
        const int64_t* dims = nullptr;
        size_t rank = 0;
        MTP_RETURN_IF(g_api24->GetTensorElementTypeAndShapeDataReference(value, &v.type, &dims, &rank));
        if (rank > kMaxRank)
            return api->CreateStatus(ORT_INVALID_ARGUMENT, ("mtp_trt.cpu: an input of rank " + std::to_string(rank) +
                                                            " (at most " + std::to_string(kMaxRank) + ")").c_str());
        v.shape.n = rank;
        std::copy_n(dims, rank, v.shape.data());
        v.present = true;
        return api->GetTensorMutableData(const_cast<OrtValue*>(value), &v.data);
    }
    OrtTensorTypeAndShapeInfo* info = nullptr;
    MTP_RETURN_IF(api->GetTensorTypeAndShape(value, &info));
    size_t rank = 0;
    OrtStatus* s = api->GetTensorElementType(info, &v.type);
    if (!s) s = api->GetDimensionsCount(info, &rank);
    if (!s && rank > kMaxRank)
        s = api->CreateStatus(ORT_INVALID_ARGUMENT, ("mtp_trt.cpu: an input of rank " + std::to_string(rank) +
                                                     " (at most " + std::to_string(kMaxRank) + ")").c_str());
    if (!s) v.shape.n = rank, s = api->GetDimensions(info, v.shape.data(), rank);
    api->ReleaseTensorTypeAndShapeInfo(info);
    if (s) return s;
    v.present = true;
    return api->GetTensorMutableData(const_cast<OrtValue*>(value), &v.data);
}

// A node's constant inputs (initializers that a run cannot override: the weights), viewed once when its kernel is
// made; the others absent.  An input ONNX Runtime does not report as constant is read on every call.
std::vector<View> constant_inputs(const OrtApi* api, const OrtKernelInfo* info, size_t inputs) {
    std::vector<View> views(inputs);
    for (size_t i = 0; i < inputs; ++i) {
        int constant = 0;
        const OrtValue* value = nullptr;
        if (OrtStatus* s = api->KernelInfoGetConstantInput_tensor(info, i, &constant, &value)) {
            api->ReleaseStatus(s);
            continue;
        }
        if (!constant || !value) continue;
        if (OrtStatus* s = view_of(api, value, views[i])) {
            api->ReleaseStatus(s);
            views[i] = View{};
        }
    }
    return views;
}

// One Compute call: inputs, outputs, errors and the intra-op thread pool.
struct Call {
    const OrtApi* api;
    OrtKernelContext* ctx;
    const char* op;
    double min_work;                    // min_parallel_work() when the kernel was made
    const std::vector<View>& constants;  // constant_inputs() when the kernel was made
    size_t pack_max;                     // pack_max_bytes() when the kernel was made
    size_t threads;                      // the session's intra-op threads (kThreadsKey), 0 where not known

    OrtStatus* error(const std::string& what) const {
        return api->CreateStatus(ORT_INVALID_ARGUMENT, (std::string("mtp_trt.cpu::") + op + ": " + what).c_str());
    }

    OrtStatus* input(size_t i, View& v) const {
        if (i < constants.size() && constants[i].present) {
            v = constants[i];
            return nullptr;
        }
        const OrtValue* value = nullptr;
        MTP_RETURN_IF(api->KernelContext_GetInput(ctx, i, &value));
        return value ? view_of(api, value, v) : nullptr;
    }

    template <class T>
    OrtStatus* output(size_t i, const Dims& shape, T** data) const {
        OrtValue* value = nullptr;
        MTP_RETURN_IF(api->KernelContext_GetOutput(ctx, i, shape.data(), shape.size(), &value));
        return api->GetTensorMutableData(value, reinterpret_cast<void**>(data));
    }

    // f(i) for i < n on ONNX Runtime's intra-op threads (the calling thread takes part) where the call's `work`
    // (its multiply-adds, roughly) is worth splitting; else all on the calling thread.  The items are the same
    // either way, so the results do not depend on the thread count.
    // Whether parallel() runs a call of `work` on the calling thread alone: then a call is best cut in as few
    // items as it can be (each item has a fixed cost), and the items give the same bits however they are cut.
    bool serial(double work) const { return work < min_work; }

    template <class F>
    OrtStatus* parallel(size_t n, F& f, double work) const {
        if (n <= 1 || serial(work)) {
            for (size_t i = 0; i < n; ++i) f(i);
            return nullptr;
        }
        return api->KernelContext_ParallelFor(
            ctx, [](void* fn, size_t i) { (*static_cast<F*>(fn))(i); }, n, 0, &f);
    }
};

// Reusable per-thread scratch (no allocation once the largest step has run).
float* scratch(size_t n) {
    thread_local std::vector<float> buf;
    if (buf.size() < n) buf.resize(n);
    return buf.data();
}

OrtStatus* attr_int(const OrtApi* api, const OrtKernelInfo* info, const char* name, int64_t* out) {
    return api->KernelInfoGetAttribute_int64(info, name, out);
}
OrtStatus* attr_float(const OrtApi* api, const OrtKernelInfo* info, const char* name, float* out) {
    return api->KernelInfoGetAttribute_float(info, name, out);
}

// Work items of `rows` weight rows: at most `max_items`, each a multiple of `align` rows.
size_t chunk_rows(size_t rows, size_t min_rows, size_t max_items, size_t align) {
    size_t items = std::max<size_t>(1, std::min(max_items, rows / std::max<size_t>(min_rows, 1)));
    size_t per = (rows + items - 1) / items;
    return (per + align - 1) / align * align;
}

OrtStatus* need_float(const Call& c, const View& v, const char* name, size_t rank) {
    if (v.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
        return c.error(std::string(name) + " must be float32");
    if (rank && v.shape.size() != rank)
        return c.error(std::string(name) + " must have rank " + std::to_string(rank) + ", got " + v.str());
    return nullptr;
}

// ----------------------------------------------------------------------------- quantized weights
// A quantized weight's two inputs (mtp_trt/quant.py): data uint8 `want` = [lead..., blocks, blob] and scales
// float32 [lead..., blocks]; `form` names the dimensions in the error.
OrtStatus* check_q(const Call& c, const View& q, const View& s, const char* name, const char* sname, const Dims& want,
                   const char* form) {
    View expect;
    expect.shape = want;
    if (q.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 || q.shape != want)
        return c.error(std::string(name) + " " + q.str() + " must be uint8 " + form + " = " + expect.str());
    expect.shape.pop_back();
    if ((s.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 && s.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) ||
        s.shape != expect.shape)
        return c.error(std::string(sname) + " " + s.str() + " must be float16 (or float32) " + expect.str() + " (as " +
                       name + " " + q.str() + " without its last dimension)");
    return nullptr;
}

// &scales[i] of a checked scales input (float16 or float32) and whether they are float16.
const void* scales_at(const View& s, size_t i) {
    return static_cast<const uint8_t*>(s.data) + i * (s.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ? 2 : 4);
}
bool half(const View& s) { return s.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16; }

// The quantization attributes: bits and block_size (QMatMul, QMoE).
OrtStatus* quant_attrs(const OrtApi* api, const OrtKernelInfo* info, const char* op, int64_t* bits, int64_t* block) {
    MTP_RETURN_IF(attr_int(api, info, "bits", bits));
    MTP_RETURN_IF(attr_int(api, info, "block_size", block));
    if ((*bits != 4 && *bits != 8) || *block < 16 || *block > 256 || (*block & (*block - 1))) {
        const std::string what = std::string("mtp_trt.cpu::") + op + ": bits " + std::to_string(*bits) +
                                 ", block_size " + std::to_string(*block) +
                                 ": expected bits 4 or 8 and block_size 16, 32, 64, 128 or 256";
        return api->CreateStatus(ORT_INVALID_ARGUMENT, what.c_str());
    }
    return nullptr;
}

// x rows quantized for w's format into qx (m * qrow_bytes(w) bytes), in parallel where there are many.
OrtStatus* quantize_parallel(const Call& c, const float* x, size_t m, size_t ldx, const QWeights& w, uint8_t* qx) {
    constexpr size_t per = 8;
    if (m < 2 * per) return quantize_rows(x, m, ldx, w, qx), nullptr;
    const size_t bytes = qrow_bytes(w);
    auto part = [&](size_t i) {
        const size_t r0 = i * per, rows = std::min(per, m - r0);
        quantize_rows(x + r0 * ldx, rows, ldx, w, qx + r0 * bytes);
    };
    return c.parallel((m + per - 1) / per, part, double(m) * double(ldx));
}

// The packed copies (qpack) of constant quantized weights: one per weight memory (data, scales, format), shared
// by every kernel of the process that reads that memory -- the sessions of one export, whose weights all point
// into one mapping of weights.bin -- and freed with the last kernel that holds it.
struct PackRegistry {
    using Key = std::tuple<const void*, const void*, size_t, size_t, size_t, int, bool>;
    std::mutex mu;
    std::map<Key, std::weak_ptr<const QPack>> packs;

    static PackRegistry& get() {
        static PackRegistry* r = new PackRegistry;  // (never destroyed: kernels may outlive static destructors)
        return *r;
    }
    std::shared_ptr<const QPack> pack(const QWeights& w, size_t n) {
        const Key key{w.data, w.scales, n, w.k, w.block, w.bits, w.half};
        std::lock_guard<std::mutex> lock(mu);
        if (auto p = packs[key].lock()) return p;
        for (auto it = packs.begin(); it != packs.end();) it = it->second.expired() ? packs.erase(it) : std::next(it);
        auto p = std::make_shared<const QPack>(qpack(w, n));
        packs[key] = p;
        return p;
    }
    size_t bytes() {  // of the live copies
        std::lock_guard<std::mutex> lock(mu);
        size_t total = 0;
        for (const auto& [key, weak] : packs)
            if (auto p = weak.lock()) total += p->bytes.size() + p->scales.size() * sizeof(float);
        return total;
    }
};

// A kernel's packed weights, one slot per (data, scales) input pair: packed on the first call where both inputs
// are constant (initializers no run can override), the CPU has packed kernels and the weight is at most
// qpack_max_bytes(); nullptr otherwise (the kernels then read the weights as stored).
template <size_t N>
struct PackSlots {
    mutable std::once_flag once[N];
    mutable std::shared_ptr<const QPack> pack[N];

    // slot i for the weight at input `data` (its scales at data + 1); whether a weight is packed depends on its
    // size and the session's limit alone, so every kernel of a session (of an OrtBackend) reads it the same way
    const QPack* get(const Call& c, size_t i, size_t data, const QWeights& w, size_t n) const {
        if (n * w.row_bytes() > c.pack_max || data + 1 >= c.constants.size() || !c.constants[data].present ||
            !c.constants[data + 1].present)
            return nullptr;
        std::call_once(once[i], [&] { pack[i] = PackRegistry::get().pack(w, n); });
        return pack[i].get();
    }
};

// ------------------------------------------------------------------------------------------ QMatMul
struct QMatMulKernel {
    int64_t k = 0, n = 0, bits = 0, block = 0;
    PackSlots<1> packed;

    QMatMulKernel(const OrtApi* api, const OrtKernelInfo* info, OrtStatus** status) {
        OrtStatus* s = attr_int(api, info, "K", &k);
        if (!s) s = attr_int(api, info, "N", &n);
        if (!s) s = quant_attrs(api, info, "QMatMul", &bits, &block);
        if (!s && (k < 1 || n < 1))
            s = api->CreateStatus(ORT_INVALID_ARGUMENT, ("mtp_trt.cpu::QMatMul: K " + std::to_string(k) + ", N " +
                                                         std::to_string(n) + ": both must be >= 1").c_str());
        *status = s;
    }

    OrtStatus* compute(const Call& c) const {
        View x, w, s;
        MTP_RETURN_IF(c.input(0, x));
        MTP_RETURN_IF(c.input(1, w));
        MTP_RETURN_IF(c.input(2, s));
        MTP_RETURN_IF(need_float(c, x, "x", 0));
        if (x.shape.empty() || x.dim(-1) != k)
            return c.error("x " + x.str() + " must be [..., K] with K = " + std::to_string(k));
        const QWeights fmt{nullptr, nullptr, size_t(k), size_t(block), int(bits)};
        MTP_RETURN_IF(check_q(c, w, s, "w", "scales", {n, int64_t(fmt.blocks()), block * bits / 8},
                              "[N, ceil(K / block_size), block_size * bits / 8]"));
        Dims shape = x.shape;
        shape.back() = n;
        float* y = nullptr;
        MTP_RETURN_IF(c.output(0, shape, &y));
        const size_t m = size_t(x.size() / k), rows = size_t(n);
        if (!m) return nullptr;
        const QWeights q{static_cast<const uint8_t*>(w.data), s.data, fmt.k, fmt.block, fmt.bits, half(s)};
        uint8_t* qx = reinterpret_cast<uint8_t*>(scratch((m * qrow_bytes(q) + 3) / 4));  // (this thread's)
        MTP_RETURN_IF(quantize_parallel(c, x.f(), m, size_t(k), q, qx));
        const double work = double(m) * double(rows) * double(k);
        const QPack* p = packed.get(c, 0, 1, q, rows);
        // (the kernels' tile rows: 4, or a packed group's)
        const size_t per = c.serial(work) ? rows : chunk_rows(rows, 16, 16, p ? p->group_rows() : 4);
        auto part = [&](size_t i) {
            const size_t j0 = i * per, j1 = std::min(rows, j0 + per);
            if (p) return qrows_dot_packed(qx, m, *p, j0, j1 - j0, y + j0, rows);
            qrows_dot(qx, m, q.from_row(j0), j1 - j0, y + j0, rows);
        };
        return c.parallel((rows + per - 1) / per, part, work);
    }
};

// ----------------------------------------------------------------------------- SwiGLU experts (MoE)
// One weight matrix [N, K] of an expert: fp32 rows (MoE), or quantized blocks and their scales (QMoE).
struct Weight {
    const float* f = nullptr;
    const uint8_t* q = nullptr;
    const void* s = nullptr;  // scales: float16 where `half`, else float32
    bool half = false;
    const QPack* pack = nullptr;  // q and s packed (where they are), this matrix from its row `pack_row`
    size_t pack_row = 0;
};

// The products of one MoE's experts: fp32 rows (bits 0), or int8 activations (quantize_rows' layout, `row_bytes`
// per row) against quantized weights.
struct Matvec {
    int bits = 0;
    size_t block = 0;

    QWeights format(const Weight& w, size_t k, size_t row0) const {
        return QWeights{w.q, w.s, k, block, bits, w.half}.from_row(row0);
    }
    size_t row_bytes(size_t k) const { return bits ? qrow_bytes(format({}, k, 0)) : k * sizeof(float); }
    // out [m, rows] = the activation rows xp [m, k] against rows [row0, row0 + rows) of w
    void dot(const uint8_t* xp, size_t m, size_t k, const Weight& w, size_t row0, size_t rows, float* out) const {
        if (w.pack) return qrows_dot_packed(xp, m, *w.pack, w.pack_row + row0, rows, out, rows);
        if (bits) return qrows_dot(xp, m, format(w, k, row0), rows, out, rows);
        rows_dot(reinterpret_cast<const float*>(xp), m, k, w.f + row0 * k, k, rows, k, out, rows);
    }
};

// One expert's work in a call: its tokens (rows of x), their gates, and its weights.
struct Expert {
    Weight fc1;    // [2I, D]
    Weight fc2;    // [D, I]
    size_t units;  // I
    std::vector<int32_t> tokens;
    std::vector<float> gates;
    uint8_t* xs = nullptr;   // the tokens' rows of x, contiguous [M, D] (quantized: M rows of Matvec::row_bytes)
    float* act = nullptr;    // SwiGLU activations [M, I]
    uint8_t* as = nullptr;   // the activations as fc2 takes them (fp32: act itself)
};

// y [N, D] = sum over experts of gate * down(silu(gate_rows x) * up_rows x), in two parallel passes:
// (1) every expert's fc1 rows in chunks (gate/up pairs kept together) -> activations, (2) the output
// columns in chunks, each over every expert's fc2 rows of those columns (threads write disjoint columns).
// Quantized experts quantize x once for all of them, and each expert's activations between the passes.
// `up` is fc1's format, `down` fc2's (a dense MLP's down-projection may keep more bits than its up-projection).
OrtStatus* run_experts(const Call& c, const Matvec& up_mv, const Matvec& down_mv, std::vector<Expert>& experts,
                       const float* x, size_t n_tokens, size_t d, float* y) {
    const size_t xb = up_mv.row_bytes(d);
    std::vector<uint8_t> xall;
    const uint8_t* xp = reinterpret_cast<const uint8_t*>(x);
    if (up_mv.bits) {
        xall.resize(n_tokens * xb);
        MTP_RETURN_IF(quantize_parallel(c, x, n_tokens, d, up_mv.format({}, d, 0), xall.data()));
        xp = xall.data();
    }
    size_t bytes = 0, floats = 0;  // per call: small (tokens x (D + I) per selected expert)
    for (const Expert& e : experts) {
        bytes += e.tokens.size() * (xb + (down_mv.bits ? down_mv.row_bytes(e.units) : 0));
        floats += e.tokens.size() * e.units;
    }
    const double macs_per_d = double(floats);  // the products' multiply-adds: 2 x this x D up, this x D down
    std::vector<uint8_t> buf(bytes);
    std::vector<float> acts(floats);
    uint8_t* p = buf.data();
    float* pa = acts.data();
    for (Expert& e : experts) {
        const size_t m = e.tokens.size();
        e.xs = p, p += m * xb;
        e.act = pa, pa += m * e.units;
        e.as = down_mv.bits ? p : reinterpret_cast<uint8_t*>(e.act);
        p += down_mv.bits ? m * down_mv.row_bytes(e.units) : 0;
        for (size_t r = 0; r < m; ++r) std::memcpy(e.xs + r * xb, xp + size_t(e.tokens[r]) * xb, xb);
    }
    struct Item {
        Expert* e;
        size_t u0, u1;  // units
    };
    std::vector<Item> items;
    const bool serial_up = c.serial(2 * double(d) * macs_per_d), serial_down = c.serial(double(d) * macs_per_d);
    for (Expert& e : experts) {
        const size_t per = serial_up ? e.units : chunk_rows(e.units, 16, 8, 32);  // (32 units: a packed group's rows)
        for (size_t u = 0; u < e.units; u += per) items.push_back({&e, u, std::min(e.units, u + per)});
    }
    auto up = [&](size_t i) {
        const Item& it = items[i];
        const Expert& e = *it.e;
        const size_t m = e.tokens.size(), rows = 2 * (it.u1 - it.u0);
        float* h = scratch(m * rows);
        up_mv.dot(e.xs, m, d, e.fc1, 2 * it.u0, rows, h);
        swiglu_pairs(h, m, rows, it.u1 - it.u0, e.act + it.u0, e.units);
    };
    MTP_RETURN_IF(c.parallel(items.size(), up, 2 * double(d) * macs_per_d));
    if (down_mv.bits) {
        auto quantize = [&](size_t i) {
            const Expert& e = experts[i];
            quantize_rows(e.act, e.tokens.size(), e.units, down_mv.format({}, e.units, 0), e.as);
        };
        MTP_RETURN_IF(c.parallel(experts.size(), quantize, macs_per_d));
    }
    std::fill(y, y + n_tokens * d, 0.f);
    const size_t per = serial_down ? d : chunk_rows(d, 32, 16, 64);  // (64: a packed group's rows)
    auto down = [&](size_t item) {
        const size_t d0 = item * per, d1 = std::min(d, d0 + per), cols = d1 - d0;
        for (const Expert& e : experts) {
            const size_t m = e.tokens.size();
            float* out = scratch(m * cols);
            down_mv.dot(e.as, m, e.units, e.fc2, d0, cols, out);
            for (size_t r = 0; r < m; ++r) {
                float* yr = y + size_t(e.tokens[r]) * d + d0;
                const float g = e.gates[r];
                for (size_t j = 0; j < cols; ++j) yr[j] += g * out[r * cols + j];
            }
        }
    };
    return c.parallel((d + per - 1) / per, down, double(d) * macs_per_d);
}

Expert all_tokens(Weight fc1, Weight fc2, size_t units, size_t n_tokens) {
    Expert e{fc1, fc2, units, {}, {}};
    for (size_t t = 0; t < n_tokens; ++t) e.tokens.push_back(int32_t(t)), e.gates.push_back(1.f);
    return e;
}

OrtStatus* check_mlp(const Call& c, const View& fc1, const View& fc2, int64_t d, const char* n1, const char* n2) {
    MTP_RETURN_IF(need_float(c, fc1, n1, 2));
    MTP_RETURN_IF(need_float(c, fc2, n2, 2));
    if (fc1.dim(1) != d || fc1.dim(0) % 2 || fc2.dim(0) != d || fc2.dim(1) * 2 != fc1.dim(0))
        return c.error(std::string(n1) + " " + fc1.str() + " and " + n2 + " " + fc2.str() +
                       " must be [2I, D] and [D, I] with D = " + std::to_string(d));
    return nullptr;
}

// ---------------------------------------------------------------------------------- MoE, QMoE
// The router's attributes and the routing: x's tokens -> the selected experts, each with its tokens and gates.
struct Router {
    int64_t top_k = 0, n_group = 1, topk_group = 1, softmax = 0, group_top2 = 0, norm_topk_prob = 1;
    float scaling = 1.f;

    Router(const OrtApi* api, const OrtKernelInfo* info, OrtStatus** status) {
        OrtStatus* s = attr_int(api, info, "top_k", &top_k);
        if (!s) s = attr_int(api, info, "n_group", &n_group);
        if (!s) s = attr_int(api, info, "topk_group", &topk_group);
        if (!s) s = attr_int(api, info, "softmax", &softmax);
        if (!s) s = attr_int(api, info, "group_top2", &group_top2);
        if (!s) s = attr_int(api, info, "norm_topk_prob", &norm_topk_prob);
        if (!s) s = attr_float(api, info, "routed_scaling_factor", &scaling);
        *status = s;
    }

    // x [..., D] and the router's inputs; d: D.
    OrtStatus* check(const Call& c, const View& x, const View& gate, const View& bias, int64_t* d) const {
        MTP_RETURN_IF(need_float(c, x, "x", 0));
        *d = x.shape.empty() ? -1 : x.dim(-1);
        if (*d < 1) return c.error("x " + x.str() + " must be [..., D] with D >= 1");
        if (!gate.present) return nullptr;  // no routed experts (a dense MLP): checked by the caller
        MTP_RETURN_IF(need_float(c, gate, "gate", 2));
        const int64_t n_exp = gate.dim(0);
        if (gate.dim(1) != *d) return c.error("gate " + gate.str() + " must be [E, D] with D = " + std::to_string(*d));
        if (bias.present && (bias.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || bias.size() != n_exp))
            return c.error("bias " + bias.str() + " must be float32 [E]");
        if (top_k < 1 || top_k > n_exp || n_group < 1 || n_exp % n_group || topk_group < 1 || topk_group > n_group ||
            n_group > 64 || top_k > n_exp / n_group * topk_group)
            return c.error("top_k " + std::to_string(top_k) + ", n_group " + std::to_string(n_group) +
                           ", topk_group " + std::to_string(topk_group) + " do not fit " + std::to_string(n_exp) +
                           " experts");
        return nullptr;
    }

    // The selected experts in order of first use; weights(e) gives expert e's (fc1, fc2).
    template <class W>
    std::vector<Expert> route(const View& x, const View& gate, const View& bias, size_t units, W weights) const {
        const size_t d = size_t(x.dim(-1)), n = size_t(x.size()) / d, e_count = size_t(gate.dim(0)), k = size_t(top_k);
        std::vector<float> logits(n * e_count), work(2 * e_count + size_t(n_group)), gates(n * k);
        std::vector<int32_t> idx(n * k);
        rows_dot(x.f(), n, d, gate.f(), d, e_count, d, logits.data(), e_count);
        for (size_t t = 0; t < n; ++t)
            route_token(logits.data() + t * e_count, e_count, softmax != 0, bias.present ? bias.f() : nullptr,
                        size_t(n_group), size_t(topk_group), group_top2 != 0, k, norm_topk_prob != 0, scaling,
                        work.data(), idx.data() + t * k, gates.data() + t * k);
        std::vector<int32_t> slot(e_count, -1);  // expert -> its entry in `experts`
        std::vector<Expert> experts;
        experts.reserve(e_count + 1);
        for (size_t t = 0; t < n; ++t)
            for (size_t r = 0; r < k; ++r) {
                const int32_t e = idx[t * k + r];
                if (slot[e] < 0) {
                    slot[e] = int32_t(experts.size());
                    const auto [fc1, fc2] = weights(size_t(e));
                    experts.push_back({fc1, fc2, units, {}, {}});
                }
                experts[slot[e]].tokens.push_back(int32_t(t));
                experts[slot[e]].gates.push_back(gates[t * k + r]);
            }
        return experts;
    }
};

// Routed experts: the gate and every routed weight input, or none of them (a dense MLP: the shared experts alone,
// which are then required).
OrtStatus* routed_present(const Call& c, const View& gate, std::initializer_list<const View*> routed,
                          const View& shared) {
    for (const View* v : routed)
        if (v->present != gate.present)
            return c.error("gate and the routed experts' weights come together (all, or none for a dense MLP)");
    if (!gate.present && !shared.present) return c.error("without routed experts the shared ones are required");
    return nullptr;
}

struct MoEKernel : Router {
    using Router::Router;

    OrtStatus* compute(const Call& c) const {
        View x, gate, bias, fc1, fc2, sfc1, sfc2;
        View* in[] = {&x, &gate, &bias, &fc1, &fc2, &sfc1, &sfc2};
        for (size_t i = 0; i < 7; ++i) MTP_RETURN_IF(c.input(i, *in[i]));
        int64_t d = 0;
        MTP_RETURN_IF(check(c, x, gate, bias, &d));
        MTP_RETURN_IF(routed_present(c, gate, {&fc1, &fc2}, sfc1));
        if (gate.present) {
            MTP_RETURN_IF(need_float(c, fc1, "fc1", 3));
            MTP_RETURN_IF(need_float(c, fc2, "fc2", 3));
            const int64_t n_exp = gate.dim(0);
            if (fc1.dim(0) != n_exp || fc2.dim(0) != n_exp || fc1.dim(2) != d || fc2.dim(1) != d ||
                fc1.dim(1) != 2 * fc2.dim(2))
                return c.error("fc1 " + fc1.str() + " and fc2 " + fc2.str() + " must be [E, 2I, D] and [E, D, I], E = " +
                               std::to_string(n_exp) + ", D = " + std::to_string(d));
        }
        if (sfc1.present != sfc2.present) return c.error("shared_fc1 and shared_fc2 come together");
        if (sfc1.present) MTP_RETURN_IF(check_mlp(c, sfc1, sfc2, d, "shared_fc1", "shared_fc2"));
        float* y = nullptr;
        MTP_RETURN_IF(c.output(0, x.shape, &y));
        const size_t n = size_t(x.size() / d);
        std::vector<Expert> experts;
        if (gate.present) {
            const size_t units = size_t(fc2.dim(2)), ud = units * size_t(d);
            experts = route(x, gate, bias, units, [&](size_t e) {
                return std::pair<Weight, Weight>{{fc1.f() + e * 2 * ud}, {fc2.f() + e * ud}};
            });
        }
        if (sfc1.present) experts.push_back(all_tokens({sfc1.f()}, {sfc2.f()}, size_t(sfc2.dim(1)), n));
        return run_experts(c, Matvec{}, Matvec{}, experts, x.f(), n, size_t(d), y);
    }
};

// MoE with quantized expert weights: inputs x, gate?, bias?, fc1?, fc1_scales?, fc2?, fc2_scales?, shared_fc1?,
// shared_fc1_scales?, shared_fc2?, shared_fc2_scales?.  Attribute down_bits (optional, default bits): the fc2
// matrices' bits (a dense MLP's down-projection may keep 8 bits under 4-bit weights).
struct QMoEKernel : Router {
    int64_t bits = 0, block = 0, down_bits = 0;
    PackSlots<4> packed;  // fc1, fc2, shared_fc1, shared_fc2

    QMoEKernel(const OrtApi* api, const OrtKernelInfo* info, OrtStatus** status) : Router(api, info, status) {
        if (!*status) *status = quant_attrs(api, info, "QMoE", &bits, &block);
        if (*status) return;
        if (OrtStatus* absent = attr_int(api, info, "down_bits", &down_bits)) {
            api->ReleaseStatus(absent);
            down_bits = bits;
        }
        if (down_bits != 4 && down_bits != 8)
            *status = api->CreateStatus(ORT_INVALID_ARGUMENT, ("mtp_trt.cpu::QMoE: down_bits " +
                                                               std::to_string(down_bits) + ": expected 4 or 8").c_str());
    }

    OrtStatus* compute(const Call& c) const {
        View x, gate, bias, fc1, fc1s, fc2, fc2s, sfc1, sfc1s, sfc2, sfc2s;
        View* in[] = {&x, &gate, &bias, &fc1, &fc1s, &fc2, &fc2s, &sfc1, &sfc1s, &sfc2, &sfc2s};
        for (size_t i = 0; i < 11; ++i) MTP_RETURN_IF(c.input(i, *in[i]));
        int64_t d = 0;
        MTP_RETURN_IF(check(c, x, gate, bias, &d));
        MTP_RETURN_IF(routed_present(c, gate, {&fc1, &fc1s, &fc2, &fc2s}, sfc1));
        const int64_t n_exp = gate.present ? gate.dim(0) : 0, blob = block * bits / 8, blob2 = block * down_bits / 8;
        auto blocks = [&](int64_t k) { return (k + block - 1) / block; };
        const int64_t i2 = fc1.shape.size() == 4 ? fc1.dim(1) : -1;
        if (gate.present) {
            if (i2 < 2 || i2 % 2)
                return c.error("fc1 " + fc1.str() + " must be uint8 [E, 2I, ceil(D / block_size), block_size * bits / 8]");
            MTP_RETURN_IF(check_q(c, fc1, fc1s, "fc1", "fc1_scales", {n_exp, i2, blocks(d), blob},
                                  "[E, 2I, ceil(D / block_size), block_size * bits / 8]"));
            MTP_RETURN_IF(check_q(c, fc2, fc2s, "fc2", "fc2_scales", {n_exp, d, blocks(i2 / 2), blob2},
                                  "[E, D, ceil(I / block_size), block_size * down_bits / 8] (2I = fc1's dim 1)"));
        }
        const View* shared[] = {&sfc1, &sfc1s, &sfc2, &sfc2s};
        const int present = int(std::count_if(shared, shared + 4, [](const View* v) { return v->present; }));
        if (present % 4)
            return c.error("shared_fc1, shared_fc1_scales, shared_fc2 and shared_fc2_scales come together");
        const int64_t s2 = present && sfc1.shape.size() == 3 ? sfc1.dim(0) : -1;
        if (present) {
            if (s2 < 2 || s2 % 2)
                return c.error("shared_fc1 " + sfc1.str() +
                               " must be uint8 [2Is, ceil(D / block_size), block_size * bits / 8]");
            MTP_RETURN_IF(check_q(c, sfc1, sfc1s, "shared_fc1", "shared_fc1_scales", {s2, blocks(d), blob},
                                  "[2Is, ceil(D / block_size), block_size * bits / 8]"));
            MTP_RETURN_IF(check_q(c, sfc2, sfc2s, "shared_fc2", "shared_fc2_scales", {d, blocks(s2 / 2), blob2},
                                  "[D, ceil(Is / block_size), block_size * down_bits / 8] (2Is = shared_fc1's dim 0)"));
        }
        float* y = nullptr;
        MTP_RETURN_IF(c.output(0, x.shape, &y));
        const size_t n = size_t(x.size() / d);
        auto q = [](const View& v) { return static_cast<const uint8_t*>(v.data); };
        // a weight input pair as QWeights (every expert's rows one after another) and its packed copy
        auto weight = [&](size_t slot, size_t in, const View& w, const View& sc, int64_t k, int64_t b, size_t rows) {
            const QWeights qw{q(w), sc.data, size_t(k), size_t(block), int(b), half(sc)};
            return Weight{nullptr, qw.data, qw.scales, qw.half, packed.get(c, slot, in, qw, rows)};
        };
        std::vector<Expert> experts;
        if (gate.present) {
            const size_t units = size_t(i2 / 2), b1 = size_t(blocks(d)), b2 = size_t(blocks(i2 / 2));
            const size_t rows1 = size_t(i2), rows2 = size_t(d);
            const Weight all1 = weight(0, 3, fc1, fc1s, d, bits, size_t(n_exp) * rows1);
            const Weight all2 = weight(1, 5, fc2, fc2s, i2 / 2, down_bits, size_t(n_exp) * rows2);
            experts = route(x, gate, bias, units, [&](size_t e) {
                return std::pair<Weight, Weight>{
                    {nullptr, q(fc1) + e * rows1 * b1 * size_t(blob), scales_at(fc1s, e * rows1 * b1), half(fc1s),
                     all1.pack, e * rows1},
                    {nullptr, q(fc2) + e * rows2 * b2 * size_t(blob2), scales_at(fc2s, e * rows2 * b2), half(fc2s),
                     all2.pack, e * rows2}};
            });
        }
        if (present)
            experts.push_back(all_tokens(weight(2, 7, sfc1, sfc1s, d, bits, size_t(s2)),
                                         weight(3, 9, sfc2, sfc2s, s2 / 2, down_bits, size_t(d)), size_t(s2 / 2), n));
        return run_experts(c, Matvec{int(bits), size_t(block)}, Matvec{int(down_bits), size_t(block)}, experts, x.f(),
                           n, size_t(d), y);
    }
};

// ---------------------------------------------------------------------------------- MlaAttention
// What MlaAttention and LightningIndexer share: the rows (`cache` [B, T, C], `rows` [B, R, C]), the valid cache
// rows per sequence and which of `rows` each query token sees.
struct Rows {
    View rows, cache, valid, vis;
    int64_t b = 0, s_len = 0, t_len = 0, r_len = 0, c = 0;

    // inputs at `first` (rows), first + 1 (cache), first + 2 (past_len), first + 3 (visible?), for B x S query
    // tokens whose rows have at least `need` values.
    OrtStatus* read(const Call& call, size_t first, int64_t b_, int64_t s_, int64_t need, const std::string& want) {
        b = b_, s_len = s_;
        MTP_RETURN_IF(call.input(first, rows));
        MTP_RETURN_IF(call.input(first + 1, cache));
        MTP_RETURN_IF(call.input(first + 2, valid));
        MTP_RETURN_IF(call.input(first + 3, vis));
        MTP_RETURN_IF(need_float(call, rows, "rows", 3));
        MTP_RETURN_IF(need_float(call, cache, "cache", 3));
        t_len = cache.dim(1), r_len = rows.dim(1), c = cache.dim(2);
        if (cache.dim(0) != b || rows.dim(0) != b || rows.dim(2) != c || c < need)
            return call.error("rows " + rows.str() + " and cache " + cache.str() + " must be [B, R, C] and [B, T, C] " +
                              want);
        if (valid.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 || valid.size() != b)
            return call.error("past_len " + valid.str() + " must be int32 [B]");
        if (r_len < s_len) return call.error("rows " + rows.str() + " has fewer rows than the " + std::to_string(s_len) +
                                             " query tokens");
        if (vis.present && (vis.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL || vis.shape.size() != 3 ||
                            (vis.dim(0) != b && vis.dim(0) != 1) || vis.dim(1) != s_len || vis.dim(2) != r_len))
            return call.error("visible " + vis.str() + " must be bool [B or 1, S, R] = [" + std::to_string(b) + ", " +
                              std::to_string(s_len) + ", " + std::to_string(r_len) + "]");
        return nullptr;
    }

    size_t cached(size_t bi) const {
        return size_t(std::clamp<int64_t>(static_cast<const int32_t*>(valid.data)[bi], 0, t_len));
    }
    const float* cache_of(size_t bi) const { return cache.f() + bi * size_t(t_len * c); }
    const float* rows_of(size_t bi) const { return rows.f() + bi * size_t(r_len * c); }
    // which of `rows` query token (bi, si) sees: the mask's row, or causal into `buf` (the last S rows are the
    // tokens' own, any rows before them all seen)
    const uint8_t* seen(size_t bi, size_t si, uint8_t* buf) const {
        if (vis.present)
            return static_cast<const uint8_t*>(vis.data) + ((vis.dim(0) == 1 ? 0 : bi) * s_len + si) * r_len;
        for (int64_t r = 0; r < r_len; ++r) buf[r] = r <= int64_t(si) + r_len - s_len;
        return buf;
    }
};

// The attention's work items: one per query token, its heads split further where there are few tokens (decode) and
// more than one thread, into groups of at least two heads (the score and value products take up to four heads per
// pass over the rows; on one thread every head of a token in one item, so that each pass over the rows serves them
// all).  A head's values do not depend on the heads beside it in an item.
size_t head_splits(const Call& c, size_t tokens, size_t heads) {
    if (c.threads == 1) return 1;
    return tokens >= 4 ? 1 : std::min<size_t>(std::max<size_t>(heads / 2, 1), (4 + tokens - 1) / tokens);
}

// Reusable per-thread table of row pointers (DeepSeek Sparse Attention's selected rows).
const float** row_table(size_t n) {
    thread_local std::vector<const float*> buf;
    if (buf.size() < n) buf.resize(n);
    return buf.data();
}

struct MlaAttentionKernel {
    int64_t heads = 0;
    float scale = 1.f;

    MlaAttentionKernel(const OrtApi* api, const OrtKernelInfo* info, OrtStatus** status) {
        OrtStatus* s = attr_int(api, info, "heads", &heads);
        if (!s) s = attr_float(api, info, "scale", &scale);
        if (!s && heads < 1) s = api->CreateStatus(ORT_INVALID_ARGUMENT, "mtp_trt.cpu::MlaAttention: heads < 1");
        *status = s;
    }

    OrtStatus* compute(const Call& c) const {
        View q_lat, q_pe, sel;
        Rows in;
        MTP_RETURN_IF(c.input(0, q_lat));
        MTP_RETURN_IF(c.input(1, q_pe));
        MTP_RETURN_IF(c.input(6, sel));
        MTP_RETURN_IF(need_float(c, q_lat, "q_lat", 3));
        MTP_RETURN_IF(need_float(c, q_pe, "q_pe", 3));
        const int64_t b = q_lat.dim(0), s_len = q_lat.dim(1), h = heads, dl = q_lat.dim(2) / h,
                      dr = q_pe.dim(2) / h, ch = dl + dr;
        if (q_lat.dim(2) != dl * h || q_pe.dim(2) != dr * h || q_pe.dim(0) != b || q_pe.dim(1) != s_len || dl < 1)
            return c.error("q_lat " + q_lat.str() + " and q_pe " + q_pe.str() + " must be [B, S, H*Dl] and [B, S, H*Dr] "
                           "with H = " + std::to_string(h));
        MTP_RETURN_IF(in.read(c, 2, b, s_len, ch, "with C >= Dl + Dr = " + std::to_string(ch) + " (q_lat " +
                                                      q_lat.str() + ", q_pe " + q_pe.str() + ")"));
        const int64_t k_sel = sel.present && sel.shape.size() == 3 ? sel.dim(2) : 0;
        if (sel.present) MTP_RETURN_IF(check_selected(c, sel, in));
        float* out = nullptr;
        MTP_RETURN_IF(c.output(0, {b, s_len, h * dl}, &out));
        const size_t tokens = size_t(b * s_len), n_ch = size_t(ch), ld = size_t(in.c);
        double macs = 0;  // per head and key: its score over C values and its share of the Dl outputs
        for (size_t tok = 0; tok < tokens; ++tok)
            macs += double(sel.present ? size_t(k_sel) : in.cached(tok / s_len) + size_t(in.r_len)) * double(h * (ch + dl));
        const size_t splits = c.serial(macs) ? 1 : head_splits(c, tokens, size_t(h));
        const size_t per = (size_t(h) + splits - 1) / splits;
        auto work = [&](size_t item) {
            const size_t tok = item / splits, h0 = (item % splits) * per, h1 = std::min(size_t(h), h0 + per);
            if (h0 >= h1) return;
            const size_t bi = tok / s_len, si = tok % s_len, nh = h1 - h0;
            const size_t keys = sel.present ? size_t(k_sel) : in.cached(bi) + size_t(in.r_len);
            const size_t stride = mla_scores_stride(keys);
            float* q = scratch(nh * n_ch + nh * stride + size_t(in.r_len));
            float* sc = q + nh * n_ch;
            for (size_t hh = 0; hh < nh; ++hh) {  // this token's queries [nh, Dl+Dr]
                std::memcpy(q + hh * n_ch, q_lat.f() + (tok * h + h0 + hh) * dl, dl * sizeof(float));
                std::memcpy(q + hh * n_ch + dl, q_pe.f() + (tok * h + h0 + hh) * dr, dr * sizeof(float));
            }
            float* o = out + (tok * h + h0) * dl;
            if (!sel.present) {
                const uint8_t* visible = in.seen(bi, si, reinterpret_cast<uint8_t*>(sc + nh * stride));
                return mla_attend_token(q, nh, n_ch, size_t(dl), scale, in.cache_of(bi), in.cached(bi), in.rows_of(bi),
                                        size_t(in.r_len), ld, visible, sc, o, size_t(dl));
            }
            const int32_t* picked = static_cast<const int32_t*>(sel.data) + tok * size_t(k_sel);
            const float** table = row_table(size_t(k_sel));
            size_t n = 0;
            for (int64_t r = 0; r < k_sel; ++r) {
                const int64_t i = picked[r];
                if (i >= 0) table[n++] = i < in.t_len ? in.cache_of(bi) + i * ld : in.rows_of(bi) + (i - in.t_len) * ld;
            }
            mla_attend_rows(q, nh, n_ch, size_t(dl), scale, table, n, sc, o, size_t(dl));
        };
        return c.parallel(tokens * splits, work, macs);
    }

    // selected: int32 [B, S, K] of indices into the T cache rows then the R rows, or -1 (none).
    static OrtStatus* check_selected(const Call& c, const View& sel, const Rows& in) {
        if (sel.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 || sel.shape.size() != 3 || sel.dim(0) != in.b ||
            sel.dim(1) != in.s_len)
            return c.error("selected " + sel.str() + " must be int32 [B, S, K] with B = " + std::to_string(in.b) +
                           ", S = " + std::to_string(in.s_len));
        const int32_t* p = static_cast<const int32_t*>(sel.data);
        for (int64_t i = 0; i < sel.size(); ++i)
            if (p[i] < -1 || p[i] >= in.t_len + in.r_len)
                return c.error("selected holds row " + std::to_string(p[i]) + ", outside -1 .. T + R - 1 = " +
                               std::to_string(in.t_len + in.r_len - 1));
        return nullptr;
    }
};

// ------------------------------------------------------------------------------------- MlaSelfAttention
// A per-head product's int8 weights (MlaSelfAttention's w_uk_q, w_uv_q): uint8 [H, N, ceil(K / bs), bs] in
// QMatMul's format at 8 bits, scales [H, N, ceil(K / bs)] -> *w, the H * N rows as one QMatMul weight.
OrtStatus* int8_heads(const Call& c, const View& q, const View& s, const char* name, const char* sname, int64_t h,
                      int64_t n, int64_t k, QWeights* w) {
    const int64_t bs = q.shape.size() == 4 ? q.dim(3) : 0;
    if (k < 1 || n < 1 || bs < 16 || bs > 256 || (bs & (bs - 1)))
        return c.error(std::string(name) + " " + q.str() + " must be uint8 [H, N, ceil(K / block), block] with block "
                       "16, 32, 64, 128 or 256, K = " + std::to_string(k) + ", N = " + std::to_string(n));
    MTP_RETURN_IF(check_q(c, q, s, name, sname, {h, n, (k + bs - 1) / bs, bs}, "[H, N, ceil(K / block), block]"));
    *w = QWeights{static_cast<const uint8_t*>(q.data), s.data, size_t(k), size_t(bs), 8, half(s)};
    return nullptr;
}

// y [n] = the quantized row xq (quantize_rows for w) against rows [j0, j0 + n) of w, packed where p is.
void int8_product(const uint8_t* xq, const QWeights& w, const QPack* p, size_t j0, size_t n, float* y) {
    if (p) return qrows_dot_packed(xq, 1, *p, j0, n, y, n);
    qrows_dot(xq, 1, w.from_row(j0), n, y, n);
}

// MLA from the projections' outputs to W^UV in one node (exporters/ort_ops.py CpuMlaSelfOp): the new latent rows
// (c_kv RMS-normed, k_pe roped at each token's position: output 1, the rows the runtime commits), each head's
// query (q_pe roped; the nope part absorbed through W^UK unless the export folded it into q's projection), MlaAttention's
// attention over the cached rows, the extra rows and the new ones, and W^UV on each head's output (unless folded
// into the output projection).  Everything per query token: a token gets the same bits however many run beside it.
// W^UK and W^UV come in float32 ([H, Dn, Dl], [H, Dv, Dl]: w_uk, w_uv) or quantized to int8 blocks in QMatMul's
// format, each head's matrix in nn.Linear's [out, in] layout (w_uk_q [H, Dl, Dn/bs, bs]: W^UK transposed; w_uv_q
// [H, Dv, Dl/bs, bs]), multiplied as QMatMul multiplies: each head's input rounded to int8 per 8 values.
struct MlaSelfAttentionKernel {
    int64_t heads = 0, interleave = 1;
    float scale = 1.f, eps = 1e-6f;
    PackSlots<2> packed;  // w_uk_q, w_uv_q (where packed)

    MlaSelfAttentionKernel(const OrtApi* api, const OrtKernelInfo* info, OrtStatus** status) {
        OrtStatus* s = attr_int(api, info, "heads", &heads);
        if (!s) s = attr_int(api, info, "interleave", &interleave);
        if (!s) s = attr_float(api, info, "scale", &scale);
        if (!s) s = attr_float(api, info, "eps", &eps);
        if (!s && heads < 1) s = api->CreateStatus(ORT_INVALID_ARGUMENT, "mtp_trt.cpu::MlaSelfAttention: heads < 1");
        *status = s;
    }

    OrtStatus* compute(const Call& c) const {
        View q, kv, norm, pos, cos, sin, cache, valid, extra, vis, w_uk, w_uv, uk_q, uk_s, uv_q, uv_s;
        View* in[] = {&q, &kv, &norm, &pos, &cos, &sin, &cache, &valid, &extra, &vis, &w_uk, &w_uv,
                      &uk_q, &uk_s, &uv_q, &uv_s};
        for (size_t i = 0; i < 16; ++i) MTP_RETURN_IF(c.input(i, *in[i]));
        MTP_RETURN_IF(need_float(c, q, "q", 3));
        MTP_RETURN_IF(need_float(c, kv, "kv", 3));
        MTP_RETURN_IF(need_float(c, norm, "kv_norm", 1));
        MTP_RETURN_IF(need_float(c, cos, "cos", 2));
        MTP_RETURN_IF(need_float(c, sin, "sin", 2));
        MTP_RETURN_IF(need_float(c, cache, "cache", 3));
        const int64_t b = q.dim(0), s_len = q.dim(1), h = heads, dl = norm.dim(0), dr = 2 * cos.dim(1), ch = dl + dr;
        if ((w_uk.present && uk_q.present) || (w_uv.present && uv_q.present) || uk_q.present != uk_s.present ||
            uv_q.present != uv_s.present)
            return c.error("W^UK and W^UV each come once: in float32 (w_uk, w_uv) or as int8 blocks with their scales "
                           "(w_uk_q and w_uk_scales, w_uv_q and w_uv_scales)");
        // q's first part per head (Dn through W^UK, else Dl) and the output per head (Dv through W^UV, else Dl)
        const int64_t dn = w_uk.present ? (w_uk.shape.size() == 3 ? w_uk.dim(1) : -1)
                           : uk_q.present ? (q.dim(2) % h ? -1 : q.dim(2) / h - dr) : dl;
        const int64_t dv = w_uv.present ? (w_uv.shape.size() == 3 ? w_uv.dim(1) : -1)
                           : uv_q.present ? (uv_q.shape.size() == 4 ? uv_q.dim(1) : -1) : dl;
        if (kv.dim(0) != b || kv.dim(1) != s_len || kv.dim(2) != ch || sin.shape != cos.shape || dr < 2)
            return c.error("kv " + kv.str() + ", cos " + cos.str() + " and sin " + sin.str() + " must be [B, S, Dl+Dr], "
                           "[P, Dr/2] and [P, Dr/2] with B = " + std::to_string(b) + ", S = " + std::to_string(s_len) +
                           ", Dl = " + std::to_string(dl) + " (kv_norm)");
        if (dn < 1 || q.dim(2) != h * (dn + dr))
            return c.error("q " + q.str() + " must be [B, S, H*F + H*Dr] with H = " + std::to_string(h) + ", Dr = " +
                           std::to_string(dr) + " and F = Dn of w_uk [H, Dn, Dl], or Dl without it");
        if ((w_uk.present && (w_uk.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || w_uk.dim(0) != h || w_uk.dim(2) != dl)) ||
            (w_uv.present && (w_uv.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || dv < 1 || w_uv.dim(0) != h ||
                              w_uv.dim(2) != dl)))
            return c.error("w_uk " + w_uk.str() + " and w_uv " + w_uv.str() + " must be float32 [H, Dn, Dl] and [H, Dv, Dl]"
                           " with H = " + std::to_string(h) + ", Dl = " + std::to_string(dl));
        QWeights uk{}, uv{};  // each head's W^UK^T [Dl, Dn] and W^UV [Dv, Dl] as int8 blocks, heads one after another
        if (uk_q.present) MTP_RETURN_IF(int8_heads(c, uk_q, uk_s, "w_uk_q", "w_uk_scales", h, dl, dn, &uk));
        if (uv_q.present) MTP_RETURN_IF(int8_heads(c, uv_q, uv_s, "w_uv_q", "w_uv_scales", h, dv, dl, &uv));
        const QPack* uk_pack = uk_q.present ? packed.get(c, 0, 12, uk, size_t(h * dl)) : nullptr;
        const QPack* uv_pack = uv_q.present ? packed.get(c, 1, 14, uv, size_t(h * dv)) : nullptr;
        // each head's input rounded to int8: rows of qrow_bytes() apart, as quantize_rows lays them out
        const size_t uk_row = uk_q.present ? qrow_bytes(uk) : 0, uv_row = uv_q.present ? qrow_bytes(uv) : 0;
        const size_t xq_bytes = std::max(uk_row, uv_row);
        if (pos.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 || pos.shape.size() != 2 || pos.dim(0) != b ||
            pos.dim(1) != s_len)
            return c.error("positions " + pos.str() + " must be int64 [B, S]");
        const int64_t n_pos = cos.dim(0);
        const int64_t* p = static_cast<const int64_t*>(pos.data);
        for (int64_t i = 0; i < b * s_len; ++i)
            if (p[i] < 0 || p[i] >= n_pos)
                return c.error("positions hold " + std::to_string(p[i]) + ", outside the tables' 0 .. " +
                               std::to_string(n_pos - 1));
        if (cache.dim(0) != b || cache.dim(2) != ch)
            return c.error("cache " + cache.str() + " must be [B, T, Dl+Dr] = [" + std::to_string(b) + ", T, " +
                           std::to_string(ch) + "]");
        if (valid.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 || valid.size() != b)
            return c.error("past_len " + valid.str() + " must be int32 [B]");
        const int64_t r_extra = extra.present ? extra.dim(1) : 0, r_len = r_extra + s_len, t_len = cache.dim(1);
        if (extra.present && (extra.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || extra.shape.size() != 3 ||
                              extra.dim(0) != b || extra.dim(2) != ch))
            return c.error("extra " + extra.str() + " must be float32 [B, R, Dl+Dr]");
        if (vis.present && (vis.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL || vis.shape.size() != 3 ||
                            (vis.dim(0) != b && vis.dim(0) != 1) || vis.dim(1) != s_len || vis.dim(2) != r_len))
            return c.error("visible " + vis.str() + " must be bool [B or 1, S, R + S] = [" + std::to_string(b) + ", " +
                           std::to_string(s_len) + ", " + std::to_string(r_len) + "]");
        float *out = nullptr, *rows = nullptr;
        MTP_RETURN_IF(c.output(0, {b, s_len, h * dv}, &out));
        MTP_RETURN_IF(c.output(1, {b, s_len, ch}, &rows));
        const size_t tokens = size_t(b * s_len), half = size_t(dr / 2);
        for (size_t tok = 0; tok < tokens; ++tok) {  // the new rows: normed c_kv, roped k_pe
            float* row = rows + tok * size_t(ch);
            rms_norm_row(kv.f() + tok * size_t(ch), size_t(dl), norm.f(), eps, row);
            std::memcpy(row + dl, kv.f() + tok * size_t(ch) + dl, size_t(dr) * sizeof(float));
            rope_heads(row + dl, 1, 0, size_t(dr), cos.f() + p[tok] * half, sin.f() + p[tok] * half, interleave != 0);
        }
        std::vector<float> joined;  // the extra rows then the new ones, per sequence, where there are extra rows
        const float* all = rows;
        if (r_extra) {
            joined.resize(size_t(b * r_len * ch));
            for (int64_t bi = 0; bi < b; ++bi) {
                float* dst = joined.data() + bi * r_len * ch;
                std::memcpy(dst, extra.f() + bi * r_extra * ch, size_t(r_extra * ch) * sizeof(float));
                std::memcpy(dst + r_extra * ch, rows + bi * s_len * ch, size_t(s_len * ch) * sizeof(float));
            }
            all = joined.data();
        }
        double macs = double(tokens * h) * double((w_uk.present || uk_q.present ? dn * dl : 0) +
                                                  (w_uv.present || uv_q.present ? dv * dl : 0));
        for (size_t tok = 0; tok < tokens; ++tok)  // per head and key: as MlaAttention's
            macs += double(std::clamp<int64_t>(static_cast<const int32_t*>(valid.data)[tok / size_t(s_len)], 0, t_len) +
                           r_len) * double(h * (ch + dl));
        const size_t splits = c.serial(macs) ? 1 : head_splits(c, tokens, size_t(h));
        const size_t per = (size_t(h) + splits - 1) / splits, n_ch = size_t(ch), qw = size_t(h * (dn + dr));
        auto work = [&](size_t item) {
            const size_t tok = item / splits, h0 = (item % splits) * per, h1 = std::min(size_t(h), h0 + per);
            if (h0 >= h1) return;
            const size_t bi = tok / size_t(s_len), si = tok % size_t(s_len), nh = h1 - h0;
            const size_t n_cached = size_t(std::clamp<int64_t>(static_cast<const int32_t*>(valid.data)[bi], 0, t_len));
            const size_t stride = mla_scores_stride(n_cached + size_t(r_len)), xq_floats = (nh * xq_bytes + 63) / 64 * 16;
            uint8_t* xq = reinterpret_cast<uint8_t*>(
                scratch(xq_floats + nh * n_ch + nh * stride + size_t(r_len) + nh * size_t(dl)));  // int8 inputs
            float* qa = reinterpret_cast<float*>(xq) + xq_floats;
            float* sc = qa + nh * n_ch;
            uint8_t* seen_buf = reinterpret_cast<uint8_t*>(sc + nh * stride);
            float* o_lat = sc + nh * stride + size_t(r_len);
            const float* qt = q.f() + tok * qw;
            if (uk_q.present) quantize_rows(qt + h0 * size_t(dn), nh, size_t(dn), uk, xq);
            for (size_t hh = 0; hh < nh; ++hh) {  // [q_lat; q_pe] of each head
                float* qh = qa + hh * n_ch;
                const float* nope = qt + (h0 + hh) * size_t(dn);
                if (uk_q.present) {
                    int8_product(xq + hh * uk_row, uk, uk_pack, (h0 + hh) * size_t(dl), size_t(dl), qh);
                } else if (w_uk.present) {
                    std::fill(qh, qh + dl, 0.f);
                    rows_axpy(nope, 1, size_t(dn), w_uk.f() + (h0 + hh) * size_t(dn * dl), size_t(dl), size_t(dn),
                              size_t(dl), qh, size_t(dl));
                } else {
                    std::memcpy(qh, nope, size_t(dl) * sizeof(float));
                }
                std::memcpy(qh + dl, qt + size_t(h * dn) + (h0 + hh) * size_t(dr), size_t(dr) * sizeof(float));
            }
            rope_heads(qa + dl, nh, n_ch, size_t(dr), cos.f() + p[tok] * half, sin.f() + p[tok] * half, interleave != 0);
            const uint8_t* visible;
            if (vis.present) {
                visible = static_cast<const uint8_t*>(vis.data) + ((vis.dim(0) == 1 ? 0 : bi) * size_t(s_len) + si) * size_t(r_len);
            } else {
                for (int64_t r = 0; r < r_len; ++r) seen_buf[r] = r <= int64_t(si) + r_extra;
                visible = seen_buf;
            }
            float* o = w_uv.present || uv_q.present ? o_lat : out + (tok * size_t(h) + h0) * size_t(dl);
            mla_attend_token(qa, nh, n_ch, size_t(dl), scale, cache.f() + bi * size_t(t_len * ch), n_cached,
                             all + bi * size_t(r_len * ch), size_t(r_len), n_ch, visible, sc, o, size_t(dl));
            if (uv_q.present) {
                quantize_rows(o_lat, nh, size_t(dl), uv, xq);
                for (size_t hh = 0; hh < nh; ++hh)
                    int8_product(xq + hh * uv_row, uv, uv_pack, (h0 + hh) * size_t(dv), size_t(dv),
                                 out + (tok * size_t(h) + h0 + hh) * size_t(dv));
            } else if (w_uv.present)
                for (size_t hh = 0; hh < nh; ++hh)
                    rows_dot(o_lat + hh * size_t(dl), 1, size_t(dl), w_uv.f() + (h0 + hh) * size_t(dv * dl), size_t(dl),
                             size_t(dv), size_t(dl), out + (tok * size_t(h) + h0 + hh) * size_t(dv), size_t(dv));
        };
        return c.parallel(tokens * splits, work, macs);
    }
};

// ------------------------------------------------------------------------------------------ MtpAccept
// Greedy (and relaxed) acceptance of the drafts input_ids[:, 1:] against the target's logits, as
// exporters/lowering.py accept_decomposed defines it: draft i is accepted if it is the argmax of row i (the first
// of equal maxima), or -- while the thinking flag before it is on and relaxed_topk > 0 -- if it ranks among the
// top relaxed_topk (ties: the lower id first) and p(draft) >= p(top-1) - relaxed_delta; the longest accepted prefix,
// then the bonus token (the argmax of the first unaccepted row), then -1.  The flag turns on at think_start_id and
// off at think_end_id.  Without relaxed_topk and relaxed_delta: strict acceptance (a plain step: S = 1).
struct MtpAcceptKernel {
    int64_t start_id = -1, end_id = -1;

    MtpAcceptKernel(const OrtApi* api, const OrtKernelInfo* info, OrtStatus** status) {
        OrtStatus* s = attr_int(api, info, "think_start_id", &start_id);
        if (!s) s = attr_int(api, info, "think_end_id", &end_id);
        *status = s;
    }

    bool after(bool flag, int32_t token) const { return token == start_id || (flag && token != end_id); }

    OrtStatus* compute(const Call& c) const {
        View logits, ids, thinking, topk, delta;
        View* in[] = {&logits, &ids, &thinking, &topk, &delta};
        for (size_t i = 0; i < 5; ++i) MTP_RETURN_IF(c.input(i, *in[i]));
        MTP_RETURN_IF(need_float(c, logits, "logits", 3));
        const int64_t b = logits.dim(0), s_len = logits.dim(1), v = logits.dim(2);
        if (ids.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 || ids.shape.size() != 2 || ids.dim(0) != b ||
            ids.dim(1) != s_len || s_len < 1 || v < 1)
            return c.error("input_ids " + ids.str() + " must be int32 [B, S] with logits " + logits.str() + " [B, S, V]");
        if (thinking.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 || thinking.size() != b)
            return c.error("thinking " + thinking.str() + " must be int32 [B]");
        if (topk.present != delta.present || (topk.present && (topk.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 ||
                                                               topk.size() != 1 || delta.size() != 1)))
            return c.error("relaxed_topk and relaxed_delta come together, int32 and float32 scalars");
        const int64_t relaxed = topk.present ? static_cast<const int32_t*>(topk.data)[0] : 0;
        const float slack = delta.present ? delta.f()[0] : 0.f;
        int32_t *accepted = nullptr, *num = nullptr, *flag_out = nullptr;
        MTP_RETURN_IF(c.output(0, {b, s_len}, &accepted));
        MTP_RETURN_IF(c.output(1, {b}, &num));
        MTP_RETURN_IF(c.output(2, {b}, &flag_out));
        const int32_t* tok = static_cast<const int32_t*>(ids.data);
        const int32_t* flags = static_cast<const int32_t*>(thinking.data);
        std::vector<int32_t> target(size_t(b * s_len));
        auto argmax = [&](size_t row) {
            const float* l = logits.f() + row * size_t(v);
            target[row] = int32_t(std::max_element(l, l + v) - l);  // (the first of equal maxima)
        };
        MTP_RETURN_IF(c.parallel(size_t(b * s_len), argmax, double(b * s_len) * double(v)));
        // draft i of row r: rank among the logits and p(draft) >= p(top-1) - delta (relaxed acceptance)
        auto relaxed_ok = [&](size_t row, int32_t d) {
            const float* l = logits.f() + row * size_t(v);
            const float ld = l[d], mx = l[target[row]];
            int64_t rank = 0;
            float sum = 0.f;
            for (int64_t u = 0; u < v; ++u) {
                rank += l[u] > ld || (l[u] == ld && u < d);
                sum += std::exp(l[u] - mx);
            }
            return rank < relaxed && std::exp(ld - mx) / sum >= 1.f / sum - slack;
        };
        for (int64_t bi = 0; bi < b; ++bi) {
            const size_t row0 = size_t(bi * s_len);
            bool flag = flags[bi] != 0;
            int64_t n = 0;
            for (; n < s_len - 1; ++n) {  // draft n is input_ids[bi, n + 1]
                const int32_t d = tok[row0 + size_t(n) + 1];
                const bool ok = d == target[row0 + size_t(n)] ||
                                (relaxed > 0 && flag && d >= 0 && d < v && relaxed_ok(row0 + size_t(n), d));
                if (!ok) break;
                flag = after(flag, d);
            }
            const int32_t bonus = target[row0 + size_t(n)];
            for (int64_t i = 0; i < s_len; ++i)
                accepted[row0 + size_t(i)] = i < n ? tok[row0 + size_t(i) + 1] : i == n ? bonus : -1;
            num[bi] = int32_t(n);
            flag_out[bi] = after(flag, bonus);
        }
        return nullptr;
    }
};

// ----------------------------------------------------------------------------------- LightningIndexer
struct LightningIndexerKernel {
    int64_t heads = 0, topk = 0;
    float scale = 1.f;

    LightningIndexerKernel(const OrtApi* api, const OrtKernelInfo* info, OrtStatus** status) {
        OrtStatus* s = attr_int(api, info, "heads", &heads);
        if (!s) s = attr_int(api, info, "topk", &topk);
        if (!s) s = attr_float(api, info, "scale", &scale);
        if (!s && (heads < 1 || topk < 1))
            s = api->CreateStatus(ORT_INVALID_ARGUMENT, ("mtp_trt.cpu::LightningIndexer: heads " + std::to_string(heads) +
                                                         ", topk " + std::to_string(topk) + ": both must be >= 1").c_str());
        *status = s;
    }

    OrtStatus* compute(const Call& c) const {
        View q, w;
        Rows in;
        MTP_RETURN_IF(c.input(0, q));
        MTP_RETURN_IF(c.input(1, w));
        MTP_RETURN_IF(need_float(c, q, "q", 3));
        MTP_RETURN_IF(need_float(c, w, "weights", 3));
        const int64_t b = q.dim(0), s_len = q.dim(1), hi = heads, di = q.dim(2) / hi;
        if (q.dim(2) != di * hi || di < 1 || w.dim(0) != b || w.dim(1) != s_len || w.dim(2) != hi)
            return c.error("q " + q.str() + " and weights " + w.str() + " must be [B, S, H*Di] and [B, S, H] with H = " +
                           std::to_string(hi));
        MTP_RETURN_IF(in.read(c, 2, b, s_len, di, "with C >= Di = " + std::to_string(di) + " (q " + q.str() +
                                                      "), the keys the last Di values of each row"));
        const int64_t k_out = std::min(topk, in.t_len + in.r_len);
        int32_t* out = nullptr;
        MTP_RETURN_IF(c.output(0, {b, s_len, k_out}, &out));
        const size_t tokens = size_t(b * s_len), ld = size_t(in.c), key_at = size_t(in.c - di);
        std::vector<size_t> at(tokens + 1, 0);  // token i's scores at `at[i]`: its cached rows, then `rows`
        for (size_t tok = 0; tok < tokens; ++tok) at[tok + 1] = at[tok] + in.cached(tok / s_len) + size_t(in.r_len);
        std::vector<float> scores(at[tokens]);
        // scores: per token, chunks of its cached rows (the last chunk also the token's `rows`), any thread each
        constexpr size_t chunk = 512;
        std::vector<std::pair<size_t, size_t>> items;  // (token, first cached row)
        for (size_t tok = 0; tok < tokens; ++tok)
            for (size_t t = 0, n = in.cached(tok / s_len); t == 0 || t < n; t += chunk) items.push_back({tok, t});
        auto score = [&](size_t i) {
            const auto [tok, t0] = items[i];
            const size_t bi = tok / s_len, si = tok % s_len, n = in.cached(bi), t1 = std::min(n, t0 + chunk);
            const float* qt = q.f() + tok * size_t(hi * di);
            const float* wt = w.f() + tok * size_t(hi);
            float* st = scores.data() + at[tok];
            index_scores(qt, wt, size_t(hi), size_t(di), scale, in.cache_of(bi) + t0 * ld + key_at, ld, t1 - t0, st + t0);
            if (t1 < n) return;
            uint8_t* buf = reinterpret_cast<uint8_t*>(scratch(size_t(in.r_len)));
            const uint8_t* seen = in.seen(bi, si, buf);
            index_scores(qt, wt, size_t(hi), size_t(di), scale, in.rows_of(bi) + key_at, ld, size_t(in.r_len), st + n);
            for (int64_t r = 0; r < in.r_len; ++r)
                if (!seen[r]) st[n + r] = -std::numeric_limits<float>::infinity();
        };
        MTP_RETURN_IF(c.parallel(items.size(), score, double(at[tokens]) * double(hi * di)));
        auto select = [&](size_t tok) {
            const size_t n = in.cached(tok / s_len), visible = n + size_t(in.r_len);
            int32_t* o = out + tok * size_t(k_out);
            const size_t got = select_top(scores.data() + at[tok], visible, size_t(k_out), scratch(visible), o);
            for (size_t r = 0; r < got; ++r)  // positions among the token's scores -> rows of cache then `rows`
                if (size_t(o[r]) >= n) o[r] += int32_t(in.t_len - int64_t(n));
            std::fill(o + got, o + k_out, -1);
        };
        return c.parallel(tokens, select, double(at[tokens]));
    }
};

// ------------------------------------------------------------------------------------------------ RmsNorm
// RMSNorm of each row of x, or of x + skip (the residual add first; output 1 its sum, where the node asks for it):
// weight * row / sqrt(mean(row^2) + epsilon), as exporters/model.py's rms_norm.  The rows are split over the
// intra-op threads only where they are worth it (Call::parallel; ONNX Runtime's own SimplifiedLayerNormalization
// and SkipSimplifiedLayerNormalization split any two rows, which at a decode step's few rows costs more than the
// norms themselves).
struct RmsNormKernel {
    float eps = 1e-6f;

    RmsNormKernel(const OrtApi* api, const OrtKernelInfo* info, OrtStatus** status) {
        *status = attr_float(api, info, "epsilon", &eps);
    }

    OrtStatus* compute(const Call& c) const {
        View x, w, skip;
        MTP_RETURN_IF(c.input(0, x));
        MTP_RETURN_IF(c.input(1, w));
        MTP_RETURN_IF(c.input(2, skip));
        MTP_RETURN_IF(need_float(c, x, "x", 0));
        MTP_RETURN_IF(need_float(c, w, "weight", 1));
        const int64_t d = w.dim(0);
        if (x.shape.empty() || x.dim(-1) != d || d < 1)
            return c.error("x " + x.str() + " must be [..., D] with D = " + std::to_string(d) + " (weight " + w.str() + ")");
        if (skip.present && (skip.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || skip.shape != x.shape))
            return c.error("skip " + skip.str() + " must be float32 of x's shape " + x.str());
        size_t outputs = 0;
        MTP_RETURN_IF(c.api->KernelContext_GetOutputCount(c.ctx, &outputs));
        if (outputs > 1 && !skip.present) return c.error("output 1 (x + skip) needs the skip input");
        float *y = nullptr, *sum = nullptr;
        MTP_RETURN_IF(c.output(0, x.shape, &y));
        if (outputs > 1) MTP_RETURN_IF(c.output(1, x.shape, &sum));
        const size_t rows = size_t(x.size() / d), n = size_t(d);
        auto norm = [&](size_t r) {
            const float* row = x.f() + r * n;
            if (skip.present) {  // the sum in output 1, or in this thread's scratch where the node has no output 1
                float* s = sum ? sum + r * n : scratch(n);
                const float* k = skip.f() + r * n;
                for (size_t i = 0; i < n; ++i) s[i] = row[i] + k[i];
                row = s;
            }
            rms_norm_row(row, n, w.f(), eps, y + r * n);
        };
        return c.parallel(rows, norm, double(rows) * double(n));
    }
};

// --------------------------------------------------------------------------------- registration
struct Spec {
    const char* name;
    std::vector<ONNXTensorElementDataType> inputs;
    std::vector<bool> optional;
    ONNXTensorElementDataType output = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    size_t outputs = 1;  // all of type `output`
    size_t required_outputs = outputs;  // the first ones; the others optional
};

template <class K>
struct Op : OrtCustomOp {
    Spec spec;

    explicit Op(Spec s) : OrtCustomOp{}, spec(std::move(s)) {
        version = kApiVersion;
        GetName = [](const OrtCustomOp* op) { return static_cast<const Op*>(op)->spec.name; };
        GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };  // CPU
        GetInputTypeCount = [](const OrtCustomOp* op) { return static_cast<const Op*>(op)->spec.inputs.size(); };
        GetInputType = [](const OrtCustomOp* op, size_t i) { return static_cast<const Op*>(op)->spec.inputs[i]; };
        GetInputCharacteristic = [](const OrtCustomOp* op, size_t i) {
            return static_cast<const Op*>(op)->spec.optional[i] ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
        };
        GetOutputTypeCount = [](const OrtCustomOp* op) { return static_cast<const Op*>(op)->spec.outputs; };
        GetOutputType = [](const OrtCustomOp* op, size_t) { return static_cast<const Op*>(op)->spec.output; };
        GetOutputCharacteristic = [](const OrtCustomOp* op, size_t i) {
            return i < static_cast<const Op*>(op)->spec.required_outputs ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
        };
        GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
        CreateKernelV2 = [](const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                            void** kernel) -> OrtStatus* {
            OrtStatus* status = nullptr;
            auto* k = new K(api, info, &status);
            if (status) {
                delete k;
                return status;
            }
            const Spec& spec = static_cast<const Op*>(op)->spec;
            *kernel = new Bound{k, api, spec.name, min_parallel_work(), constant_inputs(api, info, spec.inputs.size()),
                                pack_max_bytes(info), config_number(info, kThreadsKey, 0)};
            return nullptr;
        };
        KernelComputeV2 = [](void* kernel, OrtKernelContext* ctx) -> OrtStatus* {
            auto* b = static_cast<Bound*>(kernel);
            const Call call{b->api, ctx, b->name, b->min_work, b->constants, b->pack_max, b->threads};
            try {
                return b->kernel->compute(call);
            } catch (const std::exception& e) {  // (allocation failures): an error, never an abort
                return call.error(e.what());
            }
        };
        KernelDestroy = [](void* kernel) {
            auto* b = static_cast<Bound*>(kernel);
            delete b->kernel;
            delete b;
        };
    }

    struct Bound {
        K* kernel;
        const OrtApi* api;
        const char* name;
        double min_work;
        std::vector<View> constants;
        size_t pack_max, threads;
    };
};

constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto I32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
constexpr auto I64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
constexpr auto BOOL = ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
constexpr auto U8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
constexpr auto SCALES = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // quantized weights' scales: float16 or float32

// The ops live as long as the process: ONNX Runtime keeps pointers to them in every session that used them.
Op<MoEKernel> g_moe({"MoE", {F32, F32, F32, F32, F32, F32, F32}, {false, true, true, true, true, true, true}});
Op<MlaAttentionKernel> g_mla({"MlaAttention", {F32, F32, F32, F32, I32, BOOL, I32},
                              {false, false, false, false, false, true, true}});
Op<MlaSelfAttentionKernel> g_mla_self({"MlaSelfAttention",
                                        {F32, F32, F32, I64, F32, F32, F32, I32, F32, BOOL, F32, F32, U8, SCALES, U8,
                                         SCALES},
                                        {false, false, false, false, false, false, false, false, true, true, true, true,
                                         true, true, true, true},
                                        F32, 2});
Op<MtpAcceptKernel> g_accept({"MtpAccept", {F32, I32, I32, I32, F32}, {false, false, false, true, true}, I32, 3});
Op<LightningIndexerKernel> g_indexer({"LightningIndexer", {F32, F32, F32, F32, I32, BOOL},
                                      {false, false, false, false, false, true}, I32});
Op<QMatMulKernel> g_qmatmul({"QMatMul", {F32, U8, SCALES}, {false, false, false}});
Op<RmsNormKernel> g_rms_norm({"RmsNorm", {F32, F32, F32}, {false, false, true}, F32, 2, 1});
Op<QMoEKernel> g_qmoe({"QMoE", {F32, F32, F32, U8, SCALES, U8, SCALES, U8, SCALES, U8, SCALES},
                       {false, true, true, true, true, true, true, true, true, true, true}});

}  // namespace
}  // namespace mtp_ort

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                              const OrtApiBase* base) {
    using namespace mtp_ort;
    g_api24 = api24(base);
    const OrtApi* api = base->GetApi(kApiVersion);
    if (!api) {  // an older ONNX Runtime: report it through the oldest API (CreateStatus is in every version)
        const OrtApi* v1 = base->GetApi(1);
        return v1 ? v1->CreateStatus(ORT_FAIL, "mtp_trt.cpu operators need ONNX Runtime >= 1.18") : nullptr;
    }
    if (*cpu_isa_error()) return api->CreateStatus(ORT_FAIL, cpu_isa_error());
    OrtCustomOpDomain* domain = nullptr;
    MTP_RETURN_IF(api->CreateCustomOpDomain(kDomain, &domain));
    for (const OrtCustomOp* op : std::initializer_list<const OrtCustomOp*>{&g_moe, &g_mla, &g_mla_self, &g_accept, &g_indexer, &g_qmatmul, &g_qmoe, &g_rms_norm})
        MTP_RETURN_IF(api->CustomOpDomain_Add(domain, op));
    return api->AddCustomOpDomain(options, domain);  // (the domain is kept for the process, as the ops are)
}


// Why MTP_TRT_CPU_ISA cannot be had ("" where it can; kernels.h cpu_isa_error), the instruction set chosen
// (kernels.h kCpuIsaNames) and every name: for ort_lib (an mtp-trt error before a session is made) and tests.
extern "C" __attribute__((visibility("default"))) const char* MtpOrtCpuIsaError() { return mtp_ort::cpu_isa_error(); }
extern "C" __attribute__((visibility("default"))) const char* MtpOrtCpuIsa() {
    return mtp_ort::kCpuIsaNames[int(mtp_ort::cpu_isa())];
}
extern "C" __attribute__((visibility("default"))) const char* MtpOrtCpuIsaNames() {
    static const std::string names = [] {
        std::string s;
        for (const char* n : mtp_ort::kCpuIsaNames) s += (s.empty() ? "" : " ") + std::string(n);
        return s;
    }();
    return names.c_str();
}

// The instruction set of the quantized products in this process (kernels.h qpath_name):
// for tests and benchmarks, through ctypes.
extern "C" __attribute__((visibility("default"))) const char* MtpOrtQuantPath() { return mtp_ort::qpath_name(); }

// The bytes of the packed weight copies the process holds (the quantized operators' kernels on the vector paths),
// likewise.
extern "C" __attribute__((visibility("default"))) size_t MtpOrtPackedBytes() {
    return mtp_ort::PackRegistry::get().bytes();
}

// The instruction set of the lightning indexer's scores ("scalar", "avx2", "avx512"), likewise.
extern "C" __attribute__((visibility("default"))) const char* MtpOrtIndexPath() { return mtp_ort::index_path_name(); }
