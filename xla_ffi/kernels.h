// Typed kernel entry points. Each kernel has one implementation per device:
// kernels_cpu.cc (multi-threaded, vectorizable loops) and kernels_cuda.cu
// (bandwidth-bound CUDA). Inputs and outputs are validated by ops.h before a
// kernel runs, so kernels trust their arguments.
#pragma once

#include <cstdint>
#include <string>

#include "dtypes.h"

namespace bagua {

// Where a kernel runs. The CUDA stream is the one XLA or torch hands over; the
// kernels only enqueue work on it and never synchronize the host.
struct Cpu {};
struct Cuda {
  void* stream;
};

// An empty message means success; `internal` marks a failure of the device
// rather than of the caller's arguments.
struct Status {
  std::string message;
  bool internal = false;
  bool ok() const { return message.empty(); }
};

#define BAGUA_DECLARE_KERNELS(Device)                                                     \
  /* Compress n elements into k chunks. With residual_in != nullptr, compress             \
     y = x + residual_in and write residual_out = y - decode(compressed). */              \
  template <typename T>                                                                   \
  Status minmax_compress(Device, const T* x, const float* residual_in, int64_t n,         \
                         int64_t k, uint8_t* out, float* residual_out);                   \
  template <typename T>                                                                   \
  Status sign_compress(Device, const T* x, const float* residual_in, int64_t n,           \
                       int64_t k, uint8_t* out, float* residual_out);                     \
  /* Decode n elements compressed in k chunks. */                                         \
  template <typename T>                                                                   \
  Status minmax_decompress(Device, const uint8_t* in, int64_t n, int64_t k, T* out);      \
  template <typename T>                                                                   \
  Status sign_decompress(Device, const uint8_t* in, int64_t n, int64_t k, T* out);        \
  /* Decode k single-chunk buffers of m elements each and sum (or average)                \
     them in float32 into m outputs. */                                                   \
  template <typename T>                                                                   \
  Status minmax_decompress_reduce(Device, const uint8_t* in, int64_t m, int64_t k,        \
                                  bool average, T* out);                                  \
  template <typename T>                                                                   \
  Status sign_decompress_reduce(Device, const uint8_t* in, int64_t m, int64_t k,          \
                                bool average, T* out);                                    \
  template <typename T>                                                                   \
  Status average2(Device, const T* a, const T* b, int64_t n, T* out);                     \
  template <typename T>                                                                   \
  Status axpy(Device, const T* x, float a, const T* y, int64_t n, T* out);                \
  template <typename T>                                                                   \
  Status async_average(Device, const T* x, const T* reduced, const T* snapshot,           \
                       float ranks, int64_t n, T* out);                                   \
  template <typename T>                                                                   \
  Status lowprec_decentralized_diff(Device, const T* x, const T* w, const T* left,        \
                                    const T* right, int64_t n, T* out);

namespace kernels {
BAGUA_DECLARE_KERNELS(Cpu)
BAGUA_DECLARE_KERNELS(Cuda)
}  // namespace kernels

}  // namespace bagua
