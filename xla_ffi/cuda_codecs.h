// What each codec does on the device: a group's statistics (min/max keys, the
// sum of |x|), the encoding of a slot, and each format's decoding of a slot, all
// through bagua::math (numerics.h). Device code for kernels_cuda.cu.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cuda_lanes.h"
#include "layout.h"
#include "numerics.h"

namespace bagua::kernels {
namespace {

// ---- Min-max statistics -----------------------------------------------------

constexpr uint32_t kQuietNaN = 0x7fc00000u;  // the NaN the CPU kernels write

// A thread's minimum and maximum keys of the values it saw, and whether one was
// NaN. A NaN makes the bounds INT32_MIN and INT32_MAX, keys no other float has
// (they are NaN bit patterns), so NaN wins both reductions.
struct MinMaxKeys {
  int32_t lo = INT32_MAX, hi = INT32_MIN;
  bool nan = false;

  __device__ void add(float v) {
    const int32_t key = math::float_key(v);
    lo = min(lo, key);
    hi = max(hi, key);
    nan |= v != v;
  }

  // The group's lo and hi (an empty group's are 0), reduced over the block:
  // every thread calls this and gets them.
  __device__ float2 block_bounds(int64_t length) const {
    int32_t l = nan ? INT32_MIN : lo, h = nan ? INT32_MAX : hi;
    block_min_max(l, h);
    if (length == 0) return make_float2(0.0f, 0.0f);
    if (l == INT32_MIN) return make_float2(bits_float(kQuietNaN), bits_float(kQuietNaN));
    return make_float2(math::key_float(l), math::key_float(h));
  }
};

// ---- Min-max codes ----------------------------------------------------------

// Encodes the U values of one slot into kBits-bit codes, packed from bit 0 of
// the word it returns, and replaces each value y by its residual y - decode(code)
// (in place: a second array would cost registers; unused, it costs nothing).
// Codes past the group's end (u >= count) stay 0.
template <int kBits, int U, typename Encode, typename Decode>
__device__ CodeWord<kBits, U> encode_slot(float* v, int count, Encode&& encode_one,
                                          Decode&& decode_one) {
  CodeWord<kBits, U> word = 0;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const auto code = encode_one(v[u]);
    if (u < count) word |= CodeWord<kBits, U>{code} << (kBits * u);
    v[u] = math::sub_rn(v[u], decode_one(code));
  }
  return word;
}

// ---- Decoders ---------------------------------------------------------------
//
// What the decoding kernels need of a format: the parameters of a group from
// its 16-byte header; the codes of a lane's step of E elements, loaded at once
// (load: `payload` the group's, `offset` the step range's first element in it);
// and the values of slot j of them (decode). All lanes of a warp call decode.

// Decompress-reduce takes kReducePerLane elements a lane, in slots of L, and
// loads the codes of kReduceInFlight<L> inputs before it adds any, with at least
// kReduceBlocks blocks resident (128 registers a thread). Min-max lanes hold few
// elements, so that many lanes share a short output: 192 bytes of codes in
// flight, in at most 64 registers (each slot's load takes registers of its own
// until it is used).
template <int kBits>
struct MinMaxCodec {
  static constexpr Format kFormat = kBits == 8 ? Format::kMinMaxUInt8 : Format::kMinMaxUInt4;
  static constexpr int kCodeBits = kBits;
  static constexpr int kReducePerLane = 8, kReduceBlocks = 2;
  template <int L>
  static constexpr int kReduceInFlight = std::min(192 / (kReducePerLane * kBits / 8),
                                                  64 / (kReducePerLane / L *
                                                        ((kBits * L + 31) / 32)));
  using Params = math::MinMaxGrid;
  // A lane's E codes packed from bit 0 of words[0], code i at bit kBits * i,
  // whatever the slot width: a register per 32 bits of codes (a word a code
  // with U = 1 held 32 codes of 16 inputs in 128 registers, and spilled).
  template <int U, int E>
  struct Codes {
    static_assert(E * kBits % 32 == 0, "whole words of codes");
    uint32_t words[E * kBits / 32];
  };

