// XLA FFI handlers for the kernels (the targets bagua_jax calls): decode the
// call frame, hand the buffers to ops.h, turn its Status into an ffi::Error.
// One template serves every device; the DLPack twin is kernel_bindings.h.
#pragma once

#include <exception>
#include <string>
#include <utility>

#include "handler_util.h"
#include "ops.h"

namespace bagua::kernel_handlers {

namespace ffi = xla::ffi;
using handler_util::dtype_of;
using handler_util::HandlerTable;

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
    return compress(exec, format, ref(x), none, ref(*out), none, k);
  });
}

template <typename Exec, Format format>
ffi::Error CompressWithFeedback(ffi::AnyBuffer x, ffi::AnyBuffer residual,
                                ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::AnyBuffer> new_residual, int64_t k, Exec exec) {
  return run("compress with error feedback", [&] {
    return compress(exec, format, ref(x), ref(residual), ref(*out), ref(*new_residual), k);
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
ffi::Error Average2(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> out,
                    Exec exec) {
  return run("average", [&] { return average2(exec, ref(a), ref(b), ref(*out)); });
}

template <typename Exec>
ffi::Error Axpy(ffi::AnyBuffer x, ffi::AnyBuffer y, ffi::Result<ffi::AnyBuffer> out, float a,
                Exec exec) {
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
ffi::Error LowPrecDecentralizedDiff(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer left,
                                    ffi::AnyBuffer right, ffi::Result<ffi::AnyBuffer> out,
                                    Exec exec) {
  return run("low-precision decentralized difference", [&] {
    return lowprec_decentralized_diff(exec, ref(x), ref(w), ref(left), ref(right), ref(*out));
  });
}

// Each format's FFI targets: X(name, implementation, binding without the device).
#define BAGUA_CODEC_TARGETS(X, format, codec)                                               \
  X(codec##_compress, (Compress<Exec, Format::format>),                                     \
    Ffi::Bind().Arg<Buffer>().Ret<Buffer>().Attr<int64_t>("k"))                             \
  X(codec##_compress_ef, (CompressWithFeedback<Exec, Format::format>),                      \
    Ffi::Bind().Arg<Buffer>().Arg<Buffer>().Ret<Buffer>().Ret<Buffer>().Attr<int64_t>("k")) \
  X(codec##_decompress, (Decompress<Exec, Format::format>),                                 \
    Ffi::Bind().Arg<Buffer>().Ret<Buffer>().Attr<int64_t>("k"))                             \
  X(codec##_decompress_reduce, (DecompressReduce<Exec, Format::format>),                    \
    Ffi::Bind().Arg<Buffer>().Ret<Buffer>().Attr<int64_t>("k").Attr<bool>("average"))
#define BAGUA_CODEC_HANDLERS(format, name, codec) \
  BAGUA_CODEC_TARGETS(BAGUA_DEFINE_HANDLER, format, codec)
#define BAGUA_CODEC_ENTRIES(format, name, codec) \
  BAGUA_CODEC_TARGETS(BAGUA_HANDLER_ENTRY, format, codec)

// The elementwise FFI targets.
#define BAGUA_ELEMENTWISE_TARGETS(X)                                                            \
  X(average2, Average2<Exec>, Ffi::Bind().Arg<Buffer>().Arg<Buffer>().Ret<Buffer>())            \
  X(axpy, Axpy<Exec>, Ffi::Bind().Arg<Buffer>().Arg<Buffer>().Ret<Buffer>().Attr<float>("a"))   \
  X(async_average, AsyncAverage<Exec>,                                                          \
    Ffi::Bind().Arg<Buffer>().Arg<Buffer>().Arg<Buffer>().Ret<Buffer>().Attr<int64_t>("ranks")) \
  X(lowprec_decentralized_diff, LowPrecDecentralizedDiff<Exec>,                                 \
    Ffi::Bind().Arg<Buffer>().Arg<Buffer>().Arg<Buffer>().Arg<Buffer>().Ret<Buffer>())

// Every kernel FFI target for one device, by target name.
template <typename Exec>
HandlerTable handlers() {
  using Buffer = ffi::AnyBuffer;
  using ffi::Ffi;
  BAGUA_FORMATS(BAGUA_CODEC_HANDLERS)
  BAGUA_ELEMENTWISE_TARGETS(BAGUA_DEFINE_HANDLER)
  return HandlerTable{BAGUA_FORMATS(BAGUA_CODEC_ENTRIES)
                          BAGUA_ELEMENTWISE_TARGETS(BAGUA_HANDLER_ENTRY)};
}

}  // namespace bagua::kernel_handlers
