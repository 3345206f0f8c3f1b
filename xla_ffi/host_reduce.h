// Element-wise reductions and the average's division on host memory, for the host engines (the
// MPI engine's 16-bit reductions, which MPI lacks, and every reduction of the TCP engine).
// 16-bit floats are computed in float32 and rounded back.
#pragma once

#include <cstdint>
#include <type_traits>

#include "communicator.h"
#include "dtypes.h"

namespace bagua {

template <typename T>
T reduce_pair(T x, T y, ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin:
      return x < y ? x : y;
    case ReduceOp::kMax:
      return x > y ? x : y;
    default:  // kSum, and kAvg's sum before the division
      return x + y;
  }
}

// inout[i] = in[i] (op) inout[i].
template <typename T>
void reduce_into(const void* in, void* inout, int64_t count, ReduceOp op) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
    for (int64_t i = 0; i < count; ++i)
      b[i] = from_float<T>(reduce_pair(to_float(a[i]), to_float(b[i]), op));
  } else {
    for (int64_t i = 0; i < count; ++i) b[i] = reduce_pair(a[i], b[i], op);
  }
}

inline void reduce_into(const void* in, void* inout, int64_t count, DType type, ReduceOp op) {
  switch (type) {
    case DType::kF32:
      return reduce_into<float>(in, inout, count, op);
    case DType::kF16:
      return reduce_into<Half>(in, inout, count, op);
    case DType::kBF16:
      return reduce_into<BFloat16>(in, inout, count, op);
    case DType::kF64:
      return reduce_into<double>(in, inout, count, op);
    case DType::kU8:
      return reduce_into<uint8_t>(in, inout, count, op);
    case DType::kI32:
      return reduce_into<int32_t>(in, inout, count, op);
    case DType::kI64:
      return reduce_into<int64_t>(in, inout, count, op);
    default:
      return;
  }
}

// An average is a sum divided by the ranks afterwards; integers are not divided.
inline void divide_in_place(void* data, int64_t count, DType type, int ranks) {
  auto divide = [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    for (int64_t i = 0; i < count; ++i) {
      if constexpr (std::is_same_v<T, double>)
        p[i] /= ranks;
      else
        p[i] = from_float<T>(to_float(p[i]) / static_cast<float>(ranks));
    }
  };
  switch (type) {
    case DType::kF32:
      return divide(static_cast<float*>(data));
    case DType::kF16:
      return divide(static_cast<Half*>(data));
    case DType::kBF16:
      return divide(static_cast<BFloat16*>(data));
    case DType::kF64:
      return divide(static_cast<double*>(data));
    default:
      return;
  }
}

}  // namespace bagua
