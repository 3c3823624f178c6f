// emu_device.h -- host versions of the asm and cluster primitives of plugins/kernels/common.cuh (included
// there, inside namespace mtp, when MTP_EMULATE_DEVICE names this file).  Tests only.
//
// The mma emulation rebuilds the 16x16 A and 16x8 B matrices from all 32 lanes' registers with
// the fragment layout documented in common.cuh and gives each lane its D elements: it checks
// that the kernels use that layout consistently (not the layout itself, which only hardware can).

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
    ++emu::counts[emu::kCpAsync];
    emu::ctx.issued.push_back(smem);
    if (pred && emu::trace.on) {
        const unsigned long long id = emu::ctx.bid.x | (static_cast<unsigned long long>(emu::ctx.bid.y) << 21) |
                                      (static_cast<unsigned long long>(emu::ctx.bid.z) << 42);
        std::lock_guard<std::mutex> lock(emu::trace.mu);
        emu::trace.rows.push_back(id);
        emu::trace.rows.push_back(reinterpret_cast<unsigned long long>(gmem));
    }
    if (emu::deferred_cp_async() || emu::deferred_tma()) {
        emu::ctx.open.push_back({smem, gmem, pred});
        return;
    }
    if (pred)
        std::memcpy(smem, gmem, 16);
    else
        std::memset(smem, 0, 16);
}
__device__ __forceinline__ void cp_async_commit() {
    emu::ctx.groups.push_back(std::move(emu::ctx.open));
    emu::ctx.open.clear();
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
    emu::ctx.issued.clear();
    auto& gs = emu::ctx.groups;
    while (gs.size() > static_cast<size_t>(N)) {
        for (const auto& c : gs.front()) {
            if (c.pred)
                std::memcpy(c.dst, c.src, 16);
            else
                std::memset(c.dst, 0, 16);
        }
        gs.erase(gs.begin());
    }
}

template <typename T> inline void emu_unpack(uint32_t r, float& lo, float& hi) {
    T a, b;
    const uint16_t l = static_cast<uint16_t>(r & 0xffffu), h = static_cast<uint16_t>(r >> 16);
    std::memcpy(&a, &l, 2);
    std::memcpy(&b, &h, 2);
    lo = to_f<T>(a);
    hi = to_f<T>(b);
}

template <typename T> struct Mma {
    static void run(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
        emu::Warp& w = *emu::ctx.warp;
        const int l = emu::ctx.lane;
        w.a[l][0] = a0;
        w.a[l][1] = a1;
        w.a[l][2] = a2;
        w.a[l][3] = a3;
        w.b[l][0] = b0;
        w.b[l][1] = b1;
        w.bar.arrive_and_wait();
        float A[16][16], B[16][8];
        for (int L = 0; L < 32; ++L) {
            const int g = L >> 2, c = L & 3;
            emu_unpack<T>(w.a[L][0], A[g][2 * c], A[g][2 * c + 1]);
            emu_unpack<T>(w.a[L][1], A[g + 8][2 * c], A[g + 8][2 * c + 1]);
            emu_unpack<T>(w.a[L][2], A[g][2 * c + 8], A[g][2 * c + 9]);
            emu_unpack<T>(w.a[L][3], A[g + 8][2 * c + 8], A[g + 8][2 * c + 9]);
            emu_unpack<T>(w.b[L][0], B[2 * c][g], B[2 * c + 1][g]);
            emu_unpack<T>(w.b[L][1], B[2 * c + 8][g], B[2 * c + 9][g]);
        }
        w.bar.arrive_and_wait();
        const int g = l >> 2, c = l & 3;
        for (int k = 0; k < 16; ++k) {
            d[0] += A[g][k] * B[k][2 * c];
            d[1] += A[g][k] * B[k][2 * c + 1];
            d[2] += A[g + 8][k] * B[k][2 * c];
            d[3] += A[g + 8][k] * B[k][2 * c + 1];
        }
    }
};

// ldmatrix .x4 .trans as the PTX ISA describes it: lanes 8m..8m+7 address the rows of matrix m;
// lane i gets (row 2(i%4), col i/4) and (row 2(i%4)+1, col i/4) of each matrix.
__device__ __forceinline__ void ldsm_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                              const void* row_addr) {
    emu::Warp& w = *emu::ctx.warp;
    const int l = emu::ctx.lane;
    w.slot[l] = reinterpret_cast<unsigned long long>(row_addr);
    w.bar.arrive_and_wait();
    uint32_t r[4];
    for (int m = 0; m < 4; ++m) {
        const unsigned char* lo_row = reinterpret_cast<const unsigned char*>(w.slot[8 * m + 2 * (l % 4)]);
        const unsigned char* hi_row = reinterpret_cast<const unsigned char*>(w.slot[8 * m + 2 * (l % 4) + 1]);
        uint16_t lo, hi;
        std::memcpy(&lo, lo_row + 2 * (l / 4), 2);
        std::memcpy(&hi, hi_row + 2 * (l / 4), 2);
        r[m] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
    w.bar.arrive_and_wait();
    r0 = r[0];
    r1 = r[1];
    r2 = r[2];
    r3 = r[3];
}

// ldmatrix .x4 (not transposed): lanes 8m..8m+7 address the rows of matrix m; lane i gets
// (row i/4, cols 2(i%4), 2(i%4)+1) of each matrix.
__device__ __forceinline__ void ldsm_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, const void* row_addr) {
    emu::Warp& w = *emu::ctx.warp;
    const int l = emu::ctx.lane;
    w.slot[l] = reinterpret_cast<unsigned long long>(row_addr);
    w.bar.arrive_and_wait();
    uint32_t r[4];
    for (int m = 0; m < 4; ++m)
        std::memcpy(&r[m], reinterpret_cast<const unsigned char*>(w.slot[8 * m + l / 4]) + 4 * (l % 4), 4);
    w.bar.arrive_and_wait();
    r0 = r[0];
    r1 = r[1];
    r2 = r[2];
    r3 = r[3];
}

// Thread-block clusters: the blocks of a cluster run at the same time (cuda_emu.h run_grid), with one barrier over
// all their threads; a peer's shared variable is the same offset in its dynamic shared memory.
inline unsigned cluster_size() { return emu::ctx.cluster_size; }
inline unsigned cluster_rank() { return emu::ctx.cluster_rank; }
inline void cluster_sync() {
    if (emu::ctx.cluster_bar)
        emu::ctx.cluster_bar->arrive_and_wait();
    else
        __syncthreads();
}
template <typename T> T* cluster_peer(T* p, unsigned rank) {
    const auto off = reinterpret_cast<const unsigned char*>(p) - emu::ctx.block->smem.data();
    return reinterpret_cast<T*>((*emu::ctx.cluster_blocks)[rank]->smem.data() + off);
}
template <typename... Params, typename... Args>
cudaError_t launch_clusters(void (*kernel)(Params...), unsigned blocks, unsigned threads, size_t smem, cudaStream_t,
                            unsigned cluster, Args... args) {
    emu::run_grid(kernel, dim3(blocks), dim3(threads), smem, cluster, static_cast<Params>(args)...);
    return cudaSuccess;
}
