// CUDA implementations of the kernels. They are memory-bound, so the design is
// about moving bytes with few instructions:
//
// * A warp works on steps of 256 consecutive elements; each lane holds 8 of
//   them as slots of V consecutive elements, and slot j of lane l starts at
//   element V * (32 * j + l) of the step. Every warp-wide access is therefore
//   contiguous: with V = 4 a float4 (or 8 bytes of 16-bit values) and 4 codes
//   per lane, with V = 1 plain coalesced scalars. Chunked kernels use V = 4
//   when every chunk starts 16-byte aligned, else V = 1, which keeps arbitrary
//   chunk starts at full bandwidth.
// * Loops stride over the grid, and grids are sized to the blocks the device
//   holds at once, so one launch covers any tensor.
// * Compression needs no scratch memory: init gives each chunk header the
//   identity of its reduction; stats reduces (chunk, segment) tiles, one per
//   block, and folds each into its chunk header with atomics; encode derives
//   lo/hi or the scale from the header and writes codes or bits and the
//   error-feedback residual; finalize turns the headers into their final bytes.
//   Encode rereads the input, so stats and encode run over batches of chunks
//   that fit in the L2 cache, which serves the second read.
//
// All arithmetic goes through bagua::math and the dtype conversions, which are
// the same code the CPU kernels run, so the bytes agree with them. Compressed
// buffers must be 16-byte aligned (the layout aligns every slot relative to
// the buffer's start); tensors may have any alignment of their element type.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "cuda_geometry.h"
#include "kernels.h"
#include "layout.h"
#include "numerics.h"

namespace bagua::kernels {
namespace {

using namespace cuda_geometry;

constexpr uint32_t kFullMask = 0xffffffffu;

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

// ---- Where a lane's elements lie -------------------------------------------

__device__ int lane_id() { return threadIdx.x % 32; }

// One warp step: elements [base, base + kStep) of a range of `length`
// elements, seen from the calling lane.
template <int V>
struct Step {
  static constexpr int kSlots = kPerLane / V;
  int64_t base;
  int64_t length;

  // First element of slot j, and how many of its V elements exist.
  __device__ int64_t at(int j) const { return base + V * (32 * j + lane_id()); }
  __device__ int count(int j) const {
    return static_cast<int>(max(int64_t{0}, min(int64_t{V}, length - at(j))));
  }
};

// ---- Loads and stores of one slot ------------------------------------------

// Four elements of T in one access: 16 bytes of float, 8 of a 16-bit type.
template <typename T>
using Vector = std::conditional_t<sizeof(T) == 4, uint4, uint2>;

__device__ uint32_t component(const uint4& r, int i) {
  return i == 0 ? r.x : i == 1 ? r.y : i == 2 ? r.z : r.w;
}
__device__ uint32_t component(const uint2& r, int i) { return i == 0 ? r.x : r.y; }

template <typename T>
__device__ float unpack(const Vector<T>& raw, int u) {
  if constexpr (sizeof(T) == 4)
    return bits_float(component(raw, u));
  else
    return to_float(T{static_cast<uint16_t>(component(raw, u / 2) >> (16 * (u % 2)))});
}

template <typename T>
__device__ Vector<T> pack(const float* v) {
  if constexpr (sizeof(T) == 4) {
    return make_uint4(float_bits(v[0]), float_bits(v[1]), float_bits(v[2]), float_bits(v[3]));
  } else {
    const auto pair = [&](int u) {
      return uint32_t{from_float<T>(v[u]).bits} | uint32_t{from_float<T>(v[u + 1]).bits} << 16;
    };
    return make_uint2(pair(0), pair(2));
  }
}

template <typename T>
__device__ bool vector_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(Vector<T>) == 0;
}

// Reads `count` <= V elements as float; missing ones read as 0. A full slot of
// V = 4 at an aligned address is one vector load.
template <int V, typename T>
__device__ void load_slot(const T* p, int count, float* v) {
  if (V == 4 && count == 4 && vector_aligned(p)) {
    const Vector<T> raw = *reinterpret_cast<const Vector<T>*>(p);
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = unpack<T>(raw, u);
    return;
  }
#pragma unroll
  for (int u = 0; u < V; ++u) v[u] = u < count ? to_float(p[u]) : 0.0f;
}

// A plain vector store, in PTX because the compiler splits a C++ one when it
// merges it with the scalar stores of the fallback path. Host compilers (the
// tests' CPU shim) take the C++ store.
__device__ void store_vector(uint4* p, uint4 v) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};"
               :
               : "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
#else
  *p = v;
