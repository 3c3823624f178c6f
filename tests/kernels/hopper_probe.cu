// hopper_probe.cu -- tests only: one warpgroup multiplies A [64 x K] by B [64 x K] (or B given as [K x 64]) with
// plugins/kernels/hopper.cuh's wgmma, both operands staged in shared memory in the 128-byte-swizzled layouts MLA
// decode v3 uses.  The same source runs under the host emulation (tests/kernels/test_hopper.py) and, built for
// sm_90a, on a Hopper GPU, where it checks the emulation's reading of the PTX ISA's layouts against the hardware.
#include "hopper.cuh"

namespace {
using namespace mtp;

constexpr int kSlice = 64 * 128;  // one 64-row slice of 64 16-bit values, 128-byte swizzled: 8 atoms of 1024 bytes

// The warpgroup's m64nN fp32 accumulators (PTX ISA fragment: thread tid's warp w, row group g, column pair c)
// into d [64][N].
template <int N>
__device__ void store_d(const float (&acc)[N / 2], float* d, int tid) {
    const int w = tid / 32, g = (tid % 32) / 4, c = tid % 4;
#pragma unroll
    for (int i = 0; i < N / 8; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 2; ++e) d[(16 * w + g + 8 * h) * N + 8 * i + 2 * c + e] = acc[4 * i + 2 * h + e];
}

// cudaSuccess on a compute capability 9.0 GPU (and under the emulation), else why the probes cannot run.
cudaError_t need_sm90() {
#ifndef MTP_EMULATE_DEVICE
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev))
        return cudaErrorNoDevice;
    if (major != 9 || minor != 0) return cudaErrorNotSupported;
#endif
    return cudaSuccess;
}

// kernel<<<1, 128, smem>>>(args...) with its dynamic shared memory allowed.
// acc = A [64][K] . B (K-major A in 64-value slices; B K-major likewise, or MN-major [K][64] with TRANS_B) issued as
// K / 16 wgmma m64n64k16 in one commit group, not waited for.
template <typename T, bool TRANS_B>
__device__ void issue_product(float (&acc)[32], const void* sA, const void* sB, int K) {
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.f;
    hopper::wgmma_fence();
    const uint32_t a0 = hopper::smem_addr(sA), b0 = hopper::smem_addr(sB);
    for (int k0 = 0; k0 < K; k0 += 16) {
        const uint64_t da = hopper::smem_desc(a0 + (k0 / 64) * kSlice + (k0 % 64) * 2, 16, 1024, hopper::kSwizzle128B);
        const uint64_t db = TRANS_B ? hopper::smem_desc(b0 + k0 * 128, 0, 1024, hopper::kSwizzle128B)
                                    : hopper::smem_desc(b0 + (k0 / 64) * kSlice + (k0 % 64) * 2, 16, 1024,
                                                        hopper::kSwizzle128B);
        hopper::Wgmma64<T, TRANS_B>::run(acc, da, db, k0 > 0);
    }
    hopper::wgmma_commit();
}

template <typename... P, typename... A>
cudaError_t launch_probe(void (*kernel)(P...), size_t smem, cudaStream_t stream, A... args) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    kernel<<<1, 128, smem, stream>>>(args...);
    return cudaGetLastError();
}

// overwrite != 0: after issuing, thread 0 zeroes A's shared copy before the wait (a deliberate ordering bug; the
// emulation, which runs wgmma at the wait, must then give a different product).
template <typename T, bool TRANS_B>
__global__ void __launch_bounds__(128, 1) wgmma_probe_kernel(const T* a, const T* b, float* d, int K, int overwrite) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024u - (hopper::smem_addr(smem_raw) & 1023u)) & 1023u);
    unsigned char* sA = smem;
    unsigned char* sB = smem + (K / 64) * kSlice;
    const int tid = threadIdx.x;
    for (int i = tid; i < 64 * K; i += 128) {
        const int r = i / K, k = i % K;  // A[r][k]; B[n = r][k] (K-major) or B[k][n] as given
        const uint32_t off = (k / 64) * kSlice + (r / 8) * 1024 + (r % 8) * 128 + (k % 64) * 2;
        *reinterpret_cast<T*>(sA + hopper::swizzle128(off)) = a[i];
        if (!TRANS_B) {
            *reinterpret_cast<T*>(sB + hopper::swizzle128(off)) = b[i];
        } else {
            const int kb = i / 64, n = i % 64;  // b is [K][64]
            *reinterpret_cast<T*>(sB + hopper::swizzle128(kb * 128 + n * 2)) = b[i];
        }
    }
    hopper::fence_proxy_async();
    __syncthreads();
    float acc[32];
    issue_product<T, TRANS_B>(acc, sA, sB, K);
    if (overwrite) {
        if (tid == 0)
            for (int i = 0; i < (K / 64) * kSlice; ++i) sA[i] = 0;
        __syncthreads();
    }
    hopper::wgmma_wait<0>();
    hopper::fence_regs(acc);
    store_d<64>(acc, d, tid);
}

