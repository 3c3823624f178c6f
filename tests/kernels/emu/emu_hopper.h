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
inline void fence_proxy_async() { emu::ctx.unfenced = false; }
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

// A wgmma operand element written by cp.async copies handed to an mbarrier: the issuing thread must have waited for
// the phase they completed in (`seen`, its phases at issue) -- or another thread's wait would have landed them.
inline void emu_check_visible(uint32_t off, const std::vector<std::pair<uint32_t, long>>& seen) {
    std::vector<uint64_t>& tags = emu::ctx.block->cp_tag;
    if (off / 16 >= tags.size()) return;
    const uint64_t tag = std::atomic_ref<uint64_t>(tags[off / 16]).load(std::memory_order_relaxed);
    if (!tag) return;
    const uint32_t bar = static_cast<uint32_t>(tag >> 32);
    const long phase = static_cast<long>(tag & 0xffffffffu);
    for (const auto& e : seen)
        if (e.first == bar && e.second >= phase) return;
    std::fprintf(stderr, "emu_hopper: wgmma reads shared offset %u, written by cp.async copies completing phase %ld of "
                         "the mbarrier at %u, before its issuing thread waited for that phase\n", off, phase, bar);
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

// One warpgroup product D[64 x N] (+)= A[64 x 16] . B[16 x N]: this thread's accumulators of the fragment, deferred
// to the wait that retires its commit group.
template <typename T, bool TRANS_B, int N>
inline void emu_wgmma(float* acc, uint64_t da, uint64_t db, bool accumulate) {
    ++emu::counts[emu::kWgmma];
    const int t = static_cast<int>(emu::ctx.tid.x + emu::ctx.bdim.x * (emu::ctx.tid.y + emu::ctx.bdim.y * emu::ctx.tid.z));
    const int w = (t / 32) % 4, g = (t % 32) / 4, c = t % 4;
    if (emu::ctx.unfenced) {
        std::fprintf(stderr, "emu_hopper: wgmma issued after a wait for cp.async data without fence.proxy.async\n");
        std::abort();
    }
    const std::vector<std::pair<uint32_t, long>> seen = emu::ctx.seen;
    emu::ctx.wg_open.push_back([=]() {
        for (int i = 0; i < N / 8; ++i)
            for (int h = 0; h < 2; ++h)
                for (int e = 0; e < 2; ++e) {
                    const int r = 16 * w + g + 8 * h, n = 8 * i + 2 * c + e;
                    float s = 0.f;
                    for (int k = 0; k < 16; ++k) {
                        const uint32_t oa = emu_operand_offset(da, r, k, false);
                        const uint32_t ob = emu_operand_offset(db, n, k, TRANS_B);
                        emu_check_visible(oa, seen);
                        emu_check_visible(ob, seen);
                        s += emu_smem_value<T>(oa) * emu_smem_value<T>(ob);
                    }
                    float& out = acc[4 * i + 2 * h + e];
                    out = (accumulate ? out : 0.f) + s;
                }
    });
}
template <typename T, bool TRANS_B> struct Wgmma64 {
    static void run(float (&d)[32], uint64_t da, uint64_t db, bool accumulate) {
        emu_wgmma<T, TRANS_B, 64>(d, da, db, accumulate);
    }
};
template <typename T, bool TRANS_B> struct Wgmma256 {
    static void run(float (&d)[128], uint64_t da, uint64_t db, bool accumulate) {
        emu_wgmma<T, TRANS_B, 256>(d, da, db, accumulate);
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

// ---- named barriers: per id, the threads arrived in the current generation; a generation completes when `count`
// have arrived (bar.sync waits for that, bar.arrive does not).  More arrivals on one generation than its count, or
// another count for the same generation, abort.
inline void emu_named(unsigned id, unsigned count, bool wait) {
    emu::Block& blk = *emu::ctx.block;
    if (id == 0 || id > 15 || count == 0 || count % 32) {
        std::fprintf(stderr, "emu_hopper: named barrier id %u count %u\n", id, count);
        std::abort();
    }
    std::unique_lock<std::mutex> lock(blk.hmu);
    emu::NamedBar& nb = blk.named[id];
    if (nb.arrived == 0) nb.count = count;
    if (nb.count != count) {
        std::fprintf(stderr, "emu_hopper: named barrier %u: count %u in a generation of count %u\n", id, count, nb.count);
        std::abort();
    }
    const long gen = nb.gen;
    if (++nb.arrived == static_cast<long>(count)) {
        nb.arrived = 0;
        ++nb.gen;
        blk.hcv.notify_all();
        return;
    }
    if (!wait) return;
    if (!blk.hcv.wait_for(lock, std::chrono::seconds(60), [&] { return nb.gen != gen; })) {
        std::fprintf(stderr, "emu_hopper: named barrier %u (count %u) never completes\n", id, count);
        for (const auto& [other, st] : blk.named)
            std::fprintf(stderr, "  named barrier %u: %ld of %u arrived, %ld generations done\n", other, st.arrived,
                         st.count, st.gen);
        std::abort();
    }
}
inline void named_sync(unsigned id, unsigned count) { emu_named(id, count, true); }
inline void named_arrive(unsigned id, unsigned count) { emu_named(id, count, false); }

// ---- mbarriers and TMA.  A barrier's state lives beside the block (Block::mbars, by shared offset), not in its 8
// bytes.  TMA copies land at issue (MTP_EMU_TMA unset or "immediate": a stage refilled while it is still being read
// corrupts the reader) or when a thread first waits on their barrier ("deferred": data read without waiting is
// stale); the tests run both.  The trace (mtp_emu_trace) records every 16-byte chunk a box reads inside the tensor.
inline bool emu_tma_deferred() { return emu::deferred_tma(); }

struct EmuTensorMap {  // what encode_tensor_map_3d stores in the CUtensorMap under the emulation
    const unsigned char* base;
    uint64_t cols, rows, depth, row_bytes;
    uint32_t box_rows;
};
static_assert(sizeof(EmuTensorMap) <= sizeof(CUtensorMap), "tensor map");

inline bool encode_tensor_map_3d(CUtensorMap* map, const void* base, uint64_t cols, uint64_t rows, uint64_t depth,
                                 uint64_t row_bytes, uint32_t box_rows) {
    if (row_bytes % 16 || reinterpret_cast<uintptr_t>(base) % 16 || box_rows == 0 || box_rows > 256 || cols < 1)
        return false;
    EmuTensorMap m{static_cast<const unsigned char*>(base), cols, rows, depth, row_bytes, box_rows};
    std::memset(map, 0, sizeof(*map));
    std::memcpy(map, &m, sizeof(m));
    return true;
}

inline void emu_mbar_complete_if_done(emu::Mbar& b) {  // under hmu
    if (b.pending == 0 && b.tx == 0) {
        b.phase ^= 1u;
        ++b.completed;
        b.cp_async_last = b.cp_async_now;
        b.cp_async_now = false;
        b.pending = b.expected;
        emu::ctx.block->hcv.notify_all();
    }
}

inline void mbar_init(uint64_t* bar, unsigned count) {
    std::lock_guard<std::mutex> lock(emu::ctx.block->hmu);
    emu::ctx.block->mbars[smem_addr(bar)] = emu::Mbar{static_cast<long>(count), static_cast<long>(count), 0, 0};
}
inline void mbar_init_fence() {}
inline void mbar_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
    std::lock_guard<std::mutex> lock(emu::ctx.block->hmu);
    auto it = emu::ctx.block->mbars.find(smem_addr(bar));
    if (it == emu::ctx.block->mbars.end()) {
        std::fprintf(stderr, "emu_hopper: arrive on an mbarrier never initialised\n");
        std::abort();
    }
    it->second.tx += bytes;
    --it->second.pending;
    emu_mbar_complete_if_done(it->second);
}
inline void emu_land(emu::TmaCopy& c) {  // under hmu
    c.copy();
    auto& b = emu::ctx.block->mbars.at(c.bar);
    if (c.arrivals) {
        std::vector<uint64_t>& tags = emu::ctx.block->cp_tag;
        const uint64_t tag = (static_cast<uint64_t>(c.bar) << 32) | static_cast<uint64_t>(b.completed + 1);
        for (uint32_t off : c.chunks)
            std::atomic_ref<uint64_t>(tags.at(off / 16)).store(tag, std::memory_order_relaxed);
        b.cp_async_now = true;
    }
    b.tx -= c.bytes;
    b.pending -= c.arrivals;
    if (b.pending < 0) {
        std::fprintf(stderr, "emu_hopper: more arrivals on an mbarrier phase than its count\n");
        std::abort();
    }
    emu_mbar_complete_if_done(b);
}
// cp.async.mbarrier.arrive.noinc: the thread's cp.async copies not yet landed (MTP_EMU_CP_ASYNC=deferred or
// MTP_EMU_TMA=deferred; committed or not -- the emulation takes them out of their groups) land together with one
// arrival on `bar`: at once, or (MTP_EMU_TMA=deferred) at the first wait on the barrier, so a reader that does not
// wait for the phase reads stale shared memory.
inline void cp_async_mbar_arrive(uint64_t* bar) {
    std::vector<emu::PendingCopy> mine;
    for (auto& g : emu::ctx.groups) mine.insert(mine.end(), g.begin(), g.end());
    mine.insert(mine.end(), emu::ctx.open.begin(), emu::ctx.open.end());
    emu::ctx.groups.clear();
    emu::ctx.open.clear();
    auto copy = [mine]() {
        for (const auto& c : mine) {
            if (c.pred)
                std::memcpy(c.dst, c.src, 16);
            else
                std::memset(c.dst, 0, 16);
        }
    };
    emu::TmaCopy c{smem_addr(bar), 0, copy, 1};
    for (void* dst : emu::ctx.issued) c.chunks.push_back(smem_addr(dst));  // landed at issue or with this arrival
    emu::ctx.issued.clear();
    std::lock_guard<std::mutex> lock(emu::ctx.block->hmu);
    if (emu::ctx.block->cp_tag.empty()) emu::ctx.block->cp_tag.assign(emu::ctx.block->smem.size() / 16 + 1, 0);
    if (emu::ctx.block->mbars.find(c.bar) == emu::ctx.block->mbars.end()) {
        std::fprintf(stderr, "emu_hopper: cp.async arrival on an mbarrier never initialised\n");
        std::abort();
    }
    if (emu_tma_deferred()) {
        emu::ctx.block->tma.push_back(std::move(c));
        emu::ctx.block->hcv.notify_all();
    } else {
        emu_land(c);
    }
}
inline void mbar_wait(uint64_t* bar, unsigned parity) {
    emu::Block& blk = *emu::ctx.block;
    const uint32_t off = smem_addr(bar);
    std::unique_lock<std::mutex> lock(blk.hmu);
    auto land = [&] {  // deferred copies on this barrier land now (and those handed to it while this thread waits)
        for (size_t i = 0; i < blk.tma.size();) {
            if (blk.tma[i].bar == off) {
                emu::TmaCopy c = std::move(blk.tma[i]);
                blk.tma.erase(blk.tma.begin() + static_cast<long>(i));
                emu_land(c);
            } else {
                ++i;
            }
        }
    };
    land();
    auto it = blk.mbars.find(off);
    if (it == blk.mbars.end()) {
        std::fprintf(stderr, "emu_hopper: wait on an mbarrier never initialised\n");
        std::abort();
    }
    if (!blk.hcv.wait_for(lock, std::chrono::seconds(60), [&] {
            land();
            return it->second.phase != parity;
        })) {
        std::fprintf(stderr, "emu_hopper: mbarrier wait (parity %u) never completes\n", parity);
        std::abort();
    }
    bool known = false;  // the phases this thread has now seen complete
    for (auto& e : emu::ctx.seen)
        if (e.first == off) {
            e.second = std::max(e.second, it->second.completed);
            known = true;
        }
    if (!known) emu::ctx.seen.emplace_back(off, it->second.completed);
    if (it->second.cp_async_last) emu::ctx.unfenced = true;
}

inline void tma_load_3d(void* dst, const CUtensorMap* map, int x, int y, int z, uint64_t* bar) {
    ++emu::counts[emu::kTma];
    EmuTensorMap m;
    std::memcpy(&m, map, sizeof(m));
    unsigned char* out = static_cast<unsigned char*>(dst);
    if (smem_addr(out) % 1024) {
        std::fprintf(stderr, "emu_hopper: 128-byte-swizzled TMA destination not 1024-byte aligned\n");
        std::abort();
    }
    if (emu::trace.on) {
        const unsigned long long id = emu::ctx.bid.x | (static_cast<unsigned long long>(emu::ctx.bid.y) << 21) |
                                      (static_cast<unsigned long long>(emu::ctx.bid.z) << 42);
        std::lock_guard<std::mutex> lock(emu::trace.mu);
        for (uint32_t r = 0; r < m.box_rows; ++r)
            for (int ch = 0; ch < 8; ++ch) {
                const uint64_t row = static_cast<uint64_t>(y) + r, col = static_cast<uint64_t>(x) + 8 * ch;
                if (y + static_cast<long long>(r) < 0 || z < 0 || row >= m.rows || col >= m.cols ||
                    static_cast<uint64_t>(z) >= m.depth)
                    continue;
                emu::trace.rows.push_back(id);
                emu::trace.rows.push_back(reinterpret_cast<unsigned long long>(
                    m.base + (static_cast<uint64_t>(z) * m.rows + row) * m.row_bytes + 2 * col));
            }
    }
    auto copy = [m, out, x, y, z]() {
        for (uint32_t r = 0; r < m.box_rows; ++r)
            for (int cidx = 0; cidx < 64; ++cidx) {
                const long long row = static_cast<long long>(y) + r, col = static_cast<long long>(x) + cidx;
                uint16_t v = 0;
                if (row >= 0 && col >= 0 && z >= 0 && static_cast<uint64_t>(row) < m.rows &&
                    static_cast<uint64_t>(col) < m.cols && static_cast<uint64_t>(z) < m.depth)
                    std::memcpy(&v, m.base + (static_cast<uint64_t>(z) * m.rows + row) * m.row_bytes + 2 * col, 2);
                std::memcpy(out + swizzle128(r * 128 + 2 * cidx), &v, 2);
            }
    };
    emu::TmaCopy c{smem_addr(bar), static_cast<long>(m.box_rows) * 128, copy};
    std::lock_guard<std::mutex> lock(emu::ctx.block->hmu);
    if (emu_tma_deferred()) {
        emu::ctx.block->tma.push_back(std::move(c));
        emu::ctx.block->hcv.notify_all();  // a thread already waiting on the barrier lands it
    } else {
        emu_land(c);
    }
}

inline void grid_dependency_wait() {}
inline void grid_launch_dependents() {}
template <typename... Params, typename... Args>
cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, unsigned threads, size_t smem, cudaStream_t,
                       Args... args) {
    emu::run_grid(kernel, grid, dim3(threads), smem, 1u, static_cast<Params>(args)...);
    return cudaSuccess;
}