#endif
}
__device__ void store_vector(uint2* p, uint2 v) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.global.v2.b32 [%0], {%1, %2};" : : "l"(p), "r"(v.x), "r"(v.y) : "memory");
#else
  *p = v;
#endif
}

template <int V, typename T>
__device__ void store_slot(T* p, int count, const float* v) {
  if (V == 4 && count == 4 && vector_aligned(p)) {
    store_vector(reinterpret_cast<Vector<T>*>(p), pack<T>(v));
    return;
  }
#pragma unroll
  for (int u = 0; u < V; ++u)
    if (u < count) p[u] = from_float<T>(v[u]);
}

// V <= 4 bytes (codes), byte u in bits 8u..8u+7; a full slot of 4 is one
// 4-byte access, aligned because payloads are 16-byte aligned.
template <int V>
__device__ uint32_t load_bytes(const uint8_t* p, int count) {
  if (V == 4 && count == 4) return *reinterpret_cast<const uint32_t*>(p);
  uint32_t word = 0;
#pragma unroll
  for (int u = 0; u < V; ++u)
    if (u < count) word |= uint32_t{p[u]} << (8 * u);
  return word;
}

template <int V>
__device__ void store_bytes(uint8_t* p, int count, uint32_t word) {
  if (V == 4 && count == 4) {
    *reinterpret_cast<uint32_t*>(p) = word;
    return;
  }
#pragma unroll
  for (int u = 0; u < V; ++u)
    if (u < count) p[u] = static_cast<uint8_t>(word >> (8 * u));
}

// The V codes of kBits bits of elements at..at+V-1 of a chunk (at % V == 0),
// code u in bits kBits*u of the word. 4-bit codes pack two to a byte, element
// 2i in the low nibble of byte i (layout.h): V = 4 is one 2-byte access; with
// V = 1, lanes l and l ^ 1 (elements 2i and 2i + 1) share a byte.
template <int kBits, int V>
__device__ uint32_t load_codes(const uint8_t* codes, int64_t at, int count) {
  if constexpr (kBits == 8) {
    return load_bytes<V>(codes + at, count);
  } else if constexpr (V == 4) {
    if (count == 4) return *reinterpret_cast<const uint16_t*>(codes + at / 2);
    uint32_t word = 0;
#pragma unroll
    for (int b = 0; b < 2; ++b)
      if (2 * b < count) word |= uint32_t{codes[at / 2 + b]} << (8 * b);
    return word;
  } else {
    return count > 0 ? uint32_t{codes[at / 2]} >> (4 * (at % 2)) : 0u;
  }
}

// Codes past the chunk's end (u >= count) must be 0 in `word` for 4-bit codes:
// they share a byte with the chunk's last code. All lanes of the warp must
// call this (V = 1 shuffles).
template <int kBits, int V>
__device__ void store_codes(uint8_t* codes, int64_t at, int count, uint32_t word) {
  if constexpr (kBits == 8) {
    store_bytes<V>(codes + at, count, word);
  } else if constexpr (V == 4) {
    if (count == 4) {
      *reinterpret_cast<uint16_t*>(codes + at / 2) = static_cast<uint16_t>(word);
      return;
    }
#pragma unroll
    for (int b = 0; b < 2; ++b)
      if (2 * b < count) codes[at / 2 + b] = static_cast<uint8_t>(word >> (8 * b));
  } else {
    const uint32_t pair = word | __shfl_xor_sync(kFullMask, word, 1) << 4;
    if (lane_id() % 2 == 0 && count > 0) codes[at / 2] = static_cast<uint8_t>(pair);
  }
}

// The value a compressor encodes: x, or x + residual with error feedback.
template <typename T>
struct Source {
  const T* x;
  const float* residual;

  __device__ Source offset(int64_t first) const {
    return {x + first, residual ? residual + first : nullptr};
  }

  template <int V>
  __device__ void load(const Step<V>& step, float (&v)[kPerLane]) const {
#pragma unroll
    for (int j = 0; j < Step<V>::kSlots; ++j)
      load_slot<V>(x + step.at(j), step.count(j), v + j * V);
    if (residual) {
      float r[kPerLane];
#pragma unroll
      for (int j = 0; j < Step<V>::kSlots; ++j)
        load_slot<V>(residual + step.at(j), step.count(j), r + j * V);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) v[i] = math::add_rn(v[i], r[i]);
    }
  }
};

// ---- Tiles: (chunk, segment) pairs (see cuda_geometry.h) ---------------------

