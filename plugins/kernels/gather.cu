// gather.cu -- small per-step kernels: last-accepted hidden state gather and the past-K window
// update of vanilla MTP mode.  Interface and semantics: mtp_kernels.h.
//
// Both are pure copies, done in units U of 16, 4 or 2 bytes (the widest that divides a row and
// the pointers' alignment).
#include "common.cuh"

namespace mtp {
namespace {

constexpr int GT_THREADS = 128;

template <typename U>
__global__ void __launch_bounds__(GT_THREADS) gather_rows_kernel(const U* __restrict__ hidden,
                                                                 const int32_t* __restrict__ last_index,
                                                                 U* __restrict__ out, int Kp1, int units) {
    const int b = blockIdx.y;
    const int u = blockIdx.x * GT_THREADS + threadIdx.x;
    if (u >= units) return;
    int k = last_index[b];
    k = max(0, min(k, Kp1 - 1));
    out[static_cast<size_t>(b) * units + u] = hidden[(static_cast<size_t>(b) * Kp1 + k) * units + u];
}

// One thread per (sequence, unit column).  Row j of the window is rewritten in ascending j from
// rows >= j of the old window (or from the new rows), so running in place is safe: every column
// is owned by one thread.
template <typename U>
__global__ void __launch_bounds__(GT_THREADS) window_kernel(
    const int32_t* win_tok_in, const U* win_in, const int32_t* __restrict__ new_tok,
    const U* __restrict__ new_hidden, const int32_t* __restrict__ num_accepted, int32_t* win_tok_out,
    U* win_out, int K, int N, int units) {
    const int b = blockIdx.y;
    const int u = blockIdx.x * GT_THREADS + threadIdx.x;
    const int n = max(0, min(num_accepted[b] + 1, N));
    if (u < units) {
        const U* wi = win_in + static_cast<size_t>(b) * K * units + u;
        const U* nw = new_hidden + static_cast<size_t>(b) * N * units + u;
        U* wo = win_out + static_cast<size_t>(b) * K * units + u;
        for (int j = 0; j < K; ++j) {
            const U v = (j + n < K) ? wi[static_cast<size_t>(j + n) * units]
                                    : nw[static_cast<size_t>(j + n - K) * units];
            wo[static_cast<size_t>(j) * units] = v;
        }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const int32_t* ti = win_tok_in + static_cast<size_t>(b) * K;
        const int32_t* tn = new_tok + static_cast<size_t>(b) * N;
        int32_t* to = win_tok_out + static_cast<size_t>(b) * K;
        for (int j = 0; j < K; ++j) to[j] = (j + n < K) ? ti[j + n] : tn[j + n - K];
    }
}

// Widest copy unit for rows of `bytes` bytes at the given pointers.
int unit_for(size_t bytes, const void* a, const void* b, const void* c = nullptr, const void* d = nullptr) {
    auto al = [](const void* p, uintptr_t m) { return p == nullptr || (reinterpret_cast<uintptr_t>(p) & (m - 1)) == 0; };
    if (bytes % 16 == 0 && al(a, 16) && al(b, 16) && al(c, 16) && al(d, 16)) return 16;
    if (bytes % 4 == 0 && al(a, 4) && al(b, 4) && al(c, 4) && al(d, 4)) return 4;
    return 2;
}

}  // namespace
}  // namespace mtp

using namespace mtp;

extern "C" cudaError_t mtp_gather_last_hidden(mtp_dtype dtype, const void* hidden, const int32_t* last_index,
                                              void* out, int B, int Kp1, int D, cudaStream_t stream) {
    if (!dtype_ok(dtype) || B < 0 || Kp1 < 1 || D < 1 || B > 65535) return cudaErrorInvalidValue;
    if (B == 0) return cudaSuccess;
    if (!hidden || !last_index || !out) return cudaErrorInvalidValue;
    const size_t bytes = static_cast<size_t>(D) * dtype_size(dtype);
    const int unit = unit_for(bytes, hidden, out);
    const int units = static_cast<int>(bytes / unit);
    const dim3 grid((units + GT_THREADS - 1) / GT_THREADS, B);
    if (unit == 16)
        gather_rows_kernel<uint4><<<grid, GT_THREADS, 0, stream>>>(static_cast<const uint4*>(hidden), last_index,
                                                                   static_cast<uint4*>(out), Kp1, units);
    else if (unit == 4)
        gather_rows_kernel<uint32_t><<<grid, GT_THREADS, 0, stream>>>(static_cast<const uint32_t*>(hidden),
                                                                      last_index, static_cast<uint32_t*>(out),
                                                                      Kp1, units);
    else
        gather_rows_kernel<uint16_t><<<grid, GT_THREADS, 0, stream>>>(static_cast<const uint16_t*>(hidden),
                                                                      last_index, static_cast<uint16_t*>(out),
                                                                      Kp1, units);
    return cudaGetLastError();
}

extern "C" cudaError_t mtp_window_update(mtp_dtype dtype, const int32_t* win_tokens_in, const void* win_hidden_in,
                                         const int32_t* new_tokens, const void* new_hidden,
                                         const int32_t* num_accepted, int32_t* win_tokens_out,
                                         void* win_hidden_out, int B, int K, int N, int D, cudaStream_t stream) {
    if (!dtype_ok(dtype) || B < 0 || K < 0 || N < 1 || D < 1 || B > 65535) return cudaErrorInvalidValue;
    if (B == 0 || K == 0) return cudaSuccess;
    if (!win_tokens_in || !win_hidden_in || !new_tokens || !new_hidden || !num_accepted || !win_tokens_out ||
        !win_hidden_out)
        return cudaErrorInvalidValue;
    const size_t bytes = static_cast<size_t>(D) * dtype_size(dtype);
    const int unit = unit_for(bytes, win_hidden_in, new_hidden, win_hidden_out);
    const int units = static_cast<int>(bytes / unit);
    const dim3 grid((units + GT_THREADS - 1) / GT_THREADS, B);
    if (unit == 16)
        window_kernel<uint4><<<grid, GT_THREADS, 0, stream>>>(
            win_tokens_in, static_cast<const uint4*>(win_hidden_in), new_tokens, static_cast<const uint4*>(new_hidden),
            num_accepted, win_tokens_out, static_cast<uint4*>(win_hidden_out), K, N, units);
    else if (unit == 4)
        window_kernel<uint32_t><<<grid, GT_THREADS, 0, stream>>>(
            win_tokens_in, static_cast<const uint32_t*>(win_hidden_in), new_tokens,
            static_cast<const uint32_t*>(new_hidden), num_accepted, win_tokens_out,
            static_cast<uint32_t*>(win_hidden_out), K, N, units);
    else
        window_kernel<uint16_t><<<grid, GT_THREADS, 0, stream>>>(
            win_tokens_in, static_cast<const uint16_t*>(win_hidden_in), new_tokens,
            static_cast<const uint16_t*>(new_hidden), num_accepted, win_tokens_out,
            static_cast<uint16_t*>(win_hidden_out), K, N, units);
    return cudaGetLastError();
}
