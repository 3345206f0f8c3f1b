// A CPU stand-in for the CUDA runtime, for tests only (never shipped): with it
// g++ compiles xla_ffi/kernels_cuda.cu as C++ and runs its kernels on the host.
//
// Blocks run on a pool of OS threads (so atomics race across blocks); the
// threads of a block are fibers, each run to its next synchronization
// point (__syncthreads, a shuffle, or its end) in forward or reverse order.
// __syncthreads reports a divergent barrier and deadlock, shuffles are
// warp-scoped and report lanes that never arrive, vector types assert their
// alignment, and the device attributes come from the test (cuda_shim::device()).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local

// ---- Vector types: CUDA's alignment, checked on every access ---------------

namespace cuda_shim {
[[noreturn]] void fail(const char* what);

inline void check_aligned(const void* p, std::size_t alignment, const char* type) {
  if (reinterpret_cast<uintptr_t>(p) % alignment != 0) {
    std::fprintf(stderr, "cuda_shim: misaligned %s access at %p\n", type, p);
    fail("misaligned vector access");
  }
}
}  // namespace cuda_shim

#define CUDA_SHIM_VECTOR(Name, Scalar, Align, ...)             \
  struct alignas(Align) Name {                                 \
    Scalar __VA_ARGS__;                                        \
    Name() = default;                                          \
    Name(const Name& o) {                                      \
      cuda_shim::check_aligned(&o, Align, #Name);              \
      std::memcpy(static_cast<void*>(this), &o, sizeof(Name)); \
    }                                                          \
    Name& operator=(const Name& o) {                           \
      cuda_shim::check_aligned(this, Align, #Name);            \
      cuda_shim::check_aligned(&o, Align, #Name);              \
      std::memcpy(static_cast<void*>(this), &o, sizeof(Name)); \
      return *this;                                            \
    }                                                          \
  };

CUDA_SHIM_VECTOR(uint4, unsigned int, 16, x, y, z, w)
CUDA_SHIM_VECTOR(uint2, unsigned int, 8, x, y)
CUDA_SHIM_VECTOR(float2, float, 8, x, y)
#undef CUDA_SHIM_VECTOR

inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
  uint4 v;
  v.x = x, v.y = y, v.z = z, v.w = w;
  return v;
}
inline uint2 make_uint2(unsigned x, unsigned y) {
  uint2 v;
  v.x = x, v.y = y;
  return v;
}
inline float2 make_float2(float x, float y) {
  float2 v;
  v.x = x, v.y = y;
  return v;
}

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

// CUDA's device min/max overloads, as templates over one integer type.
template <typename T>
inline T min(T a, T b) {
  return b < a ? b : a;
}
template <typename T>
inline T max(T a, T b) {
  return a < b ? b : a;
}

// ---- The runtime API the host drivers call ----------------------------------

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorNotReady = 600,
};
enum cudaDeviceAttr {
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrL2CacheSize = 38,
};
struct CUstream_st;
using cudaStream_t = CUstream_st*;
struct CUevent_st;
using cudaEvent_t = CUevent_st*;
constexpr unsigned cudaEventDisableTiming = 2;

namespace cuda_shim {

// What the test says the device is; the host drivers size grids and batches
// from it.
struct Device {
  int sms = 4;
  int l2_bytes = 1 << 20;
  int blocks_per_sm = 2;
  int workers = 2;       // OS threads running blocks
  bool reverse = false;  // run a block's fibers last to first
};
Device& device();

// Records a launch failure for cudaGetLastError, as the runtime does.
void set_error(cudaError_t error);
cudaError_t take_error();

// Runs `body` for every thread of a grid of `grid` x `block` threads.
using Body = void (*)(void* context);
void run_grid(dim3 grid, dim3 block, Body body, void* context);

// The calling GPU thread's coordinates.
struct Coordinates {
  uint3 thread_idx, block_idx, block_dim, grid_dim;
};
const Coordinates& coordinates();

// Synchronization points, implemented by the scheduler: a shuffle returns the
// value of lane `source` of the warp.
void sync_block();
uint64_t shuffle(unsigned mask, uint64_t value, int source);
uint32_t ballot(unsigned mask, bool predicate);  // bit l: lane l's predicate

// Every global access of the kernels (xla_ffi/cuda_lanes.h) is checked for its
// natural alignment and, while a log is set, appended to it: launch number (one
// per launch since the start), block, thread, the thread's access number,
// address, size, and whether it writes. An inactive access (a lane's predicate
// off) only takes its access number, as a lane's share of a warp instruction.
struct Access {
  uint32_t launch, block, thread, sequence;
  uintptr_t address;
  uint32_t bytes;
  bool write;
};
void record_access(const void* p, std::size_t bytes, bool write, bool active);
void set_access_log(std::vector<Access>* log);  // nullptr stops logging

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), int grid, int block, cudaStream_t, Args&&... args) {
  std::tuple<Params...> params(std::forward<Args>(args)...);
  struct Context {
    void (*kernel)(Params...);
    std::tuple<Params...>* params;
  } context{kernel, &params};
  run_grid(
      dim3(static_cast<unsigned>(grid)), dim3(static_cast<unsigned>(block)),
      [](void* c) {
        auto* ctx = static_cast<Context*>(c);
        std::apply(ctx->kernel, *ctx->params);
      },
      &context);
}

}  // namespace cuda_shim