struct Tile {
  int64_t first;    // global index of the chunk's first element
  int64_t length;   // elements in the chunk
  int64_t slot;     // byte offset of the chunk's slot
  int64_t s_begin;  // the tile's warp steps, counted from the chunk's start
  int64_t s_end;

  __device__ bool empty() const { return s_begin >= s_end; }
  template <int V>
  __device__ Step<V> step(int64_t s) const {
    return {s * kStep, length};
  }
};

__device__ Tile tile_at(const Tiles& tiles, int64_t t) {
  const Chunking& c = tiles.chunking;
  const int64_t chunk = tiles.first_chunk + t / tiles.per_chunk;
  Tile tile;
  tile.first = c.begin(chunk);
  tile.length = c.length(chunk);
  tile.slot = c.slot_offset(chunk);
  tile.s_begin = (t % tiles.per_chunk) * tiles.tile_steps;
  tile.s_end = min(tile.s_begin + tiles.tile_steps, ceil_div(tile.length, kStep));
  return tile;
}

// V = 4 when every chunk starts 16-byte aligned in every buffer (null
// pointers count as aligned); the layout keeps slot payloads aligned anyway.
bool chunks_aligned(const Chunking& chunking, const void* a, const void* b = nullptr,
                    const void* c = nullptr) {
  return chunking.chunk_elements() % 4 == 0 && is_aligned16(a) && is_aligned16(b) &&
         is_aligned16(c);
}

// Reduces one value per thread over the block; every thread gets the result.
template <typename V, typename Op>
__device__ V block_reduce(V v, Op op) {
  __shared__ V partial[kWarps];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(kFullMask, v, offset));
  if (lane_id() == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  v = partial[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) v = op(v, partial[w]);
  __syncthreads();  // the next call reuses `partial`
  return v;
}

// ---- Per-chunk statistics, accumulated in the chunk header ------------------

// A signed integer with the order of the floats (-0 < +0), so that integer
// atomicMin/atomicMax reduce floats. The map is its own inverse.
__device__ int32_t ordered(int32_t bits) { return bits ^ ((bits >> 31) & 0x7fffffff); }
__device__ int32_t float_key(float f) { return ordered(static_cast<int32_t>(float_bits(f))); }
__device__ float key_float(int32_t key) { return bits_float(static_cast<uint32_t>(ordered(key))); }

constexpr uint32_t kQuietNaN = 0x7fc00000u;  // the NaN the CPU kernels write

// MinMaxUInt8: header words 0 and 1 hold the keys of lo and hi while reducing.
// A NaN sets lo = INT32_MIN and hi = INT32_MAX, keys no other float has (they
// are NaN bit patterns), so NaN wins both reductions.
struct MinMaxStats {
  int32_t lo = INT32_MAX, hi = INT32_MIN;
  bool nan = false;

  static __device__ void init(uint8_t* header) {
    *reinterpret_cast<uint4*>(header) =
        make_uint4(static_cast<uint32_t>(INT32_MAX), static_cast<uint32_t>(INT32_MIN), 0, 0);
  }

  __device__ void add(float v) {
    const int32_t key = float_key(v);
    lo = min(lo, key);
    hi = max(hi, key);
    nan |= v != v;
  }

  // Called by every thread of the block.
  __device__ void commit(uint8_t* header) {
    if (nan) {
      lo = INT32_MIN;
      hi = INT32_MAX;
    }
    lo = block_reduce(lo, [](int32_t a, int32_t b) { return min(a, b); });
    hi = block_reduce(hi, [](int32_t a, int32_t b) { return max(a, b); });
    if (threadIdx.x == 0) {
      atomicMin(reinterpret_cast<int32_t*>(header), lo);
      atomicMax(reinterpret_cast<int32_t*>(header) + 1, hi);
    }
  }

  // The chunk's final lo and hi, from the reduced keys.
  static __device__ float2 bounds(const uint8_t* header, int64_t length) {
    const int32_t* keys = reinterpret_cast<const int32_t*>(header);
    if (length == 0) return make_float2(0.0f, 0.0f);
    if (keys[0] == INT32_MIN) return make_float2(bits_float(kQuietNaN), bits_float(kQuietNaN));
    return make_float2(key_float(keys[0]), key_float(keys[1]));
  }

  // Bytes 8..15 are still the zeros init wrote.
  static __device__ void finalize(uint8_t* header, int64_t length) {
    *reinterpret_cast<float2*>(header) = bounds(header, length);
  }
};

// Sign: header bytes 8..15 accumulate sum |x| as a double while reducing;
// each thread sums in double too, so no finite chunk's sum overflows.
struct SignStats {
  double sum = 0.0;

