// XLA FFI handlers for the collectives, one template for every engine: the
// communicator comes from the registry by the `comm` attribute, the device
// (Cpu or Cuda, see handler_util.h) from the context. The DLPack twin is
// collective_bindings.h. Each handler takes and
// returns an XLA token, which bagua_jax threads through an ordered effect so
// that every rank issues its collectives in program order.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "communicator.h"
#include "communicator_registry.h"
#include "handler_util.h"

namespace bagua::collective_handlers {

namespace ffi = xla::ffi;
using handler_util::dtype_of;
using handler_util::HandlerTable;

inline void* stream_of(Cpu) { return nullptr; }
inline void* stream_of(Cuda device) { return device.stream; }

// What every collective handler needs before it can call the engine.
struct Call {
  std::shared_ptr<Communicator> comm;
  DType type;
};

inline ffi::Error prepare(const char* op, int64_t handle, const ffi::AnyBuffer& x,
                          const ffi::AnyBuffer& y, Call* call) {
  call->comm = CommunicatorRegistry::instance().get(handle);
  if (!call->comm)
    return ffi::Error::InvalidArgument(std::string("bagua ") + op + ": " +
                                       unknown_handle_message(handle));
  call->type = dtype_of(x.element_type());
  if (call->type == DType::kUnsupported)
    return ffi::Error::InvalidArgument(
        std::string("bagua ") + op +
        ": unsupported element type (use float32/16, bfloat16, float64, uint8, int32 or int64)");
  if (x.element_type() != y.element_type())
    return ffi::Error::InvalidArgument(std::string("bagua ") + op +
                                       ": input and output dtypes differ");
  return ffi::Error::Success();
}

inline ffi::Error to_error(const Status& s) {
  if (s.ok()) return ffi::Error::Success();
  return s.internal ? ffi::Error::Internal("bagua " + s.message)
                    : ffi::Error::InvalidArgument("bagua " + s.message);
}

inline ffi::Error size_error(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("bagua ") + op + ": " + what);
}

inline ReduceOp reduce_op(int64_t op) { return static_cast<ReduceOp>(op); }

// Every collective from x into y whose sizes follow one rule: finds the
// communicator, checks the dtypes and `blocks`, then runs call(communicator, dtype).
template <typename Engine>
ffi::Error collective(const char* op, int64_t handle, const ffi::AnyBuffer& x,
                      const ffi::AnyBuffer& y, Blocks blocks, Engine&& call) {
  Call c;
  if (auto e = prepare(op, handle, x, y, &c); e.failure()) return e;
  if (const char* wrong =
          blocks_mismatch(blocks, c.comm->size(), x.element_count(), y.element_count()))
    return size_error(op, wrong);
  return to_error(call(*c.comm, c.type));
}

template <typename Exec>
ffi::Error AllReduce(ffi::AnyBuffer x, ffi::Token, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::Token>, int64_t handle, int64_t op, Exec exec) {
  return collective("allreduce", handle, x, *y, Blocks::kSame, [&](Communicator& c, DType t) {
    return c.allreduce(x.untyped_data(), y->untyped_data(), x.element_count(), t, reduce_op(op),
                       stream_of(exec));
  });
}

// Ranks other than the root get zeros.
template <typename Exec>
ffi::Error Reduce(ffi::AnyBuffer x, ffi::Token, ffi::Result<ffi::AnyBuffer> y,
                  ffi::Result<ffi::Token>, int64_t handle, int64_t op, int64_t root, Exec exec) {
  return collective("reduce", handle, x, *y, Blocks::kSame, [&](Communicator& c, DType t) {
    if (c.rank() != root)
      if (Status s = device_zero(exec, y->untyped_data(), y->size_bytes()); !s.ok()) return s;
    return c.reduce(x.untyped_data(), y->untyped_data(), x.element_count(), t, reduce_op(op),
                    static_cast<int>(root), stream_of(exec));
  });
}