template <typename T, bool TRANS_B>
cudaError_t launch(const void* a, const void* b, float* d, int K, int overwrite, cudaStream_t stream) {
    return launch_probe(wgmma_probe_kernel<T, TRANS_B>, 1024 + 2 * static_cast<size_t>(K / 64) * kSlice, stream,
                        static_cast<const T*>(a), static_cast<const T*>(b), d, K, overwrite);
}
}  // namespace

// D [64][64] fp32 = A [64][K] . B^T with B [64][K] (trans_b = 0) or D = A . B with B [K][64] (trans_b = 1); fp16 or
// bf16 (mtp_dtype); K a multiple of 64, at most 576.  cudaErrorNotSupported on a GPU other than sm_90.
extern "C" cudaError_t mtp_probe_wgmma(int dtype, const void* a, const void* b, float* d, int K, int trans_b,
                                       int overwrite, cudaStream_t stream) {
    if ((dtype != MTP_DTYPE_F16 && dtype != MTP_DTYPE_BF16) || K <= 0 || K % 64 != 0 || K > 576 || !a || !b || !d)
        return cudaErrorInvalidValue;
    if (cudaError_t err = need_sm90(); err != cudaSuccess) return err;
    if (dtype == MTP_DTYPE_F16)
        return trans_b ? launch<__half, true>(a, b, d, K, overwrite, stream)
                       : launch<__half, false>(a, b, d, K, overwrite, stream);
    return trans_b ? launch<__nv_bfloat16, true>(a, b, d, K, overwrite, stream)
                   : launch<__nv_bfloat16, false>(a, b, d, K, overwrite, stream);
}

// ---- TMA: one box of 64 values x box_rows rows at (x, y, z) of a 3-D tensor map lands in shared memory (128-byte
// swizzled, on an mbarrier) and is written back unswizzled to out [box_rows][64].
namespace {
__global__ void __launch_bounds__(128, 1) tma_probe_kernel(const __grid_constant__ CUtensorMap tm, uint16_t* out,
                                                           int box_rows, int x, int y, int z) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024u - (hopper::smem_addr(smem_raw) & 1023u)) & 1023u);
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem + box_rows * 128);
    if (threadIdx.x == 0) {
        hopper::mbar_init(bar, 1);
        hopper::mbar_init_fence();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        hopper::mbar_arrive_expect_tx(bar, box_rows * 128);
        hopper::tma_load_3d(smem, &tm, x, y, z, bar);
    }
    hopper::mbar_wait(bar, 0);
    for (int i = threadIdx.x; i < box_rows * 64; i += 128)
        out[i] = *reinterpret_cast<const uint16_t*>(smem + hopper::swizzle128((i / 64) * 128 + (i % 64) * 2));
}
}  // namespace

// base: depth x rows x cols 16-bit values, rows row_bytes apart; out: [box_rows][64].
extern "C" cudaError_t mtp_probe_tma(const void* base, int cols, int rows, int depth, int row_bytes, int box_rows,
                                     int x, int y, int z, uint16_t* out, cudaStream_t stream) {
    CUtensorMap tm;
    if (!hopper::encode_tensor_map_3d(&tm, base, cols, rows, depth, row_bytes, box_rows)) return cudaErrorInvalidValue;
    return launch_probe(tma_probe_kernel, 1024 + static_cast<size_t>(box_rows) * 128 + 64, stream, tm, out, box_rows,
                        x, y, z);
}

// ---- cp.async onto an mbarrier (MLA decode v3's sparse tiles): D [64][64] fp32 = A [64][K] . B_sel^T, where row n of
// B_sel is row sel[n] of b [nrows][K] (zeros where sel[n] < 0), gathered by 16-byte cp.async straight into the
// 128-byte-swizzled K-major layout, each thread's copies completing on one mbarrier (cp.async.mbarrier.arrive.noinc,
// 128 arrivals); the threads wait for its phase and fence for the async proxy before wgmma.  skip: bit 0 leaves out
// the wait, bit 1 the fence (deliberate bugs the emulation must refuse).
namespace {
template <typename T>
__global__ void __launch_bounds__(128, 1) gather_probe_kernel(const T* a, const T* b, const int* sel, float* d, int K,
                                                              int skip) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024u - (hopper::smem_addr(smem_raw) & 1023u)) & 1023u);
    unsigned char* sA = smem;
    unsigned char* sB = smem + (K / 64) * kSlice;
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem + 2 * (K / 64) * kSlice);
    const int tid = threadIdx.x;
    if (tid == 0) {
        hopper::mbar_init(bar, 128);
        hopper::mbar_init_fence();
    }
    for (int i = tid; i < 64 * K; i += 128) {
        const int r = i / K, k = i % K;
        const uint32_t off = (k / 64) * kSlice + (r / 8) * 1024 + (r % 8) * 128 + (k % 64) * 2;
        *reinterpret_cast<T*>(sA + hopper::swizzle128(off)) = a[i];
    }
    hopper::fence_proxy_async();
    __syncthreads();
    const int chunks = K / 8;  // per row
    for (int e = tid; e < 64 * chunks; e += 128) {
        const int n = e / chunks, q = e % chunks, row = sel[n];
        cp_async16(sB + (q / 8) * kSlice + hopper::swizzle128(n * 128 + (q % 8) * 16),
                   b + static_cast<size_t>(row < 0 ? 0 : row) * K + 8 * q, row >= 0);
    }
    hopper::cp_async_mbar_arrive(bar);
    if (!(skip & 1)) hopper::mbar_wait(bar, 0);
    if (!(skip & 2)) hopper::fence_proxy_async();
    float acc[32];
    issue_product<T, false>(acc, sA, sB, K);
    hopper::wgmma_wait<0>();
    hopper::fence_regs(acc);
    if (skip & 1) hopper::mbar_wait(bar, 0);  // the copies are done before the block exits
    store_d<64>(acc, d, tid);
}
}  // namespace