  static __device__ void init(uint8_t* header) {
    *reinterpret_cast<uint4*>(header) = make_uint4(0, 0, 0, 0);
  }

  __device__ void add(float v) { sum = math::add_rn(sum, static_cast<double>(fabsf(v))); }

  __device__ void commit(uint8_t* header) {
    const double total = block_reduce(sum, [](double a, double b) { return a + b; });
    if (threadIdx.x == 0) atomicAdd(reinterpret_cast<double*>(header + 8), total);
  }

  // scale = mean |x| rounded from double, as on the CPU; a NaN gets the CPU's
  // bits rather than the GPU's canonical NaN.
  static __device__ float scale(const uint8_t* header, int64_t length) {
    if (length == 0) return 0.0f;
    const double total = *reinterpret_cast<const double*>(header + 8);
    const float mean = static_cast<float>(total / static_cast<double>(length));
    return mean == mean ? mean : bits_float(kQuietNaN);
  }

  static __device__ void finalize(uint8_t* header, int64_t length) {
    *reinterpret_cast<uint4*>(header) = make_uint4(float_bits(scale(header, length)), 0, 0, 0);
  }
};

template <typename Stats>
__global__ void __launch_bounds__(kThreads) init_kernel(Chunking chunking, uint8_t* out) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < chunking.k;
       i += int64_t{gridDim.x} * kThreads)
    Stats::init(out + chunking.slot_offset(i));
}

template <typename Stats, int V, typename T>
__global__ void __launch_bounds__(kThreads) stats_kernel(Source<T> src, Tiles tiles, uint8_t* out) {
  for (int64_t t = blockIdx.x; t < tiles.count(); t += gridDim.x) {
    const Tile tile = tile_at(tiles, t);
    if (tile.empty()) continue;  // the same for the whole block
    const Source<T> chunk = src.offset(tile.first);
    Stats stats;
    for (int64_t s = tile.s_begin + threadIdx.x / 32; s < tile.s_end; s += kWarps) {
      const Step<V> step = tile.step<V>(s);
      float v[kPerLane];
      chunk.load(step, v);
#pragma unroll
      for (int j = 0; j < Step<V>::kSlots; ++j) {
        const int count = step.count(j);
#pragma unroll
        for (int u = 0; u < V; ++u)
          if (u < count) stats.add(v[j * V + u]);
      }
    }
    stats.commit(out + tile.slot);
  }
}

// Also zeroes each slot's padding (at most 15 bytes, never touched by the
// encoders), so equal inputs always give equal bytes, as on the CPU.
template <typename Stats>
__global__ void __launch_bounds__(kThreads) finalize_kernel(Chunking chunking, uint8_t* out) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < chunking.k;
       i += int64_t{gridDim.x} * kThreads) {
    uint8_t* slot = out + chunking.slot_offset(i);
    Stats::finalize(slot, chunking.length(i));
    const int64_t used = kHeaderBytes + payload_bytes(chunking.format, chunking.length(i));
    const int64_t slot_end = chunking.slot_offset(i + 1) - chunking.slot_offset(i);
    for (int64_t b = used; b < slot_end; ++b) slot[b] = 0;
  }
}

// ---- Encoders and decoders of one warp step ---------------------------------

template <int kBits>
struct MinMaxEncoder {
  using Stats = MinMaxStats;
  math::MinMaxGrid grid;
  uint8_t* codes;

  __device__ MinMaxEncoder(uint8_t* slot, int64_t length) {
    const float2 b = Stats::bounds(slot, length);
    grid = math::minmax_grid<kBits>(b.x, b.y);
    codes = slot + kHeaderBytes;
  }

  // Writes the codes of the step and replaces each value y by its residual
  // y - decode (in place: a second array would cost registers). The float32
  // and the wide grid are separate loops, so that the common one carries none
  // of the other's registers.
  template <int V>
  __device__ void operator()(const Step<V>& s, float (&v)[kPerLane]) const {
    if (grid.wide) {
      const double scale = math::minmax_wide_scale<kBits>(grid);
      encode<V>(
          s, v, [&](float x) { return math::minmax_encode_wide<kBits>(x, grid, scale); },
          [&](uint8_t q) { return math::minmax_decode_wide(q, grid); });
    } else {
      encode<V>(
          s, v, [&](float x) { return math::minmax_encode_f32<kBits>(x, grid); },
          [&](uint8_t q) { return math::minmax_decode_f32(q, grid); });
    }
  }

