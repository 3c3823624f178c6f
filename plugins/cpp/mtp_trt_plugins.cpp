// mtp_trt_plugins.cpp -- libmtp_trt_plugins.so: the custom ops of the `plugin` lowering
// (mtp_trt/ops.py, table in op_contract.h) as C++ TensorRT IPluginV3 plugins, the C++ twins of
// the Python plugins in plugins/trt_plugins.py: same names, version, namespace, fields, inputs,
// outputs, aliasing and workspace, so an engine built with either runs with the other.
//
//   MlaGenerationAttention -> mtp_mla_decode (plugins/kernels/mla_decode.cu): writes new_rows into
//     the cache in place (output kv_cache_out is aliased to input kv_cache: getAliasedInput(1)
//     == 2, IPluginV3OneBuildV2, builder preview feature kALIASED_PLUGIN_IO_10_03) and attends.
//   MlaSparseAttention -> mtp_mla_kv_commit, mtp_dsa_select (plugins/kernels/dsa.cu) and mtp_mla_sparse_decode:
//     DeepSeek Sparse Attention (the new rows committed in place, the indexer's top-k, MLA over those rows).
//   MtpAccept -> mtp_accept_relaxed_dev (plugins/kernels/accept.cu, kernel ABI 3): drafts read in
//     place from input_ids + 1 (stride S), thinking -> thinking_out; no workspace, no copies.
//
// Split counts and the other shape-derived launch parameters are worked out in onShapeChange
// (runtime) / configurePlugin (build), not per enqueue.  Nothing here synchronises a stream, so
// the engines can be captured in a CUDA graph.  Entry points for IPluginRegistry::loadLibrary and
// `trtexec --dynamicPlugins`: setLoggerFinder, getCreators (and the deprecated getPluginCreators).
#include <NvInferRuntime.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

#include "mtp_kernels.h"
#include "op_contract.h"
#include "workspace.h"

using namespace nvinfer1;

namespace mtp_trt {
namespace {

namespace ct = contract;

// ---- logging: through the logger TensorRT hands to setLoggerFinder, else stderr ------------------
std::atomic<ILoggerFinder*> gLoggerFinder{nullptr};

void report(ILogger::Severity severity, const std::string& msg) noexcept {
    ILoggerFinder* finder = gLoggerFinder.load();
    ILogger* logger = finder ? finder->findLogger() : nullptr;
    const std::string line = "mtp_trt_plugins: " + msg;
    if (logger) {
        logger->log(severity, line.c_str());
    } else {
        std::fprintf(stderr, "%s\n", line.c_str());
    }
}

void error(const std::string& msg) noexcept { report(ILogger::Severity::kERROR, msg); }

PluginFieldType trt_type(ct::FieldType t) {
    return t == ct::FieldType::kInt32 ? PluginFieldType::kINT32 : PluginFieldType::kFLOAT32;
}

mtp_dtype kernel_dtype(DataType t) {
    return t == DataType::kHALF ? MTP_DTYPE_F16 : t == DataType::kBF16 ? MTP_DTYPE_BF16 : MTP_DTYPE_F32;
}

// The op's fields as values: ints and floats in the order of the contract's field table.
struct FieldValues {
    int32_t i[2] = {0, 0};  // (MlaSparseAttention: kv_lora_rank, index_topk)
    float f[2] = {0.f, 0.f};
};

// Common part of both plugins.  Op is ct::mla or ct::accept (as a tag type below).
template <class Derived, class Op>
class PluginBase : public IPluginV3, public IPluginV3OneCore, public IPluginV3OneBuildV2, public IPluginV3OneRuntime {
   public:
    explicit PluginBase(const FieldValues& v) : mValues(v) {}

    // IPluginV3
    IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
        switch (type) {
            case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
            case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuildV2*>(this);
            case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
        }
        return nullptr;
    }
    IPluginV3* clone() noexcept override {
        try {
            return new Derived(static_cast<const Derived&>(*this));
        } catch (const std::exception& e) {
            error(std::string(Op::kName) + ": clone: " + e.what());
            return nullptr;
        }
    }

    // IPluginV3OneCore
    const char* getPluginName() const noexcept override { return Op::kName; }
    const char* getPluginVersion() const noexcept override { return ct::kVersionString; }
    const char* getPluginNamespace() const noexcept override { return ct::kNamespace; }