// a [64][K], b [nrows][K] (fp16 or bf16, mtp_dtype), sel [64], d [64][64]; K a multiple of 64, at most 576.
extern "C" cudaError_t mtp_probe_gather(int dtype, const void* a, const void* b, const int* sel, float* d, int K,
                                        int skip, cudaStream_t stream) {
    if ((dtype != MTP_DTYPE_F16 && dtype != MTP_DTYPE_BF16) || K <= 0 || K % 64 != 0 || K > 576 || !a || !b || !sel ||
        !d)
        return cudaErrorInvalidValue;
    if (cudaError_t err = need_sm90(); err != cudaSuccess) return err;
    const size_t smem = 1024 + 2 * static_cast<size_t>(K / 64) * kSlice + 64;
    if (dtype == MTP_DTYPE_F16)
        return launch_probe(gather_probe_kernel<__half>, smem, stream, static_cast<const __half*>(a),
                            static_cast<const __half*>(b), sel, d, K, skip);
    return launch_probe(gather_probe_kernel<__nv_bfloat16>, smem, stream, static_cast<const __nv_bfloat16*>(a),
                        static_cast<const __nv_bfloat16*>(b), sel, d, K, skip);
}

// ---- wgmma m64n256k16 (MLA decode v3's seesaw P . V): D [64][256] fp32 = A [64][64] . B [64][256], A K-major, B
// MN-major as four 64-column blocks of 8 KB (a tile's four V slices), one instruction per 16 rows of B.
namespace {
template <typename T>
__global__ void __launch_bounds__(128, 1) wgmma256_probe_kernel(const T* a, const T* b, float* d) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024u - (hopper::smem_addr(smem_raw) & 1023u)) & 1023u);
    unsigned char* sA = smem;
    unsigned char* sB = smem + kSlice;
    const int tid = threadIdx.x;
    for (int i = tid; i < 64 * 64; i += 128)
        *reinterpret_cast<T*>(sA + hopper::swizzle128((i / 512) * 1024 + (i / 64 % 8) * 128 + (i % 64) * 2)) = a[i];
    for (int i = tid; i < 64 * 256; i += 128) {
        const int k = i / 256, n = i % 256;
        *reinterpret_cast<T*>(sB + (n / 64) * kSlice + hopper::swizzle128(k * 128 + (n % 64) * 2)) = b[i];
    }
    hopper::fence_proxy_async();
    __syncthreads();
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    hopper::wgmma_fence();
    const uint32_t a0 = hopper::smem_addr(sA), b0 = hopper::smem_addr(sB);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
        hopper::Wgmma256<T, true>::run(acc, hopper::smem_desc(a0 + 32 * kk, 16, 1024, hopper::kSwizzle128B),
                                       hopper::smem_desc(b0 + 2048 * kk, kSlice, 1024, hopper::kSwizzle128B), kk > 0);
    hopper::wgmma_commit();
    hopper::wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < 4; ++j) hopper::fence_regs(reinterpret_cast<float(&)[32]>(acc[32 * j]));
    store_d<256>(acc, d, tid);
}
}  // namespace

// a [64][64], b [64][256] (fp16 or bf16, mtp_dtype), d [64][256].
extern "C" cudaError_t mtp_probe_wgmma256(int dtype, const void* a, const void* b, float* d, cudaStream_t stream) {
    if ((dtype != MTP_DTYPE_F16 && dtype != MTP_DTYPE_BF16) || !a || !b || !d) return cudaErrorInvalidValue;
    if (cudaError_t err = need_sm90(); err != cudaSuccess) return err;
    const size_t smem = 1024 + 5 * static_cast<size_t>(kSlice);
    if (dtype == MTP_DTYPE_F16)
        return launch_probe(wgmma256_probe_kernel<__half>, smem, stream, static_cast<const __half*>(a),
                            static_cast<const __half*>(b), d);
    return launch_probe(wgmma256_probe_kernel<__nv_bfloat16>, smem, stream, static_cast<const __nv_bfloat16*>(a),
                        static_cast<const __nv_bfloat16*>(b), d);
}