  template <int V, typename Encode, typename Decode>
  __device__ void encode(const Step<V>& s, float (&v)[kPerLane], Encode&& encode_one,
                         Decode&& decode_one) const {
#pragma unroll
    for (int j = 0; j < Step<V>::kSlots; ++j) {
      const int count = s.count(j);
      uint32_t word = 0;
#pragma unroll
      for (int u = 0; u < V; ++u) {
        const uint8_t q = encode_one(v[j * V + u]);
        if (kBits == 8 || u < count) word |= uint32_t{q} << (kBits * u);
        v[j * V + u] = math::sub_rn(v[j * V + u], decode_one(q));
      }
      store_codes<kBits, V>(codes, s.at(j), count, word);
    }
  }
};

struct SignEncoder {
  using Stats = SignStats;
  float scale;
  uint8_t* bits;

  __device__ SignEncoder(uint8_t* slot, int64_t length)
      : scale(Stats::scale(slot, length)), bits(slot + kHeaderBytes) {}

  // A byte of bits spans 8 / V lanes: they OR their bits together and the
  // first of them stores the byte. Bits past the chunk's end stay 0. All
  // lanes of the warp must call this (shuffles). Like MinMaxEncoder, replaces
  // each value by its residual.
  template <int V>
  __device__ void operator()(const Step<V>& s, float (&v)[kPerLane]) const {
    constexpr int kLanesPerByte = 8 / V;
#pragma unroll
    for (int j = 0; j < Step<V>::kSlots; ++j) {
      const int count = s.count(j);
      uint32_t byte = 0;
#pragma unroll
      for (int u = 0; u < V; ++u) {
        const bool bit = math::sign_bit(v[j * V + u]);
        if (u < count) byte |= uint32_t{bit} << u;
        v[j * V + u] = math::sub_rn(v[j * V + u], math::sign_decode(bit, scale));
      }
      if constexpr (V == 1) {
        // One ballot gathers the warp's 32 bits; lanes 0, 8, 16 and 24 store a byte each.
        byte = __ballot_sync(kFullMask, byte != 0) >> (lane_id() & ~7);
      } else {
        byte <<= V * (lane_id() % kLanesPerByte);
#pragma unroll
        for (int offset = 1; offset < kLanesPerByte; offset *= 2)
          byte |= __shfl_xor_sync(kFullMask, byte, offset);
      }
      if (lane_id() % kLanesPerByte == 0 && count > 0)
        bits[s.at(j) / 8] = static_cast<uint8_t>(byte);
    }
  }
};

template <int kBits>
struct MinMaxDecoder {
  math::MinMaxGrid grid;
  const uint8_t* codes;

  __device__ explicit MinMaxDecoder(const uint8_t* slot) {
    const float* h = reinterpret_cast<const float*>(slot);
    grid = math::minmax_grid<kBits>(h[0], h[1]);
    codes = slot + kHeaderBytes;
  }

  template <int V>
  __device__ void operator()(const Step<V>& s, float (&v)[kPerLane]) const {
    if (grid.wide) {
      decode<V>(s, v, [&](uint8_t q) { return math::minmax_decode_wide(q, grid); });
    } else {
      decode<V>(s, v, [&](uint8_t q) { return math::minmax_decode_f32(q, grid); });
    }
  }

  template <int V, typename Decode>
  __device__ void decode(const Step<V>& s, float (&v)[kPerLane], Decode&& decode_one) const {
    constexpr uint32_t kMask = (1u << kBits) - 1;
#pragma unroll
    for (int j = 0; j < Step<V>::kSlots; ++j) {
      const uint32_t word = load_codes<kBits, V>(codes, s.at(j), s.count(j));
#pragma unroll
      for (int u = 0; u < V; ++u)
        v[j * V + u] = decode_one(static_cast<uint8_t>((word >> (kBits * u)) & kMask));
    }
  }
};

struct SignDecoder {
  float scale;
  const uint8_t* bits;

  __device__ explicit SignDecoder(const uint8_t* slot)
      : scale(reinterpret_cast<const float*>(slot)[0]), bits(slot + kHeaderBytes) {}

  // A slot's V bits lie inside one byte (V divides 8).
  template <int V>
  __device__ void operator()(const Step<V>& s, float (&v)[kPerLane]) const {
#pragma unroll
    for (int j = 0; j < Step<V>::kSlots; ++j) {
      const int64_t at = s.at(j);
      const uint32_t byte = s.count(j) > 0 ? bits[at / 8] >> (at % 8) : 0;
#pragma unroll
      for (int u = 0; u < V; ++u) v[j * V + u] = math::sign_decode((byte >> u) & 1u, scale);
    }
  }
};