    // IPluginV3OneBuild(V2)
    int32_t getNbOutputs() const noexcept override { return ct::count(Op::kOutputs); }
    int32_t getAliasedInput(int32_t output) noexcept override {
        return output >= 0 && output < ct::count(Op::kAliasedInput) ? Op::kAliasedInput[output] : -1;
    }

    // IPluginV3OneRuntime
    IPluginV3* attachToContext(IPluginResourceContext*) noexcept override { return clone(); }
    const PluginFieldCollection* getFieldsToSerialize() noexcept override {
        mFields.clear();
        int ni = 0, nf = 0;
        for (const ct::Field& field : Op::kFields) {
            const void* data = field.type == ct::FieldType::kInt32 ? static_cast<const void*>(&mValues.i[ni++])
                                                                   : static_cast<const void*>(&mValues.f[nf++]);
            mFields.emplace_back(field.name, data, trt_type(field.type), 1);
        }
        mCollection.nbFields = static_cast<int32_t>(mFields.size());
        mCollection.fields = mFields.data();
        return &mCollection;
    }

   protected:
    bool bad_io(int32_t nbInputs, int32_t nbOutputs, const char* where) const {
        const int most = ct::count(Op::kInputs), least = most - Op::kOptionalInputs;
        if (nbInputs >= least && nbInputs <= most && nbOutputs == ct::count(Op::kOutputs)) return false;
        error(std::string(Op::kName) + ": " + where + ": " + std::to_string(nbInputs) + " inputs and " +
              std::to_string(nbOutputs) + " outputs, expected " + std::to_string(least) +
              (least == most ? "" : ".." + std::to_string(most)) + " and " + std::to_string(ct::count(Op::kOutputs)));
        return true;
    }

    FieldValues mValues;

   private:
    std::vector<PluginField> mFields;
    PluginFieldCollection mCollection{};
};

// The attention plugins' formats: linear; q one of fp32/fp16/bf16; past_len int32; the tree mask (the optional
// last input, at mask_at) bool; index_weights (at weights_at, MlaSparseAttention) fp32; every other tensor q's type.
bool attention_format(int32_t pos, const DynamicPluginTensorDesc* io, int32_t nbInputs, int past_at, int mask_at,
                      int weights_at) {
    const PluginTensorDesc& d = io[pos].desc;
    if (d.format != TensorFormat::kLINEAR) return false;
    if (pos == 0) return d.type == DataType::kFLOAT || d.type == DataType::kHALF || d.type == DataType::kBF16;
    if (pos == past_at) return d.type == DataType::kINT32;
    if (pos == weights_at) return d.type == DataType::kFLOAT;
    if (pos == mask_at && nbInputs > mask_at) return d.type == DataType::kBOOL;
    return d.type == io[0].desc.type;
}

// SM count of the current device (kMaxSms when it cannot be read), asked once per plugin object.
int device_sms(int& cached) {
    if (cached <= 0) {
        int dev = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&cached, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
            cached = ct::kMaxSms;
        }
    }
    return cached;
}

struct MlaOp {
    static constexpr const char* kName = ct::mla::kName;
    static constexpr const auto& kInputs = ct::mla::kInputs;
    static constexpr const auto& kOutputs = ct::mla::kOutputs;
    static constexpr const auto& kFields = ct::mla::kFields;
    static constexpr const auto& kAliasedInput = ct::mla::kAliasedInput;
    static constexpr int kOptionalInputs = ct::mla::kOptionalInputs;
};
struct SparseOp {
    static constexpr const char* kName = ct::sparse::kName;
    static constexpr const auto& kInputs = ct::sparse::kInputs;
    static constexpr const auto& kOutputs = ct::sparse::kOutputs;
    static constexpr const auto& kFields = ct::sparse::kFields;
    static constexpr const auto& kAliasedInput = ct::sparse::kAliasedInput;
    static constexpr int kOptionalInputs = ct::sparse::kOptionalInputs;
};
struct AcceptOp {
    static constexpr const char* kName = ct::accept::kName;
    static constexpr const auto& kInputs = ct::accept::kInputs;
    static constexpr const auto& kOutputs = ct::accept::kOutputs;
    static constexpr const auto& kFields = ct::accept::kFields;
    static constexpr const auto& kAliasedInput = ct::accept::kAliasedInput;
    static constexpr int kOptionalInputs = ct::accept::kOptionalInputs;
};

