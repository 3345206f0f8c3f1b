// The kernels on DLPack tensors (for bagua_torch; no libtorch at build time):
// check the device, refuse JAX outputs, hand the buffers to ops.h, turn its
// Status into a Python exception. The XLA FFI twin is kernel_handlers.h.
#pragma once

#include <nanobind/stl/string.h>

#include <initializer_list>
#include <stdexcept>
#include <string>

#include "binding_util.h"
#include "ops.h"

namespace bagua::kernel_bindings {

// Runs `op` on the device holding every tensor: CPU, or CUDA on `stream`.
template <typename Op>
void run(const char* name, std::initializer_list<Placement> tensors, uintptr_t stream, Op&& op) {
  const Placement first = *tensors.begin();
  for (const Placement& p : tensors)
    if (p.type != first.type || p.id != first.id)
      throw nb::value_error(
          (std::string("bagua ") + name + ": all tensors must be on one device").c_str());
  Status status;
  if (first.type == nb::device::cpu::value) {
    nb::gil_scoped_release release;
    status = op(Cpu{});
  } else if (first.type == nb::device::cuda::value) {
#ifdef BAGUA_WITH_CUDA
    nb::gil_scoped_release release;
    status = op(Cuda{reinterpret_cast<void*>(stream)});
#else
    throw nb::value_error("bagua was built without CUDA kernels; see build_info()");
#endif
  } else {
    throw nb::value_error(
        (std::string("bagua ") + name + ": tensors must be on the CPU or a CUDA device").c_str());
  }
  if (!status.ok()) {
    const std::string message = std::string("bagua ") + name + ": " + status.message;
    if (status.internal) throw std::runtime_error(message);
    throw nb::value_error(message.c_str());
  }
}

inline Format format_of(const std::string& name) {
  std::string known;
#define BAGUA_FORMAT_OF(enumerator, format_name, codec) \
  if (name == format_name) return Format::enumerator;   \
  known += std::string(known.empty() ? "'" : ", '") + format_name + "'";
  BAGUA_FORMATS(BAGUA_FORMAT_OF)
  throw nb::value_error(("unknown compression format '" + name + "'; use " + known).c_str());
}

inline void bind(nb::module_& m) {
  m.def(
      "compressed_bytes",
      [](const std::string& format, int64_t n, int64_t k) {
        if (n < 0)
          throw nb::value_error(
              ("the element count n must be >= 0, got " + std::to_string(n)).c_str());
        if (k < 1)
          throw nb::value_error(
              ("the chunk count k must be at least 1, got " + std::to_string(k)).c_str());
        return compressed_bytes(format_of(format), n, k);
      },
      nb::arg("format"), nb::arg("n"), nb::arg("k"),
      "Size in bytes of n elements compressed into k chunks ('minmax_uint8', 'minmax_uint4' or "
      "'sign').");

  m.def(
      "compress",
      [](const std::string& format, Input x, nb::handle out_obj, int64_t k, uintptr_t stream) {
        Output out = writable(out_obj, "out");
        const Format f = format_of(format);
        run("compress", {placement(x), placement(out)}, stream, [&](const auto& exec) {
          return compress(exec, f, ref(x), none(), ref(out), none(), k);
        });
      },
      nb::arg("format"), nb::arg("x"), nb::arg("out"), nb::arg("k"), nb::arg("stream") = 0);

  m.def(
      "compress_ef",
      [](const std::string& format, Input x, nb::handle residual_obj, nb::handle out_obj, int64_t k,
         uintptr_t stream) {
        Output residual = writable(residual_obj, "residual");
        Output out = writable(out_obj, "out");
        const Format f = format_of(format);
        run("compress with error feedback", {placement(x), placement(residual), placement(out)},
            stream, [&](const auto& exec) {
              return compress(exec, f, ref(x), ref(residual), ref(out), ref(residual), k);
            });
      },
      nb::arg("format"), nb::arg("x"), nb::arg("residual"), nb::arg("out"), nb::arg("k"),
      nb::arg("stream") = 0, "Compresses x + residual and updates residual in place.");

  m.def(
      "decompress",
      [](const std::string& format, Input in, nb::handle out_obj, int64_t k, uintptr_t stream) {
        Output out = writable(out_obj, "out");
        const Format f = format_of(format);
        run("decompress", {placement(in), placement(out)}, stream,
            [&](const auto& exec) { return decompress(exec, f, ref(in), ref(out), k); });
      },
      nb::arg("format"), nb::arg("compressed"), nb::arg("out"), nb::arg("k"),
      nb::arg("stream") = 0);

  m.def(
      "decompress_reduce",
      [](const std::string& format, Input in, nb::handle out_obj, int64_t k, bool average,
         uintptr_t stream) {
        Output out = writable(out_obj, "out");
        const Format f = format_of(format);
        run("decompress-reduce", {placement(in), placement(out)}, stream, [&](const auto& exec) {
          return decompress_reduce(exec, f, ref(in), ref(out), k, average);
        });
      },
      nb::arg("format"), nb::arg("compressed"), nb::arg("out"), nb::arg("k"), nb::arg("average"),
      nb::arg("stream") = 0);

  m.def(
      "average2",
      [](Input a, Input b, nb::handle out_obj, uintptr_t stream) {
        Output out = writable(out_obj, "out");
        run("average", {placement(a), placement(b), placement(out)}, stream,
            [&](const auto& exec) { return average2(exec, ref(a), ref(b), ref(out)); });
      },
      nb::arg("a"), nb::arg("b"), nb::arg("out"), nb::arg("stream") = 0);

  m.def(
      "axpy",
      [](Input x, float a, Input y, nb::handle out_obj, uintptr_t stream) {
        Output out = writable(out_obj, "out");
        run("axpy", {placement(x), placement(y), placement(out)}, stream,
            [&](const auto& exec) { return axpy(exec, ref(x), a, ref(y), ref(out)); });
      },
      nb::arg("x"), nb::arg("a"), nb::arg("y"), nb::arg("out"), nb::arg("stream") = 0);

  m.def(
      "async_average",
      [](Input x, Input reduced, Input snapshot, int64_t ranks, nb::handle out_obj,
         uintptr_t stream) {
        Output out = writable(out_obj, "out");
        run("async model average update",
            {placement(x), placement(reduced), placement(snapshot), placement(out)}, stream,
            [&](const auto& exec) {
              return async_average(exec, ref(x), ref(reduced), ref(snapshot), ranks, ref(out));
            });
      },
      nb::arg("x"), nb::arg("reduced"), nb::arg("snapshot"), nb::arg("ranks"), nb::arg("out"),
      nb::arg("stream") = 0);

  m.def(
      "lowprec_decentralized_diff",
      [](Input x, Input w, Input left, Input right, nb::handle out_obj, uintptr_t stream) {
        Output out = writable(out_obj, "out");
        run("low-precision decentralized difference",
            {placement(x), placement(w), placement(left), placement(right), placement(out)}, stream,
            [&](const auto& exec) {
              return lowprec_decentralized_diff(exec, ref(x), ref(w), ref(left), ref(right),
                                                ref(out));
            });
      },
      nb::arg("x"), nb::arg("w"), nb::arg("left"), nb::arg("right"), nb::arg("out"),
      nb::arg("stream") = 0);
}

}  // namespace bagua::kernel_bindings
