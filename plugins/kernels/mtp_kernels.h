/*
 * mtp_kernels.h -- plain C interface of the mtp-trt CUDA kernels.
 *
 * No TensorRT dependency: every function takes device pointers, sizes and a cudaStream_t, launches
 * asynchronously on that stream and returns the launch status (cudaSuccess, cudaErrorInvalidValue
 * for bad arguments -- nothing is launched then -- or cudaGetLastError() after the launch).
 * All tensors are dense, row-major (C order), with the shapes given below.  Sizes are `int`.
 * NumPy references of every function: plugins/reference.py.  Design notes: docs/kernels.md.
 */
#ifndef MTP_TRT_KERNELS_H
#define MTP_TRT_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element type of floating-point tensors. */
typedef enum mtp_dtype {
    MTP_DTYPE_F32 = 0,  /* float */
    MTP_DTYPE_F16 = 1,  /* IEEE half (__half) */
    MTP_DTYPE_BF16 = 2  /* bfloat16 (__nv_bfloat16) */
} mtp_dtype;

/* Version of this interface (bumped on any change of its functions): 5. */
int mtp_kernels_abi_version(void);
/* cudaGetErrorString / cudaGetLastError of the CUDA runtime linked into this library. */
const char* mtp_error_string(int err);
int mtp_get_last_error(void);

/* ============================================================================================
 * 1. MLA generation attention over the compressed latent cache ("absorbed" DeepSeek-V3 MLA).
 *
 *   D = Dl + Dr (Dl = kv_lora_rank, Dr = rope dim);  M = S * H query rows per sequence.
 *   q          [B, S, H, D]   dtype   (q_nope absorbed through W_UK | roped q_pe)
 *   kv_cache   [B, T_max, D]  dtype   row t of sequence b = [c_kv (Dl) | k_pe (Dr)]
 *   past_len   [B]            int32   valid rows of sequence b BEFORE this step (not modified)
 *   new_rows   [B, S, D]      dtype   or NULL.  When given, row s is first written to cache row
 *                                     past_len[b] + s (the "KV commit"); when NULL the rows are
 *                                     assumed to be in the cache already.
 *   mask       [B, S, S]      uint8   or NULL.  NULL: causal -- query s sees cache rows
 *                                     t <= past_len[b] + s.  Given: query s sees every cached row
 *                                     t < past_len[b] and new row j iff mask[b][s][j] != 0 (tree
 *                                     drafts; the diagonal should normally be 1).
 *   out        [B, S, H, Dl]  dtype   out = softmax(scale * q . row) @ row[:Dl] over the visible
 *                                     rows (V is the first Dl values of the same latent row).  A
 *                                     query that sees no row gets zeros.
 *   scale: softmax scale (include the YaRN mscale^2 / sqrt(Dqk) yourself).
 *   The caller guarantees past_len[b] + S <= T_max; the kernels clamp (never write or read past
 *   row T_max - 1) but the result is then meaningless.
 *
 * Precision: fp32 accumulation everywhere.  fp16/bf16: the probabilities are rounded to the input
 * type before the P.V product (as in FlashAttention); the softmax denominator sums those rounded
 * values, so the weights used are exactly normalised.  A score beyond the fp32 range (+inf, or
 * scale * q . row overflowing) counts as the largest fp32 value: such rows share the weight equally
 * (no NaN row).
 * The workspace (num_splits > 1) must be 16-byte aligned (cudaErrorInvalidValue otherwise).
 *
 * Work split (num_splits): num_splits == 1 -- one block per (block of query rows, sequence), `out`
 * written directly, no workspace (pass NULL/0).  num_splits = P > 1 -- a persistent grid of P "parts"
 * per block of query rows, independent of the lengths (CUDA graphs and TensorRT need that): a
 * schedule worked out on the device from past_len cuts the KV tiles of all sequences, in order, into
 * P equal runs; a sequence run by one part is written directly, the others' parts write fp32 partial
 * outputs with their running max and sum to the workspace and a combine kernel merges them.  Use
 * mtp_mla_decode_num_splits for P.
 *
 * Paths: DeepSeek's dims (Dl = 512, Dr = 64; GLM-4.7-Flash's too), fp16/bf16, 16-byte aligned
 * pointers -> v2 (one pass over the latent cache serves up to 64 query rows: all heads and MTP
 * tokens of a block of rows; scores in registers; mma.sync; 3-stage cp.async).  Other fp16/bf16
 * shapes with Dl % 16 == 0, Dr % 16 == 0, 16 <= Dl <= 512, Dl + Dr <= 640 -> the general tensor-core
 * kernel (32 query rows per block) with ceil((P + B - 1) / B) KV splits per sequence; everything else
 * (fp32, odd dims) -> SIMT (Dl <= 512).  docs/kernels.md describes each.
 * flags: MTP_MLA_FORCE_SIMT forces the SIMT path (for testing); MTP_MLA_FORCE_V1 the general
 * tensor-core kernel (benchmarking); MTP_MLA_SINGLE_STAGE disables the general tensor-core
 * kernel's cp.async double buffering; MTP_MLA_FORCE_V2 keeps Hopper's launches on v2 and
 * MTP_MLA_SEESAW takes v3's dense launches on the seesaw schedule (benchmarking).
 * ========================================================================================== */