// ---- MlaGenerationAttention ---------------------------------------------------------------------
class MlaPlugin final : public PluginBase<MlaPlugin, MlaOp> {
   public:
    using PluginBase::PluginBase;

    int32_t dl() const { return mValues.i[0]; }
    float scale() const { return mValues.f[0]; }

    int32_t getOutputDataTypes(DataType* out, int32_t nbOutputs, const DataType* in, int32_t nbInputs)
        const noexcept override {
        if (bad_io(nbInputs, nbOutputs, "getOutputDataTypes")) return -1;
        out[ct::mla::kOut] = in[ct::mla::kQ];
        out[ct::mla::kKvCacheOut] = in[ct::mla::kKvCache];
        return 0;
    }

    int32_t getOutputShapes(const DimsExprs* in, int32_t nbInputs, const DimsExprs*, int32_t, DimsExprs* out,
                            int32_t nbOutputs, IExprBuilder& exprs) noexcept override {
        if (bad_io(nbInputs, nbOutputs, "getOutputShapes")) return -1;
        const DimsExprs &q = in[ct::mla::kQ], &rows = in[ct::mla::kNewRows], &cache = in[ct::mla::kKvCache];
        if (q.nbDims != 4 || rows.nbDims != 3 || cache.nbDims != 3 || in[ct::mla::kPastLen].nbDims != 1) {
            error("MlaGenerationAttention: expected q [B, S, H, D], new_rows [B, S, D], kv_cache [B, T, D], "
                  "past_len [B]");
            return -1;
        }
        if (nbInputs > ct::mla::kTreeMask && in[ct::mla::kTreeMask].nbDims != 3) {
            error("MlaGenerationAttention: expected tree_mask [B, S, S]");
            return -1;
        }
        const IDimensionExpr* last[] = {q.d[3], rows.d[2], cache.d[2]};
        for (int k = 0; k < 3; ++k) {
            if (last[k]->isConstant() && last[k]->getConstantValue() <= dl()) {
                error(std::string("MlaGenerationAttention: ") + ct::mla::kInputs[k] + "'s last dim " +
                      std::to_string(last[k]->getConstantValue()) + " must exceed kv_lora_rank " +
                      std::to_string(dl()));
                return -1;
            }
        }
        DimsExprs& o = out[ct::mla::kOut];
        o.nbDims = 4;
        o.d[0] = q.d[0], o.d[1] = q.d[1], o.d[2] = q.d[2], o.d[3] = exprs.constant(dl());
        out[ct::mla::kKvCacheOut] = cache;
        return 0;
    }

    bool supportsFormatCombination(int32_t pos, const DynamicPluginTensorDesc* io, int32_t nbInputs,
                                   int32_t nbOutputs) noexcept override {
        if (bad_io(nbInputs, nbOutputs, "supportsFormatCombination")) return false;
        return attention_format(pos, io, nbInputs, ct::mla::kPastLen, ct::mla::kTreeMask, -1);
    }

    size_t getWorkspaceSize(const DynamicPluginTensorDesc* in, int32_t nbInputs, const DynamicPluginTensorDesc*,
                            int32_t nbOutputs) const noexcept override {
        if (bad_io(nbInputs, nbOutputs, "getWorkspaceSize")) return 0;
        const DynamicPluginTensorDesc &q = in[ct::mla::kQ], &cache = in[ct::mla::kKvCache];
        return static_cast<size_t>(mla_workspace_bound(q.min.d[0], q.max.d[0], q.min.d[1], q.max.d[1], q.max.d[2],
                                                       dl(), cache.max.d[1]));
    }

    int32_t configurePlugin(const DynamicPluginTensorDesc* in, int32_t nbInputs, const DynamicPluginTensorDesc*,
                            int32_t nbOutputs) noexcept override {
        if (bad_io(nbInputs, nbOutputs, "configurePlugin")) return -1;
        const int64_t d = in[ct::mla::kQ].desc.dims.d[3];  // -1 while dynamic
        return d < 0 || d > dl() ? 0 : -1;
    }

