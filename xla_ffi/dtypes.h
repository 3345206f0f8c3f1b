// The element types bagua knows (the kernels take the three float types and
// uint8, the collectives all of them), and the 16-bit float types' conversions
// to and from float32. One definition serves the CPU and the CUDA code.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define BAGUA_HD __host__ __device__ __forceinline__
#else
#define BAGUA_HD inline
#endif

namespace bagua {

// Mapped once from XLA's element types (handler_util.h) and once from
// DLPack's (binding_util.h); everything else speaks DType.
enum class DType { kF32, kF16, kBF16, kF64, kU8, kI32, kI64, kUnsupported };

inline const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "float32";
    case DType::kF16:
      return "float16";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF64:
      return "float64";
    case DType::kU8:
      return "uint8";
    case DType::kI32:
      return "int32";
    case DType::kI64:
      return "int64";
    case DType::kUnsupported:
      break;
  }
  return "an unsupported dtype";
}

inline int64_t dtype_bytes(DType dtype) {
  switch (dtype) {
    case DType::kU8:
      return 1;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF64:
    case DType::kI64:
      return 8;
    case DType::kUnsupported:
      break;
  }
  return 0;
}

inline bool is_floating_point(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16 ||
         dtype == DType::kF64;
}

// IEEE binary16, stored as raw bits.
struct Half {
  uint16_t bits;
};

// bfloat16 (the upper half of a float32), stored as raw bits.
struct BFloat16 {
  uint16_t bits;
};

BAGUA_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

BAGUA_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

BAGUA_HD float to_float(float x) { return x; }
BAGUA_HD float to_float(BFloat16 x) { return bits_float(uint32_t{x.bits} << 16); }

// Branch-free, so conversion loops vectorize. Normals rebias the exponent in
// integer arithmetic; subnormals are mantissa * 2^-24 from an exact integer
// conversion (never a float subnormal, which XLA's threads flush to zero);
// infinity and NaN get the float's all-ones exponent.
BAGUA_HD float to_float(Half x) {
  const uint32_t exponent = x.bits & 0x7c00u;
  const uint32_t mantissa = x.bits & 0x3ffu;
  const uint32_t normal = ((uint32_t{x.bits & 0x7fffu} << 13) + (112u << 23));
  const uint32_t special = (mantissa << 13) | 0x7f800000u;
  const uint32_t subnormal =
      float_bits(static_cast<float>(mantissa) * 5.9604644775390625e-08f);  // 2^-24
  const uint32_t magnitude = exponent == 0x7c00u ? special : exponent == 0 ? subnormal : normal;
  return bits_float(magnitude | (uint32_t{x.bits & 0x8000u} << 16));
}

template <typename T>
BAGUA_HD T from_float(float f);

template <>
BAGUA_HD float from_float<float>(float f) {
  return f;
}

// Round to nearest even; NaN stays NaN (quiet).
template <>
BAGUA_HD BFloat16 from_float<BFloat16>(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BFloat16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return BFloat16{static_cast<uint16_t>(rounded >> 16)};
}

// Round to nearest even, overflow to infinity, gradual underflow.
template <>
BAGUA_HD Half from_float<Half>(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return Half{static_cast<uint16_t>(sign | 0x7e00u)};
  if (magnitude >= 0x477ff000u) return Half{static_cast<uint16_t>(sign | 0x7c00u)};  // >= 65520
  if (magnitude < 0x38800000u) {
    // Result is subnormal or zero: round |f| / 2^-24 to an integer, ties to even.
    // Adding 2^-1 * 2^23 style magic would need FMA care; scale exactly instead.
    const float scaled = bits_float(magnitude) * 16777216.0f;  // exact: power of two
    uint32_t integer = static_cast<uint32_t>(scaled);
    const float remainder = scaled - static_cast<float>(integer);
    if (remainder > 0.5f || (remainder == 0.5f && (integer & 1u))) ++integer;
    return Half{static_cast<uint16_t>(sign | integer)};
  }
  const uint32_t rebased = magnitude - (112u << 23);
  const uint32_t rounded = rebased + 0xfffu + ((rebased >> 13) & 1u);
  return Half{static_cast<uint16_t>(sign | (rounded >> 13))};
}

}  // namespace bagua