#define MTP_MLA_FORCE_SIMT 1
#define MTP_MLA_SINGLE_STAGE 2 /* general tensor-core kernel: no double buffering (benchmarking) */
#define MTP_MLA_FORCE_V1 4     /* DeepSeek's dims served by the general kernels, not v2 (benchmarking) */
#define MTP_MLA_FORCE_V2 8     /* DeepSeek's dims on v2 where v3 (Hopper) would serve them (benchmarking) */
#define MTP_MLA_SEESAW 16      /* v3's dense launches on the seesaw schedule (benchmarking; docs/kernels.md) */
#define MTP_MLA_MAX_SPLITS 256

/* Parts of the persistent grid for a launch: floor(num_sms / ceil(S*H / 64)) -- one wave of blocks of
 * 64 query rows --, at most one part per four 32-row tiles of B * max_len rows, at most 256; 1 when the
 * row blocks alone fill the GPU.  max_len: upper bound of past_len[b] + S (e.g. T_max).
 * num_sms <= 0: ask the current device. */
int mtp_mla_decode_num_splits(int B, int S, int H, int max_len, int num_sms);

/* Bytes of workspace mtp_mla_decode needs (0 when num_splits <= 1), with P = num_splits and
 * rows = (P + B - 1) * S * H: fp32 partial outputs [rows][Dl], fp32 (max, sum) pairs [rows][2] (max in
 * log2 units), the schedule (int32 [P][4], int32 [B * S][2]), each part 256-byte aligned. */
size_t mtp_mla_decode_workspace_size(int B, int S, int H, int Dl, int num_splits);

cudaError_t mtp_mla_decode(mtp_dtype dtype, const void* q, void* kv_cache, const int32_t* past_len,
                           const void* new_rows, const uint8_t* mask, void* out, void* workspace,
                           size_t workspace_bytes, int B, int S, int H, int Dl, int Dr, int T_max,
                           float scale, int num_splits, int flags, cudaStream_t stream);

/* The KV commit alone: kv_cache[b][past_len[b] + s] = new_rows[b][s] (rows >= T_max skipped). */
cudaError_t mtp_mla_kv_commit(mtp_dtype dtype, void* kv_cache, const int32_t* past_len,
                              const void* new_rows, int B, int S, int D, int T_max,
                              cudaStream_t stream);

/* Sparse MLA (DeepSeek Sparse Attention): query token s of sequence b attends only to the cache rows its
 * index list names, the same kernels as mtp_mla_decode reading the rows through the list.
 *   q         [B, S, H, D]   dtype   as mtp_mla_decode (D = Dl + Dr)
 *   kv_cache  [B, T_max, C]  dtype   C >= D values per row: the latent first (DSA rows continue with the
 *                                    indexer key); only the first D are read
 *   past_len [B]            int32   valid rows before this step
 *   new_rows  [B, S, C]      dtype   or NULL: written (all C values) to rows past_len[b] + s first
 *   selected  [B, S, K]      int32   cache rows of sequence b that query (b, s) attends to; a slot holding -1
 *                                    (or a row outside 0 .. T_max-1) is skipped (mtp_dsa_select's output)
 *   out       [B, S, H, Dl]  dtype   softmax(scale q . row) @ row[:Dl] over the listed rows; zeros if none
 * Every query token is its own sequence of K slots: num_splits = mtp_mla_decode_num_splits(B * S, 1, H, K, sms),
 * workspace = mtp_mla_decode_workspace_size(B * S, 1, H, Dl, num_splits).  B * S <= 65535.  Paths and precision as
 * mtp_mla_decode (the tensor-core path also needs C * sizeof(dtype) % 16 == 0). */
cudaError_t mtp_mla_sparse_decode(mtp_dtype dtype, const void* q, void* kv_cache, const int32_t* past_len,
                                  const void* new_rows, const int32_t* selected, void* out, void* workspace,
                                  size_t workspace_bytes, int B, int S, int H, int Dl, int Dr, int C, int T_max,
                                  int K, float scale, int num_splits, int flags, cudaStream_t stream);

