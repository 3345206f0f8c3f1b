#include "mpi_communicator.h"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <vector>

#include "host_reduce.h"
#include "mpi_runtime.h"

namespace bagua {
namespace {

class MpiCommunicator final : public Communicator {
 public:
  // `abandonable`: the communicator belongs to a membership that may change, so an operation may be
  // abandoned with live peers still sending to it; see staged().
  MpiCommunicator(MPI_Comm comm, std::string name, double timeout_seconds, int64_t ring_min_bytes,
                  bool abandonable = false)
      : comm_(comm),
        name_(std::move(name)),
        timeout_(timeout_seconds),
        ring_min_bytes_(ring_min_bytes),
        abandonable_(abandonable) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    spans_nodes_ = ranks_span_nodes(comm_, size_);
  }

  ~MpiCommunicator() override {
    // Freeing a communicator with a collective still pending would block.
    if (!broken_) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  MPI_Comm comm() const { return comm_; }
  double timeout() const { return timeout_; }
  bool spans_nodes() const { return spans_nodes_; }
  int64_t ring_min_bytes() const { return ring_min_bytes_; }
  void set_ring_min_bytes(int64_t bytes) {
    check_ring_min_bytes(bytes);
    ring_min_bytes_ = bytes;
  }
  int average_divisor() const { return average_divisor_ > 0 ? average_divisor_.load() : size_; }
  void set_average_divisor(int ranks) {
    if (ranks < 0 || ranks > size_)
      throw std::invalid_argument("the ranks an average divides by must be 1.." +
                                  std::to_string(size_) + " (0: all), got " +
                                  std::to_string(ranks));
    average_divisor_ = ranks;
  }

  Status allreduce(const void* send, void* recv, int64_t count, DType type, ReduceOp op,
                   void*) override {
    return staged(send, count * dtype_bytes(type), recv, count * dtype_bytes(type),
                  [&](const void* send, void* recv) -> Status {
                    if (op == ReduceOp::kAvg && !is_floating_point(type))
                      return fail("allreduce", "avg needs a float type");
                    Status s = spans_nodes_ && count * dtype_bytes(type) >= ring_min_bytes_
                                   ? ring_allreduce(send, recv, count, type, op)
                                   : run("allreduce", [&](MPI_Request* r) {
                                       return MPI_Iallreduce_c(send == recv ? MPI_IN_PLACE : send,
                                                               recv, count, mpi_type(type),
                                                               mpi_op(type, op), comm_, r);
                                     });
                    if (s.ok() && op == ReduceOp::kAvg)
                      divide_in_place(recv, count, type, average_divisor());
                    return s;
                  });
  }

  Status reduce(const void* send, void* recv, int64_t count, DType type, ReduceOp op, int root,
                void*) override {
    return staged(send, count * dtype_bytes(type), recv, count * dtype_bytes(type),
                  [&](const void* send, void* recv) -> Status {
                    if (op == ReduceOp::kAvg && !is_floating_point(type))
                      return fail("reduce", "avg needs a float type");
                    if (Status s = check_root("reduce", root); !s.ok()) return s;
                    const bool in_place = send == recv && rank_ == root;
                    Status s = run("reduce", [&](MPI_Request* r) {
                      return MPI_Ireduce_c(in_place ? MPI_IN_PLACE : send, recv, count,
                                           mpi_type(type), mpi_op(type, op), root, comm_, r);
                    });
                    if (s.ok() && op == ReduceOp::kAvg && rank_ == root)
                      divide_in_place(recv, count, type, average_divisor());
                    return s;
                  });
  }

  Status broadcast(void* buffer, int64_t count, DType type, int root, void*) override {
    if (Status s = check_root("broadcast", root); !s.ok()) return s;
    const int64_t bytes = count * dtype_bytes(type);
    return staged(buffer, bytes, buffer, bytes, [&](const void*, void* staged_buffer) {
      return run("broadcast", [&](MPI_Request* r) {
        return MPI_Ibcast_c(staged_buffer, count, mpi_type(type), root, comm_, r);
      });
    });
  }

  Status reduce_scatter(const void* send, void* recv, int64_t count, DType type, ReduceOp op,
                        void*) override {
    return staged(send, count * size_ * dtype_bytes(type), recv, count * dtype_bytes(type),
                  [&](const void* send, void* recv) -> Status {
                    if (op == ReduceOp::kAvg && !is_floating_point(type))
                      return fail("reduce_scatter", "avg needs a float type");
                    Status s = run("reduce_scatter", [&](MPI_Request* r) {
                      return MPI_Ireduce_scatter_block_c(send, recv, count, mpi_type(type),
                                                         mpi_op(type, op), comm_, r);
                    });
                    if (s.ok() && op == ReduceOp::kAvg)
                      divide_in_place(recv, count, type, average_divisor());
                    return s;
                  });
  }

  Status allgather(const void* send, void* recv, int64_t count, DType type, void*) override {
    return staged(send, count * dtype_bytes(type), recv, count * size_ * dtype_bytes(type),
                  [&](const void* send, void* recv) -> Status {
                    return run("allgather", [&](MPI_Request* r) {
                      return MPI_Iallgather_c(send, count, mpi_type(type), recv, count,
                                              mpi_type(type), comm_, r);
                    });
                  });
  }

  Status gather(const void* send, void* recv, int64_t count, DType type, int root, void*) override {
    return staged(send, count * dtype_bytes(type), recv, count * size_ * dtype_bytes(type),
                  [&](const void* send, void* recv) -> Status {
                    if (Status s = check_root("gather", root); !s.ok()) return s;
                    return run("gather", [&](MPI_Request* r) {
                      return MPI_Igather_c(send, count, mpi_type(type), recv, count, mpi_type(type),
                                           root, comm_, r);
                    });
                  });
  }

  Status scatter(const void* send, void* recv, int64_t count, DType type, int root,
                 void*) override {
    return staged(send, count * size_ * dtype_bytes(type), recv, count * dtype_bytes(type),
                  [&](const void* send, void* recv) -> Status {
                    if (Status s = check_root("scatter", root); !s.ok()) return s;
                    return run("scatter", [&](MPI_Request* r) {
                      return MPI_Iscatter_c(send, count, mpi_type(type), recv, count,
                                            mpi_type(type), root, comm_, r);
                    });
                  });
  }

  Status alltoall(const void* send, void* recv, int64_t count, DType type, void*) override {
    return staged(send, count * size_ * dtype_bytes(type), recv, count * size_ * dtype_bytes(type),
                  [&](const void* send, void* recv) -> Status {
                    return run("alltoall", [&](MPI_Request* r) {
                      return MPI_Ialltoall_c(send, count, mpi_type(type), recv, count,
                                             mpi_type(type), comm_, r);
                    });
                  });
  }

  Status alltoall_v(const void* send, const int64_t* send_counts, void* recv,
                    const int64_t* recv_counts, DType type, void*) override {
    return staged(send, total(send_counts, size_) * dtype_bytes(type), recv,
                  total(recv_counts, size_) * dtype_bytes(type),
                  [&](const void* send, void* recv) -> Status {
                    std::vector<MPI_Count> sc(size_), rc(size_);
                    std::vector<MPI_Aint> sd(size_), rd(size_);
                    MPI_Aint send_offset = 0, recv_offset = 0;
                    for (int j = 0; j < size_; ++j) {
                      if (send_counts[j] < 0 || recv_counts[j] < 0)
                        return fail("alltoall_v", "counts must be non-negative");
                      sc[j] = send_counts[j];
                      sd[j] = send_offset;
                      send_offset += send_counts[j];
                      rc[j] = recv_counts[j];
                      rd[j] = recv_offset;
                      recv_offset += recv_counts[j];
                    }
                    return run("alltoall_v", [&](MPI_Request* r) {
                      return MPI_Ialltoallv_c(send, sc.data(), sd.data(), mpi_type(type), recv,
                                              rc.data(), rd.data(), mpi_type(type), comm_, r);
                    });
                  });
  }

  // Between nodes the data to a peer waits for its zero-byte "ready": sent eagerly, a rank done
  // early pushed its next exchange into a busy peer, and the ranks drifted into sharing links.
  Status send_recv(const void* send, void* recv, int64_t count, DType type, const int32_t* peers,
                   int num_peers, void*) override {
    return staged(
        send, count * dtype_bytes(type), recv, count * num_peers * dtype_bytes(type),
        [&](const void* send, void* recv) -> Status {
          for (int i = 0; i < num_peers; ++i)
            if (peers[i] < 0 || peers[i] >= size_ || peers[i] == rank_)
              return fail("send_recv", "peer " + std::to_string(peers[i]) +
                                           " is not another rank of " + std::to_string(size_));
          // Per peer i: the data's receive, the data's send (in `advance`, once the peer is ready:
          // at once within a node), the ready's receive, the ready's send.
          const int n = num_peers;
          std::vector<MPI_Request> requests(4 * n, MPI_REQUEST_NULL);
          std::vector<bool> sending(n, false);
          const int64_t bytes = count * dtype_bytes(type);
          // Tag i for the i-th exchange with a peer: repeated peers (a ring of two) pair in order.
          auto tag = [&](int i) {
            int t = 0;
            for (int j = 0; j < i; ++j) t += peers[j] == peers[i];
            return t;
          };
          return run_until(
              "send_recv", requests, deadline(),
              [&](MPI_Request* r) {
                for (int i = 0; i < n; ++i) {
                  int rc = MPI_Irecv_c(static_cast<char*>(recv) + i * bytes, count, mpi_type(type),
                                       peers[i], tag(i), comm_, &r[i]);
                  if (rc == MPI_SUCCESS && spans_nodes_)
                    rc = MPI_Irecv(nullptr, 0, MPI_BYTE, peers[i], kReadyTag, comm_, &r[2 * n + i]);
                  if (rc == MPI_SUCCESS && spans_nodes_)
                    rc = MPI_Isend(nullptr, 0, MPI_BYTE, peers[i], kReadyTag, comm_, &r[3 * n + i]);
                  if (rc != MPI_SUCCESS) return rc;
                }
                return MPI_SUCCESS;
              },
              [&](MPI_Request* r, bool* all_started) {
                for (int i = 0; i < n; ++i) {
                  if (sending[i]) continue;
                  int ready = 1;
                  int rc = spans_nodes_ ? MPI_Test(&r[2 * n + i], &ready, MPI_STATUS_IGNORE)
                                        : MPI_SUCCESS;
                  if (rc == MPI_SUCCESS && ready)
                    rc = MPI_Isend_c(send, count, mpi_type(type), peers[i], tag(i), comm_,
                                     &r[n + i]);
                  if (rc != MPI_SUCCESS) return rc;
                  sending[i] = ready;
                  *all_started = *all_started && ready;
                }
                return MPI_SUCCESS;
              });
        });
  }

  Status send(const void* buffer, int64_t count, DType type, int peer, void*) override {
    if (Status s = check_peer("send", peer); !s.ok()) return s;
    return staged(buffer, count * dtype_bytes(type), nullptr, 0,
                  [&](const void* staged_buffer, void*) {
                    return run("send", [&](MPI_Request* r) {
                      return MPI_Isend_c(staged_buffer, count, mpi_type(type), peer,
                                         kPointToPointTag, comm_, r);
                    });
                  });
  }

  Status recv(void* buffer, int64_t count, DType type, int peer, void*) override {
    if (Status s = check_peer("recv", peer); !s.ok()) return s;
    return staged(nullptr, 0, buffer, count * dtype_bytes(type),
                  [&](const void*, void* staged_buffer) {
                    return run("recv", [&](MPI_Request* r) {
                      return MPI_Irecv_c(staged_buffer, count, mpi_type(type), peer,
                                         kPointToPointTag, comm_, r);
                    });
                  });
  }

  Status barrier(void*) override {
    return run("barrier", [&](MPI_Request* r) { return MPI_Ibarrier(comm_, r); });
  }

  void revoke(const std::string& reason) override {
    std::lock_guard<std::mutex> lock(revoke_mutex_);
    if (revoked_) return;
    revoke_reason_ = reason;
    revoked_.store(true, std::memory_order_release);
  }

 private:
  Status fail(const char* op, const std::string& what) const {
    return Status{"MPI " + std::string(op) + " on communicator '" + name_ + "' (rank " +
                      std::to_string(rank_) + " of " + std::to_string(size_) + "): " + what,
                  true};
  }

  // Tags below this are send_recv's per-peer sequence numbers.
  static constexpr int kPointToPointTag = 1 << 20;
  static constexpr int kRingTag = kPointToPointTag + 1;
  static constexpr int kReadyTag = kPointToPointTag + 2;

  // Reduce-scatter then allgather around the ring, 2 (size - 1) steps of a size-th of the
  // buffer each. Between nodes MPI's own non-blocking allreduce (MPICH: recursive halving
  // and doubling) measured about 25% slower on bandwidth-limited TCP links. Each chunk is
  // reduced in the same rank order for every rank, so all ranks get the same bits.
  Status ring_allreduce(const void* send, void* recv, int64_t count, DType type, ReduceOp op) {
    const int64_t element = dtype_bytes(type);
    char* out = static_cast<char*>(recv);
    if (send != recv) std::memcpy(out, send, count * element);
    auto first = [&](int chunk) {
      return count / size_ * chunk + std::min<int64_t>(chunk, count % size_);
    };
    auto length = [&](int chunk) { return first(chunk + 1) - first(chunk); };
    auto wrap = [&](int chunk) { return ((chunk % size_) + size_) % size_; };
    std::unique_ptr<char[]> incoming(new char[std::max<int64_t>(length(0) * element, 1)]);
    const int next = wrap(rank_ + 1), prev = wrap(rank_ - 1);
    const auto until = deadline();
    std::vector<MPI_Request> requests(2, MPI_REQUEST_NULL);
    for (int step = 0; step < 2 * (size_ - 1); ++step) {
      // Reducing: pass on the partial sum of chunk rank - step, add prev's to chunk rank - step
      // - 1. Gathering: pass on the finished chunk rank - s + 1, take finished chunk rank - s.
      const bool reducing = step < size_ - 1;
      const int s = reducing ? step : step - (size_ - 1);
      const int outgoing = wrap(rank_ - s + (reducing ? 0 : 1)), arriving = wrap(outgoing - 1);
      char* target = out + first(arriving) * element;
      Status status = run_until("allreduce", requests, until, [&](MPI_Request* r) {
        int rc = MPI_Irecv_c(reducing ? incoming.get() : target, length(arriving), mpi_type(type),
                             prev, kRingTag, comm_, &r[0]);
        if (rc != MPI_SUCCESS) return rc;
        return MPI_Isend_c(out + first(outgoing) * element, length(outgoing), mpi_type(type), next,
                           kRingTag, comm_, &r[1]);
      });
      if (!status.ok()) {
        keep_forever(std::move(incoming));  // a live peer may still write into it
        return status;
      }
      if (reducing) {
        const auto lock = lock_mpi();
        const int rc = MPI_Reduce_local_c(incoming.get(), target, length(arriving), mpi_type(type),
                                          mpi_op(type, op));
        if (rc != MPI_SUCCESS) return fail("allreduce", mpi_error(rc));
      }
    }
    return {};
  }

  Status check_peer(const char* op, int peer) const {
    if (peer < 0 || peer >= size_ || peer == rank_)
      return Status{"MPI " + std::string(op) + ": peer " + std::to_string(peer) +
                    " is not another rank of " + std::to_string(size_)};
    return {};
  }

  Status check_root(const char* op, int root) const {
    if (root < 0 || root >= size_)
      return Status{"MPI " + std::string(op) + ": root " + std::to_string(root) +
                    " is not a rank of " + std::to_string(size_)};
    return {};
  }

  template <typename Start>
  Status run(const char* op, Start&& start) {
    std::vector<MPI_Request> requests(1, MPI_REQUEST_NULL);
    return run_many(op, requests, start);
  }

  template <typename Start>
  Status run_many(const char* op, std::vector<MPI_Request>& requests, Start&& start) {
    return run_until(op, requests, deadline(), start);
  }

  std::chrono::steady_clock::time_point deadline() const {
    return std::chrono::steady_clock::now() +
           std::chrono::duration_cast<std::chrono::steady_clock::duration>(
               std::chrono::duration<double>(timeout_));
  }

  template <typename Start>
  Status run_until(const char* op, std::vector<MPI_Request>& requests,
                   std::chrono::steady_clock::time_point until, Start&& start) {
    return run_until(op, requests, until, start, [](MPI_Request*, bool*) { return MPI_SUCCESS; });
  }

  // Starts the non-blocking calls, then polls them until done, the deadline, or a revoke (whose
  // requests are abandoned: ch4 never completes an operation with a dead peer). Before each poll
  // `advance` may start calls in null requests, clearing its flag while some are still to start.
  template <typename Start, typename Advance>
  Status run_until(const char* op, std::vector<MPI_Request>& requests,
                   std::chrono::steady_clock::time_point until, Start&& start, Advance&& advance) {
    if (revoked_.load(std::memory_order_acquire)) return revoked(op);
    if (broken_) return fail(op, "the communicator is unusable after an earlier failure");
    auto lock = lock_mpi();
    int rc = start(requests.data());
    if (rc != MPI_SUCCESS) return call_failed(op, rc);
    std::vector<MPI_Status> statuses(requests.size());
    for (int polls = 0;; ++polls) {
      bool all_started = true;
      rc = advance(requests.data(), &all_started);
      int done = 0;
      if (rc == MPI_SUCCESS) {
        rc =
            MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, statuses.data());
        for (const MPI_Status& status : statuses)  // which request failed, and why
          if (rc == MPI_ERR_IN_STATUS && status.MPI_ERROR != MPI_SUCCESS &&
              status.MPI_ERROR != MPI_ERR_PENDING)
            rc = status.MPI_ERROR;
      }
      if (rc != MPI_SUCCESS) return call_failed(op, rc);
      if (done && all_started) return {};
      if (revoked_.load(std::memory_order_acquire)) {
        mark_broken();
        return revoked(op);
      }
      if (std::chrono::steady_clock::now() > until) {
        mark_broken();
        char seconds[32];
        std::snprintf(seconds, sizeof seconds, "%g", timeout_);
        return fail(op, std::string("did not complete within ") + seconds +
                            " s; a peer may have died or not entered the same collective");
      }
      if (polls > 1000) {
        if (lock.owns_lock()) lock.unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        if (!thread_multiple()) lock.lock();
      }
    }
  }

