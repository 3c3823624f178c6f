// op_contract.h -- the op contract of mtp_trt/ops.py (names, version, fields, inputs, outputs,
// aliases) and the workspace constants of plugins/trt_plugins.py, as C++ constants for the C++
// plugins (libmtp_trt_plugins.so).  Hand-written; tests/test_cpp_contract.py parses this file and
// compares every entry with mtp_trt/ops.py and plugins/trt_plugins.py (no TensorRT needed), so an
// edit to either side that is not mirrored here fails the tests.  No TensorRT or CUDA include.
#ifndef MTP_TRT_OP_CONTRACT_H
#define MTP_TRT_OP_CONTRACT_H

namespace mtp_trt {
namespace contract {

inline constexpr int kVersion = 3;                // ops.VERSION
inline constexpr char kVersionString[] = "3";     // the plugin version string (str(ops.VERSION))
inline constexpr char kNamespace[] = "";          // the plugin namespace the ONNX parser looks up
inline constexpr char kDomain[] = "mtp_trt";      // ops.DOMAIN (ONNX domain of the nodes)

// Workspace reservation of MlaGenerationAttention (plugins/reference.py: MLA_ROW_BLOCK, MLA_TILE_ROWS,
// MLA_MIN_TILES, MLA_MAX_SPLITS; trt_plugins.py: MAX_SMS): engines built by either implementation reserve the
// same bytes.
inline constexpr int kRowBlock = 64;
inline constexpr int kTileRows = 32;
inline constexpr int kMinTiles = 4;
inline constexpr int kMaxSplits = 256;
inline constexpr int kMaxSms = 192;
// mtp_dsa_select's workspace (trt_plugins.py DSA_STATE_BYTES = MTP_DSA_STATE_BYTES): histograms and counts per
// query token after the index scores.
inline constexpr int kDsaStateBytes = 20992;

enum class FieldType { kInt32, kFloat32 };
struct Field {
    const char* name;
    FieldType type;
};

namespace mla {  // MlaGenerationAttention
inline constexpr char kName[] = "MlaGenerationAttention";
inline constexpr const char* kInputs[] = {"q", "new_rows", "kv_cache", "past_len", "tree_mask"};
inline constexpr int kOptionalInputs = 1;  // tree_mask may be left out (then causal)
inline constexpr const char* kOutputs[] = {"out", "kv_cache_out"};
inline constexpr Field kFields[] = {{"kv_lora_rank", FieldType::kInt32}, {"softmax_scale", FieldType::kFloat32}};
inline constexpr int kAliasedInput[] = {-1, 2};  // per output: the input it is aliased to, -1 none
enum Input { kQ = 0, kNewRows = 1, kKvCache = 2, kPastLen = 3, kTreeMask = 4 };
enum Output { kOut = 0, kKvCacheOut = 1 };
}  // namespace mla

namespace sparse {  // MlaSparseAttention
inline constexpr char kName[] = "MlaSparseAttention";
inline constexpr const char* kInputs[] = {"q", "new_rows", "kv_cache", "past_len", "index_q", "index_weights", "tree_mask"};
inline constexpr int kOptionalInputs = 1;  // tree_mask may be left out (then causal)
inline constexpr const char* kOutputs[] = {"out", "kv_cache_out"};
inline constexpr Field kFields[] = {{"kv_lora_rank", FieldType::kInt32}, {"softmax_scale", FieldType::kFloat32}, {"index_topk", FieldType::kInt32}};
inline constexpr int kAliasedInput[] = {-1, 2};
enum Input { kQ = 0, kNewRows = 1, kKvCache = 2, kPastLen = 3, kIndexQ = 4, kIndexWeights = 5, kTreeMask = 6 };
enum Output { kOut = 0, kKvCacheOut = 1 };
}  // namespace sparse

namespace accept {  // MtpAccept
inline constexpr char kName[] = "MtpAccept";
inline constexpr const char* kInputs[] = {"logits", "input_ids", "thinking", "relaxed_topk", "relaxed_delta"};
inline constexpr int kOptionalInputs = 0;
inline constexpr const char* kOutputs[] = {"accepted_tokens", "num_accepted", "thinking_out"};
inline constexpr Field kFields[] = {{"think_start_id", FieldType::kInt32}, {"think_end_id", FieldType::kInt32}};
inline constexpr int kAliasedInput[] = {-1, -1, -1};
enum Input { kLogits = 0, kInputIds = 1, kThinking = 2, kRelaxedTopk = 3, kRelaxedDelta = 4 };
enum Output { kAcceptedTokens = 0, kNumAccepted = 1, kThinkingOut = 2 };
}  // namespace accept

template <typename T, int N>
constexpr int count(const T (&)[N]) {
    return N;
}

}  // namespace contract
}  // namespace mtp_trt

#endif  // MTP_TRT_OP_CONTRACT_H
