// hopper.cuh -- sm_90a building blocks for MLA decode v3 (internal): warpgroup MMA (wgmma) with both operands in
// shared memory addressed by matrix descriptors, the 128-byte swizzle those descriptors and the TMA engine share,
// and the warpgroup's fences and commit / wait groups.  Under the host emulation (tests/kernels/emu) the same
// functions are implemented by tests/kernels/emu/emu_hopper.h from the PTX ISA's definitions; the emulation checks
// that a kernel uses the layouts consistently, only a GPU can check the layouts themselves
// (tests/kernels/test_hopper.py runs the same probe on both).
//
// Shared-memory operand layouts used here (PTX ISA, "Matrix Descriptor" / "Shared Memory Matrix Layout"):
//   * 128-byte swizzle: a tile is made of 8-row atoms of 1024 bytes (8 rows of 128 bytes = 64 16-bit values); the
//     16-byte chunk j of row r of an atom is stored at chunk j ^ (r % 8).  The swizzle is a function of the shared
//     address (bits 4..6 ^= bits 7..9), so every atom starts at a 1024-byte aligned address.
//   * K-major operand (A always; B without transpose), rows m (or n) of 64 k-values: element (r, k) of a 16-wide
//     k-step at byte  start + (r / 8) * SBO + (r % 8) * 128 + 2 k  before the swizzle; a k-step further along k
//     adds 32 bytes to start (within the 128-byte row).
//   * MN-major operand (B transposed: the rows are k, 64 n-values each): element (n, k) at
//     start + (n / 64) * LBO + (k / 8) * SBO + (k % 8) * 128 + 2 (n % 64)  before the swizzle; a k-step adds 2 SBO.
// Accumulator fragment of wgmma.m64nNk16 (fp32), warp w of the warpgroup, g = lane / 4, c = lane % 4:
//   d[4 i + 0 / 1] = D[16 w + g][8 i + 2 c + 0 / 1],  d[4 i + 2 / 3] = D[16 w + g + 8][8 i + 2 c + 0 / 1].
// Named barriers (bar.sync / bar.arrive with an id and a thread count) let the two warpgroups of a block hand work
// to each other without stopping the whole block.
// TMA and mbarriers: a 3-D tensor map over matrices of rows of 16-bit values (encode_tensor_map_3d, host), box copies
// of 64 values x `rows` rows into a 128-byte-swizzled tile (tma_load_3d), completing on a shared-memory mbarrier whose
// phases the consumers wait for (mbar_*); elements outside the tensor arrive as zeros.  Rows TMA's tiled mode cannot
// gather (a sparse list's) are loaded with 16-byte cp.async into the same swizzled layout, each thread's copies
// completing on the mbarrier by cp_async_mbar_arrive.  Programmatic dependent
// launch: launch_pdl starts a kernel that may begin before the previous kernel on the stream ends; it calls
// grid_dependency_wait() before reading what that kernel wrote, and grid_launch_dependents() lets the next one start.
#pragma once

#include <cuda.h>

#include "common.cuh"

