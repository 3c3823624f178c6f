// api.cu -- library-level entry points (version, error strings).  See mtp_kernels.h.
#include "common.cuh"

extern "C" int mtp_kernels_abi_version(void) { return 5; }  // 5: the persistent MLA decode grid, its workspace and the indexer's
extern "C" const char* mtp_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }
extern "C" int mtp_get_last_error(void) { return static_cast<int>(cudaGetLastError()); }
