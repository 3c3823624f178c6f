# TensorRT's public headers for both CMake projects (plugins/cpp, samples/cpp): TensorRT_INCLUDE_DIR from
# -DTensorRT_ROOT, $TensorRT_ROOT, $TENSORRT_INCLUDE_DIR or the usual install paths; a clear error otherwise.
find_path(TensorRT_INCLUDE_DIR NvInferRuntime.h
  HINTS ${TensorRT_ROOT} $ENV{TensorRT_ROOT} $ENV{TENSORRT_INCLUDE_DIR}
  PATH_SUFFIXES include include/x86_64-linux-gnu include/aarch64-linux-gnu
  PATHS /usr /usr/local/TensorRT /opt/tensorrt)
if(NOT TensorRT_INCLUDE_DIR)
  message(FATAL_ERROR "TensorRT headers (NvInferRuntime.h) not found: pass -DTensorRT_ROOT=<TensorRT install> "
                      "or set TensorRT_ROOT / TENSORRT_INCLUDE_DIR")
endif()