    // Launch parameters for the new shapes: dims, dtype, split count (capped at the bound the
    // workspace was reserved for) and the workspace it needs.
    int32_t onShapeChange(const PluginTensorDesc* in, int32_t nbInputs, const PluginTensorDesc*,
                          int32_t nbOutputs) noexcept override {
        if (bad_io(nbInputs, nbOutputs, "onShapeChange")) return -1;
        const Dims &q = in[ct::mla::kQ].dims, &cache = in[ct::mla::kKvCache].dims;
        mB = static_cast<int>(q.d[0]), mS = static_cast<int>(q.d[1]), mH = static_cast<int>(q.d[2]);
        mDr = static_cast<int>(q.d[3]) - dl(), mT = static_cast<int>(cache.d[1]);
        mDtype = kernel_dtype(in[ct::mla::kQ].type);
        mTreeMask = nbInputs > ct::mla::kTreeMask;
        mSplits = std::min(mtp_mla_decode_num_splits(mB, mS, mH, mT, device_sms(mNumSms)),
                           mla_splits_bound(mB, mS, mH, mT));
        mWorkspace = mtp_mla_decode_workspace_size(mB, mS, mH, dl(), mSplits);
        if (static_cast<int64_t>(mWorkspace) != mla_workspace_size(mB, mS, mH, dl(), mSplits)) {
            error("MlaGenerationAttention: the kernel library's split-KV workspace differs from workspace.h");
            return -1;
        }
        return 0;
    }

    int32_t enqueue(const PluginTensorDesc*, const PluginTensorDesc*, const void* const* inputs, void* const* outputs,
                    void* workspace, cudaStream_t stream) noexcept override {
        void* cache = outputs[ct::mla::kKvCacheOut];
        if (cache != inputs[ct::mla::kKvCache]) {
            error("MlaGenerationAttention: kv_cache_out is not bound to kv_cache's buffer (aliased I/O)");
            return -1;
        }
        const cudaError_t e = mtp_mla_decode(
            mDtype, inputs[ct::mla::kQ], cache, static_cast<const int32_t*>(inputs[ct::mla::kPastLen]),
            inputs[ct::mla::kNewRows],
            mTreeMask ? static_cast<const uint8_t*>(inputs[ct::mla::kTreeMask]) : nullptr,  // bool: one byte, 0 / 1
            outputs[ct::mla::kOut], mWorkspace ? workspace : nullptr, mWorkspace,
            mB, mS, mH, dl(), mDr, mT, scale(), mSplits, 0, stream);
        if (e != cudaSuccess) {
            error(std::string("MlaGenerationAttention: mtp_mla_decode: ") + cudaGetErrorString(e));
            return -1;
        }
        return 0;
    }

   private:
    int mB = 0, mS = 0, mH = 0, mDr = 0, mT = 0, mSplits = 1, mNumSms = 0;
    bool mTreeMask = false;  // a fifth input: the tree mask [B, S, S]
    size_t mWorkspace = 0;
    mtp_dtype mDtype = MTP_DTYPE_F32;
};

// ---- MlaSparseAttention -------------------------------------------------------------------------
// The new rows (with their indexer keys) committed in place, the indexer's scores and top-k over the cache
// (mtp_dsa_select), then MLA over the selected rows (mtp_mla_sparse_decode); workspace: scores | selected rows |
// split-KV partials.
class SparsePlugin final : public PluginBase<SparsePlugin, SparseOp> {
   public:
    using PluginBase::PluginBase;

    int32_t dl() const { return mValues.i[0]; }
    int32_t topk() const { return mValues.i[1]; }
    float scale() const { return mValues.f[0]; }

    int32_t getOutputDataTypes(DataType* out, int32_t nbOutputs, const DataType* in, int32_t nbInputs)
        const noexcept override {
        if (bad_io(nbInputs, nbOutputs, "getOutputDataTypes")) return -1;
        out[ct::sparse::kOut] = in[ct::sparse::kQ];
        out[ct::sparse::kKvCacheOut] = in[ct::sparse::kKvCache];
        return 0;
    }

