#include "nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <vector>

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "the NCCL engine needs NCCL 2.18 or newer (non-blocking communicators, ncclCommSplit)"
#endif

namespace bagua {
namespace {

using Clock = std::chrono::steady_clock;

// How often the watchdog looks at the enqueued operations and the async error.
constexpr auto kWatchInterval = std::chrono::milliseconds(10);

ncclDataType_t nccl_type(DType t) {
#define BAGUA_DTYPE_TO_NCCL(enumerator, name, bits, dlpack, xla, nccl, mpi, ...) \
  if (t == DType::enumerator) return nccl;
  BAGUA_DTYPES(BAGUA_DTYPE_TO_NCCL)
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
#define BAGUA_REDUCE_OP_TO_NCCL(enumerator, name, nccl) \
  if (op == ReduceOp::enumerator) return nccl;
  BAGUA_REDUCE_OPS(BAGUA_REDUCE_OP_TO_NCCL)
  return ncclSum;
}

std::string seconds(double s) {
  char text[32];
  std::snprintf(text, sizeof text, "%g s", s);
  return text;
}

std::string describe(ncclResult_t r, ncclComm_t comm) {
  std::string text = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last && *last) text += std::string(" (") + last + ")";
  return text;
}

// Polls `done` until it holds (true) or the deadline passes (false): yielding at
// first, then sleeping briefly so that a long wait does not hold a core.
template <typename Deadline, typename Done>
bool poll_until(Deadline deadline, Done done) {
  for (int polls = 0;; ++polls) {
    if (done()) return true;
    if (Clock::now() > deadline) return false;
    if (polls > 1000)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    else
      std::this_thread::yield();
  }
}

// A non-blocking communicator finishes some calls in the background; until its
// state leaves ncclInProgress no other NCCL call may be made on it. Returns the
// final state, or ncclInProgress if the deadline passed first.
template <typename Deadline>
ncclResult_t wait_ready(ncclComm_t comm, Deadline deadline) {
  ncclResult_t state = ncclInProgress;
  poll_until(deadline, [&] {
    ncclResult_t async = ncclInProgress;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &async);
    state = r != ncclSuccess ? r : async;
    return state != ncclInProgress;
  });
  return state;
}

// The child of a non-blocking split, once NCCL hands it out. NCCL versions differ
// in when: with the call, or only after the parent reports the split done (2.28).
// Returns nullptr if the deadline passes first.
template <typename Deadline>
ncclComm_t wait_for_child(ncclComm_t* child, Deadline deadline) {
  ncclComm_t ready = nullptr;
  poll_until(deadline,
             [&] { return (ready = __atomic_load_n(child, __ATOMIC_ACQUIRE)) != nullptr; });
  return ready;
}

auto deadline_after(double timeout_seconds) {
  return Clock::now() + std::chrono::duration<double>(timeout_seconds);
}

// Makes the communicator's device current for the calls that create or use
// device objects, and restores the caller's device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = device;
    if (previous_ != device_) cudaSetDevice(device_);
  }
  ~DeviceGuard() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int previous_ = 0;
};

// Runs point-to-point calls as one group; ncclGroupEnd always balances the start.
template <typename Calls>
ncclResult_t grouped(Calls&& calls) {
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) return r;
  r = calls();
  const ncclResult_t end = ncclGroupEnd();
  return r != ncclSuccess ? r : end;
}

// Element `index` of a buffer of `type`, const or not.
template <typename Void>
Void* element_at(Void* base, int64_t index, DType type) {
  using Byte = std::conditional_t<std::is_const_v<Void>, const char, char>;
  return static_cast<Byte*>(base) + index * dtype_bytes(type);
}

class NcclCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm`, initialized on `device` (which must be current).
  NcclCommunicator(ncclComm_t comm, int device, std::string name, double timeout_seconds)
      : comm_(comm), device_(device), name_(std::move(name)), timeout_(timeout_seconds) {
    ncclCommUserRank(comm_, &rank_);
    ncclCommCount(comm_, &size_);
    // Every rank contributes this zero to the barrier's sum, so it stays zero.
    // It is set before any barrier can run, on whatever stream that is.
    cudaError_t e = cudaMalloc(&barrier_, sizeof(float));
    if (e == cudaSuccess) e = cudaMemset(barrier_, 0, sizeof(float));
    if (e == cudaSuccess) e = cudaStreamSynchronize(nullptr);
    if (e != cudaSuccess) {
      ncclCommAbort(comm_);
      cudaFree(barrier_);
      throw std::runtime_error(
          fail("create", std::string("CUDA: ") + cudaGetErrorString(e)).message);
    }
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    watchdog_.join();
    DeviceGuard guard(device_);
    if (comm_ && revoke_done_) {
      ncclCommDestroy(comm_);  // quiescent after the revoke; finalize is invalid then
    } else if (comm_) {
      // Finalize completes the outstanding operations with the peers; one that
      // never completes (a dead peer) must not hang the destructor.
      ncclResult_t r = ncclCommFinalize(comm_);
      if (r == ncclSuccess || r == ncclInProgress) r = wait_ready(comm_, deadline_after(timeout_));
      if (r == ncclSuccess)
        ncclCommDestroy(comm_);
      else
        ncclCommAbort(comm_);
    }
    for (const Pending& p : pending_) recycle(p);
    for (cudaEvent_t e : spare_events_) cudaEventDestroy(e);
    cudaFree(barrier_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }

  Status allreduce(const void* send, void* recv, int64_t count, DType type, ReduceOp op,
                   void* stream) override {
    if (Status s = check_reduction("allreduce", type, op); !s.ok()) return s;
    return enqueue("allreduce", count, stream, [&](cudaStream_t s) {
      return ncclAllReduce(send, recv, count, nccl_type(type), nccl_op(op), comm_, s);
    });
  }

  Status reduce(const void* send, void* recv, int64_t count, DType type, ReduceOp op, int root,
                void* stream) override {
    if (Status s = check_reduction("reduce", type, op); !s.ok()) return s;
    if (Status s = check_rank("reduce", "root", root); !s.ok()) return s;
    return enqueue("reduce", count, stream, [&](cudaStream_t s) {
      return ncclReduce(send, recv, count, nccl_type(type), nccl_op(op), root, comm_, s);
    });
  }

  Status broadcast(void* buffer, int64_t count, DType type, int root, void* stream) override {
    if (Status s = check_rank("broadcast", "root", root); !s.ok()) return s;
    return enqueue("broadcast", count, stream, [&](cudaStream_t s) {
      return ncclBroadcast(buffer, buffer, count, nccl_type(type), root, comm_, s);
    });
  }

  Status reduce_scatter(const void* send, void* recv, int64_t count, DType type, ReduceOp op,
                        void* stream) override {
    if (Status s = check_reduction("reduce_scatter", type, op); !s.ok()) return s;
    return enqueue("reduce_scatter", count, stream, [&](cudaStream_t s) {
      return ncclReduceScatter(send, recv, count, nccl_type(type), nccl_op(op), comm_, s);
    });
  }

  Status allgather(const void* send, void* recv, int64_t count, DType type, void* stream) override {
    return enqueue("allgather", count, stream, [&](cudaStream_t s) {
      return ncclAllGather(send, recv, count, nccl_type(type), comm_, s);
    });
  }

  // The root receives from every rank, itself included (NCCL copies to self).
  Status gather(const void* send, void* recv, int64_t count, DType type, int root,
                void* stream) override {
    if (Status s = check_rank("gather", "root", root); !s.ok()) return s;
    std::vector<Exchange> exchanges{{root, send, count, nullptr, 0}};
    for (int j = 0; rank_ == root && j < size_; ++j)
      exchanges.push_back({j, nullptr, 0, element_at(recv, j * count, type), count});
    return exchange("gather", count, type, stream, exchanges);
  }

  Status scatter(const void* send, void* recv, int64_t count, DType type, int root,
                 void* stream) override {
    if (Status s = check_rank("scatter", "root", root); !s.ok()) return s;
    std::vector<Exchange> exchanges{{root, nullptr, 0, recv, count}};
    for (int j = 0; rank_ == root && j < size_; ++j)
      exchanges.push_back({j, element_at(send, j * count, type), count, nullptr, 0});
    return exchange("scatter", count, type, stream, exchanges);
  }

  Status alltoall(const void* send, void* recv, int64_t count, DType type, void* stream) override {
    std::vector<Exchange> exchanges;
    for (int j = 0; j < size_; ++j)
      exchanges.push_back(
          {j, element_at(send, j * count, type), count, element_at(recv, j * count, type), count});
    return exchange("alltoall", count, type, stream, exchanges);
  }

  Status alltoall_v(const void* send, const int64_t* send_counts, void* recv,
                    const int64_t* recv_counts, DType type, void* stream) override {
    std::vector<Exchange> exchanges;
    int64_t sent = 0, received = 0;
    for (int j = 0; j < size_; ++j) {
      if (send_counts[j] < 0 || recv_counts[j] < 0)
        return invalid("alltoall_v", "counts must be non-negative");
      exchanges.push_back({j, element_at(send, sent, type), send_counts[j],
                           element_at(recv, received, type), recv_counts[j]});
      sent += send_counts[j];
      received += recv_counts[j];
    }
    return exchange("alltoall_v", sent + received, type, stream, exchanges);
  }

  // Self-exchanges are allowed (NCCL copies to self). NCCL pairs the sends and
  // receives between two ranks in the order they are posted, so a peer listed
  // twice (a ring of two ranks) exchanges two blocks in order.
  Status send_recv(const void* send, void* recv, int64_t count, DType type, const int32_t* peers,
                   int num_peers, void* stream) override {
    std::vector<Exchange> exchanges;
    for (int i = 0; i < num_peers; ++i) {
      if (Status s = check_rank("send_recv", "peer", peers[i]); !s.ok()) return s;
      exchanges.push_back({peers[i], send, count, element_at(recv, i * count, type), count});
    }
    return exchange("send_recv", count * num_peers, type, stream, exchanges);
  }

  Status send(const void* buffer, int64_t count, DType type, int peer, void* stream) override {
    if (Status s = check_rank("send", "peer", peer); !s.ok()) return s;
    return enqueue("send", count, stream, [&](cudaStream_t s) {
      return ncclSend(buffer, count, nccl_type(type), peer, comm_, s);
    });
  }

  Status recv(void* buffer, int64_t count, DType type, int peer, void* stream) override {
    if (Status s = check_rank("recv", "peer", peer); !s.ok()) return s;
    return enqueue("recv", count, stream, [&](cudaStream_t s) {
      return ncclRecv(buffer, count, nccl_type(type), peer, comm_, s);
    });
  }

  // Ordered on the stream like the collectives: work enqueued after it starts
  // once every rank has enqueued and reached it; the host does not wait.
  Status barrier(void* stream) override {
    return enqueue("barrier", 1, stream, [&](cudaStream_t s) {
      return ncclAllReduce(barrier_, barrier_, 1, ncclFloat32, ncclSum, comm_, s);
    });
  }

  // Stops the operations in flight at the watchdog's next look (within kWatchInterval): NCCL
  // 2.28's ncclCommRevoke keeps the communicator for a shrink; older NCCLs abort it.
  void revoke(const std::string& reason) override {
    {
      std::lock_guard<std::mutex> lock(revoke_mutex_);
      if (revoked_) return;
      revoke_reason_ = reason;
      revoked_.store(true, std::memory_order_release);
    }
    wake_.notify_all();
  }

  // The ranks of this communicator but `excluded` (ncclCommShrink, NCCL 2.27): only the
  // survivors call it, with the same list; a revoked communicator shrinks as it is, a live one
  // first stops its operations in flight. Throws on failure.
  std::shared_ptr<Communicator> shrink(const std::vector<int>& excluded, const std::string& name) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
    for (int r : excluded)
      if (r < 0 || r >= size_ || r == rank_)
        throw std::invalid_argument(
            invalid("shrink", "cannot exclude rank " + std::to_string(r)).message);
    DeviceGuard guard(device_);
    std::lock_guard<std::mutex> lock(mutex_);
    if (revoked_.load(std::memory_order_acquire) && !revoke_done_) revoke_locked();
    if (!comm_) throw std::runtime_error(unusable("shrink").message);
    const auto deadline = deadline_after(timeout_);
    std::vector<int> list(excluded);
    ncclComm_t child = nullptr;
    ncclResult_t r =
        ncclCommShrink(comm_, list.data(), static_cast<int>(list.size()), &child, nullptr,
                       revoke_done_ ? NCCL_SHRINK_DEFAULT : NCCL_SHRINK_ABORT);
    if (r == ncclInProgress) r = wait_ready(comm_, deadline);
    ncclComm_t ready = nullptr;
    if (r == ncclSuccess) {
      ready = wait_for_child(&child, deadline);
      r = ready ? wait_ready(ready, deadline) : ncclInProgress;
    }
    if (r != ncclSuccess) {
      const std::string what = r == ncclInProgress ? "did not complete within " + seconds(timeout_)
                                                   : describe(r, ready ? ready : comm_);
      if (ncclComm_t created = __atomic_load_n(&child, __ATOMIC_ACQUIRE)) ncclCommAbort(created);
      throw std::runtime_error(abort_locked("shrink", what).message);
    }
    return std::make_shared<NcclCommunicator>(ready, device_, name, timeout_);
#else
    (void)excluded;
    (void)name;
    throw std::runtime_error(
        invalid("shrink", "needs NCCL 2.27 or newer (ncclCommShrink); this build has " +
                              std::to_string(NCCL_VERSION_CODE))
            .message);
#endif
  }

  // ncclCommSplit on this communicator; throws on failure.
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name) {
    if (color < 0)
      throw std::invalid_argument(
          invalid("split", "the color must be >= 0, got " + std::to_string(color)).message);
    DeviceGuard guard(device_);
    std::lock_guard<std::mutex> lock(mutex_);
    if (!comm_) throw std::runtime_error(unusable("split").message);
    const auto deadline = deadline_after(timeout_);
    ncclComm_t child = nullptr;
    // The child inherits the non-blocking configuration. The split runs in the
    // background: the parent's state reports when it is done, and only then is
    // the child handed out.
    ncclResult_t r = ncclCommSplit(comm_, color, key, &child, nullptr);
    if (r == ncclInProgress) r = wait_ready(comm_, deadline);
    ncclComm_t ready = nullptr;
    if (r == ncclSuccess) {
      ready = wait_for_child(&child, deadline);
      r = ready ? wait_ready(ready, deadline) : ncclInProgress;
    }
    if (r != ncclSuccess) {
      const std::string what = r == ncclInProgress
                                   ? "did not complete within " + seconds(timeout_) +
                                         "; did every rank of the parent call it?"
                                   : describe(r, ready ? ready : comm_);
      const Status failure = abort_locked("split", what);
      // Aborting the parent ends the split's background work; a child it got
      // to create is aborted as well.
      if (ncclComm_t created = __atomic_load_n(&child, __ATOMIC_ACQUIRE)) ncclCommAbort(created);
      throw std::runtime_error(failure.message);
    }
    return std::make_shared<NcclCommunicator>(ready, device_, name, timeout_);
  }

 private:
  // One enqueued operation: `start` completes when the stream reaches it,
  // `end` when it is done.
  struct Pending {
    cudaEvent_t start = nullptr, end = nullptr;
    const char* op = "";
    bool started = false;
    Clock::time_point started_at{};
  };

  Status fail(const char* op, const std::string& what) const {
    return Status{"NCCL " + std::string(op) + " on communicator '" + name_ + "' (rank " +
                      std::to_string(rank_) + " of " + std::to_string(size_) + "): " + what,
                  true};
  }

  Status invalid(const char* op, const std::string& what) const {
    Status s = fail(op, what);
    s.internal = false;
    return s;
  }

  Status unusable(const char* op) const {
    return fail(op, "the communicator was aborted after an earlier failure: " + failure_);
  }

  Status check_rank(const char* op, const char* role, int r) const {
    if (r < 0 || r >= size_)
      return invalid(op, std::string(role) + " " + std::to_string(r) + " is not a rank of " +
                             std::to_string(size_));
    return {};
  }

  Status check_reduction(const char* op, DType type, ReduceOp reduction) const {
    if (reduction != ReduceOp::kSum && reduction != ReduceOp::kAvg && reduction != ReduceOp::kMin &&
        reduction != ReduceOp::kMax)
      return invalid(op, "unknown reduction " + std::to_string(static_cast<int>(reduction)));
    if (reduction == ReduceOp::kAvg && !is_floating_point(type))
      return invalid(op, "avg needs a float type");
    return {};
  }

  // One peer's part of a grouped point-to-point operation: a send, then a
  // receive. A side with no elements is skipped (the peer's counts agree).
  struct Exchange {
    int peer;
    const void* send;
    int64_t send_count;
    void* recv;
    int64_t recv_count;
  };

  Status exchange(const char* op, int64_t elements, DType type, void* stream,
                  const std::vector<Exchange>& exchanges) {
    return enqueue(op, elements, stream, [&](cudaStream_t s) {
      return grouped([&] {
        ncclResult_t r = ncclSuccess;
        for (size_t i = 0; i < exchanges.size() && r == ncclSuccess; ++i) {
          const Exchange& x = exchanges[i];
          if (x.send_count > 0)
            r = ncclSend(x.send, x.send_count, nccl_type(type), x.peer, comm_, s);
          if (r == ncclSuccess && x.recv_count > 0)
            r = ncclRecv(x.recv, x.recv_count, nccl_type(type), x.peer, comm_, s);
        }
        return r;
      });
    });
  }

  // Enqueues `calls` on the stream between the two events of a Pending entry
  // and hands it to the watchdog. The timeout runs from the moment the stream
  // reaches the operation, not from the enqueue: XLA and torch may queue a lot
  // of compute ahead of it.
  template <typename Calls>
  Status enqueue(const char* op, int64_t elements, void* stream, Calls&& calls) {
    if (revoked_.load(std::memory_order_acquire)) return revoked(op);
    DeviceGuard guard(device_);
    std::lock_guard<std::mutex> lock(mutex_);
    if (!comm_) return unusable(op);
    // Nothing to move (an empty tensor may not even have a data pointer).
    if (elements == 0) return {};
    const auto s = static_cast<cudaStream_t>(stream);
    Pending p;
    p.op = op;
    cudaError_t e = take_event(&p.start);
    if (e == cudaSuccess) e = take_event(&p.end);
    if (e == cudaSuccess) e = cudaEventRecord(p.start, s);
    if (e != cudaSuccess) {
      recycle(p);
      return fail(
          op, "cannot record an event on the stream (is it a stream of the communicator's device " +
                  std::to_string(device_) + "?): " + cudaGetErrorString(e));
    }
    ncclResult_t r = calls(s);
    // Until a non-blocking call is fully enqueued (it may be connecting to
    // peers) nothing else may touch the communicator or the stream.
    if (r == ncclInProgress) r = wait_ready(comm_, deadline_after(timeout_));
    if (r != ncclSuccess) {
      recycle(p);
      return abort_locked(op, r == ncclInProgress
                                  ? "could not be enqueued within " + seconds(timeout_) +
                                        "; a peer may have died or not entered the same collective"
                                  : describe(r, comm_));
    }
    e = cudaEventRecord(p.end, s);
    if (e != cudaSuccess) {
      recycle(p);
      return abort_locked(
          op, std::string("cannot watch the operation: CUDA: ") + cudaGetErrorString(e));
    }
    pending_.push_back(p);
    return {};
  }

  void watch() {
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_ && comm_) {
      wake_.wait_for(lock, kWatchInterval);
      if (stopping_ || !comm_) break;
      if (revoked_.load(std::memory_order_acquire) && !revoke_done_)
        revoke_locked();
      else if (!revoke_done_)
        check_locked();
    }
  }

  // Stops the operations in flight; their kernels return and the streams move on.
  void revoke_locked() {
    revoke_done_ = true;
    const std::string reason = revoked("communication").message;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
    failure_ = reason;
    const ncclResult_t r = ncclCommRevoke(comm_, NCCL_REVOKE_DEFAULT);
    if (r == ncclSuccess || r == ncclInProgress) {
      if (wait_ready(comm_, deadline_after(timeout_)) == ncclSuccess) {
        for (const Pending& p : pending_) recycle(p);
        pending_.clear();
        return;
      }
    }
#endif
    abort_locked("communication", reason);
  }

  Status revoked(const char* op) {
    std::lock_guard<std::mutex> lock(revoke_mutex_);
    return fail(op, "the communicator was revoked: " + revoke_reason_);
  }

  void check_locked() {
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess &&
        state != ncclInProgress) {
      abort_locked(pending_.empty() ? "communication" : pending_.front().op,
                   "asynchronous NCCL error: " + describe(state, comm_));
      return;
    }
    const auto now = Clock::now();
    for (auto it = pending_.begin(); it != pending_.end();) {
      const cudaError_t done = cudaEventQuery(it->end);
      if (done == cudaSuccess) {
        recycle(*it);
        it = pending_.erase(it);
        continue;
      }
      if (done != cudaErrorNotReady) {
        abort_locked(it->op, std::string("CUDA error while it ran: ") + cudaGetErrorString(done));
        return;
      }
      if (!it->started && cudaEventQuery(it->start) == cudaSuccess) {
        it->started = true;
        it->started_at = now;
      }
      if (it->started && now - it->started_at > std::chrono::duration<double>(timeout_)) {
        abort_locked(
            it->op,
            "did not complete within " + seconds(timeout_) +
                " of starting on the GPU; a peer may have died or not entered the same collective");
        return;
      }
      ++it;
    }
  }

  // Records the failure and aborts the communicator, which also stops any of
  // its kernels still waiting on a peer, so the streams move on.
  Status abort_locked(const char* op, const std::string& what) {
    failure_ = fail(op, what).message;
    // Printed because the failure otherwise surfaces only at the next call.
    std::fprintf(stderr, "bagua: %s; aborting the communicator\n", failure_.c_str());
    ncclCommAbort(comm_);
    comm_ = nullptr;
    return Status{failure_, true};
  }

  cudaError_t take_event(cudaEvent_t* event) {
    if (spare_events_.empty()) return cudaEventCreateWithFlags(event, cudaEventDisableTiming);
    *event = spare_events_.back();
    spare_events_.pop_back();
    return cudaSuccess;
  }

  void recycle(const Pending& p) {
    for (cudaEvent_t e : {p.start, p.end})
      if (e) spare_events_.push_back(e);
  }

  ncclComm_t comm_;  // null once aborted
  const int device_;
  const std::string name_;
  const double timeout_;
  int rank_ = 0, size_ = 1;
  void* barrier_ = nullptr;

  std::mutex mutex_;  // guards everything below and every NCCL call on comm_
  std::condition_variable wake_;
  std::vector<Pending> pending_;
  std::vector<cudaEvent_t> spare_events_;
  std::string failure_;
  bool stopping_ = false;
  bool revoke_done_ = false;  // the watchdog stopped the operations of a revoke
  std::atomic<bool> revoked_{false};
  std::mutex revoke_mutex_;  // guards revoke_reason_
  std::string revoke_reason_;
  std::thread watchdog_;
};

}  // namespace

std::string nccl_unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) throw std::runtime_error("ncclGetUniqueId failed: " + describe(r, nullptr));
  return std::string(id.internal, NCCL_UNIQUE_ID_BYTES);
}

std::shared_ptr<Communicator> nccl_create(const std::string& unique_id, int rank, int size,
                                          const std::string& name, double timeout_seconds,
                                          int device) {
  const std::string where = "NCCL create of communicator '" + name + "' (rank " +
                            std::to_string(rank) + " of " + std::to_string(size) + "): ";
  if (unique_id.size() != NCCL_UNIQUE_ID_BYTES)
    throw std::invalid_argument(where + "the unique id must be the " +
                                std::to_string(NCCL_UNIQUE_ID_BYTES) +
                                " bytes of unique_id(), got " + std::to_string(unique_id.size()));
  if (size < 1 || rank < 0 || rank >= size)
    throw std::invalid_argument(where + "the rank is out of range");
  if (!(timeout_seconds > 0)) throw std::invalid_argument(where + "the timeout must be positive");
  int devices = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess)
    throw std::runtime_error(where + "no usable CUDA device: " + cudaGetErrorString(e));
  if (device < 0) cudaGetDevice(&device);
  if (device >= devices)
    throw std::invalid_argument(where + "CUDA device " + std::to_string(device) +
                                " does not exist (" + std::to_string(devices) + " visible)");
  DeviceGuard guard(device);

  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), NCCL_UNIQUE_ID_BYTES);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  // Non-blocking, so that initialization (which waits for every rank) and
  // every later call can be given up on at the deadline.
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  if (r == ncclSuccess || r == ncclInProgress)
    r = wait_ready(comm, deadline_after(timeout_seconds));
  if (r != ncclSuccess) {
    const std::string what = r == ncclInProgress
                                 ? "did not complete within " + seconds(timeout_seconds) +
                                       "; did every rank call it with the same unique id and size?"
                                 : describe(r, comm);
    if (comm) ncclCommAbort(comm);
    throw std::runtime_error(where + what);
  }
  return std::make_shared<NcclCommunicator>(comm, device, name, timeout_seconds);
}

std::shared_ptr<Communicator> nccl_shrink(Communicator& parent, const std::vector<int>& excluded,
                                          const std::string& name) {
  auto* nccl_parent = dynamic_cast<NcclCommunicator*>(&parent);
  if (!nccl_parent) throw std::invalid_argument("nccl_shrink needs an NCCL communicator as parent");
  return nccl_parent->shrink(excluded, name);
}

std::shared_ptr<Communicator> nccl_split(Communicator& parent, int color, int key,
                                         const std::string& name) {
  auto* nccl_parent = dynamic_cast<NcclCommunicator*>(&parent);
  if (!nccl_parent) throw std::invalid_argument("nccl_split needs an NCCL communicator as parent");
  return nccl_parent->split(color, key, name);
}

}  // namespace bagua