template <typename Exec>
ffi::Error Broadcast(ffi::AnyBuffer x, ffi::Token, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::Token>, int64_t handle, int64_t root, Exec exec) {
  return collective("broadcast", handle, x, *y, Blocks::kSame, [&](Communicator& c, DType t) {
    if (Status s = device_copy(exec, y->untyped_data(), x.untyped_data(), x.size_bytes()); !s.ok())
      return s;
    return c.broadcast(y->untyped_data(), y->element_count(), t, static_cast<int>(root),
                       stream_of(exec));
  });
}

template <typename Exec>
ffi::Error ReduceScatter(ffi::AnyBuffer x, ffi::Token, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::Token>, int64_t handle, int64_t op, Exec exec) {
  return collective(
      "reduce_scatter", handle, x, *y, Blocks::kPerRankInSend, [&](Communicator& c, DType t) {
        return c.reduce_scatter(x.untyped_data(), y->untyped_data(), y->element_count(), t,
                                reduce_op(op), stream_of(exec));
      });
}

template <typename Exec>
ffi::Error AllGather(ffi::AnyBuffer x, ffi::Token, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::Token>, int64_t handle, Exec exec) {
  return collective("allgather", handle, x, *y, Blocks::kPerRankInRecv,
                    [&](Communicator& c, DType t) {
                      return c.allgather(x.untyped_data(), y->untyped_data(), x.element_count(), t,
                                         stream_of(exec));
                    });
}

// Ranks other than the root get zeros.
template <typename Exec>
ffi::Error Gather(ffi::AnyBuffer x, ffi::Token, ffi::Result<ffi::AnyBuffer> y,
                  ffi::Result<ffi::Token>, int64_t handle, int64_t root, Exec exec) {
  return collective("gather", handle, x, *y, Blocks::kPerRankInRecv, [&](Communicator& c, DType t) {
    if (c.rank() != root)
      if (Status s = device_zero(exec, y->untyped_data(), y->size_bytes()); !s.ok()) return s;
    return c.gather(x.untyped_data(), y->untyped_data(), x.element_count(), t,
                    static_cast<int>(root), stream_of(exec));
  });
}

template <typename Exec>
ffi::Error Scatter(ffi::AnyBuffer x, ffi::Token, ffi::Result<ffi::AnyBuffer> y,
                   ffi::Result<ffi::Token>, int64_t handle, int64_t root, Exec exec) {
  return collective("scatter", handle, x, *y, Blocks::kPerRankInSend,
                    [&](Communicator& c, DType t) {
                      return c.scatter(x.untyped_data(), y->untyped_data(), y->element_count(), t,
                                       static_cast<int>(root), stream_of(exec));
                    });
}

template <typename Exec>
ffi::Error AllToAll(ffi::AnyBuffer x, ffi::Token, ffi::Result<ffi::AnyBuffer> y,
                    ffi::Result<ffi::Token>, int64_t handle, Exec exec) {
  return collective("alltoall", handle, x, *y, Blocks::kEqualPerRank,
                    [&](Communicator& c, DType t) {
                      return c.alltoall(x.untyped_data(), y->untyped_data(),
                                        x.element_count() / c.size(), t, stream_of(exec));
                    });
}

