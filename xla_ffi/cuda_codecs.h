// What each codec does on the device: per-chunk statistics reduced into the chunk
// header (min/max keys, the sum of |x|), and the encoders and decoders of one warp
// step, all through bagua::math (numerics.h). Device code for kernels_cuda.cu.
#pragma once

#include <cstdint>

#include "cuda_lanes.h"
#include "layout.h"
#include "numerics.h"

namespace bagua::kernels {
namespace {

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

// ---- Encoders and decoders of one warp step ---------------------------------

// Encodes the V values of one slot into kBits-bit codes, packed from bit 0 of
// the word it returns, and replaces each value y by its residual y - decode(code)
// (in place: a second array would cost registers). Sub-byte codes past the
// chunk's end (u >= count) stay 0; store_codes writes only the chunk's bytes.
template <int kBits, int V, typename Encode, typename Decode>
__device__ uint32_t encode_slot(float* v, int count, Encode&& encode_one, Decode&& decode_one) {
  uint32_t word = 0;
#pragma unroll
  for (int u = 0; u < V; ++u) {
    const auto code = encode_one(v[u]);
    if (kBits == 8 || u < count) word |= uint32_t{code} << (kBits * u);
    v[u] = math::sub_rn(v[u], decode_one(code));
  }
  return word;
}

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

  // Writes the codes of the step and replaces each value by its residual. The
  // float32 and the wide grid are separate loops, so that the common one
  // carries none of the other's registers.
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
      const uint32_t word = encode_slot<kBits, V>(v + j * V, count, encode_one, decode_one);
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
      uint32_t byte = encode_slot<1, V>(
          v + j * V, count, [](float x) { return math::sign_bit(x); },
          [&](bool bit) { return math::sign_decode(bit, scale); });
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

}  // namespace
}  // namespace bagua::kernels
