// Host side of the CUDA kernels' launches: the stream, the device's shape, grid-
// stride launches (or the tests' CPU shim without nvcc) and their status, and the
// alignment checks. Included by kernels_cuda.cu only.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "cuda_geometry.h"
#include "kernels.h"

namespace bagua::kernels {
namespace {

using namespace cuda_geometry;

cudaStream_t stream_of(Cuda device) { return static_cast<cudaStream_t>(device.stream); }

// The current device's SM count and L2 size. A failed query leaves its error
// for launch_status to report.
DeviceInfo device_info() {
  DeviceInfo info;
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess) {
    cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device);
    cudaDeviceGetAttribute(&info.l2_bytes, cudaDevAttrL2CacheSize, device);
  }
  return info;
}

// Blocks of `kernel` that the device runs at once: the grid of a grid-stride
// launch.
template <typename Kernel>
int64_t resident_blocks(const DeviceInfo& info, Kernel kernel) {
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
  return int64_t{std::max(info.sms, 1)} * std::max(per_sm, 1);
}

// Enqueues `kernel` on `stream` with kThreads threads per block. Without nvcc,
// the tests' CPU execution shim (tests/cuda_shim) runs it on the host instead.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), int grid, cudaStream_t stream, Args&&... args) {
#if defined(__CUDACC__)
  kernel<<<grid, kThreads, 0, stream>>>(std::forward<Args>(args)...);
#else
  cuda_shim::launch(kernel, grid, kThreads, stream, std::forward<Args>(args)...);
#endif
}

Status launch_status() {
  const cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) return {};
  return Status{std::string("CUDA error: ") + cudaGetErrorString(error), /*internal=*/true};
}

bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The kernels access headers and payloads with aligned vector loads, stores
// and atomics, which a misaligned buffer would turn into a device fault.
Status check_compressed(const void* buffer) {
  if (is_aligned16(buffer)) return {};
  return Status{"the compressed buffer must be 16-byte aligned"};
}

}  // namespace
}  // namespace bagua::kernels