template <typename Encoder, int V, typename T>
__global__ void __launch_bounds__(kThreads)
    encode_kernel(Source<T> src, Tiles tiles, uint8_t* out, float* residual_out) {
  for (int64_t t = blockIdx.x; t < tiles.count(); t += gridDim.x) {
    const Tile tile = tile_at(tiles, t);
    if (tile.empty()) continue;
    const Source<T> chunk = src.offset(tile.first);
    const Encoder encode(out + tile.slot, tile.length);
    float* chunk_residual = residual_out ? residual_out + tile.first : nullptr;
    // Backwards: what stats read last is the likeliest to be still cached.
    for (int64_t s = tile.s_end - 1 - threadIdx.x / 32; s >= tile.s_begin; s -= kWarps) {
      const Step<V> step = tile.step<V>(s);
      float v[kPerLane];
      chunk.load(step, v);
      encode(step, v);  // v holds the residuals now
      if (chunk_residual) {
#pragma unroll
        for (int j = 0; j < Step<V>::kSlots; ++j)
          store_slot<V>(chunk_residual + step.at(j), step.count(j), v + j * V);
      }
    }
  }
}

template <typename Decoder, int V, typename T>
__global__ void __launch_bounds__(kThreads) decode_kernel(const uint8_t* in, Tiles tiles, T* out) {
  for (int64_t t = blockIdx.x; t < tiles.count(); t += gridDim.x) {
    const Tile tile = tile_at(tiles, t);
    if (tile.empty()) continue;
    const Decoder decode(in + tile.slot);
    T* chunk_out = out + tile.first;
    for (int64_t s = tile.s_begin + threadIdx.x / 32; s < tile.s_end; s += kWarps) {
      const Step<V> step = tile.step<V>(s);
      float v[kPerLane];
      decode(step, v);
#pragma unroll
      for (int j = 0; j < Step<V>::kSlots; ++j)
        store_slot<V>(chunk_out + step.at(j), step.count(j), v + j * V);
    }
  }
}

// Warp steps over a flat range of n elements, striding over the whole grid.
template <typename F>
__device__ void for_each_step(int64_t n, F&& f) {
  const int64_t warps = int64_t{gridDim.x} * kWarps;
  for (int64_t s = blockIdx.x * int64_t{kWarps} + threadIdx.x / 32; s * kStep < n; s += warps)
    f(Step<4>{s * kStep, n});
}

__device__ bool is_infinite(float v) { return v == v && !math::is_finite(v); }

// The lane's elements whose float32 sum (or average) overflowed are summed
// again, scaled by 2^-64 (math::resum_scale), so that finite inputs give a
// finite average (SPEC section 2); the others keep their bits.
template <typename Decoder>
__device__ void resum_scaled(const uint8_t* in, int64_t k, int64_t slot, bool average,
                             const Step<4>& step, float (&acc)[kPerLane]) {
  float scaled[kPerLane] = {};
  for (int64_t r = 0; r < k; ++r) {
    float v[kPerLane];
    const Decoder decode(in + r * slot);
    decode(step, v);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) scaled[i] = math::resum_add(scaled[i], v[i]);
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i)
    if (is_infinite(acc[i])) acc[i] = math::resum_result(scaled[i], average, static_cast<float>(k));
}

// The k inputs are single-chunk buffers of m elements, `slot` bytes apart. Each
// lane sums its elements of every input in order j = 0..k-1.
template <typename Decoder, typename T>
__global__ void __launch_bounds__(kThreads)
    decode_reduce_kernel(const uint8_t* in, int64_t m, int64_t k, int64_t slot, bool average,
                         T* out) {
  for_each_step(m, [&](const Step<4>& step) {
    float acc[kPerLane] = {};
    for (int64_t j = 0; j < k; ++j) {
      float v[kPerLane];
      const Decoder decode(in + j * slot);
      decode(step, v);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc[i] = math::add_rn(acc[i], v[i]);
    }
    bool overflow = false;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (average) acc[i] = math::div_rn(acc[i], static_cast<float>(k));
      overflow |= is_infinite(acc[i]);
    }
    if (overflow) resum_scaled<Decoder>(in, k, slot, average, step, acc);
#pragma unroll
    for (int j = 0; j < Step<4>::kSlots; ++j)
      store_slot<4>(out + step.at(j), step.count(j), acc + j * 4);
  });
}

// ---- Host drivers -----------------------------------------------------------

