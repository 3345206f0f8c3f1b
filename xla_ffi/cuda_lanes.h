// How a warp sees its elements: the warp step (32 lanes x 8 elements, slots of V),
// loads and stores of one slot (floats, 16-bit types, 8-bit codes, 4-bit codes),
// the value a compressor encodes, the (chunk, segment) tiles of chunked kernels and
// a block-wide reduction. Device code for kernels_cuda.cu (see its design notes).
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda_launch.h"
#include "dtypes.h"
#include "layout.h"
#include "numerics.h"

namespace bagua::kernels {
namespace {

constexpr uint32_t kFullMask = 0xffffffffu;

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

}  // namespace
}  // namespace bagua::kernels
