// common.cuh -- small device helpers shared by the mtp-trt kernels (internal, not installed API).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

#include "mtp_kernels.h"

namespace mtp {

constexpr unsigned kFullMask = 0xffffffffu;

// ---- element conversions ------------------------------------------------------------------
template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// Two 16-bit values packed into one 32-bit register, `lo` in the low half (the lower-indexed
// element of an mma fragment pair).
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}
template <typename T> __device__ __forceinline__ uint32_t pack2_raw(T lo, T hi) {
    const uint32_t l = *reinterpret_cast<const uint16_t*>(&lo);
    const uint32_t h = *reinterpret_cast<const uint16_t*>(&hi);
    return l | (h << 16);
}
// 32-bit shared-memory load of two consecutive 16-bit elements (address must be 4-byte aligned).
template <typename T> __device__ __forceinline__ uint32_t lds32(const T* p) {
    return *reinterpret_cast<const uint32_t*>(p);
}

// Value e (0 .. 16 / sizeof(T) - 1, a constant after unrolling) of a 16-byte load, as float.
template <typename T> __device__ __forceinline__ float unpack16(const uint4& u, int e);
__device__ __forceinline__ uint32_t word_of(const uint4& u, int w) {
    return w == 0 ? u.x : w == 1 ? u.y : w == 2 ? u.z : u.w;
}
template <> __device__ __forceinline__ float unpack16<float>(const uint4& u, int e) {
    return __uint_as_float(word_of(u, e));
}
template <> __device__ __forceinline__ float unpack16<__half>(const uint4& u, int e) {
    const uint32_t w = word_of(u, e >> 1);
    return __half2float(__ushort_as_half(static_cast<unsigned short>(e & 1 ? w >> 16 : w & 0xffffu)));
}
template <> __device__ __forceinline__ float unpack16<__nv_bfloat16>(const uint4& u, int e) {
    const uint32_t w = word_of(u, e >> 1);
    return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(e & 1 ? w >> 16 : w & 0xffffu)));
}

// ---- warp reductions ----------------------------------------------------------------------
// A softmax score in log2 units, +inf (an fp32 overflow of q.row or of its scaling) taken as the largest finite
// float, so that the running max stays finite and exp2(x - max) is 1 for that row, not inf - inf = NaN; -inf (hidden)
// and NaN pass through.
__device__ __forceinline__ float finite_score(float x) { return x > 3.402823466e38f ? 3.402823466e38f : x; }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
    return v;
}

// ---- block-wide prefix sum ------------------------------------------------------------------
// Exclusive prefix sum of one value per thread over a block of THREADS threads (threadIdx.x order); *total gets
// the block's sum.  s_warp: THREADS / 32 shared slots.  Two barriers, so s_warp may be reused right after.
template <int THREADS, typename V>
__device__ __forceinline__ V block_exclusive_scan(V v, V* s_warp, V* total) {
    static_assert(THREADS % 32 == 0, "whole warps");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    V x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const V y = __shfl_up_sync(kFullMask, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) s_warp[warp] = x;
    __syncthreads();
    V before = 0, sum = 0;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) {
        const V n = s_warp[w];
        if (w < warp) before += n;
        sum += n;
    }
    __syncthreads();
    *total = sum;
    return before + x - v;
}

#ifndef MTP_EMULATE_DEVICE
// ---- thread-block clusters (sm_90+) -----------------------------------------------------------
// The cluster's size and this block's rank in it (1 and 0 in code built for an earlier arch, which the launchers
// never start as clusters: cluster_launch_possible), a barrier over all its threads that also orders their
// shared-memory accesses (__syncthreads without clusters), and the address of a shared variable in another block
// of the cluster (distributed shared memory).
__device__ __forceinline__ unsigned cluster_size() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    return __clusterSizeInBlocks();
#else
    return 1;
#endif
}
__device__ __forceinline__ unsigned cluster_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    return __clusterRelativeBlockRank();
#else
    return 0;
#endif
}
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __cluster_barrier_arrive();
    __cluster_barrier_wait();
#else
    __syncthreads();
#endif
}
template <typename T> __device__ __forceinline__ T* cluster_peer(T* p, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    return static_cast<T*>(__cluster_map_shared_rank(p, rank));
#else
    return p;
#endif
}

// Launch kernel<<<blocks, threads, smem, stream>>>(args...) in clusters of `cluster` consecutive blocks (1: none).
template <typename... Params, typename... Args>
cudaError_t launch_clusters(void (*kernel)(Params...), unsigned blocks, unsigned threads, size_t smem,
                            cudaStream_t stream, unsigned cluster, Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = cluster;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = cluster > 1 ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
}

