// One interface for the collective engines (MPI for host buffers, NCCL for
// device buffers). The FFI handlers and the DLPack bindings call it; a
// registry (communicator_registry.h) maps integer handles to instances.
//
// Every call either completes, or fails with a Status naming the communicator,
// the operation and the rank, within the communicator's timeout: a dead peer or
// a collective that never completes never hangs the caller.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "dtypes.h"
#include "kernels.h"

namespace bagua {

// Every reduction once, in the order of the integers the front ends pass:
// X(enumerator, name, NCCL operation).
#define BAGUA_REDUCE_OPS(X) \
  X(kSum, "sum", ncclSum)   \
  X(kAvg, "avg", ncclAvg)   \
  X(kMin, "min", ncclMin)   \
  X(kMax, "max", ncclMax)

BAGUA_NAMED_ENUM(ReduceOp, BAGUA_REDUCE_OPS, reduce_op_name, "?")

// How a collective's send and receive element counts must relate; the FFI
// handlers and the DLPack bindings check the same rules.
enum class Blocks { kSame, kPerRankInSend, kPerRankInRecv, kEqualPerRank };

// nullptr if `sent` and `received` elements fit `blocks` for `ranks` ranks,
// else what is wrong.
inline const char* blocks_mismatch(Blocks blocks, size_t ranks, size_t sent, size_t received) {
  switch (blocks) {
    case Blocks::kSame:
      return sent == received ? nullptr : "send and receive sizes differ";
    case Blocks::kPerRankInSend:
      return sent == received * ranks ? nullptr : "send must hold one receive-sized block per rank";
    case Blocks::kPerRankInRecv:
      return received == sent * ranks ? nullptr : "recv must hold one send-sized block per rank";
    case Blocks::kEqualPerRank:
      break;
  }
  return sent == received && sent % ranks == 0 ? nullptr
                                               : "send and recv must hold one equal block per rank";
}

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // A short name used in error messages, e.g. "world" or "intra-node".
  virtual const std::string& name() const = 0;

  // `stream` is the CUDA stream for device engines and ignored by host ones.
  // Buffer sizes are element counts of `type`; `count` is per rank where the
  // operation moves one block per rank.
  virtual Status allreduce(const void* send, void* recv, int64_t count, DType type, ReduceOp op,
                           void* stream) = 0;
  virtual Status reduce(const void* send, void* recv, int64_t count, DType type, ReduceOp op,
                        int root, void* stream) = 0;
  virtual Status broadcast(void* buffer, int64_t count, DType type, int root, void* stream) = 0;
  // send holds size() blocks of `count`; rank r receives block r reduced.
  virtual Status reduce_scatter(const void* send, void* recv, int64_t count, DType type,
                                ReduceOp op, void* stream) = 0;
  // recv holds size() blocks of `count`, block j from rank j.
  virtual Status allgather(const void* send, void* recv, int64_t count, DType type,
                           void* stream) = 0;
  virtual Status gather(const void* send, void* recv, int64_t count, DType type, int root,
                        void* stream) = 0;
  virtual Status scatter(const void* send, void* recv, int64_t count, DType type, int root,
                         void* stream) = 0;
  // send and recv hold size() blocks of `count`: block j goes to / comes from rank j.
  virtual Status alltoall(const void* send, void* recv, int64_t count, DType type,
                          void* stream) = 0;
  // Blocks of varying length, packed contiguously in rank order. The counts
  // are host arrays of size() elements.
  virtual Status alltoall_v(const void* send, const int64_t* send_counts, void* recv,
                            const int64_t* recv_counts, DType type, void* stream) = 0;
  // Sends `send` to each of the `num_peers` ranks in `peers` and receives one
  // block of `count` from each into recv (block i from peers[i]), as one group.
  // Peers must be symmetric: if r lists q, q lists r the same number of times.
  virtual Status send_recv(const void* send, void* recv, int64_t count, DType type,
                           const int32_t* peers, int num_peers, void* stream) = 0;
  // Point-to-point: blocking on the host engine until matched (or timed out),
  // enqueued on the stream for device engines. A send must meet a recv of the
  // same count on the peer, in the same order.
  virtual Status send(const void* buffer, int64_t count, DType type, int peer, void* stream) = 0;
  virtual Status recv(void* buffer, int64_t count, DType type, int peer, void* stream) = 0;
  virtual Status barrier(void* stream) = 0;

  // Makes the operations in flight and every later one fail at once with an error naming
  // `reason` (the membership changed: a peer died or hangs). Local: the other ranks learn of the
  // change from the job's membership, not from this call. Thread-safe and never waits, so a
  // watchdog may call it while another thread is blocked in a collective.
  virtual void revoke(const std::string& reason) = 0;
};

// Memory moves the collective handlers need around the engine calls, for the
// device an engine serves: plain memcpy/memset for host engines, stream-ordered
// copies for device engines. copy_to_host returns only when the bytes are on
// the host (a small synchronous read of run-time peers or counts).
Status device_copy(Cpu, void* dst, const void* src, int64_t bytes);
Status device_zero(Cpu, void* dst, int64_t bytes);
Status copy_to_host(Cpu, void* dst, const void* src, int64_t bytes);
// A few host bytes into device memory, ordered with the device's work; `src` may be reused as soon
// as it returns.
Status copy_from_host(Cpu, void* dst, const void* src, int64_t bytes);
Status device_copy(Cuda, void* dst, const void* src, int64_t bytes);
Status device_zero(Cuda, void* dst, int64_t bytes);
Status copy_to_host(Cuda, void* dst, const void* src, int64_t bytes);
Status copy_from_host(Cuda, void* dst, const void* src, int64_t bytes);

}  // namespace bagua
