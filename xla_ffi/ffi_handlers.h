// XLA FFI handlers: decode the call frame, hand the buffers to ops.h, turn its
// Status into an ffi::Error. One template serves every device; the device is
// last context argument (Cpu carries nothing, Cuda carries XLA's stream).
#pragma once

#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "ops.h"
#include "xla/ffi/api/ffi.h"

namespace xla::ffi {

template <>
struct CtxDecoding<bagua::Cpu> {
  using Type = bagua::Cpu;
  static std::optional<Type> Decode(const XLA_FFI_Api*, XLA_FFI_ExecutionContext*,
                                    DiagnosticEngine&) {
    return bagua::Cpu{};
  }
};

template <>
struct CtxDecoding<bagua::Cuda> {
  using Type = bagua::Cuda;
  static std::optional<Type> Decode(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx,
                                    DiagnosticEngine& diagnostic) {
    auto stream = CtxDecoding<PlatformStream<void*>>::Decode(api, ctx, diagnostic);
    if (!stream) return std::nullopt;
    return bagua::Cuda{*stream};
  }
};

}  // namespace xla::ffi

namespace bagua::ffi_handlers {

namespace ffi = xla::ffi;

inline DType dtype_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return DType::kF32;
    case ffi::DataType::F16:
      return DType::kF16;
    case ffi::DataType::BF16:
      return DType::kBF16;
    case ffi::DataType::U8:
      return DType::kU8;
    default:
      return DType::kUnsupported;
  }
}

inline TensorRef ref(const ffi::AnyBuffer& b) {
  return {b.untyped_data(), dtype_of(b.element_type()), static_cast<int64_t>(b.element_count())};
}

template <typename F>
ffi::Error run(const char* op, F&& f) {
  try {
    const Status s = f();
    if (s.ok()) return ffi::Error::Success();
    std::string message = std::string("bagua ") + op + ": " + s.message;
    return s.internal ? ffi::Error::Internal(std::move(message))
                      : ffi::Error::InvalidArgument(std::move(message));
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("bagua ") + op + ": " + e.what());
  }
}

template <typename Exec, Format format>
ffi::Error Compress(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, int64_t k, Exec exec) {
  return run("compress", [&] {
    const TensorRef none{nullptr, DType::kF32, 0};
    return format == Format::kMinMaxUInt8 ? minmax_compress(exec, ref(x), none, ref(*out), none, k)
                                          : sign_compress(exec, ref(x), none, ref(*out), none, k);
  });
}

template <typename Exec, Format format>
ffi::Error CompressWithFeedback(ffi::AnyBuffer x, ffi::AnyBuffer residual,
                                ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::AnyBuffer> new_residual, int64_t k, Exec exec) {
  return run("compress with error feedback", [&] {
    return format == Format::kMinMaxUInt8
               ? minmax_compress(exec, ref(x), ref(residual), ref(*out), ref(*new_residual), k)
               : sign_compress(exec, ref(x), ref(residual), ref(*out), ref(*new_residual), k);
  });
}

template <typename Exec, Format format>
ffi::Error Decompress(ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out, int64_t k, Exec exec) {
  return run("decompress", [&] { return decompress(exec, format, ref(in), ref(*out), k); });
}

template <typename Exec, Format format>
ffi::Error DecompressReduce(ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out, int64_t k,
                            bool average, Exec exec) {
  return run("decompress-reduce",
             [&] { return decompress_reduce(exec, format, ref(in), ref(*out), k, average); });
}

template <typename Exec>
ffi::Error Average2(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> out, Exec exec) {
  return run("average", [&] { return average2(exec, ref(a), ref(b), ref(*out)); });
}

template <typename Exec>
ffi::Error Axpy(ffi::AnyBuffer x, ffi::AnyBuffer y, ffi::Result<ffi::AnyBuffer> out,
                float a, Exec exec) {
  return run("axpy", [&] { return axpy(exec, ref(x), a, ref(y), ref(*out)); });
}

template <typename Exec>
ffi::Error AsyncAverage(ffi::AnyBuffer x, ffi::AnyBuffer reduced, ffi::AnyBuffer snapshot,
                        ffi::Result<ffi::AnyBuffer> out, int64_t ranks, Exec exec) {
  return run("async model average update", [&] {
    return async_average(exec, ref(x), ref(reduced), ref(snapshot), ranks, ref(*out));
  });
}

template <typename Exec>
ffi::Error LowPrecDecentralizedDiff(ffi::AnyBuffer x, ffi::AnyBuffer w,
                                    ffi::AnyBuffer left, ffi::AnyBuffer right,
                                    ffi::Result<ffi::AnyBuffer> out, Exec exec) {
  return run("low-precision decentralized difference", [&] {
    return lowprec_decentralized_diff(exec, ref(x), ref(w), ref(left), ref(right), ref(*out));
  });
}