  void mark_broken() {
    broken_ = true;
    forbid_finalize();
  }

  // An MPI call of `op` failed (MPICH gives up a send to a peer that died this way: PatientSends),
  // leaving requests pending.
  Status call_failed(const char* op, int rc) {
    mark_broken();
    return fail(op, "the call failed and left the communicator unusable: " + mpi_error(rc));
  }

  // Runs `body(send', recv')` with the buffers MPI should use. On an abandonable communicator those
  // are engine memory holding copies of `send` and `recv` (copied back to `recv` on success): an
  // abandoned operation's receive may still be written by a live peer's late message long after the
  // caller's buffer is gone, so the memory of an operation that failed with its requests pending is
  // kept until the process ends. Elsewhere MPI uses the caller's buffers.
  template <typename Body>
  Status staged(const void* send, int64_t send_bytes, void* recv, int64_t recv_bytes, Body&& body) {
    if (!abandonable_) return body(send, recv);
    const bool in_place = send != nullptr && send == recv;
    std::unique_ptr<char[]> in, out;
    if (send && !in_place) {
      in.reset(new char[std::max<int64_t>(send_bytes, 1)]);
      std::memcpy(in.get(), send, send_bytes);
    }
    if (recv) {  // preloaded: MPI leaves some of it as it was (a reduce's non-root ranks, in place)
      out.reset(new char[std::max<int64_t>(recv_bytes, 1)]);
      std::memcpy(out.get(), recv, recv_bytes);
    }
    const bool was_broken = broken_;
    Status s = body(in_place ? out.get() : in.get(), out.get());
    if (broken_ && !was_broken) {
      keep_forever(std::move(in));
      keep_forever(std::move(out));
    } else if (s.ok() && recv) {
      std::memcpy(recv, out.get(), recv_bytes);
    }
    return s;
  }