// The counts are run-time int32 arrays of one entry per rank (JAX's default
// integer width); the output is zero beyond the received elements.
template <typename Exec>
ffi::Error AllToAllV(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> send_counts,
                     ffi::Buffer<ffi::S32> recv_counts, ffi::Token, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::Token>, int64_t handle, Exec exec) {
  Call c;
  if (auto e = prepare("alltoall_v", handle, x, *y, &c); e.failure()) return e;
  const int n = c.comm->size();
  if (send_counts.element_count() != static_cast<size_t>(n) ||
      recv_counts.element_count() != static_cast<size_t>(n))
    return size_error("alltoall_v", "send and receive counts need one entry per rank");
  std::vector<int32_t> sc32(n), rc32(n);
  if (Status s = copy_to_host(exec, sc32.data(), send_counts.typed_data(), n * 4); !s.ok())
    return to_error(s);
  if (Status s = copy_to_host(exec, rc32.data(), recv_counts.typed_data(), n * 4); !s.ok())
    return to_error(s);
  const std::vector<int64_t> sc(sc32.begin(), sc32.end()), rc(rc32.begin(), rc32.end());
  int64_t sent = 0, received = 0;
  for (int j = 0; j < n; ++j) sent += sc[j], received += rc[j];
  if (sent > static_cast<int64_t>(x.element_count()) ||
      received > static_cast<int64_t>(y->element_count()))
    return size_error("alltoall_v", "the counts exceed the input or output size");
  if (Status s = device_zero(exec, y->untyped_data(), y->size_bytes()); !s.ok()) return to_error(s);
  return to_error(c.comm->alltoall_v(x.untyped_data(), sc.data(), y->untyped_data(), rc.data(),
                                     c.type, stream_of(exec)));
}

template <typename Exec>
ffi::Error SendRecv(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> peers, ffi::Token,
                    ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>, int64_t handle,
                    Exec exec) {
  Call c;
  if (auto e = prepare("send_recv", handle, x, *y, &c); e.failure()) return e;
  const int p = static_cast<int>(peers.element_count());
  if (y->element_count() != x.element_count() * p)
    return size_error("send_recv", "the output must hold one input-sized block per peer");
  std::vector<int32_t> host_peers(p);
  if (Status s = copy_to_host(exec, host_peers.data(), peers.typed_data(), p * 4); !s.ok())
    return to_error(s);
  return to_error(c.comm->send_recv(x.untyped_data(), y->untyped_data(), x.element_count(), c.type,
                                    host_peers.data(), p, stream_of(exec)));
}

// The peer is a run-time int32 operand, so it may change every step.
template <typename Exec>
ffi::Error read_peer(const char* op, const ffi::Buffer<ffi::S32>& peer, int32_t* out, Exec exec) {
  if (peer.element_count() != 1) return size_error(op, "the peer must be one int32");
  return to_error(copy_to_host(exec, out, peer.typed_data(), 4));
}

template <typename Exec>
ffi::Error Send(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> peer, ffi::Token, ffi::Result<ffi::Token>,
                int64_t handle, Exec exec) {
  Call c;
  if (auto e = prepare("send", handle, x, x, &c); e.failure()) return e;
  int32_t to = 0;
  if (auto e = read_peer("send", peer, &to, exec); e.failure()) return e;
  return to_error(c.comm->send(x.untyped_data(), x.element_count(), c.type, to, stream_of(exec)));
}

template <typename Exec>
ffi::Error Recv(ffi::Buffer<ffi::S32> peer, ffi::Token, ffi::Result<ffi::AnyBuffer> y,
                ffi::Result<ffi::Token>, int64_t handle, Exec exec) {
  Call c;
  if (auto e = prepare("recv", handle, *y, *y, &c); e.failure()) return e;
  int32_t from = 0;
  if (auto e = read_peer("recv", peer, &from, exec); e.failure()) return e;
  return to_error(
      c.comm->recv(y->untyped_data(), y->element_count(), c.type, from, stream_of(exec)));
}

template <typename Exec>
ffi::Error Barrier(ffi::Token, ffi::Result<ffi::Token>, int64_t handle, Exec exec) {
  auto comm = CommunicatorRegistry::instance().get(handle);
  if (!comm) return ffi::Error::InvalidArgument("bagua barrier: " + unknown_handle_message(handle));
  return to_error(comm->barrier(stream_of(exec)));
}

