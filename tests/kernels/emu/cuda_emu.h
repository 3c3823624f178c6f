// cuda_emu.h -- host emulation of the CUDA execution model, enough to run the mtp-trt kernels on
// a CPU for tests (g++ -std=c++20 -pthread; force-included before each kernel source).
//
// Blocks run one after another (the blocks of a cluster together); the threads of a block run as
// std::threads.  __syncthreads is a std::barrier over the block, warp shuffles / __syncwarp / mma use
// a per-warp barrier and exchange slots.  Threads that return are dropped from the barriers (as exited
// threads on Volta+).  Dynamic shared memory is filled with 0xFF bytes (NaN for fp16/bf16/fp32) before
// each block.  cp.async copies happen at issue ("immediate") or at the wait that retires their
// group ("deferred"), chosen by MTP_EMU_CP_ASYNC=deferred, to flush out missing waits.
// Static __shared__ variables become function statics (shared by all blocks: blocks are serial, so
// kernels launched in clusters keep their shared state in dynamic shared memory).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __host__
#define __host__
#undef __forceinline__
#define __forceinline__ inline
#undef __shared__
#define __shared__ static
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __grid_constant__
#define __grid_constant__

using std::max;
using std::min;

namespace emu {

enum Count { kAttribute, kFuncAttribute, kCpAsync, kSyncthreads, kWgmma, kTma, kCounts };
extern std::atomic<long> counts[kCounts];  // calls the tests count (emu_runtime.cpp: mtp_emu_count);
                                           // kSyncthreads counts block barriers once per block (thread 0)

// The cp.async trace (emu_runtime.cpp: mtp_emu_trace): while on, every cp.async source address with the
// block that issued it (blockIdx x | y << 21 | z << 42), so tests can check which bytes each block reads.
struct Trace {
    std::mutex mu;
    bool on = false;
    std::vector<unsigned long long> rows;  // pairs: block id, address
};
extern Trace trace;

struct Warp {
    explicit Warp(int n) : bar(n) {}
    std::barrier<> bar;
    unsigned long long slot[32];
    uint32_t a[32][4], b[32][2];
};

// An mbarrier (emu_hopper.h): arrivals still expected in the current phase, its transaction bytes, its parity.
struct Mbar {
    long expected = 0, pending = 0, tx = 0;
    unsigned phase = 0;
    long completed = 0;                            // phases completed so far
    bool cp_async_now = false, cp_async_last = false;  // cp.async copies arrived in the current / last completed phase
};
struct NamedBar {  // a named barrier (emu_hopper.h): threads arrived in the current generation, its count, generations done
    long arrived = 0, gen = 0;
    unsigned count = 0;
};
struct TmaCopy {  // a TMA box copy (or a thread's cp.async copies and their mbarrier arrival) not yet landed
    uint32_t bar;
    long bytes;
    std::function<void()> copy;
    long arrivals = 0;  // cp_async_mbar_arrive: one arrival when the copies land
    std::vector<uint32_t> chunks;  // cp_async_mbar_arrive: the shared offsets its copies write
};

struct Block {
    std::unique_ptr<std::barrier<>> bar;
    std::vector<std::unique_ptr<Warp>> warps;
    std::vector<unsigned char> smem;
    std::mutex hmu;  // mbarriers and TMA of the block (emu_hopper.h)
    std::condition_variable hcv;
    std::map<uint32_t, Mbar> mbars;  // by shared-memory offset
    std::map<unsigned, NamedBar> named;  // by id
    std::vector<TmaCopy> tma;
    // per 16-byte chunk of shared memory written by cp.async copies handed to an mbarrier: (barrier offset << 32) |
    // the number of the phase they complete in (emu_hopper.h checks that wgmma reads them only after waiting for it)
    std::vector<uint64_t> cp_tag;
};

struct PendingCopy {
    void* dst;
    const void* src;
    bool pred;
};

struct Ctx {
    uint3 tid, bid;
    dim3 bdim, gdim;
    Block* block = nullptr;
    Warp* warp = nullptr;
    int lane = 0;
    unsigned cluster_rank = 0, cluster_size = 1;
    std::barrier<>* cluster_bar = nullptr;       // null: not a cluster launch
    std::vector<Block*>* cluster_blocks = nullptr;
    std::vector<PendingCopy> open;
    std::vector<std::vector<PendingCopy>> groups;
    std::vector<void*> issued;  // cp.async destinations since the last cp_async_wait / cp_async_mbar_arrive
    // wgmma (emu_hopper.h): issued operations not yet committed, and the committed groups not yet waited for; each
    // runs (reads shared memory, updates the issuing thread's accumulators) when a wait retires its group
    std::vector<std::function<void()>> wg_open;
    std::vector<std::vector<std::function<void()>>> wg_groups;
    // mbarriers (emu_hopper.h): the phases this thread has seen complete, per barrier offset; whether it waited for a
    // phase cp.async copies completed in and has not executed fence.proxy.async since
    std::vector<std::pair<uint32_t, long>> seen;
    bool unfenced = false;
};
inline thread_local Ctx ctx;

inline bool deferred_cp_async() {
    static const bool on = [] {
        const char* e = std::getenv("MTP_EMU_CP_ASYNC");
        return e && std::strcmp(e, "deferred") == 0;
    }();
    return on;
}

// MTP_EMU_TMA=deferred: TMA boxes and the cp.async copies a thread hands to an mbarrier (emu_hopper.h) land at the
// first wait on the barrier (read at every copy: tests switch it between launches).
inline bool deferred_tma() {
    const char* e = std::getenv("MTP_EMU_TMA");
    return e && std::strcmp(e, "deferred") == 0;
}

inline unsigned char* dyn_smem() { return ctx.block->smem.data(); }

// Blocks x .. x + cluster - 1 (same y, z) form a cluster and run at the same time; clusters run one after another.
template <typename K, typename... Args>
void run_grid(K kernel, dim3 g, dim3 b, size_t smem, unsigned cluster, Args... args) {
    const int nthreads = static_cast<int>(b.x * b.y * b.z);
    cluster = std::max(1u, cluster);
    for (unsigned bz = 0; bz < g.z; ++bz)
        for (unsigned by = 0; by < g.y; ++by)
            for (unsigned bx0 = 0; bx0 < g.x; bx0 += cluster) {
                std::vector<std::unique_ptr<Block>> blks;
                std::vector<Block*> members;
                for (unsigned c = 0; c < cluster; ++c) {
                    auto blk = std::make_unique<Block>();
                    blk->bar = std::make_unique<std::barrier<>>(nthreads);
                    for (int w = 0; w * 32 < nthreads; ++w)
                        blk->warps.push_back(std::make_unique<Warp>(std::min(32, nthreads - w * 32)));
                    blk->smem.assign(std::max<size_t>(smem, 16), 0xFF);
                    members.push_back(blk.get());
                    blks.push_back(std::move(blk));
                }
                std::barrier<> cluster_bar(static_cast<std::ptrdiff_t>(cluster) * nthreads);
                std::vector<std::thread> ts;
                ts.reserve(cluster * nthreads);
                for (unsigned c = 0; c < cluster; ++c) {
                    for (int t = 0; t < nthreads; ++t) {
                        ts.emplace_back([&, c, t]() {
                            Block& blk = *members[c];
                            ctx.tid = make_uint3(t % b.x, (t / b.x) % b.y, t / (b.x * b.y));
                            ctx.bid = make_uint3(bx0 + c, by, bz);
                            ctx.bdim = b;
                            ctx.gdim = g;
                            ctx.block = &blk;
                            ctx.warp = blk.warps[t / 32].get();
                            ctx.lane = t % 32;
                            ctx.cluster_rank = c;
                            ctx.cluster_size = cluster;
                            ctx.cluster_bar = cluster > 1 ? &cluster_bar : nullptr;
                            ctx.cluster_blocks = &members;
                            ctx.open.clear();
                            ctx.seen.clear();
                            ctx.issued.clear();
                            ctx.unfenced = false;
                            ctx.groups.clear();
                            ctx.wg_open.clear();
                            ctx.wg_groups.clear();
                            kernel(args...);
                            ctx.warp->bar.arrive_and_drop();
                            blk.bar->arrive_and_drop();
                            if (cluster > 1) cluster_bar.arrive_and_drop();
                        });
                    }
                }
                for (auto& th : ts) th.join();
            }
}

template <typename K>
auto launcher(K kernel, dim3 g, dim3 b, size_t smem = 0, cudaStream_t = nullptr) {
    return [=](auto... args) { run_grid(kernel, g, b, smem, 1u, args...); };
}

}  // namespace emu