  static __device__ Params params(const uint4& header) {
    return math::minmax_grid<kBits>(bits_float(header.x), bits_float(header.y));
  }

  template <int U, int E>
  static __device__ Codes<U, E> load(const uint8_t* payload, int64_t offset,
                                     const Step<U, E>& step) {
    Codes<U, E> c{};
#pragma unroll
    for (int j = 0; j < E / U; ++j) {
      const CodeWord<kBits, U> word =
          load_codes<kBits, U>(payload, offset + step.at(j), step.count(j));
      constexpr int kSlotBits = kBits * U;
      const int bit = kSlotBits * j;
      c.words[bit / 32] |= static_cast<uint32_t>(word) << (bit % 32);
      if constexpr (kSlotBits == 64) c.words[bit / 32 + 1] = static_cast<uint32_t>(word >> 32);
    }
    return c;
  }

  // Code i of a lane's codes (i a constant once loops unroll).
  template <int U, int E>
  static __device__ uint8_t code(const Codes<U, E>& codes, int i) {
    const int bit = kBits * i;
    return static_cast<uint8_t>(codes.words[bit / 32] >> (bit % 32) & ((1u << kBits) - 1));
  }

  // One loop per form, so that the float32 one carries no per-element choice.
  template <int U, int E>
  static __device__ void decode(const Params& grid, const Codes<U, E>& codes, int j, float* v) {
    if (grid.wide) {
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = math::minmax_decode_wide(code(codes, U * j + u), grid);
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = math::minmax_decode_f32(code(codes, U * j + u), grid);
    }
  }
};

// Sign bits: a lane loads one 32-bit word of a step's bits (cuda_lanes.h), so a
// step is 32 elements a lane; slot j's bits come from the word's lane by a
// shuffle.
struct SignCodec {
  static constexpr Format kFormat = Format::kSign;
  static constexpr int kCodeBits = 1;
  static constexpr int kReducePerLane = 32, kReduceBlocks = 2;
  template <int L>
  static constexpr int kReduceInFlight = 16;
  using Params = float;  // the chunk's scale
  template <int U, int E>
  struct Codes {
    static_assert(E == 32, "a lane's word holds 32 bits");
    uint32_t word;
  };

  static __device__ Params params(const uint4& header) { return bits_float(header.x); }

  template <int U, int E>
  static __device__ Codes<U, E> load(const uint8_t* payload, int64_t offset,
                                     const Step<U, E>& step) {
    return {load_sign_word<U>(payload, offset + step.base, offset + step.length)};
  }

  template <int U, int E>
  static __device__ void decode(float scale, const Codes<U, E>& codes, int j, float* v) {
    const uint32_t bits = scatter_sign_bits<U>(codes.word, j);
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = math::sign_decode((bits >> u & 1u) != 0, scale);
  }
};

// ---- Sign statistics --------------------------------------------------------

// Header bytes 8..15 accumulate sum |y| as a double while a chunk is reduced;
// each thread sums in double too, so no finite chunk's sum overflows.
struct SignSum {
  double sum = 0.0;

  __device__ void add(float v) { sum = math::add_rn(sum, static_cast<double>(fabsf(v))); }

  // Called by every thread of the block.
  __device__ void commit(uint8_t* header) const {
    const double total = block_reduce(sum, [](double a, double b) { return a + b; });
    if (threadIdx.x == 0) atomic_add_global(reinterpret_cast<double*>(header + 8), total);
  }
};

// scale = mean |y| rounded from double, as on the CPU; a NaN gets the CPU's bits
// rather than the GPU's canonical NaN.
__device__ float sign_scale(const uint8_t* header, int64_t length) {
  if (length == 0) return 0.0f;
  const double total = load_global(reinterpret_cast<const double*>(header + 8));
  const float mean = math::narrow_rn(math::div_rn(total, static_cast<double>(length)));
  return mean == mean ? mean : bits_float(kQuietNaN);
}

}  // namespace
}  // namespace bagua::kernels