/* ============================================================================================
 * 2. Acceptance of K draft tokens per sequence.  Common outputs (all int32):
 *   out_tokens   [B, K+1]  accepted drafts followed by the bonus token; unused slots = -1
 *   num_accepted [B]       drafts accepted, 0..K (new tokens = num_accepted + 1)
 *   last_index   [B]       = num_accepted: the position whose hidden state the MTP module needs
 * K >= 0, V >= 1, V < 2^30.  Argmax ties -> lowest index; a NaN counts as larger than any number
 * (the first NaN wins, as numpy.argmax).
 * ========================================================================================== */

/* Strict (greedy): accepted = longest prefix of drafts equal to the target argmax at the same
 * position; bonus = target argmax at position num_accepted.
 *   logits     [B, K+1, V] dtype, or NULL and then
 *   target_ids [B, K+1]    int32 (the argmax ids already computed). */
cudaError_t mtp_accept_strict(mtp_dtype dtype, const void* logits, const int32_t* target_ids,
                              const int32_t* drafts, int32_t* out_tokens, int32_t* num_accepted,
                              int32_t* last_index, int B, int K, int V, cudaStream_t stream);

/* Relaxed (TensorRT-LLM's relaxed acceptance for the thinking phase).  Draft i (token d) is
 * accepted when it equals the argmax at position i, or -- only while the thinking flag in effect
 * for position i is on -- when both
 *   rank(d) < topk   (rank = number of tokens j with logit_j > logit_d, or logit_j == logit_d and
 *                     j < d: the position of d in the (logit desc, index asc) order), and
 *   p(d) >= p(top1) - delta   with p = softmax(logits[b, i, :]) computed in fp32.
 * thinking [B] int32 in/out: the flag before this step; the accepted tokens (drafts in order, then
 * the bonus) are processed in order: a token == think_start_id sets it to 1, == think_end_id sets
 * it to 0.  The flag in effect for position i is the one after the tokens before i.  The final
 * flag is written back.  Bonus = argmax.  topk <= 0 disables relaxation (strict). */
cudaError_t mtp_accept_relaxed(mtp_dtype dtype, const void* logits, const int32_t* drafts,
                               int32_t* thinking, int32_t* out_tokens, int32_t* num_accepted,
                               int32_t* last_index, int B, int K, int V, int topk, float delta,
                               int think_start_id, int think_end_id, cudaStream_t stream);

/* The same as the MtpAccept plugin needs it, with no copies around it:
 *   topk [] int32 and delta [] float are read from device memory by the kernels (nothing waits
 *   for the host, so it can be captured in a CUDA graph);
 *   drafts of sequence b are drafts[b * draft_stride + i], i < K (draft_stride >= K; the plugin
 *   passes input_ids + 1 with draft_stride = S = K + 1, so the drafts are read in place);
 *   thinking_in [B] is the flag before the step, thinking_out [B] receives the flag after it
 *   (thinking_out may equal thinking_in);
 *   last_index may be NULL (then not written).
 * ABI 3 (was: dense [B, K] drafts and one in/out thinking array). */
cudaError_t mtp_accept_relaxed_dev(mtp_dtype dtype, const void* logits, const int32_t* drafts,
                                   int draft_stride, const int32_t* thinking_in, int32_t* thinking_out,
                                   int32_t* out_tokens, int32_t* num_accepted, int32_t* last_index,
                                   int B, int K, int V, const int32_t* topk, const float* delta,
                                   int think_start_id, int think_end_id, cudaStream_t stream);

/* Rejection sampling (lossless speculative sampling).
 *   p        [B, K+1, V] dtype  target probabilities (converted to fp32)
 *   q        [B, K, V]   dtype  draft probabilities (converted to fp32); may be NULL when K == 0
 *   drafts   [B, K]      int32
 *   uniforms [B, K+1]    float  in [0, 1)
 * Uniforms convention (the reference reproduces the chosen tokens exactly):
 *   u[b][i], i < K: draft i (token d) is accepted iff  u[b][i] < p_i(d) / q_i(d)  (fp32 division;
 *                   when q_i(d) <= 0: accepted iff p_i(d) > 0).  Stop at the first rejection.
 *   u[b][K]:        samples the one final token, at position n = num_accepted:
 *                   n < K  -> from w = max(p_n - q_n, 0) (fp32 subtraction),
 *                   n == K -> from w = p_K;
 *                   if all w quantise to 0 (below), from w = p_n.
 * Inverse-CDF sampling in exact integer arithmetic:
 *   W_j = floor(min(max(w_j, 0), 1) * 2^40)  (uint64),  TOT = sum_j W_j,
 *   U   = floor(u[b][K] * 2^24),             THR = floor(U * TOT / 2^24)  (exact, 128-bit),
 *   token = smallest j with W_0 + ... + W_j > THR.
 * (Tokens with w < 2^-40 cannot be drawn.) */