template <typename Encoder, int V, typename T>
Status compress(Cuda device, const Chunking& chunking, const Source<T>& src, uint8_t* out,
                float* residual_out) {
  using Stats = typename Encoder::Stats;
  const auto stats = stats_kernel<Stats, V, T>;
  const auto encode = encode_kernel<Encoder, V, T>;
  const cudaStream_t stream = stream_of(device);
  const DeviceInfo info = device_info();
  // One tiling serves both passes, so it must fit the one with fewer blocks.
  const int64_t resident = std::min(resident_blocks(info, stats), resident_blocks(info, encode));
  const int64_t batch = chunks_per_batch(info, chunking, sizeof(T) + (src.residual ? 4 : 0));
  const int header_grid = grid_size(ceil_div(chunking.k, kThreads), resident);
  launch(init_kernel<Stats>, header_grid, stream, chunking, out);
  for (int64_t first = 0; first < chunking.k; first += batch) {
    const Tiles tiles = make_tiles(chunking, first, std::min(batch, chunking.k - first), resident);
    const int tile_grid = grid_size(tiles.count(), resident);
    launch(stats, tile_grid, stream, src, tiles, out);
    launch(encode, tile_grid, stream, src, tiles, out, residual_out);
  }
  launch(finalize_kernel<Stats>, header_grid, stream, chunking, out);
  return launch_status();
}

template <typename Encoder, typename T>
Status compress(Cuda device, Format format, const T* x, const float* residual_in, int64_t n,
                int64_t k, uint8_t* out, float* residual_out) {
  if (Status s = check_compressed(out); !s.ok()) return s;
  const Chunking chunking{format, n, k};
  const Source<T> src{x, residual_in};
  return chunks_aligned(chunking, x, residual_in, residual_out)
             ? compress<Encoder, 4>(device, chunking, src, out, residual_out)
             : compress<Encoder, 1>(device, chunking, src, out, residual_out);
}

template <typename Decoder, int V, typename T>
Status decompress(Cuda device, const Chunking& chunking, const uint8_t* in, T* out) {
  const auto decode = decode_kernel<Decoder, V, T>;
  const int64_t resident = resident_blocks(device_info(), decode);
  const Tiles tiles = make_tiles(chunking, 0, chunking.k, resident);
  launch(decode, grid_size(tiles.count(), resident), stream_of(device), in, tiles, out);
  return launch_status();
}

template <typename Decoder, typename T>
Status decompress(Cuda device, Format format, const uint8_t* in, int64_t n, int64_t k, T* out) {
  if (n == 0) return {};
  if (Status s = check_compressed(in); !s.ok()) return s;
  const Chunking chunking{format, n, k};
  return chunks_aligned(chunking, out) ? decompress<Decoder, 4>(device, chunking, in, out)
                                       : decompress<Decoder, 1>(device, chunking, in, out);
}

template <typename Decoder, typename T>
Status decompress_reduce(Cuda device, Format format, const uint8_t* in, int64_t m, int64_t k,
                         bool average, T* out) {
  if (m == 0) return {};
  if (Status s = check_compressed(in); !s.ok()) return s;
  const auto reduce = decode_reduce_kernel<Decoder, T>;
  const int grid =
      grid_size(ceil_div(m, int64_t{kStep} * kWarps), resident_blocks(device_info(), reduce));
  launch(reduce, grid, stream_of(device), in, m, k, slot_bytes(format, m), average, out);
  return launch_status();
}

// ---- Elementwise helpers ----------------------------------------------------

template <typename T, int N>
struct Inputs {
  const T* at[N];
};

template <typename F, int N, size_t... A>
__device__ float apply(const F& f, const float (&v)[N][kPerLane], int i,
                       std::index_sequence<A...>) {
  return math::overflow_safe(f, v[A][i]...);
}

template <typename T, int N, typename F>
__global__ void __launch_bounds__(kThreads)
    elementwise_kernel(Inputs<T, N> in, int64_t n, T* out, F f) {
  for_each_step(n, [&](const Step<4>& step) {
    // All inputs are read before out is written: out may alias one of them.
    float v[N][kPerLane], r[kPerLane];
#pragma unroll
    for (int a = 0; a < N; ++a)
#pragma unroll
      for (int j = 0; j < Step<4>::kSlots; ++j)
        load_slot<4>(in.at[a] + step.at(j), step.count(j), v[a] + j * 4);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) r[i] = apply(f, v, i, std::make_index_sequence<N>{});
#pragma unroll
    for (int j = 0; j < Step<4>::kSlots; ++j)
      store_slot<4>(out + step.at(j), step.count(j), r + j * 4);
  });
}