// This rank's index in the communicator the slot holds now: a run-time value, so
// that rebinding the slot after a membership change compiles nothing again.
template <typename Exec>
ffi::Error Rank(ffi::Token, ffi::Result<ffi::Buffer<ffi::S32>> y, ffi::Result<ffi::Token>,
                int64_t handle, Exec exec) {
  auto comm = CommunicatorRegistry::instance().get(handle);
  if (!comm) return ffi::Error::InvalidArgument("bagua rank: " + unknown_handle_message(handle));
  const int32_t rank = comm->rank();
  return to_error(copy_from_host(exec, y->typed_data(), &rank, sizeof rank));
}

// The collective FFI targets: X(name, implementation, binding without the
// device). Each takes and returns an ordering token and names its communicator.
// BAGUA_COLLECTIVE_BIND_AFTER(operands) binds the operands, then the token in, the
// output and the token out, and the communicator.
#define BAGUA_COLLECTIVE_BIND_AFTER(operands) \
  operands.Arg<Token>().Ret<AnyBuffer>().Ret<Token>().Attr<int64_t>("comm")
#define BAGUA_COLLECTIVE_BIND BAGUA_COLLECTIVE_BIND_AFTER(Ffi::Bind().Arg<AnyBuffer>())
#define BAGUA_COLLECTIVE_TARGETS(X)                                                             \
  X(allreduce, AllReduce<Exec>, BAGUA_COLLECTIVE_BIND.Attr<int64_t>("op"))                      \
  X(reduce, Reduce<Exec>, BAGUA_COLLECTIVE_BIND.Attr<int64_t>("op").Attr<int64_t>("root"))      \
  X(broadcast, Broadcast<Exec>, BAGUA_COLLECTIVE_BIND.Attr<int64_t>("root"))                    \
  X(reduce_scatter, ReduceScatter<Exec>, BAGUA_COLLECTIVE_BIND.Attr<int64_t>("op"))             \
  X(allgather, AllGather<Exec>, BAGUA_COLLECTIVE_BIND)                                          \
  X(gather, Gather<Exec>, BAGUA_COLLECTIVE_BIND.Attr<int64_t>("root"))                          \
  X(scatter, Scatter<Exec>, BAGUA_COLLECTIVE_BIND.Attr<int64_t>("root"))                        \
  X(alltoall, AllToAll<Exec>, BAGUA_COLLECTIVE_BIND)                                            \
  X(alltoall_v, AllToAllV<Exec>,                                                                \
    BAGUA_COLLECTIVE_BIND_AFTER(Ffi::Bind().Arg<AnyBuffer>().Arg<Int32s>().Arg<Int32s>()))      \
  X(send_recv, SendRecv<Exec>,                                                                  \
    BAGUA_COLLECTIVE_BIND_AFTER(Ffi::Bind().Arg<AnyBuffer>().Arg<Int32s>()))                    \
  X(send, Send<Exec>,                                                                           \
    Ffi::Bind().Arg<AnyBuffer>().Arg<Int32s>().Arg<Token>().Ret<Token>().Attr<int64_t>("comm")) \
  X(recv, Recv<Exec>,                                                                           \
    Ffi::Bind().Arg<Int32s>().Arg<Token>().Ret<AnyBuffer>().Ret<Token>().Attr<int64_t>("comm")) \
  X(barrier, Barrier<Exec>, Ffi::Bind().Arg<Token>().Ret<Token>().Attr<int64_t>("comm"))        \
  X(rank, Rank<Exec>, Ffi::Bind().Arg<Token>().Ret<Int32s>().Ret<Token>().Attr<int64_t>("comm"))

// Every collective FFI target for one device, by target name.
template <typename Exec>
HandlerTable handlers() {
  using ffi::AnyBuffer;
  using ffi::Ffi;
  using ffi::Token;
  using Int32s = ffi::Buffer<ffi::S32>;
  BAGUA_HANDLER_TABLE(BAGUA_COLLECTIVE_TARGETS)
}

}  // namespace bagua::collective_handlers
