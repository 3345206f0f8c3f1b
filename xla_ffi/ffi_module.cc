// The Python extension `_bagua_ffi`: the kernels' FFI handler capsules for JAX,
// the same kernels on DLPack tensors for PyTorch, and what the build contains.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "binding_util.h"
#include "kernel_bindings.h"
#include "kernel_handlers.h"

namespace nb = nanobind;

NB_MODULE(_bagua_ffi, m) {
  using namespace bagua;
  m.doc() = "Bagua's native kernels: XLA FFI handlers and DLPack entry points.";

  bind_registrations(m, {
                            {"cpu", kernel_handlers::handlers<Cpu>()},
#ifdef BAGUA_WITH_CUDA
                            {"CUDA", kernel_handlers::handlers<Cuda>()},
#endif
                        });

  m.def(
      "build_info",
      [] {
        nb::dict info;
        info["cpu"] = true;
#ifdef BAGUA_WITH_CUDA
        info["cuda"] = true;
        info["cuda_architectures"] = BAGUA_CUDA_ARCHITECTURES;
#else
        info["cuda"] = false;
        info["cuda_architectures"] = "";
#endif
#ifdef BAGUA_WITH_NCCL
        info["nccl"] = true;
#else
        info["nccl"] = false;
#endif
#ifdef BAGUA_WITH_MPI
        info["mpi"] = true;
#else
        info["mpi"] = false;
#endif
#ifdef BAGUA_WITH_TCP
        info["tcp"] = true;
#else
        info["tcp"] = false;
#endif
        info["jaxlib"] = BAGUA_BUILT_WITH_JAXLIB;
        info["xla_ffi_api"] =
            std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR);
        return info;
      },
      "What this build of the native library contains.");

  kernel_bindings::bind(m);
}
