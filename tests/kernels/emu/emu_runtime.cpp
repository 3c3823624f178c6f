// emu_runtime.cpp -- the few CUDA runtime calls the kernel launchers make, for the host emulation.
// Device properties come from MTP_EMU_SMS (default 132), MTP_EMU_SMEM_OPTIN (default 232448,
// an H100; 101376 for an sm_86/89 GPU) and MTP_EMU_CC (compute capability, default 80: the kernels take their sm_80
// paths; 90 selects the Hopper ones); cudaGetDevice returns MTP_EMU_DEVICE (default 0); kernels report the PTX
// arch MTP_EMU_PTX (default 90).
#include "cuda_emu.h"

static int env_int(const char* name, int dflt) {
    const char* e = std::getenv(name);
    return e ? std::atoi(e) : dflt;
}

namespace emu {
std::atomic<long> counts[kCounts];
Trace trace;
}

extern "C" {
// Calls counted by the emulation (emu::Count): device-attribute queries, shared-memory limit raises, cp.async,
// block barriers.
long mtp_emu_count(int which) { return emu::counts[which].load(); }

// on = 1: start the cp.async trace (cleared); on = 0: stop it, copy up to `cap` pairs (block id, address) to `out`
// and return how many pairs it holds.
long mtp_emu_trace(int on, unsigned long long* out, long cap) {
    std::lock_guard<std::mutex> lock(emu::trace.mu);
    emu::trace.on = on != 0;
    if (on) {
        emu::trace.rows.clear();
        return 0;
    }
    const long n = static_cast<long>(emu::trace.rows.size() / 2);
    if (out) std::memcpy(out, emu::trace.rows.data(), sizeof(unsigned long long) * 2 * std::min(n, cap));
    return n;
}

cudaError_t cudaGetDevice(int* d) {
    *d = env_int("MTP_EMU_DEVICE", 0);
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* v, enum cudaDeviceAttr attr, int) {
    ++emu::counts[emu::kAttribute];
    switch (attr) {
        case cudaDevAttrMultiProcessorCount: *v = env_int("MTP_EMU_SMS", 132); break;
        case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = env_int("MTP_EMU_SMEM_OPTIN", 232448); break;
        case cudaDevAttrComputeCapabilityMajor: *v = env_int("MTP_EMU_CC", 80) / 10; break;
        case cudaDevAttrComputeCapabilityMinor: *v = env_int("MTP_EMU_CC", 80) % 10; break;
        default: *v = 0;
    }
    return cudaSuccess;
}
// The PTX arch kernels are built from: MTP_EMU_PTX (default 90, clusters; 80: none).
cudaError_t cudaFuncGetAttributes(struct cudaFuncAttributes* attr, const void*) {
    *attr = cudaFuncAttributes{};
    attr->ptxVersion = attr->binaryVersion = env_int("MTP_EMU_PTX", 90);
    return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void*, enum cudaFuncAttribute, int) {
    ++emu::counts[emu::kFuncAttribute];
    return cudaSuccess;
}
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "invalid argument"; }
}
