// The CPU kernels' lanes: eight float32 lanes as compiler vectors, the widening
// loads and the stores of the kernels' element types, the lane-wise rounding of
// the codecs (numerics.h's math, vector by vector), and where a chunk's codes lie.
// Included by kernels_cpu.cc only: its code is compiled once per instruction set,
// into that set's namespace.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "dtypes.h"
#include "numerics.h"

#ifndef BAGUA_CPU_ISA
#error "cpu_lanes.h belongs to kernels_cpu.cc, which sets BAGUA_CPU_ISA"
#endif

namespace bagua::kernels::BAGUA_CPU_ISA {
namespace {

// Eight float32 lanes as GCC/Clang vectors: the reductions are written lane-wise
// so they vectorize without reassociating float arithmetic, and the loads widen
// eight elements at once (dtypes.h's scalar conversions, vector by vector).
using f32x8 = float __attribute__((vector_size(32)));
using i32x8 = int32_t __attribute__((vector_size(32)));
using u32x8 = uint32_t __attribute__((vector_size(32)));
using u16x8 = uint16_t __attribute__((vector_size(16)));
using u8x8 = uint8_t __attribute__((vector_size(8)));
using f64x4 = double __attribute__((vector_size(32)));
using f64x8 = double __attribute__((vector_size(64)));

f32x8 widen(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

u32x8 widen_bits(const void* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, u32x8);
}

f32x8 widen(const BFloat16* p) { return reinterpret_cast<f32x8>(widen_bits(p) << 16); }

// The vector form of to_float(Half) in dtypes.h.
f32x8 widen(const Half* p) {
  const u32x8 h = widen_bits(p);
  const u32x8 exponent = h & 0x7c00u, mantissa = h & 0x3ffu;
  const u32x8 normal = ((h & 0x7fffu) << 13) + (112u << 23);
  const u32x8 special = (mantissa << 13) | 0x7f800000u;
  const f32x8 scaled =
      __builtin_convertvector(reinterpret_cast<i32x8>(mantissa), f32x8) * 5.9604644775390625e-08f;
  const u32x8 subnormal = reinterpret_cast<u32x8>(scaled);
  const u32x8 magnitude = exponent == 0x7c00u ? special : (exponent == 0u ? subnormal : normal);
  return reinterpret_cast<f32x8>(magnitude | ((h & 0x8000u) << 16));
}

f32x8 splat(float x) { return f32x8{x, x, x, x, x, x, x, x}; }

// math::float_key, lane by lane.
i32x8 float_keys(f32x8 v) {
  const i32x8 bits = reinterpret_cast<i32x8>(v);
  return bits ^ ((bits >> 31) & 0x7fffffff);
}

// math::clamp, clamp_or_zero and round_half_even, lane by lane.
constexpr float kRoundingMagic = 12582912.0f;  // 1.5 * 2^23, as in math::round_half_even

f32x8 clamp(f32x8 v, float low, float high) {
  v = v > low ? v : splat(low);
  return v < high ? v : splat(high);
}

f32x8 clamp_or_zero(f32x8 v, float low, float high) {
  return clamp(v == v ? v : splat(0.0f), low, high);
}

f32x8 round_half_even(f32x8 v) {
  const f32x8 magic = splat(kRoundingMagic);
  return (v + magic) - magic;
}

// Bit j of a sign byte is lane j (least significant bit first, SPEC section 2).
constexpr i32x8 kLaneBits = {1, 2, 4, 8, 16, 32, 64, 128};

// `set` is all ones or all zeros per lane, so its sign bits are the byte: one
// movemask where the processor has it, instead of eight lane extractions.
uint8_t pack_bits(i32x8 set) {
#if defined(__AVX2__)
  return static_cast<uint8_t>(_mm256_movemask_ps(reinterpret_cast<__m256>(set)));
#else
  const i32x8 b = set & kLaneBits;
  return static_cast<uint8_t>(b[0] | b[1] | b[2] | b[3] | b[4] | b[5] | b[6] | b[7]);
#endif
}

i32x8 unpack_bits(uint8_t byte) {
  const int32_t v = byte;
  return (i32x8{v, v, v, v, v, v, v, v} & kLaneBits) != 0;
}

// Where decoders put their values: one element, or eight at once (whole bytes
// of sign bits). Eight float32 lanes go out as one vector store; stored lane by
// lane, GCC did not merge them.
template <typename T>
void store(T* p, float v) {
  *p = from_float<T>(v);
}

template <typename T>
void store(T* p, f32x8 v) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof v);
  } else {
    for (int j = 0; j < 8; ++j) p[j] = from_float<T>(v[j]);
  }
}

void accumulate(float* p, float v) { *p = math::add_rn(*p, v); }

void accumulate(float* p, f32x8 v) { store(p, widen(p) + v); }  // add_rn lane by lane

// Element i of a chunk's codes (SPEC section 2, layout.h): byte i for 8-bit
// codes; for 4-bit ones the low (even i) or high (odd i) nibble of byte i / 2.
template <int kBits>
uint8_t code_at(const uint8_t* codes, int64_t i) {
  if constexpr (kBits == 8) return codes[i];
  return (codes[i >> 1] >> ((i & 1) * 4)) & 0xf;
}

// Stores code q of element i; 4-bit codes go in increasing i from an even one,
// so an even element's store clears the nibble its odd neighbour fills.
template <int kBits>
void put_code(uint8_t* codes, int64_t i, uint8_t q) {
  if constexpr (kBits == 8) {
    codes[i] = q;
  } else if (i & 1) {
    codes[i >> 1] |= static_cast<uint8_t>(q << 4);
  } else {
    codes[i >> 1] = q;
  }
}

// The codes of elements i..i+7 (i even), as one 8- or 4-byte store. 4-bit codes
// are paired in a 64-bit word: byte 2j of w | w >> 4 is code 2j with code 2j + 1
// above it (codes are below 16), and the even bytes then close up. (Extracting
// the lanes one by one cost the 4-bit compression about a quarter of its time.)
template <int kBits>
void put_codes8(uint8_t* codes, int64_t i, i32x8 q) {
  const u8x8 bytes = __builtin_convertvector(q, u8x8);
  if constexpr (kBits == 8) {
    std::memcpy(codes + i, &bytes, sizeof bytes);
  } else {
    uint64_t w;
    std::memcpy(&w, &bytes, sizeof w);
    w = (w | (w >> 4)) & 0x00ff00ff00ff00ffu;
    w = (w | (w >> 8)) & 0x0000ffff0000ffffu;
    const uint32_t packed = static_cast<uint32_t>(w | (w >> 16));
    std::memcpy(codes + i / 2, &packed, sizeof packed);
  }
}

}  // namespace
}  // namespace bagua::kernels::BAGUA_CPU_ISA
