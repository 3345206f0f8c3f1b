// The operations both front ends call: argument checks with messages a user
// understands, then a dtype switch into the typed kernels. The XLA FFI handlers
// (kernel_handlers.h) and the DLPack bindings (kernel_bindings.h) are thin shells around
// these functions.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "dtypes.h"
#include "kernels.h"
#include "layout.h"

namespace bagua {

// A contiguous buffer seen by an operation; data == nullptr means "absent".
struct TensorRef {
  void* data;
  DType dtype;
  int64_t numel;
};

namespace detail {

// The float types the kernels take (float64 is for collectives only).
inline bool is_kernel_float(DType d) {
  return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16;
}

inline Status invalid(std::string what) { return Status{std::move(what)}; }

template <typename F>
Status dispatch_float(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32:
      return f(float{});
    case DType::kF16:
      return f(Half{});
    case DType::kBF16:
      return f(BFloat16{});
    default:
      return invalid(std::string("expected float32, float16 or bfloat16, got ") +
                     dtype_name(dtype));
  }
}

inline Status check_float(const char* name, TensorRef t) {
  if (!is_kernel_float(t.dtype))
    return invalid(std::string(name) + " must be float32, float16 or bfloat16, got " +
                   dtype_name(t.dtype));
  return {};
}

inline Status check_numel(const char* name, TensorRef t, int64_t expected) {
  if (t.numel != expected)
    return invalid(std::string(name) + " has " + std::to_string(t.numel) + " elements, expected " +
                   std::to_string(expected));
  return {};
}

inline Status check_bytes(const char* name, TensorRef t, int64_t expected) {
  if (t.dtype != DType::kU8)
    return invalid(std::string(name) + " must be uint8, got " + dtype_name(t.dtype));
  return check_numel(name, t, expected);
}

inline Status check_chunks(int64_t k) {
  if (k < 1) return invalid("the chunk count k must be at least 1, got " + std::to_string(k));
  return {};
}

template <typename... Checks>
Status first_error(Checks... checks) {
  Status result;
  ((result.ok() ? (void)(result = std::move(checks)) : (void)0), ...);
  return result;
}

// The typed kernels of one format, as BAGUA_FORMATS names them.
template <Format format>
struct Codec;
#define BAGUA_CODEC_KERNELS(enumerator, name, codec)      \
  template <>                                             \
  struct Codec<Format::enumerator> {                      \
    template <typename... Args>                           \
    static Status compress(Args... args) {                \
      return kernels::codec##_compress(args...);          \
    }                                                     \
    template <typename... Args>                           \
    static Status decompress(Args... args) {              \
      return kernels::codec##_decompress(args...);        \
    }                                                     \
    template <typename... Args>                           \
    static Status decompress_reduce(Args... args) {       \
      return kernels::codec##_decompress_reduce(args...); \
    }                                                     \
  };
BAGUA_FORMATS(BAGUA_CODEC_KERNELS)

// Calls f(Codec<format>{}) for a run-time format.
template <typename F>
Status dispatch_format(Format format, F&& f) {
#define BAGUA_FORMAT_CASE(enumerator, name, codec) \
  if (format == Format::enumerator) return f(Codec<Format::enumerator>{});
  BAGUA_FORMATS(BAGUA_FORMAT_CASE)
  return invalid("unknown compression format");
}

// Calls f(Codec<format>{}, T{}) for a run-time format and kernel float dtype.
template <typename F>
Status dispatch_codec(Format format, DType dtype, F&& f) {
  return dispatch_float(dtype, [&](auto tag) {
    return dispatch_format(format, [&](auto codec) { return f(codec, tag); });
  });
}

}  // namespace detail

// With residual_in.data == nullptr, compress x; else compress x + residual_in
// and write the new residual to residual_out.
template <typename Exec>
Status compress(const Exec& exec, Format format, TensorRef x, TensorRef residual_in, TensorRef out,
                TensorRef residual_out, int64_t k) {
  const bool feedback = residual_in.data != nullptr;
  Status s =
      detail::first_error(detail::check_chunks(k), detail::check_float("x", x),
                          detail::check_bytes("the compressed output", out,
                                              k >= 1 ? compressed_bytes(format, x.numel, k) : 0));
  if (!s.ok()) return s;
  if (feedback) {
    if (residual_in.dtype != DType::kF32 || residual_out.dtype != DType::kF32)
      return detail::invalid("error-feedback residuals must be float32");
    s = detail::first_error(detail::check_numel("the residual", residual_in, x.numel),
                            detail::check_numel("the new residual", residual_out, x.numel));
    if (!s.ok()) return s;
  }
  return detail::dispatch_codec(format, x.dtype, [&](auto codec, auto tag) {
    return decltype(codec)::compress(exec, static_cast<const decltype(tag)*>(x.data),
                                     static_cast<const float*>(residual_in.data), x.numel, k,
                                     static_cast<uint8_t*>(out.data),
                                     feedback ? static_cast<float*>(residual_out.data) : nullptr);
  });
}