#define threadIdx (emu::ctx.tid)
#define blockIdx (emu::ctx.bid)
#define blockDim (emu::ctx.bdim)
#define gridDim (emu::ctx.gdim)

inline void __syncthreads() {
    if (emu::ctx.tid.x == 0 && emu::ctx.tid.y == 0 && emu::ctx.tid.z == 0) ++emu::counts[emu::kSyncthreads];
    emu::ctx.block->bar->arrive_and_wait();
}
inline void __syncwarp(unsigned = 0xffffffffu) { emu::ctx.warp->bar.arrive_and_wait(); }

template <typename T>
T emu_shfl(T v, int src, bool keep_own) {
    static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
    emu::Warp& w = *emu::ctx.warp;
    std::memcpy(&w.slot[emu::ctx.lane], &v, sizeof(T));
    w.bar.arrive_and_wait();
    T r = v;
    if (!keep_own) std::memcpy(&r, &w.slot[src & 31], sizeof(T));
    w.bar.arrive_and_wait();
    return r;
}
template <typename T> T __shfl_xor_sync(unsigned, T v, int m, int = 32) { return emu_shfl(v, emu::ctx.lane ^ m, false); }
template <typename T> T __shfl_sync(unsigned, T v, int src, int = 32) { return emu_shfl(v, src, false); }
inline unsigned __ballot_sync(unsigned, int pred) {
    emu::Warp& w = *emu::ctx.warp;
    w.slot[emu::ctx.lane] = pred ? 1u : 0u;
    w.bar.arrive_and_wait();
    unsigned r = 0;
    for (int l = 0; l < 32; ++l)
        if (w.slot[l]) r |= 1u << l;
    w.bar.arrive_and_wait();
    return r;
}
template <typename T> T __shfl_up_sync(unsigned, T v, unsigned d, int = 32) {
    return emu_shfl(v, emu::ctx.lane - static_cast<int>(d), emu::ctx.lane < static_cast<int>(d));
}
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}

// cuda_runtime.h declares this C++ overload only for nvcc.
template <typename T>
inline cudaError_t cudaFuncSetAttribute(T* entry, cudaFuncAttribute attr, int value) {
    return cudaFuncSetAttribute(reinterpret_cast<const void*>(entry), attr, value);
}

// Atomics and bit casts of the kernels (dsa.cu).
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline float __uint_as_float(unsigned u) {
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
}
inline unsigned __float_as_uint(float x) {
    unsigned u;
    std::memcpy(&u, &x, sizeof u);
    return u;
}
