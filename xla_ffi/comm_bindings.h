// The collectives on DLPack tensors (for bagua_torch), shared by every engine
// module: each module binds them for the device its engine serves. Calls
// release the GIL, so Python threads can overlap communication with compute.
#pragma once

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "communicator.h"
#include "communicator_registry.h"
#include "dlpack_util.h"

namespace bagua::comm_bindings {

inline CommType comm_type_of(nb::dlpack::dtype t) {
  if (t == nb::dtype<float>()) return CommType::kF32;
  if (t == nb::dtype<double>()) return CommType::kF64;
  if (t == nb::dtype<uint8_t>()) return CommType::kU8;
  if (t == nb::dtype<int32_t>()) return CommType::kI32;
  if (t == nb::dtype<int64_t>()) return CommType::kI64;
  switch (dtype_of(t)) {
    case DType::kF16: return CommType::kF16;
    case DType::kBF16: return CommType::kBF16;
    default: throw nb::type_error("unsupported dtype for a collective (use float32/16, bfloat16, float64, uint8, int32 or int64)");
  }
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

template <typename A, typename B>
CommType same_type(const char* op, const A& a, const B& b) {
  const CommType t = comm_type_of(a.dtype());
  if (comm_type_of(b.dtype()) != t) throw nb::type_error((std::string(op) + ": send and receive dtypes differ").c_str());
  return t;
}

inline void check_size(bool ok, const char* op, const char* what) {
  if (!ok) throw nb::value_error((std::string(op) + ": " + what).c_str());
}

// `device_type` is the DLPack device the engine serves (CPU for MPI, CUDA for NCCL).
inline void bind(nb::module_& m, int device_type) {
  auto on_device = [device_type](const char* op, auto... arrays) {
    for (int t : {arrays.device_type()...})
      if (t != device_type)
        throw nb::value_error((std::string(op) + ": this engine communicates " +
                               (device_type == nb::device::cpu::value ? "CPU" : "CUDA") + " tensors").c_str());
  };
  auto stream = [](uintptr_t s) { return reinterpret_cast<void*>(s); };

  m.def("rank", [](int64_t h) { return lookup(h)->rank(); });
  m.def("size", [](int64_t h) { return lookup(h)->size(); });
  m.def("destroy", [](int64_t h) { return CommunicatorRegistry::instance().remove(h); },
        "Forget a communicator; it is freed when no call uses it any more.");

  m.def("allreduce", [=](int64_t h, Input send, nb::handle recv_obj, int op, uintptr_t s) {
    Output recv = writable(recv_obj, "recv");
    on_device("allreduce", send, recv);
    const CommType t = same_type("allreduce", send, recv);
    check_size(send.size() == recv.size(), "allreduce", "send and receive sizes differ");
    auto comm = lookup(h);
    nb::gil_scoped_release release;
    check(comm->allreduce(send.data(), recv.data(), send.size(), t, static_cast<ReduceOp>(op), stream(s)));
  }, nb::arg("handle"), nb::arg("send"), nb::arg("recv"), nb::arg("op"), nb::arg("stream") = 0);

  m.def("reduce", [=](int64_t h, Input send, nb::handle recv_obj, int op, int root, uintptr_t s) {
    Output recv = writable(recv_obj, "recv");
    on_device("reduce", send, recv);
    const CommType t = same_type("reduce", send, recv);
    check_size(send.size() == recv.size(), "reduce", "send and receive sizes differ");
    auto comm = lookup(h);
    nb::gil_scoped_release release;
    check(comm->reduce(send.data(), recv.data(), send.size(), t, static_cast<ReduceOp>(op), root, stream(s)));
  }, nb::arg("handle"), nb::arg("send"), nb::arg("recv"), nb::arg("op"), nb::arg("root"), nb::arg("stream") = 0);

  m.def("broadcast", [=](int64_t h, nb::handle buffer_obj, int root, uintptr_t s) {
    Output buffer = writable(buffer_obj, "buffer");
    on_device("broadcast", buffer);
    const CommType t = comm_type_of(buffer.dtype());
    auto comm = lookup(h);
    nb::gil_scoped_release release;
    check(comm->broadcast(buffer.data(), buffer.size(), t, root, stream(s)));
  }, nb::arg("handle"), nb::arg("buffer"), nb::arg("root"), nb::arg("stream") = 0);

  m.def("reduce_scatter", [=](int64_t h, Input send, nb::handle recv_obj, int op, uintptr_t s) {
    Output recv = writable(recv_obj, "recv");
    on_device("reduce_scatter", send, recv);
    const CommType t = same_type("reduce_scatter", send, recv);
    auto comm = lookup(h);
    check_size(send.size() == recv.size() * comm->size(), "reduce_scatter", "send must hold one receive-sized block per rank");
    nb::gil_scoped_release release;
    check(comm->reduce_scatter(send.data(), recv.data(), recv.size(), t, static_cast<ReduceOp>(op), stream(s)));
  }, nb::arg("handle"), nb::arg("send"), nb::arg("recv"), nb::arg("op"), nb::arg("stream") = 0);

  m.def("allgather", [=](int64_t h, Input send, nb::handle recv_obj, uintptr_t s) {
    Output recv = writable(recv_obj, "recv");
    on_device("allgather", send, recv);
    const CommType t = same_type("allgather", send, recv);
    auto comm = lookup(h);
    check_size(recv.size() == send.size() * comm->size(), "allgather", "recv must hold one send-sized block per rank");
    nb::gil_scoped_release release;
    check(comm->allgather(send.data(), recv.data(), send.size(), t, stream(s)));
  }, nb::arg("handle"), nb::arg("send"), nb::arg("recv"), nb::arg("stream") = 0);

  m.def("gather", [=](int64_t h, Input send, nb::handle recv_obj, int root, uintptr_t s) {
    Output recv = writable(recv_obj, "recv");
    on_device("gather", send, recv);
    const CommType t = same_type("gather", send, recv);
    auto comm = lookup(h);
    check_size(recv.size() == send.size() * comm->size(), "gather", "recv must hold one send-sized block per rank");
    nb::gil_scoped_release release;
    check(comm->gather(send.data(), recv.data(), send.size(), t, root, stream(s)));
  }, nb::arg("handle"), nb::arg("send"), nb::arg("recv"), nb::arg("root"), nb::arg("stream") = 0);

  m.def("scatter", [=](int64_t h, Input send, nb::handle recv_obj, int root, uintptr_t s) {
    Output recv = writable(recv_obj, "recv");
    on_device("scatter", send, recv);
    const CommType t = same_type("scatter", send, recv);
    auto comm = lookup(h);
    check_size(send.size() == recv.size() * comm->size(), "scatter", "send must hold one receive-sized block per rank");
    nb::gil_scoped_release release;
    check(comm->scatter(send.data(), recv.data(), recv.size(), t, root, stream(s)));
  }, nb::arg("handle"), nb::arg("send"), nb::arg("recv"), nb::arg("root"), nb::arg("stream") = 0);

  m.def("alltoall", [=](int64_t h, Input send, nb::handle recv_obj, uintptr_t s) {
    Output recv = writable(recv_obj, "recv");
    on_device("alltoall", send, recv);
    const CommType t = same_type("alltoall", send, recv);
    auto comm = lookup(h);
    check_size(send.size() == recv.size() && send.size() % comm->size() == 0, "alltoall",
               "send and recv must hold one equal block per rank");
    nb::gil_scoped_release release;
    check(comm->alltoall(send.data(), recv.data(), send.size() / comm->size(), t, stream(s)));
  }, nb::arg("handle"), nb::arg("send"), nb::arg("recv"), nb::arg("stream") = 0);

  m.def("alltoall_v", [=](int64_t h, Input send, const std::vector<int64_t>& send_counts, nb::handle recv_obj,
                          const std::vector<int64_t>& recv_counts, uintptr_t s) {
    Output recv = writable(recv_obj, "recv");
    on_device("alltoall_v", send, recv);
    const CommType t = same_type("alltoall_v", send, recv);
    auto comm = lookup(h);
    const size_t n = comm->size();
    check_size(send_counts.size() == n && recv_counts.size() == n, "alltoall_v", "counts need one entry per rank");
    int64_t sent = 0, received = 0;
    for (size_t j = 0; j < n; ++j) sent += send_counts[j], received += recv_counts[j];
    check_size(sent <= static_cast<int64_t>(send.size()) && received <= static_cast<int64_t>(recv.size()),
               "alltoall_v", "the counts exceed the tensor sizes");
    nb::gil_scoped_release release;
    check(comm->alltoall_v(send.data(), send_counts.data(), recv.data(), recv_counts.data(), t, stream(s)));
  }, nb::arg("handle"), nb::arg("send"), nb::arg("send_counts"), nb::arg("recv"), nb::arg("recv_counts"),
     nb::arg("stream") = 0);

  m.def("send_recv", [=](int64_t h, Input send, nb::handle recv_obj, const std::vector<int32_t>& peers, uintptr_t s) {
    Output recv = writable(recv_obj, "recv");
    on_device("send_recv", send, recv);
    const CommType t = same_type("send_recv", send, recv);
    check_size(recv.size() == send.size() * peers.size(), "send_recv", "recv must hold one send-sized block per peer");
    auto comm = lookup(h);
    nb::gil_scoped_release release;
    check(comm->send_recv(send.data(), recv.data(), send.size(), t, peers.data(), static_cast<int>(peers.size()),
                          stream(s)));
  }, nb::arg("handle"), nb::arg("send"), nb::arg("recv"), nb::arg("peers"), nb::arg("stream") = 0);

  m.def("barrier", [](int64_t h, uintptr_t s) {
    auto comm = lookup(h);
    nb::gil_scoped_release release;
    check(comm->barrier(reinterpret_cast<void*>(s)));
  }, nb::arg("handle"), nb::arg("stream") = 0);
}

}  // namespace bagua::comm_bindings