template <typename T, typename F, typename... In>
Status elementwise(Cuda device, int64_t n, T* out, F f, const In*... in) {
  if (n == 0) return {};
  constexpr int N = sizeof...(In);
  const auto kernel = elementwise_kernel<T, N, F>;
  const int grid =
      grid_size(ceil_div(n, int64_t{kStep} * kWarps), resident_blocks(device_info(), kernel));
  launch(kernel, grid, stream_of(device), Inputs<T, N>{{in...}}, n, out, f);
  return launch_status();
}

struct Average2 {
  __device__ float operator()(float a, float b) const { return math::average2(a, b); }
};

struct Axpy {
  float a;
  __device__ float operator()(float x, float y) const { return math::axpy(x, a, y); }
};

struct AsyncAverage {
  float ranks;
  __device__ float operator()(float x, float reduced, float snapshot) const {
    return math::async_average(x, reduced, ranks, snapshot);
  }
};

struct LowprecDecentralizedDiff {
  __device__ float operator()(float x, float w, float left, float right) const {
    return math::lowprec_decentralized_diff(x, w, left, right);
  }
};

}  // namespace

template <typename T>
Status minmax_compress(Cuda device, const T* x, const float* residual_in, int64_t n, int64_t k,
                       uint8_t* out, float* residual_out) {
  return compress<MinMaxEncoder<8>>(device, Format::kMinMaxUInt8, x, residual_in, n, k, out,
                                    residual_out);
}

template <typename T>
Status minmax_uint4_compress(Cuda device, const T* x, const float* residual_in, int64_t n,
                             int64_t k, uint8_t* out, float* residual_out) {
  return compress<MinMaxEncoder<4>>(device, Format::kMinMaxUInt4, x, residual_in, n, k, out,
                                    residual_out);
}

template <typename T>
Status sign_compress(Cuda device, const T* x, const float* residual_in, int64_t n, int64_t k,
                     uint8_t* out, float* residual_out) {
  return compress<SignEncoder>(device, Format::kSign, x, residual_in, n, k, out, residual_out);
}

template <typename T>
Status minmax_decompress(Cuda device, const uint8_t* in, int64_t n, int64_t k, T* out) {
  return decompress<MinMaxDecoder<8>>(device, Format::kMinMaxUInt8, in, n, k, out);
}

template <typename T>
Status minmax_uint4_decompress(Cuda device, const uint8_t* in, int64_t n, int64_t k, T* out) {
  return decompress<MinMaxDecoder<4>>(device, Format::kMinMaxUInt4, in, n, k, out);
}

template <typename T>
Status sign_decompress(Cuda device, const uint8_t* in, int64_t n, int64_t k, T* out) {
  return decompress<SignDecoder>(device, Format::kSign, in, n, k, out);
}

template <typename T>
Status minmax_decompress_reduce(Cuda device, const uint8_t* in, int64_t m, int64_t k, bool average,
                                T* out) {
  return decompress_reduce<MinMaxDecoder<8>>(device, Format::kMinMaxUInt8, in, m, k, average, out);
}

template <typename T>
Status minmax_uint4_decompress_reduce(Cuda device, const uint8_t* in, int64_t m, int64_t k,
                                      bool average, T* out) {
  return decompress_reduce<MinMaxDecoder<4>>(device, Format::kMinMaxUInt4, in, m, k, average, out);
}

template <typename T>
Status sign_decompress_reduce(Cuda device, const uint8_t* in, int64_t m, int64_t k, bool average,
                              T* out) {
  return decompress_reduce<SignDecoder>(device, Format::kSign, in, m, k, average, out);
}

template <typename T>
Status average2(Cuda device, const T* a, const T* b, int64_t n, T* out) {
  return elementwise(device, n, out, Average2{}, a, b);
}

template <typename T>
Status axpy(Cuda device, const T* x, float a, const T* y, int64_t n, T* out) {
  return elementwise(device, n, out, Axpy{a}, x, y);
}

template <typename T>
Status async_average(Cuda device, const T* x, const T* reduced, const T* snapshot, float ranks,
                     int64_t n, T* out) {
  return elementwise(device, n, out, AsyncAverage{ranks}, x, reduced, snapshot);
}

template <typename T>
Status lowprec_decentralized_diff(Cuda device, const T* x, const T* w, const T* left,
                                  const T* right, int64_t n, T* out) {
  return elementwise(device, n, out, LowprecDecentralizedDiff{}, x, w, left, right);
}

BAGUA_INSTANTIATE_KERNELS(Cuda)

}  // namespace bagua::kernels
