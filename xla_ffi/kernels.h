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

// The kernels, one entry each: X(Device, T, name, (parameters), (arguments)).
// Every list of them expands this one: the declarations below, the explicit
// instantiations in kernels_cpu.cc and kernels_cuda.cu, and the run-time ISA
// dispatch in kernels_cpu_dispatch.cc.
#define BAGUA_KERNELS(X, Device, T)                                                            \
  /* Compress n elements into k chunks. With residual_in != nullptr, compress                  \
     y = x + residual_in and write residual_out = y - decode(compressed). */                   \
  X(Device, T, minmax_compress,                                                                \
    (const T* x, const float* residual_in, int64_t n, int64_t k, uint8_t* out,                 \
     float* residual_out),                                                                     \
    (x, residual_in, n, k, out, residual_out))                                                 \
  X(Device, T, minmax_uint4_compress,                                                          \
    (const T* x, const float* residual_in, int64_t n, int64_t k, uint8_t* out,                 \
     float* residual_out),                                                                     \
    (x, residual_in, n, k, out, residual_out))                                                 \
  X(Device, T, sign_compress,                                                                  \
    (const T* x, const float* residual_in, int64_t n, int64_t k, uint8_t* out,                 \
     float* residual_out),                                                                     \
    (x, residual_in, n, k, out, residual_out))                                                 \
  /* Decode n elements compressed in k chunks. */                                              \
  X(Device, T, minmax_decompress, (const uint8_t* in, int64_t n, int64_t k, T* out),           \
    (in, n, k, out))                                                                           \
  X(Device, T, minmax_uint4_decompress, (const uint8_t* in, int64_t n, int64_t k, T* out),     \
    (in, n, k, out))                                                                           \
  X(Device, T, sign_decompress, (const uint8_t* in, int64_t n, int64_t k, T* out),             \
    (in, n, k, out))                                                                           \
  /* Decode k single-chunk buffers of m elements each and sum (or average)                     \
     them in float32 into m outputs. */                                                        \
  X(Device, T, minmax_decompress_reduce,                                                       \
    (const uint8_t* in, int64_t m, int64_t k, bool average, T* out), (in, m, k, average, out)) \
  X(Device, T, minmax_uint4_decompress_reduce,                                                 \
    (const uint8_t* in, int64_t m, int64_t k, bool average, T* out), (in, m, k, average, out)) \
  X(Device, T, sign_decompress_reduce,                                                         \
    (const uint8_t* in, int64_t m, int64_t k, bool average, T* out), (in, m, k, average, out)) \
  X(Device, T, average2, (const T* a, const T* b, int64_t n, T* out), (a, b, n, out))          \
  X(Device, T, axpy, (const T* x, float a, const T* y, int64_t n, T* out), (x, a, y, n, out))  \
  X(Device, T, async_average,                                                                  \
    (const T* x, const T* reduced, const T* snapshot, float ranks, int64_t n, T* out),         \
    (x, reduced, snapshot, ranks, n, out))                                                     \
  X(Device, T, lowprec_decentralized_diff,                                                     \
    (const T* x, const T* w, const T* left, const T* right, int64_t n, T* out),                \
    (x, w, left, right, n, out))

#define BAGUA_UNPARENTHESIZE(...) __VA_ARGS__

#define BAGUA_DECLARE_KERNEL(Device, T, name, parameters, arguments) \
  template <typename T>                                              \
  Status name(Device, BAGUA_UNPARENTHESIZE parameters);
#define BAGUA_DECLARE_KERNELS(Device) BAGUA_KERNELS(BAGUA_DECLARE_KERNEL, Device, T)

// Explicit instantiations for every element type, in the file that defines
// the kernels for `Device`.
#define BAGUA_INSTANTIATE_KERNEL(Device, T, name, parameters, arguments) \
  template Status name(Device, BAGUA_UNPARENTHESIZE parameters);
#define BAGUA_INSTANTIATE_KERNELS(Device)                \
  BAGUA_KERNELS(BAGUA_INSTANTIATE_KERNEL, Device, float) \
  BAGUA_KERNELS(BAGUA_INSTANTIATE_KERNEL, Device, Half)  \
  BAGUA_KERNELS(BAGUA_INSTANTIATE_KERNEL, Device, BFloat16)

namespace kernels {
BAGUA_DECLARE_KERNELS(Cpu)
BAGUA_DECLARE_KERNELS(Cuda)
}  // namespace kernels

}  // namespace bagua
