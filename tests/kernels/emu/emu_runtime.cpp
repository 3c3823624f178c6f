// emu_runtime.cpp -- the few CUDA runtime calls the kernel launchers make, for the host emulation.
// Device properties come from MTP_EMU_SMS (default 132) and MTP_EMU_SMEM_OPTIN (default 232448,
// an H100; 101376 for an sm_86/89 GPU).
#include "cuda_emu.h"

static int env_int(const char* name, int dflt) {
    const char* e = std::getenv(name);
    return e ? std::atoi(e) : dflt;
}

extern "C" {
cudaError_t cudaGetDevice(int* d) {
    *d = 0;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* v, enum cudaDeviceAttr attr, int) {
    switch (attr) {
        case cudaDevAttrMultiProcessorCount: *v = env_int("MTP_EMU_SMS", 132); break;
        case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = env_int("MTP_EMU_SMEM_OPTIN", 232448); break;
        default: *v = 0;
    }
    return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void*, enum cudaFuncAttribute, int) { return cudaSuccess; }
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "invalid argument"; }
}
