// emu_hopper.h -- host versions of plugins/kernels/hopper.cuh's sm_90a primitives (included there, inside namespace
// mtp::hopper, under the emulation).  Tests only.
//
// wgmma: every thread of the warpgroup computes its own accumulators of the fragment (hopper.cuh) from shared
// memory, addressing each operand element through its descriptor (start, LBO, SBO, swizzle) exactly as hopper.cuh
// documents the PTX ISA's layouts.  The operation is deferred: it runs when a wgmma_wait retires its commit group,
// reading shared memory and the accumulators then, so a kernel that overwrites an operand, or reads or writes the
// accumulators, before the wait gets a wrong result.  "Shared addresses" are offsets into the block's dynamic shared
// memory.

inline uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(static_cast<const unsigned char*>(p) - emu::ctx.block->smem.data());
}
inline void fence_proxy_async() {}
inline void wgmma_fence() {}
inline void fence_regs(float (&)[32]) {}

// Byte offset in shared memory of element (mn, k) of a 16-bit operand described by `desc` (k: 0..15 of the k-step).
inline uint32_t emu_operand_offset(uint64_t desc, int mn, int k, bool mn_major) {
    const uint32_t start = static_cast<uint32_t>(desc & 0x3FFFu) << 4;
    const uint32_t lbo = static_cast<uint32_t>((desc >> 16) & 0x3FFFu) << 4;
    const uint32_t sbo = static_cast<uint32_t>((desc >> 32) & 0x3FFFu) << 4;
    const int swizzle = static_cast<int>(desc >> 62);
    if (swizzle == kSwizzle128B) {
        const uint32_t off = mn_major ? start + (mn / 64) * lbo + (k / 8) * sbo + (k % 8) * 128 + 2 * (mn % 64)
                                      : start + (mn / 8) * sbo + (mn % 8) * 128 + 2 * k;
        return swizzle128(off);
    }
    if (swizzle == kSwizzleNone && !mn_major)  // core matrices of 8 rows x 16 bytes
        return start + (mn / 8) * sbo + (k / 8) * lbo + (mn % 8) * 16 + 2 * (k % 8);
    std::fprintf(stderr, "emu_hopper: descriptor layout not emulated (swizzle %d, %s-major)\n", swizzle,
                 mn_major ? "MN" : "K");
    std::abort();
}

template <typename T> inline float emu_smem_value(uint32_t off) {
    const std::vector<unsigned char>& smem = emu::ctx.block->smem;
    if (off + 2 > smem.size()) {
        std::fprintf(stderr, "emu_hopper: operand element at shared offset %u outside %zu bytes\n", off, smem.size());
        std::abort();
    }
    T v;
    std::memcpy(&v, smem.data() + off, 2);
    return to_f<T>(v);
}

template <typename T, bool TRANS_B> struct Wgmma64 {
    static void run(float (&d)[32], uint64_t da, uint64_t db, bool accumulate) {
        ++emu::counts[emu::kWgmma];
        const int t = static_cast<int>(emu::ctx.tid.x + emu::ctx.bdim.x * (emu::ctx.tid.y + emu::ctx.bdim.y * emu::ctx.tid.z));
        const int w = (t / 32) % 4, g = (t % 32) / 4, c = t % 4;
        float* acc = d;
        emu::ctx.wg_open.push_back([=]() {
            for (int i = 0; i < 8; ++i)
                for (int h = 0; h < 2; ++h)
                    for (int e = 0; e < 2; ++e) {
                        const int r = 16 * w + g + 8 * h, n = 8 * i + 2 * c + e;
                        float s = 0.f;
                        for (int k = 0; k < 16; ++k)
                            s += emu_smem_value<T>(emu_operand_offset(da, r, k, false)) *
                                 emu_smem_value<T>(emu_operand_offset(db, n, k, TRANS_B));
                        float& out = acc[4 * i + 2 * h + e];
                        out = (accumulate ? out : 0.f) + s;
                    }
        });
    }
};

inline void wgmma_commit() {
    emu::ctx.wg_groups.push_back(std::move(emu::ctx.wg_open));
    emu::ctx.wg_open.clear();
}
template <int N> inline void wgmma_wait() {
    auto& gs = emu::ctx.wg_groups;
    while (gs.size() > static_cast<size_t>(N)) {
        for (auto& op : gs.front()) op();
        gs.erase(gs.begin());
    }
}