using HandlerTable = std::vector<std::pair<const char*, XLA_FFI_Handler*>>;

// Every FFI target of the library for one device, by target name.
template <typename Exec>
HandlerTable handlers() {
  using ffi::AnyBuffer;
  using ffi::Ffi;
  using ffi::Result;
  constexpr Format kMinMax = Format::kMinMaxUInt8;
  constexpr Format kSign = Format::kSign;
  XLA_FFI_DEFINE_HANDLER(minmax_compress, (Compress<Exec, kMinMax>),
                         Ffi::Bind().Arg<AnyBuffer>().Ret<AnyBuffer>().Attr<int64_t>("k").Ctx<Exec>());
  XLA_FFI_DEFINE_HANDLER(sign_compress, (Compress<Exec, kSign>),
                         Ffi::Bind().Arg<AnyBuffer>().Ret<AnyBuffer>().Attr<int64_t>("k").Ctx<Exec>());
  XLA_FFI_DEFINE_HANDLER(minmax_compress_ef, (CompressWithFeedback<Exec, kMinMax>),
                         Ffi::Bind().Arg<AnyBuffer>().Arg<AnyBuffer>().Ret<AnyBuffer>()
                             .Ret<AnyBuffer>().Attr<int64_t>("k").Ctx<Exec>());
  XLA_FFI_DEFINE_HANDLER(sign_compress_ef, (CompressWithFeedback<Exec, kSign>),
                         Ffi::Bind().Arg<AnyBuffer>().Arg<AnyBuffer>().Ret<AnyBuffer>()
                             .Ret<AnyBuffer>().Attr<int64_t>("k").Ctx<Exec>());
  XLA_FFI_DEFINE_HANDLER(minmax_decompress, (Decompress<Exec, kMinMax>),
                         Ffi::Bind().Arg<AnyBuffer>().Ret<AnyBuffer>().Attr<int64_t>("k").Ctx<Exec>());
  XLA_FFI_DEFINE_HANDLER(sign_decompress, (Decompress<Exec, kSign>),
                         Ffi::Bind().Arg<AnyBuffer>().Ret<AnyBuffer>().Attr<int64_t>("k").Ctx<Exec>());
  XLA_FFI_DEFINE_HANDLER(minmax_decompress_reduce, (DecompressReduce<Exec, kMinMax>),
                         Ffi::Bind().Arg<AnyBuffer>().Ret<AnyBuffer>().Attr<int64_t>("k")
                             .Attr<bool>("average").Ctx<Exec>());
  XLA_FFI_DEFINE_HANDLER(sign_decompress_reduce, (DecompressReduce<Exec, kSign>),
                         Ffi::Bind().Arg<AnyBuffer>().Ret<AnyBuffer>().Attr<int64_t>("k")
                             .Attr<bool>("average").Ctx<Exec>());
  XLA_FFI_DEFINE_HANDLER(average2, Average2<Exec>,
                         Ffi::Bind().Arg<AnyBuffer>().Arg<AnyBuffer>().Ret<AnyBuffer>().Ctx<Exec>());
  XLA_FFI_DEFINE_HANDLER(axpy, Axpy<Exec>,
                         Ffi::Bind().Arg<AnyBuffer>().Arg<AnyBuffer>().Ret<AnyBuffer>()
                             .Attr<float>("a").Ctx<Exec>());
  XLA_FFI_DEFINE_HANDLER(async_average, AsyncAverage<Exec>,
                         Ffi::Bind().Arg<AnyBuffer>().Arg<AnyBuffer>().Arg<AnyBuffer>()
                             .Ret<AnyBuffer>().Attr<int64_t>("ranks").Ctx<Exec>());
  XLA_FFI_DEFINE_HANDLER(lowprec_decentralized_diff, LowPrecDecentralizedDiff<Exec>,
                         Ffi::Bind().Arg<AnyBuffer>().Arg<AnyBuffer>().Arg<AnyBuffer>()
                             .Arg<AnyBuffer>().Ret<AnyBuffer>().Ctx<Exec>());
  return {
      {"bagua_minmax_compress", minmax_compress},
      {"bagua_sign_compress", sign_compress},
      {"bagua_minmax_compress_ef", minmax_compress_ef},
      {"bagua_sign_compress_ef", sign_compress_ef},
      {"bagua_minmax_decompress", minmax_decompress},
      {"bagua_sign_decompress", sign_decompress},
      {"bagua_minmax_decompress_reduce", minmax_decompress_reduce},
      {"bagua_sign_decompress_reduce", sign_decompress_reduce},
      {"bagua_average2", average2},
      {"bagua_axpy", axpy},
      {"bagua_async_average", async_average},
      {"bagua_lowprec_decentralized_diff", lowprec_decentralized_diff},
  };
}

HandlerTable cpu_handlers();
HandlerTable cuda_handlers();

}  // namespace bagua::ffi_handlers
