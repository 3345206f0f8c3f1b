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
  with_element_type(type, [&](auto tag) { reduce_into<decltype(tag)>(in, inout, count, op); });
}

// An average is a sum divided by the ranks afterwards; integers are not divided.
inline void divide_in_place(void* data, int64_t count, DType type, int ranks) {
  with_element_type(type, [&](auto tag) {
    using T = decltype(tag);
    T* p = static_cast<T*>(data);
    if constexpr (std::is_same_v<T, double>) {
      for (int64_t i = 0; i < count; ++i) p[i] /= ranks;
    } else if constexpr (!std::is_integral_v<T>) {
      for (int64_t i = 0; i < count; ++i)
        p[i] = from_float<T>(to_float(p[i]) / static_cast<float>(ranks));
    }
  });
}

}  // namespace bagua
