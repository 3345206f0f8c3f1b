// What the XLA FFI handler files share (kernel_handlers.h,
// collective_handlers.h): the device as the last context argument (Cpu carries
// nothing, Cuda carries XLA's stream), XLA's element types as DType, and the
// table of handlers by target name.
#pragma once

#include <optional>
#include <utility>
#include <vector>

#include "dtypes.h"
#include "kernels.h"
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

namespace bagua::handler_util {

namespace ffi = xla::ffi;

inline DType dtype_of(ffi::DataType t) {
#define BAGUA_DTYPE_FROM_XLA(enumerator, name, bits, dlpack, xla, ...) \
  if (t == ffi::DataType::xla) return DType::enumerator;
  BAGUA_DTYPES(BAGUA_DTYPE_FROM_XLA)
  return DType::kUnsupported;
}

using HandlerTable = std::vector<std::pair<const char*, XLA_FFI_Handler*>>;

// Defines one handler per entry of a target list, X(name, implementation,
// binding without the device context), for the device `Exec`, and lists them
// by target name "bagua_<name>". Used inside a function templated on Exec.
#define BAGUA_DEFINE_HANDLER(name, implementation, binding) \
  XLA_FFI_DEFINE_HANDLER(name, implementation, binding.Ctx<Exec>());
#define BAGUA_HANDLER_ENTRY(name, implementation, binding) {"bagua_" #name, name},
#define BAGUA_HANDLER_TABLE(TARGETS) \
  TARGETS(BAGUA_DEFINE_HANDLER)      \
  return HandlerTable{TARGETS(BAGUA_HANDLER_ENTRY)};

}  // namespace bagua::handler_util
