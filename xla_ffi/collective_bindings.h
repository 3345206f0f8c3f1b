// The collectives on DLPack tensors (for bagua_torch), shared by every engine
// module: each module binds them for the device its engine serves. Calls
// release the GIL, so Python threads can overlap communication with compute.
// The XLA FFI twin is collective_handlers.h.
#pragma once

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <initializer_list>
#include <numeric>
#include <string>
#include <vector>

#include "binding_util.h"
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

// How send and recv sizes must relate, given the rank count: nullptr if they
// fit, else what is wrong.
inline const char* same_size(size_t, size_t sent, size_t received) {
  return sent == received ? nullptr : "send and receive sizes differ";
}
inline const char* block_per_rank_in_send(size_t ranks, size_t sent, size_t received) {
  return sent == received * ranks ? nullptr : "send must hold one receive-sized block per rank";
}
inline const char* block_per_rank_in_recv(size_t ranks, size_t sent, size_t received) {
  return received == sent * ranks ? nullptr : "recv must hold one send-sized block per rank";
}
inline const char* equal_block_per_rank(size_t ranks, size_t sent, size_t received) {
  return sent == received && sent % ranks == 0 ? nullptr
                                               : "send and recv must hold one equal block per rank";
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

// `device_type` is the DLPack device the engine serves (CPU for MPI, CUDA for NCCL).
inline void bind(nb::module_& m, int device_type) {
  m.def("rank", [](int64_t h) { return lookup(h)->rank(); });
  m.def("size", [](int64_t h) { return lookup(h)->size(); });
  m.def(
      "destroy", [](int64_t h) { return CommunicatorRegistry::instance().remove(h); },
      "Forget a communicator; it is freed when no call uses it any more.");

  m.def(
      "allreduce",
      [=](int64_t h, Input send, nb::handle recv_obj, int op, uintptr_t s) {
        collective("allreduce", device_type, h, send, recv_obj, same_size,
                   [&](Communicator& c, const Output& recv, DType t) {
                     return c.allreduce(send.data(), recv.data(), send.size(), t,
                                        static_cast<ReduceOp>(op), stream(s));
                   });
      },
      nb::arg("handle"), nb::arg("send"), nb::arg("recv"), nb::arg("op"), nb::arg("stream") = 0);

  m.def(
      "reduce",
      [=](int64_t h, Input send, nb::handle recv_obj, int op, int root, uintptr_t s) {
        collective("reduce", device_type, h, send, recv_obj, same_size,
                   [&](Communicator& c, const Output& recv, DType t) {
                     return c.reduce(send.data(), recv.data(), send.size(), t,
                                     static_cast<ReduceOp>(op), root, stream(s));
                   });
      },
      nb::arg("handle"), nb::arg("send"), nb::arg("recv"), nb::arg("op"), nb::arg("root"),
      nb::arg("stream") = 0);

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

  m.def(
      "reduce_scatter",
      [=](int64_t h, Input send, nb::handle recv_obj, int op, uintptr_t s) {
        collective("reduce_scatter", device_type, h, send, recv_obj, block_per_rank_in_send,
                   [&](Communicator& c, const Output& recv, DType t) {
                     return c.reduce_scatter(send.data(), recv.data(), recv.size(), t,
                                             static_cast<ReduceOp>(op), stream(s));
                   });
      },
      nb::arg("handle"), nb::arg("send"), nb::arg("recv"), nb::arg("op"), nb::arg("stream") = 0);

  m.def(
      "allgather",
      [=](int64_t h, Input send, nb::handle recv_obj, uintptr_t s) {
        collective("allgather", device_type, h, send, recv_obj, block_per_rank_in_recv,
                   [&](Communicator& c, const Output& recv, DType t) {
                     return c.allgather(send.data(), recv.data(), send.size(), t, stream(s));
                   });
      },
      nb::arg("handle"), nb::arg("send"), nb::arg("recv"), nb::arg("stream") = 0);

  m.def(
      "gather",
      [=](int64_t h, Input send, nb::handle recv_obj, int root, uintptr_t s) {
        collective("gather", device_type, h, send, recv_obj, block_per_rank_in_recv,
                   [&](Communicator& c, const Output& recv, DType t) {
                     return c.gather(send.data(), recv.data(), send.size(), t, root, stream(s));
                   });
      },
      nb::arg("handle"), nb::arg("send"), nb::arg("recv"), nb::arg("root"), nb::arg("stream") = 0);

  m.def(
      "scatter",
      [=](int64_t h, Input send, nb::handle recv_obj, int root, uintptr_t s) {
        collective("scatter", device_type, h, send, recv_obj, block_per_rank_in_send,
                   [&](Communicator& c, const Output& recv, DType t) {
                     return c.scatter(send.data(), recv.data(), recv.size(), t, root, stream(s));
                   });
      },
      nb::arg("handle"), nb::arg("send"), nb::arg("recv"), nb::arg("root"), nb::arg("stream") = 0);

  m.def(
      "alltoall",
      [=](int64_t h, Input send, nb::handle recv_obj, uintptr_t s) {
        collective("alltoall", device_type, h, send, recv_obj, equal_block_per_rank,
                   [&](Communicator& c, const Output& recv, DType t) {
                     return c.alltoall(send.data(), recv.data(), send.size() / c.size(), t,
                                       stream(s));
                   });
      },
      nb::arg("handle"), nb::arg("send"), nb::arg("recv"), nb::arg("stream") = 0);

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