    int32_t getOutputShapes(const DimsExprs* in, int32_t nbInputs, const DimsExprs*, int32_t, DimsExprs* out,
                            int32_t nbOutputs, IExprBuilder& exprs) noexcept override {
        if (bad_io(nbInputs, nbOutputs, "getOutputShapes")) return -1;
        const int ranks[] = {4, 3, 3, 1, 4, 3, 3};
        for (int k = 0; k < nbInputs; ++k) {
            if (in[k].nbDims != ranks[k]) {
                error("MlaSparseAttention: expected q [B, S, H, D], new_rows [B, S, C], kv_cache [B, T, C], past_len "
                      "[B], index_q [B, S, Hi, Di], index_weights [B, S, Hi] and optionally tree_mask [B, S, S]");
                return -1;
            }
        }
        const DimsExprs &q = in[ct::sparse::kQ], &cache = in[ct::sparse::kKvCache];
        const IDimensionExpr *d = q.d[3], *di = in[ct::sparse::kIndexQ].d[3];
        if (d->isConstant() && d->getConstantValue() <= dl()) {
            error("MlaSparseAttention: q's last dim " + std::to_string(d->getConstantValue()) +
                  " must exceed kv_lora_rank " + std::to_string(dl()));
            return -1;
        }
        if (d->isConstant() && di->isConstant()) {
            const int64_t c = d->getConstantValue() + di->getConstantValue();
            for (const IDimensionExpr* row : {in[ct::sparse::kNewRows].d[2], cache.d[2]}) {
                if (row->isConstant() && row->getConstantValue() != c) {
                    error("MlaSparseAttention: new_rows and kv_cache rows must hold q's values and the indexer key (" +
                          std::to_string(c) + "), got " + std::to_string(row->getConstantValue()));
                    return -1;
                }
            }
        }
        DimsExprs& o = out[ct::sparse::kOut];
        o.nbDims = 4;
        o.d[0] = q.d[0], o.d[1] = q.d[1], o.d[2] = q.d[2], o.d[3] = exprs.constant(dl());
        out[ct::sparse::kKvCacheOut] = cache;
        return 0;
    }

    bool supportsFormatCombination(int32_t pos, const DynamicPluginTensorDesc* io, int32_t nbInputs,
                                   int32_t nbOutputs) noexcept override {
        if (bad_io(nbInputs, nbOutputs, "supportsFormatCombination")) return false;
        return attention_format(pos, io, nbInputs, ct::sparse::kPastLen, ct::sparse::kTreeMask,
                                ct::sparse::kIndexWeights);
    }

    size_t getWorkspaceSize(const DynamicPluginTensorDesc* in, int32_t nbInputs, const DynamicPluginTensorDesc*,
                            int32_t nbOutputs) const noexcept override {
        if (bad_io(nbInputs, nbOutputs, "getWorkspaceSize")) return 0;
        const DynamicPluginTensorDesc &q = in[ct::sparse::kQ], &cache = in[ct::sparse::kKvCache];
        return static_cast<size_t>(sparse_workspace_bound(q.min.d[0], q.max.d[0], q.min.d[1], q.max.d[1], q.max.d[2],
                                                          dl(), cache.max.d[1], topk()));
    }

    int32_t configurePlugin(const DynamicPluginTensorDesc* in, int32_t nbInputs, const DynamicPluginTensorDesc*,
                            int32_t nbOutputs) noexcept override {
        if (bad_io(nbInputs, nbOutputs, "configurePlugin")) return -1;
        const int64_t d = in[ct::sparse::kQ].desc.dims.d[3];  // -1 while dynamic
        return d < 0 || d > dl() ? 0 : -1;
    }

    int32_t onShapeChange(const PluginTensorDesc* in, int32_t nbInputs, const PluginTensorDesc*,
                          int32_t nbOutputs) noexcept override {
        if (bad_io(nbInputs, nbOutputs, "onShapeChange")) return -1;
        const Dims &q = in[ct::sparse::kQ].dims, &cache = in[ct::sparse::kKvCache].dims,
                   &iq = in[ct::sparse::kIndexQ].dims;
        mB = static_cast<int>(q.d[0]), mS = static_cast<int>(q.d[1]), mH = static_cast<int>(q.d[2]);
        mD = static_cast<int>(q.d[3]), mT = static_cast<int>(cache.d[1]), mC = static_cast<int>(cache.d[2]);
        mHi = static_cast<int>(iq.d[2]), mDi = static_cast<int>(iq.d[3]);
        mDtype = kernel_dtype(in[ct::sparse::kQ].type);
        mTreeMask = nbInputs > ct::sparse::kTreeMask;
        mSplits = std::min(mtp_mla_decode_num_splits(mB * mS, 1, mH, topk(), device_sms(mNumSms)),
                           sparse_splits_bound(mB, mS, mH, topk()));
        mWorkspace = sparse_workspace_size(mB, mS, mH, dl(), mT, topk(), mSplits);
        if (static_cast<int64_t>(mtp_dsa_select_workspace_size(mB, mS, mT)) != mWorkspace.scores ||
            static_cast<int64_t>(mtp_mla_decode_workspace_size(mB * mS, 1, mH, dl(), mSplits)) != mWorkspace.partials) {
            error("MlaSparseAttention: the kernel library's workspace sizes differ from workspace.h");
            return -1;
        }
        return 0;
    }