template <typename Exec>
Status decompress(const Exec& exec, Format format, TensorRef in, TensorRef out, int64_t k) {
  Status s =
      detail::first_error(detail::check_chunks(k), detail::check_float("the output", out),
                          detail::check_bytes("the compressed input", in,
                                              k >= 1 ? compressed_bytes(format, out.numel, k) : 0));
  if (!s.ok()) return s;
  return detail::dispatch_codec(format, out.dtype, [&](auto codec, auto tag) {
    return decltype(codec)::decompress(exec, static_cast<const uint8_t*>(in.data), out.numel, k,
                                       static_cast<decltype(tag)*>(out.data));
  });
}

template <typename Exec>
Status decompress_reduce(const Exec& exec, Format format, TensorRef in, TensorRef out, int64_t k,
                         bool average) {
  Status s = detail::first_error(
      detail::check_chunks(k), detail::check_float("the output", out),
      detail::check_bytes("the compressed input", in, k * compressed_bytes(format, out.numel, 1)));
  if (!s.ok()) return s;
  return detail::dispatch_codec(format, out.dtype, [&](auto codec, auto tag) {
    return decltype(codec)::decompress_reduce(exec, static_cast<const uint8_t*>(in.data), out.numel,
                                              k, average, static_cast<decltype(tag)*>(out.data));
  });
}

namespace detail {

// Elementwise helpers: every operand has the output's dtype and size.
template <typename Exec, typename Kernel, typename... Operands>
Status elementwise(const Exec& exec, Kernel kernel, TensorRef out, Operands... operands) {
  Status s = check_float("the output", out);
  if (!s.ok()) return s;
  for (const TensorRef& t : {operands...}) {
    if (t.dtype != out.dtype)
      return invalid(std::string("operands must share one dtype, got ") + dtype_name(t.dtype) +
                     " and " + dtype_name(out.dtype));
    if (t.numel != out.numel)
      return invalid("operands must have the same number of elements, got " +
                     std::to_string(t.numel) + " and " + std::to_string(out.numel));
  }
  return dispatch_float(out.dtype, [&](auto tag) {
    using T = decltype(tag);
    return kernel(static_cast<const T*>(operands.data)..., out.numel, static_cast<T*>(out.data));
  });
}

}  // namespace detail

template <typename Exec>
Status average2(const Exec& exec, TensorRef a, TensorRef b, TensorRef out) {
  return detail::elementwise(
      exec,
      [&](auto* pa, auto* pb, int64_t n, auto* po) {
        return kernels::average2(exec, pa, pb, n, po);
      },
      out, a, b);
}

template <typename Exec>
Status axpy(const Exec& exec, TensorRef x, float a, TensorRef y, TensorRef out) {
  return detail::elementwise(
      exec,
      [&](auto* px, auto* py, int64_t n, auto* po) {
        return kernels::axpy(exec, px, a, py, n, po);
      },
      out, x, y);
}

template <typename Exec>
Status async_average(const Exec& exec, TensorRef x, TensorRef reduced, TensorRef snapshot,
                     int64_t ranks, TensorRef out) {
  if (ranks < 1) return detail::invalid("the rank count must be at least 1");
  return detail::elementwise(
      exec,
      [&](auto* px, auto* pr, auto* ps, int64_t n, auto* po) {
        return kernels::async_average(exec, px, pr, ps, static_cast<float>(ranks), n, po);
      },
      out, x, reduced, snapshot);
}

template <typename Exec>
Status lowprec_decentralized_diff(const Exec& exec, TensorRef x, TensorRef w, TensorRef left,
                                  TensorRef right, TensorRef out) {
  return detail::elementwise(
      exec,
      [&](auto* px, auto* pw, auto* pl, auto* pr, int64_t n, auto* po) {
        return kernels::lowprec_decentralized_diff(exec, px, pw, pl, pr, n, po);
      },
      out, x, w, left, right);
}

}  // namespace bagua
