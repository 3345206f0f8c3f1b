// The CUDA kernels' bandwidth on one GPU, timed alone: each kernel is called
// through its C++ entry point (xla_ffi/kernels.h) on device buffers, between
// two CUDA events, with the L2 cache flushed before every repeat; the median of
// the repeats counts the bytes the kernel reads plus the bytes it writes. Next
// to it: cudaMemcpy device to device, a 16-byte copy kernel of our own, and the
// theoretical peak (2 x memory clock x bus width).
//
// Built and run by benchmarks/gpu_check.py (its `bandwidth` step):
//   nvcc -O3 -std=c++17 -arch=sm_90 -Ixla_ffi benchmarks/kernel_bandwidth.cu
//        xla_ffi/kernels_cuda.cu -o kernel_bandwidth
//   kernel_bandwidth MiB...      e.g. kernel_bandwidth 64 1024
//   kernel_bandwidth --once MiB  each case once, untimed (for Nsight Compute)
// It prints one JSON object per line: the device, then per case {"kernel",
// "dtype", "k", "input_bytes", "bytes", "ms", "gbps"}; the references' kernels
// are "memcpy" and "copy16". Inputs are `MiB` of the kernel's dtype (float32,
// bfloat16); min-max codecs run at k = 8, 64 and 512 chunks.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels.h"
#include "layout.h"

namespace {

using bagua::BFloat16;
using bagua::Cuda;
using bagua::Format;
using bagua::Status;
namespace kernels = bagua::kernels;

constexpr int kWarmups = 3;
constexpr int kRepeats = 15;
constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kChunkCounts[] = {8, 64, 512};

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "kernel_bandwidth: %s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}

void check(const Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "kernel_bandwidth: %s: %s\n", what, s.message.c_str());
  std::exit(1);
}

// Gradient-like values from a hash of the index: uniform in [-3, 3).
template <typename T>
__global__ void fill(T* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9e3779b1u ^ seed;
    h ^= h >> 15;
    h *= 0x2c1b3c6du;
    h ^= h >> 12;
    const float v = (static_cast<float>(h >> 8) * 0x1p-24f - 0.5f) * 6.0f;
    p[i] = bagua::from_float<T>(v);
  }
}

// Our own copy at full width: 16 bytes a lane, the whole grid striding.
__global__ void copy16(const uint4* in, uint4* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    out[i] = in[i];
}

template <typename T>
T* device_array(int64_t count) {
  void* p = nullptr;
  check(cudaMalloc(&p, std::max<int64_t>(count, 1) * sizeof(T)), "cudaMalloc");
  return static_cast<T*>(p);
}

struct Bench {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  uint8_t* flush = nullptr;  // twice the L2 cache, rewritten before every repeat
  int64_t flush_bytes = 0;
  int grid = 0;  // blocks of the helper kernels: 4 per multiprocessor
  bool once = false;

  // Median milliseconds of `run` over kRepeats, each after an L2 flush. The
  // flush's memset is enqueued first, so the host's launch work hides behind it
  // and the events time the GPU's work alone. With `once`, one untimed run.
  double time_ms(const std::function<void()>& run) {
    if (once) {
      run();
      check(cudaStreamSynchronize(stream), "run");
      return 0.0;
    }
    for (int i = 0; i < kWarmups; ++i) run();
    std::vector<float> ms(kRepeats);
    for (int r = 0; r < kRepeats; ++r) {
      check(cudaMemsetAsync(flush, r & 0xff, flush_bytes, stream), "flush");
      check(cudaEventRecord(start, stream), "event");
      run();
      check(cudaEventRecord(stop, stream), "event");
      check(cudaEventSynchronize(stop), "run");
      check(cudaEventElapsedTime(&ms[r], start, stop), "elapsed");
    }
    check(cudaGetLastError(), "a kernel");
    std::sort(ms.begin(), ms.end());
    return ms[kRepeats / 2];
  }