    int32_t enqueue(const PluginTensorDesc*, const PluginTensorDesc*, const void* const* inputs, void* const* outputs,
                    void* workspace, cudaStream_t stream) noexcept override {
        void* cache = outputs[ct::sparse::kKvCacheOut];
        if (cache != inputs[ct::sparse::kKvCache]) {
            error("MlaSparseAttention: kv_cache_out is not bound to kv_cache's buffer (aliased I/O)");
            return -1;
        }
        const auto* past = static_cast<const int32_t*>(inputs[ct::sparse::kPastLen]);
        char* ws = static_cast<char*>(workspace);
        auto* selected = reinterpret_cast<int32_t*>(ws + mWorkspace.scores);
        cudaError_t e = mtp_mla_kv_commit(mDtype, cache, past, inputs[ct::sparse::kNewRows], mB, mS, mC, mT, stream);
        const char* what = "mtp_mla_kv_commit";
        if (e == cudaSuccess) {
            what = "mtp_dsa_select";
            e = mtp_dsa_select(mDtype, inputs[ct::sparse::kIndexQ],
                               static_cast<const float*>(inputs[ct::sparse::kIndexWeights]), cache, past,
                               mTreeMask ? static_cast<const uint8_t*>(inputs[ct::sparse::kTreeMask]) : nullptr,
                               selected, ws, static_cast<size_t>(mWorkspace.scores), mB, mS, mHi, mDi, mC, mD, mT,
                               topk(), 1.0f / std::sqrt(static_cast<float>(mDi)), stream);
        }
        if (e == cudaSuccess) {
            what = "mtp_mla_sparse_decode";
            e = mtp_mla_sparse_decode(mDtype, inputs[ct::sparse::kQ], cache, past, nullptr, selected,
                                      outputs[ct::sparse::kOut],
                                      mWorkspace.partials ? ws + mWorkspace.scores + mWorkspace.selected : nullptr,
                                      static_cast<size_t>(mWorkspace.partials), mB, mS, mH, dl(), mD - dl(), mC, mT,
                                      topk(), scale(), mSplits, 0, stream);
        }
        if (e != cudaSuccess) {
            error(std::string("MlaSparseAttention: ") + what + ": " + cudaGetErrorString(e));
            return -1;
        }
        return 0;
    }

   private:
    int mB = 0, mS = 0, mH = 0, mD = 0, mT = 0, mC = 0, mHi = 0, mDi = 0, mSplits = 1, mNumSms = 0;
    bool mTreeMask = false;
    SparseWorkspace mWorkspace{0, 0, 0};
    mtp_dtype mDtype = MTP_DTYPE_F32;
};

// ---- MtpAccept ----------------------------------------------------------------------------------
class AcceptPlugin final : public PluginBase<AcceptPlugin, AcceptOp> {
   public:
    using PluginBase::PluginBase;

    int32_t getOutputDataTypes(DataType* out, int32_t nbOutputs, const DataType*, int32_t nbInputs)
        const noexcept override {
        if (bad_io(nbInputs, nbOutputs, "getOutputDataTypes")) return -1;
        for (int32_t k = 0; k < nbOutputs; ++k) out[k] = DataType::kINT32;
        return 0;
    }

    int32_t getOutputShapes(const DimsExprs* in, int32_t nbInputs, const DimsExprs*, int32_t, DimsExprs* out,
                            int32_t nbOutputs, IExprBuilder&) noexcept override {
        if (bad_io(nbInputs, nbOutputs, "getOutputShapes")) return -1;
        const int ranks[] = {3, 2, 1, 0, 0};
        for (int k = 0; k < 5; ++k) {
            if (in[k].nbDims != ranks[k]) {
                error("MtpAccept: expected logits [B, S, V], input_ids [B, S], thinking [B], relaxed_topk [], "
                      "relaxed_delta []");
                return -1;
            }
        }
        const DimsExprs& logits = in[ct::accept::kLogits];
        out[ct::accept::kAcceptedTokens].nbDims = 2;
        out[ct::accept::kAcceptedTokens].d[0] = logits.d[0];
        out[ct::accept::kAcceptedTokens].d[1] = logits.d[1];
        for (int k : {ct::accept::kNumAccepted, ct::accept::kThinkingOut}) {
            out[k].nbDims = 1;
            out[k].d[0] = logits.d[0];
        }
        return 0;
    }

