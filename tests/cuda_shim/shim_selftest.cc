// The shim's own checks, one scenario per run: `shim_selftest NAME` runs a
// small kernel that breaks one CUDA rule (the shim must abort and say why), or
// a correct one that the shim must run faithfully (exit 0).
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "cuda_runtime.h"

namespace {

constexpr int kThreads = 64;

__global__ void divergent_barrier(int*) {
  if (threadIdx.x < 32) return;  // half the block never reaches the barrier
  __syncthreads();
}

__global__ void partial_shuffle(int* out) {
  int v = static_cast<int>(threadIdx.x);
  if (threadIdx.x % 32 < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);  // half a warp
  out[threadIdx.x] = v;
}

// Half a warp waits at a shuffle, the rest of the block at a barrier.
__global__ void deadlock(int* out) {
  int v = static_cast<int>(threadIdx.x);
  if (threadIdx.x < 16)
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  else
    __syncthreads();
  out[threadIdx.x] = v;
}

__global__ void misaligned_vector(int* out) {
  alignas(16) unsigned char bytes[32] = {};
  const uint4 v = *reinterpret_cast<const uint4*>(bytes + 4);
  out[threadIdx.x] = static_cast<int>(v.x);
}

// Correct: xor shuffles exchange within the warp, atomics add up across
// blocks, and the coordinates are unsigned as on a GPU.
__global__ void faithful(int* out) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int partner = __shfl_xor_sync(0xffffffffu, lane, 5);
  if (partner != (lane ^ 5)) out[0] = -1000;
  static_assert(std::is_unsigned_v<decltype(threadIdx.x)>, "threadIdx.x is unsigned");
  if (threadIdx.x - 1 < threadIdx.x)
    atomicMax(out + 1, 0);  // 0 - 1 wraps for thread 0
  else
    atomicAdd(reinterpret_cast<double*>(out + 2), 1.0);
  __syncthreads();
  atomicAdd(reinterpret_cast<double*>(out + 4), 1.0);
}

}  // namespace

int main(int argc, char** argv) {
  const char* name = argc > 1 ? argv[1] : "";
  alignas(16) int out[8 * kThreads] = {};
  const struct {
    const char* name;
    void (*kernel)(int*);
  } scenarios[] = {
      {"divergent_barrier", divergent_barrier},
      {"partial_shuffle", partial_shuffle},
      {"deadlock", deadlock},
      {"misaligned_vector", misaligned_vector},
      {"faithful", faithful},
  };
  for (const auto& s : scenarios) {
    if (std::strcmp(s.name, name) != 0) continue;
    const int blocks = 7;
    cuda_shim::launch(s.kernel, blocks, kThreads, nullptr, out);
    if (s.kernel != faithful) return 0;  // the shim should have aborted
    double once, all;
    std::memcpy(&once, out + 2, sizeof once);
    std::memcpy(&all, out + 4, sizeof all);
    std::printf("shuffle %d, thread 0 wrapped %g times, %g threads\n", out[0], once, all);
    return out[0] == 0 && once == blocks && all == blocks * kThreads ? 0 : 1;
  }
  std::fprintf(stderr, "unknown scenario '%s'\n", name);
  return 2;
}
