// The collectives on DLPack tensors (for bagua_torch), shared by every engine
// module: each module binds them for the device its engine serves. Calls
// release the GIL, so Python threads can overlap communication with compute.
// The XLA FFI twin is collective_handlers.h.
#pragma once

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <deque>
#include <initializer_list>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "binding_util.h"
#include "collective_handlers.h"
#include "communicator.h"
#include "communicator_registry.h"

namespace bagua::collective_bindings {

inline DType collective_dtype(nb::dlpack::dtype t) {
  const DType dtype = dtype_of(t);
  if (dtype == DType::kUnsupported)
    throw nb::type_error(
        "unsupported dtype for a collective (use float32/16, bfloat16, float64, uint8, int32 or "
        "int64)");
  return dtype;
}

inline std::shared_ptr<Communicator> lookup(int64_t handle) {
  auto comm = CommunicatorRegistry::instance().get(handle);
  if (!comm) throw nb::value_error(unknown_handle_message(handle).c_str());
  return comm;
}

inline void check(const Status& s) {
  if (s.ok()) return;
  if (s.internal) throw std::runtime_error("bagua " + s.message);
  throw nb::value_error(("bagua " + s.message).c_str());
}

inline void* stream(uintptr_t s) { return reinterpret_cast<void*>(s); }

inline void on_device(const char* op, int device_type,
                      std::initializer_list<int32_t> tensor_devices) {
  for (int32_t t : tensor_devices)
    if (t != device_type)
      throw nb::value_error((std::string(op) + ": this engine communicates " +
                             (device_type == nb::device::cpu::value ? "CPU" : "CUDA") + " tensors")
                                .c_str());
}

// Every collective from `send` into `recv`: refuses a JAX output, checks the
// device, the dtypes, the handle and the sizes (`fits`), then runs
// `call(communicator, recv, dtype)` without the GIL.
template <typename Fits, typename Call>
void collective(const char* op, int device_type, int64_t handle, const Input& send,
                nb::handle recv_obj, Fits&& fits, Call&& call) {
  Output recv = writable(recv_obj, "recv");
  on_device(op, device_type, {send.device_type(), recv.device_type()});
  const DType t = collective_dtype(send.dtype());
  if (collective_dtype(recv.dtype()) != t)
    throw nb::type_error((std::string(op) + ": send and receive dtypes differ").c_str());
  auto comm = lookup(handle);
  if (const char* wrong = fits(static_cast<size_t>(comm->size()), send.size(), recv.size()))
    throw nb::value_error((std::string(op) + ": " + wrong).c_str());
  nb::gil_scoped_release release;
  check(call(*comm, recv, t));
}

// Binds the collective `name`(handle, send, recv, extra..., stream) whose sizes
// follow `blocks`; `engine(communicator, send, recv, dtype, stream, extra...)`
// calls the engine, and `extra_names` name the Extra arguments.
template <typename... Extra, typename Engine, typename... Names>
void def_collective(nb::module_& m, int device_type, const char* name, Blocks blocks, Engine engine,
                    Names... extra_names) {
  m.def(
      name,
      [=](int64_t h, Input send, nb::handle recv_obj, Extra... extra, uintptr_t s) {
        collective(
            name, device_type, h, send, recv_obj,
            [&](size_t ranks, size_t sent, size_t received) {
              return blocks_mismatch(blocks, ranks, sent, received);
            },
            [&](Communicator& c, const Output& recv, DType t) {
              return engine(c, send, recv, t, stream(s), extra...);
            });
      },
      nb::arg("handle"), nb::arg("send"), nb::arg("recv"), nb::arg(extra_names)...,
      nb::arg("stream") = 0);
}

// Binds `name`(parent, args...) -> handle: `make(parent's communicator, args...)` builds a
// communicator from the parent's ranks, waiting for the others without the GIL.
template <typename... Args, typename Make, typename... Names>
void def_derived(nb::module_& m, const char* name, Make make, const char* doc, Names... arg_names) {
  m.def(
      name,
      [make](int64_t parent, Args... args) {
        auto comm = lookup(parent);
        std::shared_ptr<Communicator> made;
        {
          nb::gil_scoped_release release;
          made = make(*comm, args...);
        }
        return CommunicatorRegistry::instance().add(std::move(made));
      },
      nb::arg("parent"), nb::arg(arg_names)..., doc);
}

// The engine's FFI targets: bagua_<engine>_<collective> (two engines may serve one platform).
inline handler_util::HandlerTable engine_targets(const char* engine,
                                                 const handler_util::HandlerTable& handlers) {
  static std::deque<std::string> names;  // the table's keys, alive with the module
  handler_util::HandlerTable renamed;
  for (const auto& [target, handler] : handlers) {
    names.push_back("bagua_" + std::string(engine) + "_" + (target + std::strlen("bagua_")));
    renamed.emplace_back(names.back().c_str(), handler);
  }
  return renamed;
}

// Makes `m` the module of `engine` ("mpi", "tcp": Cpu; "nccl": Cuda) described by
// `doc`: the FFI handler capsules for XLA's platform, and the same collectives on
// the DLPack tensors of that device.
template <typename Exec>
void bind(nb::module_& m, const char* engine, const char* doc) {
  m.doc() = doc;
  constexpr bool kCpu = std::is_same_v<Exec, Cpu>;
  bind_registrations(
      m, {{kCpu ? "cpu" : "CUDA", engine_targets(engine, collective_handlers::handlers<Exec>())}});
  const int device_type = kCpu ? nb::device::cpu::value : nb::device::cuda::value;
  m.def("rank", [](int64_t h) { return lookup(h)->rank(); });
  m.def("size", [](int64_t h) { return lookup(h)->size(); });
  m.def(
      "destroy", [](int64_t h) { return CommunicatorRegistry::instance().remove(h); },
      "Forget a communicator; it is freed when no call uses it any more.");
  m.def(
      "share",
      [](int64_t h) {
        lookup(h);
        return CommunicatorRegistry::instance().share(h);
      },
      nb::arg("handle"),
      "A second handle of the same communicator; destroying either leaves the other.");
  m.def(
      "rebind",
      [](int64_t h, int64_t from) { return CommunicatorRegistry::instance().rebind(h, from); },
      nb::arg("handle"), nb::arg("source"),
      "Put the communicator of handle `source` in `handle`'s slot and forget `source` (programs "
      "that name `handle` use it from their next call on); False if either handle is unknown.");
  m.def(
      "revoke", [](int64_t h, const std::string& reason) { lookup(h)->revoke(reason); },
      nb::arg("handle"), nb::arg("reason"),
      "Make the calls in flight on the communicator, and every later one, fail at once with an "
      "error naming `reason`; local and never waiting.");

  def_collective<int>(
      m, device_type, "allreduce", Blocks::kSame,
      [](Communicator& c, const Input& send, const Output& recv, DType t, void* s, int op) {
        return c.allreduce(send.data(), recv.data(), send.size(), t, static_cast<ReduceOp>(op), s);
      },
      "op");
  def_collective<int, int>(
      m, device_type, "reduce", Blocks::kSame,
      [](Communicator& c, const Input& send, const Output& recv, DType t, void* s, int op,
         int root) {
        return c.reduce(send.data(), recv.data(), send.size(), t, static_cast<ReduceOp>(op), root,
                        s);
      },
      "op", "root");

  m.def(
      "broadcast",
      [=](int64_t h, nb::handle buffer_obj, int root, uintptr_t s) {
        Output buffer = writable(buffer_obj, "buffer");
        on_device("broadcast", device_type, {buffer.device_type()});
        const DType t = collective_dtype(buffer.dtype());
        auto comm = lookup(h);
        nb::gil_scoped_release release;
        check(comm->broadcast(buffer.data(), buffer.size(), t, root, stream(s)));
      },
      nb::arg("handle"), nb::arg("buffer"), nb::arg("root"), nb::arg("stream") = 0);

  def_collective<int>(
      m, device_type, "reduce_scatter", Blocks::kPerRankInSend,
      [](Communicator& c, const Input& send, const Output& recv, DType t, void* s, int op) {
        return c.reduce_scatter(send.data(), recv.data(), recv.size(), t, static_cast<ReduceOp>(op),
                                s);
      },
      "op");
  def_collective<>(m, device_type, "allgather", Blocks::kPerRankInRecv,
                   [](Communicator& c, const Input& send, const Output& recv, DType t, void* s) {
                     return c.allgather(send.data(), recv.data(), send.size(), t, s);
                   });
  def_collective<int>(
      m, device_type, "gather", Blocks::kPerRankInRecv,
      [](Communicator& c, const Input& send, const Output& recv, DType t, void* s, int root) {
        return c.gather(send.data(), recv.data(), send.size(), t, root, s);
      },
      "root");
  def_collective<int>(
      m, device_type, "scatter", Blocks::kPerRankInSend,
      [](Communicator& c, const Input& send, const Output& recv, DType t, void* s, int root) {
        return c.scatter(send.data(), recv.data(), recv.size(), t, root, s);
      },
      "root");
  def_collective<>(m, device_type, "alltoall", Blocks::kEqualPerRank,
                   [](Communicator& c, const Input& send, const Output& recv, DType t, void* s) {
                     return c.alltoall(send.data(), recv.data(), send.size() / c.size(), t, s);
                   });

  m.def(
      "alltoall_v",
      [=](int64_t h, Input send, const std::vector<int64_t>& send_counts, nb::handle recv_obj,
          const std::vector<int64_t>& recv_counts, uintptr_t s) {
        auto counts_fit = [&](size_t ranks, size_t sent, size_t received) -> const char* {
          if (send_counts.size() != ranks || recv_counts.size() != ranks)
            return "counts need one entry per rank";
          const int64_t total_sent =
              std::accumulate(send_counts.begin(), send_counts.end(), int64_t{0});
          const int64_t total_received =
              std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0});
          if (total_sent > static_cast<int64_t>(sent) ||
              total_received > static_cast<int64_t>(received))
            return "the counts exceed the tensor sizes";
          return nullptr;
        };
        collective("alltoall_v", device_type, h, send, recv_obj, counts_fit,
                   [&](Communicator& c, const Output& recv, DType t) {
                     return c.alltoall_v(send.data(), send_counts.data(), recv.data(),
                                         recv_counts.data(), t, stream(s));
                   });
      },
      nb::arg("handle"), nb::arg("send"), nb::arg("send_counts"), nb::arg("recv"),
      nb::arg("recv_counts"), nb::arg("stream") = 0);

  m.def(
      "send_recv",
      [=](int64_t h, Input send, nb::handle recv_obj, const std::vector<int32_t>& peers,
          uintptr_t s) {
        auto block_per_peer = [&](size_t, size_t sent, size_t received) -> const char* {
          return received == sent * peers.size() ? nullptr
                                                 : "recv must hold one send-sized block per peer";
        };
        collective("send_recv", device_type, h, send, recv_obj, block_per_peer,
                   [&](Communicator& c, const Output& recv, DType t) {
                     return c.send_recv(send.data(), recv.data(), send.size(), t, peers.data(),
                                        static_cast<int>(peers.size()), stream(s));
                   });
      },
      nb::arg("handle"), nb::arg("send"), nb::arg("recv"), nb::arg("peers"), nb::arg("stream") = 0);

  m.def(
      "barrier",
      [](int64_t h, uintptr_t s) {
        auto comm = lookup(h);
        nb::gil_scoped_release release;
        check(comm->barrier(stream(s)));
      },
      nb::arg("handle"), nb::arg("stream") = 0);
}

}  // namespace bagua::collective_bindings