    bool supportsFormatCombination(int32_t pos, const DynamicPluginTensorDesc* io, int32_t nbInputs,
                                   int32_t nbOutputs) noexcept override {
        if (bad_io(nbInputs, nbOutputs, "supportsFormatCombination")) return false;
        static constexpr DataType kTypes[] = {DataType::kFLOAT, DataType::kINT32, DataType::kINT32, DataType::kINT32,
                                              DataType::kFLOAT, DataType::kINT32, DataType::kINT32, DataType::kINT32};
        return io[pos].desc.format == TensorFormat::kLINEAR && io[pos].desc.type == kTypes[pos];
    }

    int32_t configurePlugin(const DynamicPluginTensorDesc*, int32_t nbInputs, const DynamicPluginTensorDesc*,
                            int32_t nbOutputs) noexcept override {
        return bad_io(nbInputs, nbOutputs, "configurePlugin") ? -1 : 0;
    }

    int32_t onShapeChange(const PluginTensorDesc* in, int32_t nbInputs, const PluginTensorDesc*,
                          int32_t nbOutputs) noexcept override {
        if (bad_io(nbInputs, nbOutputs, "onShapeChange")) return -1;
        const Dims& logits = in[ct::accept::kLogits].dims;
        mB = static_cast<int>(logits.d[0]), mS = static_cast<int>(logits.d[1]), mV = static_cast<int>(logits.d[2]);
        return mS >= 1 ? 0 : -1;
    }

    int32_t enqueue(const PluginTensorDesc*, const PluginTensorDesc*, const void* const* inputs, void* const* outputs,
                    void*, cudaStream_t stream) noexcept override {
        const auto* ids = static_cast<const int32_t*>(inputs[ct::accept::kInputIds]);
        const cudaError_t e = mtp_accept_relaxed_dev(
            MTP_DTYPE_F32, inputs[ct::accept::kLogits], ids + 1, mS,  // drafts = input_ids[:, 1:], in place
            static_cast<const int32_t*>(inputs[ct::accept::kThinking]),
            static_cast<int32_t*>(outputs[ct::accept::kThinkingOut]), static_cast<int32_t*>(outputs[ct::accept::kAcceptedTokens]),
            static_cast<int32_t*>(outputs[ct::accept::kNumAccepted]), nullptr, mB, mS - 1, mV,
            static_cast<const int32_t*>(inputs[ct::accept::kRelaxedTopk]),
            static_cast<const float*>(inputs[ct::accept::kRelaxedDelta]), mValues.i[0], mValues.i[1], stream);
        if (e != cudaSuccess) {
            error(std::string("MtpAccept: mtp_accept_relaxed_dev: ") + cudaGetErrorString(e));
            return -1;
        }
        return 0;
    }

   private:
    int mB = 0, mS = 1, mV = 1;
};

// ---- creators -----------------------------------------------------------------------------------
template <class Plugin, class Op>
class Creator final : public IPluginCreatorV3One {
   public:
    Creator() {
        for (const ct::Field& field : Op::kFields) mFieldNames.emplace_back(field.name, nullptr, trt_type(field.type), 1);
        mCollection.nbFields = static_cast<int32_t>(mFieldNames.size());
        mCollection.fields = mFieldNames.data();
    }

    const char* getPluginName() const noexcept override { return Op::kName; }
    const char* getPluginVersion() const noexcept override { return ct::kVersionString; }
    const char* getPluginNamespace() const noexcept override { return ct::kNamespace; }
    const PluginFieldCollection* getFieldNames() noexcept override { return &mCollection; }