namespace mtp {
namespace hopper {

constexpr int kSwizzleNone = 0, kSwizzle128B = 1;  // descriptor bits 62..63

// The byte offset of a 16-bit matrix element in a 128-byte-swizzled tile, from its unswizzled offset (the tile at a
// 1024-byte aligned address): what TMA's CU_TENSOR_MAP_SWIZZLE_128B writes and wgmma's 128B mode reads.
__host__ __device__ constexpr uint32_t swizzle128(uint32_t off) { return off ^ (((off >> 7) & 7u) << 4); }

// A shared-memory matrix descriptor: start address, leading and stride byte offsets (16-byte units, 14 bits each),
// swizzle mode.  `saddr` is a shared-state-space address (smem_addr).
__host__ __device__ constexpr uint64_t smem_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo, int swizzle) {
    return static_cast<uint64_t>((saddr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFFu) << 16) |
           (static_cast<uint64_t>((sbo >> 4) & 0x3FFFu) << 32) | (static_cast<uint64_t>(swizzle & 3) << 62);
}

#ifndef MTP_EMULATE_DEVICE
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MTP_HAS_WGMMA 1
#endif

// Ordinary shared-memory stores made visible to the async proxy (wgmma / TMA reads) -- before the barrier.
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_fence() {
#ifdef MTP_HAS_WGMMA
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef MTP_HAS_WGMMA
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void wgmma_wait() {
#ifdef MTP_HAS_WGMMA
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Keeps the compiler from moving accumulator reads / writes across an asynchronous wgmma.
__device__ __forceinline__ void fence_regs(float (&d)[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define MTP_WGMMA_D32                                                                                            \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define MTP_WGMMA_D32_OUT()                                                                                          \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),    \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),      \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),     \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// D[64 x 64] (fp32, the fragment above) = A[64 x 16] . B[16 x 64] + (accumulate ? D : 0), asynchronous (complete
// after wgmma_commit + wgmma_wait); A K-major, B K-major (TRANS_B = false: B given as [n][k]) or MN-major
// (TRANS_B = true: B given as [k][n]), both by descriptor.  Issued by all 128 threads of a warpgroup.
template <typename T, bool TRANS_B> struct Wgmma64;

// D[64 x 256] = A[64 x 16] . B[16 x 256] + (accumulate ? D : 0): as Wgmma64 with N = 256 (one instruction where four
// m64n64k16 would read A four times), d[4 i + 0 / 1] = D[16 w + g][8 i + 2 c + 0 / 1], d[4 i + 2 / 3] = D[16 w + g +
// 8][8 i + 2 c + 0 / 1] for i < 32 -- so four Wgmma64 accumulators of consecutive 64-column blocks, laid end to end,
// are one Wgmma256 accumulator.  B by descriptor; MN-major B's 64-column blocks lie LBO bytes apart.
template <typename T, bool TRANS_B> struct Wgmma256;
#define MTP_WGMMA_D128 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
    "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, " \
    "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, " \
    "%62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, " \
    "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, " \
    "%102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, " \
    "%119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define MTP_WGMMA_F8(i) \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
        "+f"(d[i + 7])
#define MTP_WGMMA_D128_OUT()                                                                                       \
    MTP_WGMMA_F8(0), MTP_WGMMA_F8(8), MTP_WGMMA_F8(16), MTP_WGMMA_F8(24), MTP_WGMMA_F8(32), MTP_WGMMA_F8(40),      \
        MTP_WGMMA_F8(48), MTP_WGMMA_F8(56), MTP_WGMMA_F8(64), MTP_WGMMA_F8(72), MTP_WGMMA_F8(80), MTP_WGMMA_F8(88), \
        MTP_WGMMA_F8(96), MTP_WGMMA_F8(104), MTP_WGMMA_F8(112), MTP_WGMMA_F8(120)

// The instruction for both shapes: d (NACC fp32 registers: DLIST, and DOUT() the asm outputs) = A . B (+ d); the
// operands da, db, the accumulate predicate and TRANS_B numbered after d (IA, IB, IP, IT).
#define MTP_WGMMA_DEF(STRUCT, NACC, SHAPE, DLIST, DOUT, IA, IB, IP, IT, TYPE, PTXT)                                   \
    template <bool TRANS_B> struct STRUCT<TYPE, TRANS_B> {                                                           \
        static __device__ __forceinline__ void run(float (&d)[NACC], uint64_t da, uint64_t db, bool accumulate) {   \
            MTP_WGMMA_ASM(SHAPE, DLIST, DOUT, IA, IB, IP, IT, PTXT)                                                   \
        }                                                                                                             \
    };
#ifdef MTP_HAS_WGMMA
#define MTP_WGMMA_ASM(SHAPE, DLIST, DOUT, IA, IB, IP, IT, PTXT)                                                      \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" IP ", 0;\nwgmma.mma_async.sync.aligned." SHAPE ".f32." PTXT     \
                 "." PTXT " " DLIST ", %" IA ", %" IB ", p, 1, 1, 0, %" IT ";\n}\n"                                    \
                 : DOUT()                                                                                            \
                 : "l"(da), "l"(db), "r"(static_cast<int>(accumulate)), "n"(static_cast<int>(TRANS_B)));
#else
#define MTP_WGMMA_ASM(...) __trap();  // only sm_90a has wgmma; the launchers never run this elsewhere
#endif
MTP_WGMMA_DEF(Wgmma64, 32, "m64n64k16", MTP_WGMMA_D32, MTP_WGMMA_D32_OUT, "32", "33", "34", "35", __half, "f16")
MTP_WGMMA_DEF(Wgmma64, 32, "m64n64k16", MTP_WGMMA_D32, MTP_WGMMA_D32_OUT, "32", "33", "34", "35", __nv_bfloat16,
              "bf16")
MTP_WGMMA_DEF(Wgmma256, 128, "m64n256k16", MTP_WGMMA_D128, MTP_WGMMA_D128_OUT, "128", "129", "130", "131", __half,
              "f16")
MTP_WGMMA_DEF(Wgmma256, 128, "m64n256k16", MTP_WGMMA_D128, MTP_WGMMA_D128_OUT, "128", "129", "130", "131",
              __nv_bfloat16, "bf16")
#undef MTP_WGMMA_DEF
#undef MTP_WGMMA_ASM

// ---- named barriers (ids 1 .. 15; 0 is __syncthreads): `count` threads, whole warps, of the block.  named_sync waits
// until `count` threads have arrived (itself included); named_arrive counts this thread's warp and goes on, so one
// warpgroup can signal another (the shared-memory writes before the arrival are visible to the waiters).
__device__ __forceinline__ void named_sync(unsigned id, unsigned count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(unsigned id, unsigned count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// ---- mbarriers (shared memory, 8 bytes each)
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#endif
}
// The initialised barriers made visible to the async proxy (TMA) -- before the block barrier that follows the init.
__device__ __forceinline__ void mbar_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
// One arrival that also announces `bytes` of TMA transfers the current phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
#endif
}
// One arrival on `bar` once every cp.async this thread issued before has landed (the arrival counted in the barrier's
// initial count: .noinc).  What those copies wrote is visible to the threads that then wait for the phase; wgmma reads
// it only after fence_proxy_async (cp.async writes through the generic proxy).
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#endif
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n.reg .pred done;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
#endif
}