// ---- cp.async (sm_80+) ----------------------------------------------------------------------
// Copies 16 bytes global -> shared; when !pred, writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const int n = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- ldmatrix: four 8x8 matrices of 16-bit elements ------------------------------------------
// Lanes 8m .. 8m+7 give the addresses of rows 0..7 of matrix m (16 bytes each, 16-byte aligned).
// Register m of lane i receives matrix m's (row i/4, cols 2(i%4), 2(i%4)+1): for a row-major 16x16
// block given as matrices (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15),
// (rows 8-15, cols 8-15), that is the A fragment of mma.m16n8k16.
__device__ __forceinline__ void ldsm_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, const void* row_addr) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(row_addr));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(s)
                 : "memory");
}

// ---- ldmatrix: four 8x8 matrices of 16-bit elements, transposed ------------------------------
// Lanes 8m .. 8m+7 give the addresses of rows 0..7 of matrix m (16 bytes each, 16-byte aligned).
// Register m of lane i receives matrix m's elements (row 2(i%4), col i/4) in the low half and
// (row 2(i%4)+1, col i/4) in the high half -- the B fragment of mma.m16n8k16 for a row-major
// [k][n] matrix when the rows are k and the 8 columns are n.
__device__ __forceinline__ void ldsm_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                              const void* row_addr) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(row_addr));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(s)
                 : "memory");
}

// ---- tensor cores: D = A(16x16, row) * B(16x8, col) + D, fp32 accumulate ---------------------
// Fragment layout (PTX ISA, mma.m16n8k16, 16-bit A/B), g = lane / 4, c = lane % 4:
//   a0: A[g][2c..2c+1]   a1: A[g+8][2c..2c+1]   a2: A[g][2c+8..]   a3: A[g+8][2c+8..]
//   b0: B[2c..2c+1][g]   b1: B[2c+8..2c+9][g]
//   d0,d1: D[g][2c..2c+1]   d2,d3: D[g+8][2c..2c+1]
template <typename T> struct Mma;
template <> struct Mma<__half> {
    static __device__ __forceinline__ void run(float* d, uint32_t a0, uint32_t a1, uint32_t a2,
                                               uint32_t a3, uint32_t b0, uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
};
template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float* d, uint32_t a0, uint32_t a1, uint32_t a2,
                                               uint32_t a3, uint32_t b0, uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
};

#else
// Host emulation of the primitives above, for the CPU tests only (tests/kernels/emu).
#include MTP_EMULATE_DEVICE
#endif

// ---- host helpers ---------------------------------------------------------------------------
__host__ __device__ inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
inline int dtype_size(mtp_dtype t) { return t == MTP_DTYPE_F32 ? 4 : 2; }
inline bool dtype_ok(int t) { return t == MTP_DTYPE_F32 || t == MTP_DTYPE_F16 || t == MTP_DTYPE_BF16; }

// Kernel launch status: the launch error if any (clears it), else success.
inline cudaError_t launch_status() { return cudaGetLastError(); }

// ---- per-device facts, read once per device ---------------------------------------------------------
// Per-device facts read once (devices 0..kMaxDevices-1; others are queried on every call).  Racing first
// calls store the same values.
constexpr int kMaxDevices = 64;

struct DeviceFacts {
    std::atomic<int> num_sms{0}, smem_optin{0}, cc_major{0};
};
inline DeviceFacts g_devices[kMaxDevices];

inline int current_device() {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    return dev;
}

inline int device_attribute(std::atomic<int> DeviceFacts::*slot, cudaDeviceAttr attr, int fallback) {
    const int dev = current_device();
    const bool cached = dev >= 0 && dev < kMaxDevices;
    if (cached) {
        const int v = (g_devices[dev].*slot).load(std::memory_order_relaxed);
        if (v > 0) return v;
    }
    int n = 0;
    if (dev < 0 || cudaDeviceGetAttribute(&n, attr, dev) != cudaSuccess || n <= 0) {
        cudaGetLastError();
        return fallback;
    }
    if (cached) (g_devices[dev].*slot).store(n, std::memory_order_relaxed);
    return n;
}

inline int current_num_sms() { return device_attribute(&DeviceFacts::num_sms, cudaDevAttrMultiProcessorCount, 132); }
// The compute capability's major number (9: Hopper; 0 where it cannot be read).
inline int compute_major() { return device_attribute(&DeviceFacts::cc_major, cudaDevAttrComputeCapabilityMajor, 0); }
inline int max_optin_smem() {
    return device_attribute(&DeviceFacts::smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 48 * 1024);
}

}  // namespace mtp

// Dispatch `FN<T>(args...)` on a runtime dtype.
#define MTP_DISPATCH_DTYPE(dtype, T, ...)                                        \
    switch (dtype) {                                                             \
        case MTP_DTYPE_F32: { using T = float; __VA_ARGS__; } break;             \
        case MTP_DTYPE_F16: { using T = __half; __VA_ARGS__; } break;            \
        case MTP_DTYPE_BF16: { using T = __nv_bfloat16; __VA_ARGS__; } break;    \
        default: return cudaErrorInvalidValue;                                   \
    }