#define threadIdx (::cuda_shim::coordinates().thread_idx)
#define blockIdx (::cuda_shim::coordinates().block_idx)
#define blockDim (::cuda_shim::coordinates().block_dim)
#define gridDim (::cuda_shim::coordinates().grid_dim)

inline void __syncthreads() { cuda_shim::sync_block(); }

template <typename T>
T __shfl_sync(unsigned mask, T value, int source) {
  static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = cuda_shim::shuffle(mask, bits, source % 32);
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int offset) {
  return __shfl_sync(mask, value, static_cast<int>(threadIdx.x % 32) ^ offset);
}

// One warp operation, with the shuffles' checks (mask, lanes that never arrive).
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return cuda_shim::ballot(mask, predicate != 0);
}

inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }

namespace cuda_shim {
// Applies `update` to *p atomically (a CAS loop, as CUDA does for these types).
template <typename T, typename F>
T atomic_update(T* p, F update) {
  T old;
  __atomic_load(p, &old, __ATOMIC_RELAXED);
  for (T next = update(old);
       !__atomic_compare_exchange(p, &old, &next, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
       next = update(old)) {
  }
  return old;
}
}  // namespace cuda_shim

inline int atomicMin(int32_t* p, int32_t v) {
  return cuda_shim::atomic_update(p, [v](int32_t old) { return min(old, v); });
}
inline int atomicMax(int32_t* p, int32_t v) {
  return cuda_shim::atomic_update(p, [v](int32_t old) { return max(old, v); });
}
inline double atomicAdd(double* p, double v) {
  return cuda_shim::atomic_update(p, [v](double old) { return old + v; });
}

inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  *value = attr == cudaDevAttrMultiProcessorCount ? cuda_shim::device().sms
                                                  : cuda_shim::device().l2_bytes;
  return cudaSuccess;
}
template <typename Kernel>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel, int, std::size_t) {
  *blocks = cuda_shim::device().blocks_per_sm;
  return cudaSuccess;
}
inline cudaError_t cudaGetLastError() { return cuda_shim::take_error(); }
inline const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorNotReady:
      return "device not ready";
    case cudaErrorInvalidConfiguration:
      return "invalid launch configuration";
    default:
      return "invalid argument";
  }
}

// Host streams and events (host_stream.cc): a stream counts the work enqueued
// on it and the work completed; the test (or a fake library enqueuing on it)
// decides when work completes. An event completes when the stream's completed
// count reaches the enqueued count at its record.
namespace cuda_shim {
// The default stream stands for the null cudaStream_t.
cudaStream_t resolve(cudaStream_t stream);
// Enqueues one operation; it completes at once unless `hold`, or unless an
// earlier one on the stream is still held (streams run in order).
void enqueue(cudaStream_t stream, bool hold);
// Completes everything enqueued on the stream so far.
void release(cudaStream_t stream);
int64_t pending_on(cudaStream_t stream);
}  // namespace cuda_shim

cudaError_t cudaStreamCreate(cudaStream_t* stream);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaMalloc(void** p, std::size_t bytes);
cudaError_t cudaFree(void* p);
cudaError_t cudaMemset(void* p, int value, std::size_t bytes);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDeviceCount(int* count);
template <typename T>
cudaError_t cudaMalloc(T** p, std::size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