  static int64_t total(const int64_t* counts, int n) {
    int64_t sum = 0;
    for (int j = 0; j < n; ++j) sum += counts[j] > 0 ? counts[j] : 0;
    return sum;
  }

  Status revoked(const char* op) {
    std::lock_guard<std::mutex> lock(revoke_mutex_);
    return fail(op, "the communicator was revoked: " + revoke_reason_);
  }

  MPI_Comm comm_;
  std::string name_;
  double timeout_;
  int rank_ = 0, size_ = 1;
  bool spans_nodes_ = false;
  // Atomic: torch sets it from its thread while collectives run on the communicator's worker.
  std::atomic<int64_t> ring_min_bytes_;
  std::atomic<int> average_divisor_{0};  // 0: the size
  bool broken_ = false;
  const bool abandonable_;
  std::atomic<bool> revoked_{false};
  std::mutex revoke_mutex_;  // guards revoke_reason_
  std::string revoke_reason_;
};

// `comm` as the MPI engine's communicator (const if `comm` is).
template <typename C>
auto& as_mpi(C& comm, const char* caller) {
  using Mpi = std::conditional_t<std::is_const_v<C>, const MpiCommunicator, MpiCommunicator>;
  auto* mpi = dynamic_cast<Mpi*>(&comm);
  if (!mpi) throw std::invalid_argument(std::string(caller) + " needs an MPI communicator");
  return *mpi;
}

}  // namespace