  void report(const std::string& kernel, const char* dtype, int64_t k, int64_t input_bytes,
              double bytes, const std::function<void()>& run) {
    const double ms = time_ms(run);
    std::printf(
        "{\"kernel\": \"%s\", \"dtype\": \"%s\", \"k\": %lld, \"input_bytes\": %lld, "
        "\"bytes\": %.0f, \"ms\": %.6f, \"gbps\": %.2f}\n",
        kernel.c_str(), dtype, static_cast<long long>(k), static_cast<long long>(input_bytes),
        bytes, ms, ms > 0 ? bytes / ms / 1e6 : 0.0);
    std::fflush(stdout);
  }
};

const char* name_of(float) { return "float32"; }
const char* name_of(BFloat16) { return "bfloat16"; }

struct Codec {
  const char* name;
  Format format;
};
constexpr Codec kCodecs[] = {{"minmax_uint8", Format::kMinMaxUInt8},
                             {"minmax_uint4", Format::kMinMaxUInt4},
                             {"sign", Format::kSign}};

template <typename T>
Status compress(Format f, Cuda c, const T* x, const float* r, int64_t n, int64_t k, uint8_t* out,
                float* ro) {
  if (f == Format::kMinMaxUInt8) return kernels::minmax_compress(c, x, r, n, k, out, ro);
  if (f == Format::kMinMaxUInt4) return kernels::minmax_uint4_compress(c, x, r, n, k, out, ro);
  return kernels::sign_compress(c, x, r, n, k, out, ro);
}

template <typename T>
Status decompress(Format f, Cuda c, const uint8_t* in, int64_t n, int64_t k, T* out) {
  if (f == Format::kMinMaxUInt8) return kernels::minmax_decompress(c, in, n, k, out);
  if (f == Format::kMinMaxUInt4) return kernels::minmax_uint4_decompress(c, in, n, k, out);
  return kernels::sign_decompress(c, in, n, k, out);
}

template <typename T>
Status decompress_reduce(Format f, Cuda c, const uint8_t* in, int64_t m, int64_t k, T* out) {
  if (f == Format::kMinMaxUInt8) return kernels::minmax_decompress_reduce(c, in, m, k, true, out);
  if (f == Format::kMinMaxUInt4)
    return kernels::minmax_uint4_decompress_reduce(c, in, m, k, true, out);
  return kernels::sign_decompress_reduce(c, in, m, k, true, out);
}