// ---- TMA: the box of 64 values x box_rows rows at (x, y) of matrix z of a 3-D tensor map into shared memory at dst,
// counted against `bar`'s transaction bytes.  One thread issues it.
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, int x, int y, int z, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::
            "r"(smem_addr(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(smem_addr(bar))
        : "memory");
#endif
}

// ---- programmatic dependent launch
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
template <typename... Params, typename... Args>
cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, unsigned threads, size_t smem, cudaStream_t stream,
                       Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
}

// A 3-D tensor map over `depth` matrices of `rows` rows of `cols` 16-bit values (rows `row_bytes` apart, a multiple of
// 16; matrices rows * row_bytes apart), boxes of 64 values x box_rows rows of one matrix landing 128-byte swizzled
// (rows past a matrix's end arrive as zeros, unread); false where the driver offers no encoder or refuses the map.
inline bool encode_tensor_map_3d(CUtensorMap* map, const void* base, uint64_t cols, uint64_t rows, uint64_t depth,
                                 uint64_t row_bytes, uint32_t box_rows) {
    using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
    static const Encode encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) !=
                cudaSuccess ||
            q != cudaDriverEntryPointSuccess) {
            cudaGetLastError();
            return static_cast<Encode>(nullptr);
        }
        return reinterpret_cast<Encode>(fn);
    }();
    if (!encode) return false;
    const cuuint64_t dims[3] = {cols, rows, depth}, strides[2] = {row_bytes, rows * row_bytes};
    const cuuint32_t box[3] = {64, box_rows, 1}, elem[3] = {1, 1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<void*>(base), dims, strides, box, elem,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

#else
// Host emulation (tests only).
#include "emu_hopper.h"
#endif

}  // namespace hopper
}  // namespace mtp