std::shared_ptr<Communicator> mpi_world(const std::string& name, double timeout_seconds) {
  const int64_t ring_min_bytes = ring_min_bytes_from_environment();  // may throw: before MPI work
  ensure_initialized();
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  // Ranks with different thresholds would pick different algorithms for one allreduce and wait
  // for each other until the timeout; compare them once, here, instead. One MPI_MAX gives the
  // largest value and, negated, the smallest.
  int64_t largest_and_negated_smallest[2] = {ring_min_bytes, -ring_min_bytes};
  MPI_Allreduce(MPI_IN_PLACE, largest_and_negated_smallest, 2, MPI_INT64_T, MPI_MAX, comm);
  const int64_t largest = largest_and_negated_smallest[0];
  const int64_t smallest = -largest_and_negated_smallest[1];
  if (smallest != largest) {
    MPI_Comm_free(&comm);
    throw std::invalid_argument("BAGUA_MPI_RING_MIN_BYTES differs across ranks (" +
                                std::to_string(smallest) + " to " + std::to_string(largest) +
                                " bytes); set the same value on every rank");
  }
  return std::make_shared<MpiCommunicator>(comm, name, timeout_seconds, ring_min_bytes);
}

// The parent's threshold carries over to its splits.
std::shared_ptr<Communicator> mpi_split(Communicator& parent, int color, int key,
                                        const std::string& name) {
  const MpiCommunicator& mpi_parent = as_mpi(parent, "mpi_split");
  MPI_Comm comm;
  const int rc = MPI_Comm_split(mpi_parent.comm(), color, key, &comm);
  if (rc != MPI_SUCCESS) throw std::runtime_error("MPI_Comm_split failed: " + mpi_error(rc));
  return std::make_shared<MpiCommunicator>(comm, name, mpi_parent.timeout(),
                                           mpi_parent.ring_min_bytes());
}

std::shared_ptr<Communicator> mpi_communicator(MPI_Comm comm, const std::string& name,
                                               double timeout_seconds, int64_t ring_min_bytes,
                                               bool abandonable) {
  return std::make_shared<MpiCommunicator>(comm, name, timeout_seconds, ring_min_bytes,
                                           abandonable);
}

MPI_Comm mpi_handle(const Communicator& comm) { return as_mpi(comm, "mpi_handle").comm(); }

double mpi_timeout(const Communicator& comm) { return as_mpi(comm, "mpi_timeout").timeout(); }

bool mpi_spans_nodes(const Communicator& comm) {
  return as_mpi(comm, "mpi_spans_nodes").spans_nodes();
}

int64_t mpi_ring_min_bytes(const Communicator& comm) {
  return as_mpi(comm, "mpi_ring_min_bytes").ring_min_bytes();
}

void set_mpi_ring_min_bytes(Communicator& comm, int64_t bytes) {
  as_mpi(comm, "set_mpi_ring_min_bytes").set_ring_min_bytes(bytes);
}

void set_mpi_average_divisor(Communicator& comm, int ranks) {
  as_mpi(comm, "set_mpi_average_divisor").set_average_divisor(ranks);
}

}  // namespace bagua
