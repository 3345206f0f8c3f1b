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

// Every element type once: X(enumerator, name, bits, DLPack type code, XLA
// element type, NCCL type, MPI type, C++ type). The enum, the names and sizes
// below, the maps from XLA (handler_util.h) and DLPack (binding_util.h) and to
// the engines' types (nccl_communicator.cc, mpi_runtime.cc), and the host
// reductions' dispatch (with_element_type) are all made from this list. MPI has
// no 16-bit floats: its column names the derived types mpi_runtime.cc makes for
// them.
#define BAGUA_DTYPES(X)                                                         \
  X(kF32, "float32", 32, Float, F32, ncclFloat32, MPI_FLOAT, float)             \
  X(kF16, "float16", 16, Float, F16, ncclFloat16, half_type, Half)              \
  X(kBF16, "bfloat16", 16, Bfloat, BF16, ncclBfloat16, bfloat16_type, BFloat16) \
  X(kF64, "float64", 64, Float, F64, ncclFloat64, MPI_DOUBLE, double)           \
  X(kU8, "uint8", 8, UInt, U8, ncclUint8, MPI_UINT8_T, uint8_t)                 \
  X(kI32, "int32", 32, Int, S32, ncclInt32, MPI_INT32_T, int32_t)               \
  X(kI64, "int64", 64, Int, S64, ncclInt64, MPI_INT64_T, int64_t)

// For every X-list whose entries begin (enumerator, name, ...): the enum's
// enumerators, and the name of `value` (inside a function of that parameter).
#define BAGUA_ENUMERATOR(enumerator, ...) enumerator,
#define BAGUA_NAME_OF_VALUE(enumerator, name, ...) \
  if (value == decltype(value)::enumerator) return name;

// The enum class `Type` of such a list, and `name_of(Type)` (`unknown` for a
// value outside it).
#define BAGUA_NAMED_ENUM(Type, LIST, name_of, unknown) \
  enum class Type { LIST(BAGUA_ENUMERATOR) };          \
  inline const char* name_of(Type value) {             \
    LIST(BAGUA_NAME_OF_VALUE)                          \
    return unknown;                                    \
  }

enum class DType { BAGUA_DTYPES(BAGUA_ENUMERATOR) kUnsupported };

inline const char* dtype_name(DType value) {
  BAGUA_DTYPES(BAGUA_NAME_OF_VALUE)
  return "an unsupported dtype";
}

inline int64_t dtype_bytes(DType dtype) {
#define BAGUA_DTYPE_BYTES(enumerator, name, bits, ...) \
  if (dtype == DType::enumerator) return bits / 8;
  BAGUA_DTYPES(BAGUA_DTYPE_BYTES)
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

// The bits of a value read as another type of the same size (std::bit_cast is
// C++20); a 4-byte memcpy compiles to a register move on the host and the device.
template <typename To, typename From>
BAGUA_HD To bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs two types of one size");
  To to;
  memcpy(&to, &from, sizeof to);
  return to;
}

BAGUA_HD uint32_t float_bits(float f) { return bit_cast<uint32_t>(f); }
BAGUA_HD float bits_float(uint32_t u) { return bit_cast<float>(u); }

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

// Calls f(T{}) with the C++ element type T of `dtype` (Half and BFloat16 for
// the 16-bit floats); nothing for an unsupported one.
template <typename F>
void with_element_type(DType dtype, F&& f) {
#define BAGUA_DTYPE_CALL(enumerator, name, bits, dlpack, xla, nccl, mpi, type) \
  if (dtype == DType::enumerator) return f(type{});
  BAGUA_DTYPES(BAGUA_DTYPE_CALL)
#undef BAGUA_DTYPE_CALL
}

}  // namespace bagua
