// What the nanobind binding files share (kernel_bindings.h,
// collective_bindings.h, the *_module.cc files): DLPack's element types as
// DType, buffer views, the rule that bagua never writes into a JAX array, and
// the FFI handler capsules each module hands to JAX.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <string>
#include <utility>
#include <vector>

#include "handler_util.h"
#include "ops.h"

namespace bagua {

namespace nb = nanobind;

using Input = nb::ndarray<nb::ro, nb::c_contig>;
using Output = nb::ndarray<nb::c_contig>;

inline DType dtype_of(nb::dlpack::dtype t) {
#define BAGUA_DTYPE_FROM_DLPACK(enumerator, name, bits_, dlpack_code, ...)                      \
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::dlpack_code) && t.bits == bits_ && \
      t.lanes == 1)                                                                             \
    return DType::enumerator;
  BAGUA_DTYPES(BAGUA_DTYPE_FROM_DLPACK)
  return DType::kUnsupported;
}

template <typename Array>
TensorRef ref(const Array& a) {
  return {const_cast<void*>(static_cast<const void*>(a.data())), dtype_of(a.dtype()),
          static_cast<int64_t>(a.size())};
}

inline TensorRef none() { return {nullptr, DType::kF32, 0}; }

// A buffer the library writes into. JAX arrays are immutable and their DLPack
// export is not marked read-only, so they are refused by type.
inline Output writable(nb::handle obj, const char* name) {
  const std::string module =
      nb::cast<std::string>(nb::getattr(obj.type(), "__module__", nb::str("")));
  if (module.rfind("jax", 0) == 0)
    throw nb::type_error(
        (std::string(name) +
         " is a JAX array; JAX arrays are immutable and bagua never writes into one")
            .c_str());
  Output out;
  if (!nb::try_cast(obj, out))
    throw nb::type_error(
        (std::string(name) + " must be a writable, C-contiguous array with DLPack support")
            .c_str());
  return out;
}

struct Placement {
  int type;
  int id;
};

template <typename Array>
Placement placement(const Array& a) {
  return {a.device_type(), a.device_id()};
}

// Defines the module's `registrations()`: FFI handler capsules by platform
// ("cpu", "CUDA"), then by target name, for bagua_jax to register.
inline void bind_registrations(
    nb::module_& m, std::vector<std::pair<const char*, handler_util::HandlerTable>> platforms) {
  m.def(
      "registrations",
      [platforms] {
        nb::dict result;
        for (const auto& [platform, table] : platforms) {
          nb::dict capsules;
          for (const auto& [target, handler] : table)
            capsules[target] = nb::capsule(reinterpret_cast<void*>(handler));
          result[platform] = capsules;
        }
        return result;
      },
      "FFI handler capsules by platform, then by target name.");
}

}  // namespace bagua
