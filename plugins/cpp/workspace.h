// workspace.h -- part counts and the workspace of MlaGenerationAttention's persistent grid, the same
// formulas as plugins/reference.py (mla_num_splits, mla_workspace_size), plugins/trt_plugins.py
// (mla_splits_bound, mla_workspace_bound) and mla_decode.cu, so an engine reserves the same workspace whichever
// implementation built it.  Plain C++17, no TensorRT or CUDA: tests/test_cpp_contract.py compiles
// it with g++ into a small program and compares its numbers with the Python functions.
#ifndef MTP_TRT_WORKSPACE_H
#define MTP_TRT_WORKSPACE_H

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "op_contract.h"

namespace mtp_trt {

inline int64_t align256(int64_t n) { return (n + 255) / 256 * 256; }

// mtp_mla_decode_num_splits for a GPU with num_sms SMs: the parts of the persistent grid.
inline int mla_num_splits(int64_t B, int64_t S, int64_t H, int64_t max_len, int64_t num_sms) {
    if (B <= 0 || S <= 0 || H <= 0 || max_len <= 0) return 1;
    const int64_t mblocks = (S * H + contract::kRowBlock - 1) / contract::kRowBlock;
    const int64_t by_len = (B * ((max_len + contract::kTileRows - 1) / contract::kTileRows) + contract::kMinTiles - 1) /
                           contract::kMinTiles;
    const int64_t n = std::min({num_sms / mblocks, by_len, static_cast<int64_t>(contract::kMaxSplits)});
    return static_cast<int>(std::max<int64_t>(1, n));
}

// mtp_mla_decode_workspace_size: P + B - 1 slots of partial rows, their (max, sum), the schedule.
inline int64_t mla_workspace_size(int64_t B, int64_t S, int64_t H, int64_t Dl, int64_t num_splits) {
    if (num_splits <= 1 || std::min({B, S, H, Dl}) <= 0) return 0;
    const int64_t rows = (num_splits + B - 1) * S * H;
    return align256(rows * Dl * 4) + align256(rows * 8) + align256(num_splits * 16) + align256(B * S * 8);
}

// The split count enqueue may use at most (what the workspace was reserved for).
inline int mla_splits_bound(int64_t B, int64_t S, int64_t H, int64_t max_len) {
    return mla_num_splits(B, S, H, max_len, contract::kMaxSms);
}

// Workspace for every (B, S) in [b_lo, b_hi] x [s_lo, s_hi] at its splits bound.
inline int64_t mla_workspace_bound(int64_t b_lo, int64_t b_hi, int64_t s_lo, int64_t s_hi, int64_t H, int64_t Dl,
                                   int64_t max_len) {
    b_lo = std::max<int64_t>(1, b_lo), b_hi = std::max<int64_t>(1, b_hi);
    s_lo = std::max<int64_t>(1, s_lo), s_hi = std::max<int64_t>(1, s_hi);
    int64_t best = 0;
    for (int64_t b = b_lo; b <= b_hi; ++b) {
        for (int64_t s = s_lo; s <= s_hi; ++s) {
            if ((s * H + contract::kRowBlock - 1) / contract::kRowBlock >= contract::kMaxSms) break;  // one part on
            best = std::max(best, mla_workspace_size(b, s, H, Dl, mla_splits_bound(b, s, H, max_len)));
        }
    }
    return best;
}

// mtp_dsa_select_workspace_size (trt_plugins.py dsa_workspace_size): the index scores as 32-bit keys
// [B*S, ceil4(T)], then kDsaStateBytes per query token.
inline int64_t dsa_workspace_size(int64_t B, int64_t S, int64_t T) {
    if (B <= 0 || S <= 0 || T <= 0) return 0;
    return align256(B * S * ((T + 3) / 4 * 4) * 4) + align256(B * S * contract::kDsaStateBytes);
}

// MlaSparseAttention's workspace parts for one shape (trt_plugins.py sparse_workspace_size): mtp_dsa_select's
// workspace, selected rows int32 [B*S, K], split-KV partials of every query token as a sequence of K rows.
struct SparseWorkspace {
    int64_t scores, selected, partials;
    int64_t total() const { return scores + selected + partials; }
};
inline SparseWorkspace sparse_workspace_size(int64_t B, int64_t S, int64_t H, int64_t Dl, int64_t T, int64_t K,
                                             int64_t num_splits) {
    return {dsa_workspace_size(B, S, T), align256(B * S * K * 4), mla_workspace_size(B * S, 1, H, Dl, num_splits)};
}

// The split count MlaSparseAttention may use at most.
inline int sparse_splits_bound(int64_t B, int64_t S, int64_t H, int64_t K) { return mla_splits_bound(B * S, 1, H, K); }

// MlaSparseAttention's workspace for every (B, S) in the ranges: each part at its largest.
inline int64_t sparse_workspace_bound(int64_t b_lo, int64_t b_hi, int64_t s_lo, int64_t s_hi, int64_t H, int64_t Dl,
                                      int64_t max_len, int64_t K) {
    const int64_t lo = std::max<int64_t>(1, b_lo) * std::max<int64_t>(1, s_lo);
    const int64_t hi = std::max<int64_t>(1, b_hi) * std::max<int64_t>(1, s_hi);
    const SparseWorkspace w = sparse_workspace_size(hi, 1, H, Dl, max_len, K, 1);
    return w.scores + w.selected + mla_workspace_bound(lo, hi, 1, 1, H, Dl, K);
}

}  // namespace mtp_trt

#endif  // MTP_TRT_WORKSPACE_H