template <typename T>
void run_dtype(Bench& b, int64_t input_bytes) {
  const char* dtype = name_of(T{});
  const int64_t n = input_bytes / sizeof(T);
  const int64_t element = sizeof(T);
  T* x = device_array<T>(n);
  T* y = device_array<T>(n);
  T* z = device_array<T>(n);
  T* out = device_array<T>(n);
  float* residual = device_array<float>(n);
  float* residual_out = device_array<float>(n);
  int64_t most = 0;
  for (const Codec& codec : kCodecs)
    for (const int64_t k : kChunkCounts)
      most = std::max(most, bagua::compressed_bytes(codec.format, n, k));
  uint8_t* packed = device_array<uint8_t>(most);
  fill<<<b.grid, 256, 0, b.stream>>>(x, n, 1);
  fill<<<b.grid, 256, 0, b.stream>>>(y, n, 2);
  fill<<<b.grid, 256, 0, b.stream>>>(z, n, 3);
  fill<<<b.grid, 256, 0, b.stream>>>(residual, n, 4);
  const Cuda c{b.stream};
  for (const Codec& codec : kCodecs) {
    for (const int64_t k : kChunkCounts) {
      // Sign has one group a chunk whatever k: the chunk count only matters to min-max.
      if (codec.format == Format::kSign && k != kChunkCounts[0]) continue;
      const std::string name = codec.name;
      const int64_t packed_bytes = bagua::compressed_bytes(codec.format, n, k);
      b.report(name + "_compress", dtype, k, input_bytes, double(n * element + packed_bytes), [&] {
        check(compress(codec.format, c, x, nullptr, n, k, packed, nullptr), "compress");
      });
      if (k == kChunkCounts[0])
        b.report(name + "_compress_feedback", dtype, k, input_bytes,
                 double(n * element + 4 * n + packed_bytes + 4 * n), [&] {
                   check(compress(codec.format, c, x, residual, n, k, packed, residual_out),
                         "compress with feedback");
                 });
      check(compress(codec.format, c, x, nullptr, n, k, packed, nullptr), "compress");
      if (k == kChunkCounts[0])
        b.report(name + "_decompress", dtype, k, input_bytes, double(packed_bytes + n * element),
                 [&] { check(decompress(codec.format, c, packed, n, k, out), "decompress"); });
      // The k chunks of n / k elements are k single-chunk buffers: a reduction's input.
      const int64_t m = n / k;
      b.report(name + "_decompress_reduce", dtype, k, input_bytes,
               double(packed_bytes + m * element), [&] {
                 check(decompress_reduce(codec.format, c, packed, m, k, out), "decompress_reduce");
               });
    }
  }
  b.report("axpy", dtype, 0, input_bytes, double(3 * n * element),
           [&] { check(kernels::axpy(c, x, 0.5f, y, n, out), "axpy"); });
  b.report("async_average", dtype, 0, input_bytes, double(4 * n * element),
           [&] { check(kernels::async_average(c, x, y, z, 8.0f, n, out), "async_average"); });
  b.report("memcpy", dtype, 0, input_bytes, double(2 * input_bytes), [&] {
    check(cudaMemcpyAsync(out, x, input_bytes, cudaMemcpyDeviceToDevice, b.stream), "memcpy");
  });
  b.report("copy16", dtype, 0, input_bytes, double(2 * input_bytes), [&] {
    copy16<<<b.grid, 256, 0, b.stream>>>(reinterpret_cast<const uint4*>(x),
                                         reinterpret_cast<uint4*>(out), input_bytes / 16);
  });
  for (void* p : std::initializer_list<void*>{x, y, z, out, residual, residual_out, packed})
    check(cudaFree(p), "cudaFree");
}

}  // namespace

int main(int argc, char** argv) {
  Bench b;
  std::vector<int64_t> sizes;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--once") == 0)
      b.once = true;
    else
      sizes.push_back(std::atoll(argv[i]) * kMiB);
  }
  if (sizes.empty()) {
    std::fprintf(stderr, "usage: kernel_bandwidth [--once] MiB...\n");
    return 2;
  }
  int device = 0, l2 = 0, clock_khz = 0, bus_bits = 0;
  cudaDeviceProp prop{};
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaGetDeviceProperties(&prop, device), "properties");
  check(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device), "L2 size");
  check(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device), "memory clock");
  check(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device), "bus width");
  const double peak = 2.0 * clock_khz * 1e3 * bus_bits / 8 / 1e9;
  std::printf(
      "{\"device\": \"%s\", \"sms\": %d, \"l2_bytes\": %d, \"memory_clock_khz\": %d, "
      "\"bus_bits\": %d, \"peak_gbps\": %.1f}\n",
      prop.name, prop.multiProcessorCount, l2, clock_khz, bus_bits, peak);
  check(cudaStreamCreate(&b.stream), "stream");
  check(cudaEventCreate(&b.start), "event");
  check(cudaEventCreate(&b.stop), "event");
  b.flush_bytes = std::max<int64_t>(2 * int64_t{l2}, 64 * kMiB);
  b.flush = device_array<uint8_t>(b.flush_bytes);
  b.grid = 4 * prop.multiProcessorCount;
  for (const int64_t bytes : sizes) {
    run_dtype<float>(b, bytes);
    run_dtype<BFloat16>(b, bytes);
  }
  return 0;
}