cudaError_t mtp_accept_rejection(mtp_dtype dtype, const void* p, const void* q,
                                 const int32_t* drafts, const float* uniforms,
                                 int32_t* out_tokens, int32_t* num_accepted, int32_t* last_index,
                                 int B, int K, int V, cudaStream_t stream);

/* ============================================================================================
 * 3. Small per-step kernels.
 * ========================================================================================== */

/* out[b] = hidden[b][clamp(last_index[b], 0, Kp1 - 1)]
 *   hidden [B, Kp1, D] dtype,  last_index [B] int32,  out [B, D] dtype. */
cudaError_t mtp_gather_last_hidden(mtp_dtype dtype, const void* hidden, const int32_t* last_index,
                                   void* out, int B, int Kp1, int D, cudaStream_t stream);

/* Past-K window of vanilla MTP mode.  For each sequence the window holds the last K accepted
 * (token, hidden) pairs, oldest first.  This step accepted n = clamp(num_accepted[b] + 1, 0, N)
 * new pairs, which are the first n rows of new_tokens [B, N] / new_hidden [B, N, D] (N = K+1 of
 * the step, e.g. out_tokens of an accept kernel and the target's hidden states).  Conceptually the
 * n new pairs are appended and only the last K kept:
 *   win'[j] = win[j + n]          if j + n < K
 *           = new[j + n - K]      otherwise            (j = 0 .. K-1)
 * so with n >= K the window is new[n-K .. n-1].  Works in place (win_out == win_in) as well as out
 * of place (then the buffers must not overlap).
 *   win_tokens_in/out [B, K] int32,  win_hidden_in/out [B, K, D] dtype. */
cudaError_t mtp_window_update(mtp_dtype dtype, const int32_t* win_tokens_in,
                              const void* win_hidden_in, const int32_t* new_tokens,
                              const void* new_hidden, const int32_t* num_accepted,
                              int32_t* win_tokens_out, void* win_hidden_out, int B, int K, int N,
                              int D, cudaStream_t stream);

/* ============================================================================================
 * 4. DeepSeek Sparse Attention: the lightning indexer's selection.
 *
 *   q_index   [B, S, Hi, Di]  dtype   the indexer's queries (roped), Hi <= 64, Hi * ceil8(Di) * 4 + 4 Hi <= 48 KiB
 *   weights   [B, S, Hi]      float   the per-head weights (weights_proj(x) / sqrt(Hi))
 *   kv_cache  [B, T_max, C]   dtype   row t holds its indexer key at values key_offset .. key_offset + Di - 1;
 *                                     the S new rows must already be committed (rows past_len[b] + s)
 *   past_len [B]             int32   valid rows before this step
 *   mask      [B, S, S]       uint8   or NULL: which new rows query s sees, as mtp_mla_decode (NULL: causal)
 *   selected  [B, S, K]       int32   out: the rows query (b, s) attends to, ascending, then -1
 * Score of a visible row t: I = sum_j weights[j] * max(0, scale * q_index[j] . key_t), fp32 (scale = Di^-0.5;
 * a NaN product stays NaN, as numpy.maximum).  The rows with the K highest scores are selected -- every visible
 * row when there are at most K; among equal scores the earlier row wins (ONNX TopK's rule; -0 equals +0); a NaN
 * score ranks above every number.
 * Workspace (16-byte aligned): per query token the scores as 32-bit keys [T_max rounded up to 4], then per query
 * token MTP_DSA_STATE_BYTES of histograms and counts; each part 256-byte aligned:
 *   align256(B * S * ceil4(T_max) * 4) + align256(B * S * MTP_DSA_STATE_BYTES)  (mtp_dsa_select_workspace_size).
 * ========================================================================================== */
#define MTP_DSA_STATE_BYTES 20992
size_t mtp_dsa_select_workspace_size(int B, int S, int T_max);

cudaError_t mtp_dsa_select(mtp_dtype dtype, const void* q_index, const float* weights, const void* kv_cache,
                           const int32_t* past_len, const uint8_t* mask, int32_t* selected, void* workspace,
                           size_t workspace_bytes, int B, int S, int Hi, int Di, int C, int key_offset, int T_max,
                           int K, float scale, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* MTP_TRT_KERNELS_H */