    IPluginV3* createPlugin(const char* name, const PluginFieldCollection* fc, TensorRTPhase) noexcept override {
        try {
            FieldValues v;
            int ni = 0, nf = 0;
            for (const ct::Field& field : Op::kFields) {
                const PluginField* f = find(fc, field.name);
                double x = 0.0;
                if (!f || !read_number(*f, x)) {
                    error(std::string(Op::kName) + " plugin for node '" + (name ? name : "") + "': missing or bad "
                          "attribute '" + field.name + "'");
                    return nullptr;
                }
                if (field.type == ct::FieldType::kInt32) {
                    v.i[ni++] = static_cast<int32_t>(x);
                } else {
                    v.f[nf++] = static_cast<float>(x);
                }
            }
            if constexpr (!std::is_same_v<Plugin, AcceptPlugin>) {
                const bool topk_ok = std::is_same_v<Plugin, MlaPlugin> || v.i[1] > 0;
                if (!(v.i[0] > 0 && topk_ok && std::isfinite(v.f[0]))) {
                    error(std::string(Op::kName) + " plugin for node '" + (name ? name : "") +
                          "': bad attributes (kv_lora_rank and index_topk must be > 0, softmax_scale finite)");
                    return nullptr;
                }
            }
            return new Plugin(v);
        } catch (const std::exception& e) {
            error(std::string(Op::kName) + ": createPlugin: " + e.what());
            return nullptr;
        }
    }

   private:
    // The first value of a numeric field (the ONNX parser and the Python plugins write int32 /
    // float32; wider or narrower numbers are accepted as well).
    static bool read_number(const PluginField& f, double& x) {
        if (f.length < 1 || !f.data) return false;
        switch (f.type) {
            case PluginFieldType::kINT32: x = *static_cast<const int32_t*>(f.data); return true;
            case PluginFieldType::kINT64: x = static_cast<double>(*static_cast<const int64_t*>(f.data)); return true;
            case PluginFieldType::kINT16: x = *static_cast<const int16_t*>(f.data); return true;
            case PluginFieldType::kINT8: x = *static_cast<const int8_t*>(f.data); return true;
            case PluginFieldType::kFLOAT32: x = *static_cast<const float*>(f.data); return true;
            case PluginFieldType::kFLOAT64: x = *static_cast<const double*>(f.data); return true;
            default: return false;
        }
    }

    static const PluginField* find(const PluginFieldCollection* fc, const char* name) {
        for (int32_t k = 0; fc && k < fc->nbFields; ++k) {
            if (fc->fields[k].name && std::strcmp(fc->fields[k].name, name) == 0) return &fc->fields[k];
        }
        return nullptr;
    }

    std::vector<PluginField> mFieldNames;
    PluginFieldCollection mCollection{};
};

}  // namespace
}  // namespace mtp_trt

// ---- library entry points (IPluginRegistry::loadLibrary, trtexec --dynamicPlugins) ---------------
extern "C" {

__attribute__((visibility("default"))) void setLoggerFinder(ILoggerFinder* finder) {
    mtp_trt::gLoggerFinder.store(finder);
}

__attribute__((visibility("default"))) IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
    static mtp_trt::Creator<mtp_trt::MlaPlugin, mtp_trt::MlaOp> mla;
    static mtp_trt::Creator<mtp_trt::SparsePlugin, mtp_trt::SparseOp> sparse;
    static mtp_trt::Creator<mtp_trt::AcceptPlugin, mtp_trt::AcceptOp> accept;
    static IPluginCreatorInterface* const creators[] = {&mla, &sparse, &accept};
    nbCreators = 3;
    return creators;
}

// Deprecated name of getCreators, still looked up by older TensorRT releases.
__attribute__((visibility("default"))) IPluginCreatorInterface* const* getPluginCreators(int32_t& nbCreators) {
    return getCreators(nbCreators);
}

// Kernel ABI of the kernels compiled into this library (for diagnostics; see mtp_kernels.h).
__attribute__((visibility("default"))) int mtp_trt_plugins_kernel_abi(void) { return mtp_kernels_abi_version(); }

}  // extern "C"

#ifdef MTP_TRT_REGISTER_ON_LOAD
// Variant built with -DMTP_TRT_REGISTER_ON_LOAD=ON (links libnvinfer): the creators are registered
// with TensorRT's global plugin registry as soon as the library is loaded, for hosts that only
// dlopen plugin libraries (LD_PRELOAD, an inference server's "plugins" option).  Such a build must
// not also be passed to IPluginRegistry::loadLibrary / trtexec --dynamicPlugins (duplicates).
namespace {
struct RegisterOnLoad {
    RegisterOnLoad() {
        int32_t n = 0;
        IPluginCreatorInterface* const* creators = getCreators(n);
        for (int32_t i = 0; i < n; ++i) {
            if (!getPluginRegistry()->registerCreator(*creators[i], mtp_trt::contract::kNamespace))
                std::fprintf(stderr, "mtp_trt_plugins: a plugin creator could not be registered (already registered?)\n");
        }
    }
} gRegisterOnLoad;
}  // namespace
#endif
