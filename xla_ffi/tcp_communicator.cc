#include "tcp_communicator.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "host_reduce.h"
#include "tcp_connections.h"

namespace bagua {
namespace {

using namespace tcp;

// The header before every message of a communicator's operations.
struct Frame {
  uint32_t magic;
  uint32_t operation;  // a hash of the operation's name
  uint64_t bytes;
};
constexpr uint32_t kFrame = 0x42475446;  // "BGTF"

// The host of a rank's address, "host:port".
std::string host_of(const std::string& address) { return address.substr(0, address.rfind(':')); }

uint32_t operation_code(const char* op) {
  uint32_t hash = 2166136261u;  // FNV-1a
  for (; *op; ++op) hash = (hash ^ static_cast<unsigned char>(*op)) * 16777619u;
  return hash;
}

class TcpCommunicator final : public Communicator {
 public:
  TcpCommunicator(std::vector<int> fds, int rank, std::vector<std::string> addresses,
                  std::string token, std::string name, double timeout)
      : fds_(std::move(fds)),
        rank_(rank),
        addresses_(std::move(addresses)),
        token_(std::move(token)),
        name_(std::move(name)),
        timeout_(timeout),
        wake_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    const int one = 1;
    for (int fd : fds_)
      if (fd >= 0) setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    for (const std::string& address : addresses_)
      same_host_.push_back(host_of(address) == host_of(addresses_[rank_]));
  }

  ~TcpCommunicator() override {
    for (int fd : fds_)
      if (fd >= 0) ::close(fd);
    ::close(wake_);
  }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(fds_.size()); }
  const std::string& name() const override { return name_; }
  const std::vector<std::string>& addresses() const { return addresses_; }
  double timeout() const { return timeout_; }

  // A token for a communicator built from some of these ranks, the `what`-th such build: the
  // job's random root (the world's token up to its first '/') and a hash of this token, the
  // build's count and `what`, so that tokens stay short and no two builds share one. Revoking this
  // communicator abandons the builds (tcp::abandon): their members are changing.
  std::string derived_token(const std::string& what) const {
    uint64_t hash = 14695981039346656037ull;  // FNV-1a
    const std::string text = token_ + "/" + std::to_string(derivations_++) + "/" + what;
    for (char ch : text) hash = (hash ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(hash));
    std::string derived = token_.substr(0, token_.find('/')) + "/" + hex;
    std::lock_guard<std::mutex> lock(revoke_mutex_);
    derived_.push_back(derived);
    if (revoked_) abandon(derived);
    return derived;
  }

  void set_average_divisor(int ranks) {
    if (ranks < 0 || ranks > size())
      throw std::invalid_argument("the ranks an average divides by must be 1.." +
                                  std::to_string(size()) + " (0: all), got " +
                                  std::to_string(ranks));
    average_divisor_ = ranks;
  }

  Status allreduce(const void* send, void* recv, int64_t count, DType type, ReduceOp op,
                   void*) override {
    if (Status s = check_average("allreduce", type, op); !s.ok()) return s;
    Operation run(*this, "allreduce");
    const int64_t element = dtype_bytes(type);
    char* out = static_cast<char*>(recv);
    if (send != recv) std::memcpy(out, send, count * element);
    const std::vector<int64_t> first = chunks(count);
    Status s = ring_reduce_scatter(run, out, first, type, op);
    if (s.ok()) s = ring_allgather(run, out, first, element);
    return finish_average(s, recv, count, type, op);
  }

  Status reduce(const void* send, void* recv, int64_t count, DType type, ReduceOp op, int root,
                void*) override {
    if (Status s = check_rank("reduce", "root", root, true); !s.ok()) return s;
    if (Status s = check_average("reduce", type, op); !s.ok()) return s;
    Operation run(*this, "reduce");
    const int64_t element = dtype_bytes(type);
    const char* in = static_cast<const char*>(send);
    std::vector<char> work(in, in + count * element);
    const std::vector<int64_t> first = chunks(count);
    Status s = ring_reduce_scatter(run, work.data(), first, type, op);
    // Then rank r sends the root chunk r, which it holds reduced.
    auto chunk = [&](char* base, int c) {
      return std::make_pair(base + first[c] * element, (first[c + 1] - first[c]) * element);
    };
    std::vector<Transfer> transfers;
    const auto [mine, bytes] = chunk(work.data(), rank_);
    transfers.push_back({root, true, mine, bytes});
    if (rank_ == root)
      for (int j = 0; j < size(); ++j) {
        const auto [into, length] = chunk(static_cast<char*>(recv), j);
        transfers.push_back({j, false, into, length});
      }
    if (s.ok()) s = run.exchange(transfers);
    return rank_ == root ? finish_average(s, recv, count, type, op) : s;
  }

  Status broadcast(void* buffer, int64_t count, DType type, int root, void*) override {
    if (Status s = check_rank("broadcast", "root", root, true); !s.ok()) return s;
    Operation run(*this, "broadcast");
    const int64_t bytes = count * dtype_bytes(type);
    std::vector<Transfer> transfers;
    if (rank_ == root) {
      for (int j = 0; j < size(); ++j)
        if (j != root) transfers.push_back({j, true, static_cast<char*>(buffer), bytes});
    } else {
      transfers.push_back({root, false, static_cast<char*>(buffer), bytes});
    }
    return run.exchange(transfers);
  }

  Status reduce_scatter(const void* send, void* recv, int64_t count, DType type, ReduceOp op,
                        void*) override {
    if (Status s = check_average("reduce_scatter", type, op); !s.ok()) return s;
    Operation run(*this, "reduce_scatter");
    const int64_t element = dtype_bytes(type);
    const char* in = static_cast<const char*>(send);
    std::vector<char> work(in, in + count * size() * element);
    std::vector<int64_t> first(size() + 1);
    for (int c = 0; c <= size(); ++c) first[c] = count * c;
    Status s = ring_reduce_scatter(run, work.data(), first, type, op);
    if (s.ok()) std::memcpy(recv, work.data() + first[rank_] * element, count * element);
    return finish_average(s, recv, count, type, op);
  }

  Status allgather(const void* send, void* recv, int64_t count, DType type, void*) override {
    Operation run(*this, "allgather");
    const int64_t element = dtype_bytes(type);
    char* out = static_cast<char*>(recv);
    if (out + rank_ * count * element != send)
      std::memmove(out + rank_ * count * element, send, count * element);
    std::vector<int64_t> first(size() + 1);
    for (int c = 0; c <= size(); ++c) first[c] = count * c;
    return ring_allgather(run, out, first, element);
  }

  Status gather(const void* send, void* recv, int64_t count, DType type, int root, void*) override {
    if (Status s = check_rank("gather", "root", root, true); !s.ok()) return s;
    Operation run(*this, "gather");
    const int64_t bytes = count * dtype_bytes(type);
    std::vector<Transfer> transfers;
    if (rank_ == root) {
      for (int j = 0; j < size(); ++j)
        transfers.push_back({j, false, static_cast<char*>(recv) + j * bytes, bytes});
      transfers.push_back({rank_, true, send_buffer(send), bytes});
    } else {
      transfers.push_back({root, true, send_buffer(send), bytes});
    }
    return run.exchange(transfers);
  }

  Status scatter(const void* send, void* recv, int64_t count, DType type, int root,
                 void*) override {
    if (Status s = check_rank("scatter", "root", root, true); !s.ok()) return s;
    Operation run(*this, "scatter");
    const int64_t bytes = count * dtype_bytes(type);
    std::vector<Transfer> transfers{{root, false, static_cast<char*>(recv), bytes}};
    if (rank_ == root)
      for (int j = 0; j < size(); ++j)
        transfers.push_back({j, true, send_buffer(send) + j * bytes, bytes});
    return run.exchange(transfers);
  }

  Status alltoall(const void* send, void* recv, int64_t count, DType type, void*) override {
    const std::vector<int64_t> counts(size(), count);
    return alltoall_v(send, counts.data(), recv, counts.data(), type, nullptr);
  }

  Status alltoall_v(const void* send, const int64_t* send_counts, void* recv,
                    const int64_t* recv_counts, DType type, void*) override {
    Operation run(*this, "alltoall");
    const int64_t element = dtype_bytes(type);
    std::vector<Transfer> transfers;
    int64_t sent = 0, received = 0;
    for (int j = 0; j < size(); ++j) {
      if (send_counts[j] < 0 || recv_counts[j] < 0)
        return fail("alltoall", "a block's count is negative");
      transfers.push_back({j, true, send_buffer(send) + sent, send_counts[j] * element});
      transfers.push_back(
          {j, false, static_cast<char*>(recv) + received, recv_counts[j] * element});
      sent += send_counts[j] * element;
      received += recv_counts[j] * element;
    }
    return run.exchange(transfers);
  }

  // The data to a peer on another host waits for its zero-byte "ready": sent eagerly, a rank done
  // early pushed its next exchange into a peer still receiving its last, and the ranks drifted
  // into sharing links (as the MPI engine found between nodes). On this host's loopback no link
  // is shared and the ready's round trip cost small exchanges a fifth of their time.
  Status send_recv(const void* send, void* recv, int64_t count, DType type, const int32_t* peers,
                   int num_peers, void*) override {
    Operation run(*this, "send_recv");
    const int64_t bytes = count * dtype_bytes(type);
    std::vector<Transfer> transfers;
    std::vector<bool> readied(size(), false);
    for (int i = 0; i < num_peers; ++i) {
      if (Status s = check_rank("send_recv", "peer", peers[i], true); !s.ok()) return s;
      if (same_host_[peers[i]] || readied[peers[i]]) continue;
      readied[peers[i]] = true;
      transfers.push_back({peers[i], true, nullptr, 0});
      transfers.push_back({peers[i], false, nullptr, 0});
    }
    for (int i = 0; i < num_peers; ++i) {
      transfers.push_back({peers[i], true, send_buffer(send), bytes, !same_host_[peers[i]]});
      transfers.push_back({peers[i], false, static_cast<char*>(recv) + i * bytes, bytes});
    }
    return run.exchange(transfers);
  }

  Status send(const void* buffer, int64_t count, DType type, int peer, void*) override {
    if (Status s = check_rank("send", "peer", peer, false); !s.ok()) return s;
    Operation run(*this, "send");
    std::vector<Transfer> transfers{{peer, true, send_buffer(buffer), count * dtype_bytes(type)}};
    return run.exchange(transfers);
  }

  Status recv(void* buffer, int64_t count, DType type, int peer, void*) override {
    if (Status s = check_rank("recv", "peer", peer, false); !s.ok()) return s;
    Operation run(*this, "send");  // a send's frames
    std::vector<Transfer> transfers{
        {peer, false, static_cast<char*>(buffer), count * dtype_bytes(type)}};
    return run.exchange(transfers);
  }

  Status barrier(void*) override {
    Operation run(*this, "barrier");
    std::vector<Transfer> transfers;
    for (int j = 0; j < size(); ++j)
      if (j != rank_) {
        transfers.push_back({j, true, nullptr, 0});
        transfers.push_back({j, false, nullptr, 0});
      }
    return run.exchange(transfers);
  }

  void revoke(const std::string& reason) override {
    std::lock_guard<std::mutex> lock(revoke_mutex_);
    if (revoked_) return;
    revoke_reason_ = reason;
    revoked_.store(true, std::memory_order_release);
    const uint64_t one = 1;
    (void)!::write(wake_, &one, sizeof one);  // wakes an operation waiting in poll
    end_connections();
    for (const std::string& derived : derived_) abandon(derived);
  }

 private:
  // One message to or from a peer; to or from this rank itself is a copy.
  struct Transfer {
    int peer;
    bool outgoing;
    char* data;
    int64_t bytes;
    // Outgoing: starts once the peer's first message of the operation (its ready) arrived.
    bool after_ready = false;
  };

  // One collective: holds the communicator for its duration (one at a time) and moves its
  // messages before one deadline.
  class Operation {
   public:
    Operation(TcpCommunicator& comm, const char* op)
        : comm_(comm),
          op_(op),
          code_(operation_code(op)),
          lock_(comm.operation_mutex_),
          until_(deadline_after(comm.timeout_)) {}

    // Moves every transfer; those with one peer in one direction go in their order.
    Status exchange(const std::vector<Transfer>& transfers);

    const char* op() const { return op_; }

   private:
    struct Lane {  // the transfers with one peer in one direction, and the current one's progress
      std::vector<const Transfer*> queue;
      size_t next = 0;
      int64_t moved = 0;  // of the current transfer's frame and data
      Frame frame{};
      bool busy() const { return next < queue.size(); }
      // Whether the current transfer may move: one after the peer's ready waits for `opposite` (the
      // lane in the other direction) to have received it.
      bool movable(const Lane& opposite) const {
        return busy() && (!queue[next]->after_ready || opposite.next > 0);
      }
    };
    Status step(Lane& lane, const Lane& opposite, int peer, bool outgoing);

    TcpCommunicator& comm_;
    const char* op_;
    uint32_t code_;
    std::lock_guard<std::mutex> lock_;
    Clock::time_point until_;
  };

  // Reduce-scatter around the ring over the chunks [first[c], first[c + 1]) of `buffer`: rank r
  // ends with chunk r reduced over every rank, each chunk reduced in the same order on every rank.
  Status ring_reduce_scatter(Operation& run, char* buffer, const std::vector<int64_t>& first,
                             DType type, ReduceOp op) {
    const int n = size();
    const int64_t element = dtype_bytes(type);
    int64_t longest = 0;
    for (int c = 0; c < n; ++c) longest = std::max(longest, first[c + 1] - first[c]);
    std::vector<char> incoming(std::max<int64_t>(longest * element, 1));
    for (int step = 0; step < n - 1; ++step) {
      const int outgoing = wrap(rank_ - step - 1), arriving = wrap(rank_ - step - 2);
      const int64_t length = first[arriving + 1] - first[arriving];
      const std::vector<Transfer> transfers{
          {wrap(rank_ + 1), true, buffer + first[outgoing] * element,
           (first[outgoing + 1] - first[outgoing]) * element},
          {wrap(rank_ - 1), false, incoming.data(), length * element}};
      if (Status s = run.exchange(transfers); !s.ok()) return s;
      reduce_into(incoming.data(), buffer + first[arriving] * element, length, type, op);
    }
    return {};
  }

  // Allgather around the ring: rank r has chunk r of `buffer`, and ends with every chunk.
  Status ring_allgather(Operation& run, char* buffer, const std::vector<int64_t>& first,
                        int64_t element) {
    for (int step = 0; step < size() - 1; ++step) {
      const int outgoing = wrap(rank_ - step), arriving = wrap(rank_ - step - 1);
      const std::vector<Transfer> transfers{
          {wrap(rank_ + 1), true, buffer + first[outgoing] * element,
           (first[outgoing + 1] - first[outgoing]) * element},
          {wrap(rank_ - 1), false, buffer + first[arriving] * element,
           (first[arriving + 1] - first[arriving]) * element}};
      if (Status s = run.exchange(transfers); !s.ok()) return s;
    }
    return {};
  }

  int wrap(int r) const { return ((r % size()) + size()) % size(); }

  // Where chunk c of `count` elements starts (first[size()] = count): count / size elements, one
  // more for the first count % size chunks.
  std::vector<int64_t> chunks(int64_t count) const {
    std::vector<int64_t> first(size() + 1);
    for (int c = 0; c <= size(); ++c)
      first[c] = count / size() * c + std::min<int64_t>(c, count % size());
    return first;
  }

  // A transfer's buffer from a collective's input: transfers that send only read it.
  static char* send_buffer(const void* data) {
    return const_cast<char*>(static_cast<const char*>(data));
  }

  // After a failure or a revoke the connections are mid-message, so they are ended: a peer waiting
  // on one fails at once instead of at its timeout. The descriptors stay open (a number reused by
  // another connection must not be shut down by a late call) until the communicator is destroyed.
  void end_connections() {
    for (int fd : fds_)
      if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
  }

  Status broke(Status s) {
    broken_ = true;
    end_connections();
    return s;
  }

  Status check_average(const char* op, DType type, ReduceOp reduction) const {
    if (reduction == ReduceOp::kAvg && !is_floating_point(type))
      return fail(op, "avg needs a float type");
    return {};
  }

  Status finish_average(Status s, void* data, int64_t count, DType type, ReduceOp op) const {
    if (s.ok() && op == ReduceOp::kAvg)
      divide_in_place(data, count, type, average_divisor_ > 0 ? average_divisor_.load() : size());
    return s;
  }

  Status check_rank(const char* op, const char* role, int r, bool self_too) const {
    if (r < 0 || r >= size() || (!self_too && r == rank_))
      return Status{"TCP " + std::string(op) + ": " + role + " " + std::to_string(r) + " is not " +
                    (self_too ? "a rank" : "another rank") + " of " + std::to_string(size())};
    return {};
  }

  Status fail(const char* op, const std::string& what) const {
    return Status{"TCP " + std::string(op) + " on communicator '" + name_ + "' (rank " +
                      std::to_string(rank_) + " of " + std::to_string(size()) + "): " + what,
                  true};
  }

  std::vector<int> fds_;  // by rank; -1 for this rank
  int rank_;
  std::vector<std::string> addresses_;
  std::vector<bool> same_host_;  // by rank: whether its address names this rank's host
  std::string token_, name_;
  double timeout_;
  int wake_;                                     // an eventfd that revoke() makes readable
  std::atomic<int> average_divisor_{0};          // 0: the size
  mutable std::atomic<int64_t> derivations_{0};  // communicators built from some of these ranks
  std::mutex operation_mutex_;
  bool broken_ = false;  // a failed operation left the connections mid-message
  std::atomic<bool> revoked_{false};
  mutable std::mutex revoke_mutex_;  // guards revoke_reason_ and derived_
  std::string revoke_reason_;
  mutable std::vector<std::string> derived_;  // the tokens of the builds from these ranks
};

Status TcpCommunicator::Operation::exchange(const std::vector<Transfer>& transfers) {
  TcpCommunicator& c = comm_;
  if (c.revoked_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(c.revoke_mutex_);
    return c.fail(op_, "the communicator was revoked: " + c.revoke_reason_);
  }
  if (c.broken_) return c.fail(op_, "the communicator is unusable after an earlier failure");
  std::vector<Lane> sending(c.size()), receiving(c.size());
  std::vector<const Transfer*> to_self, from_self;
  for (const Transfer& t : transfers) {
    if (t.peer == c.rank_)
      (t.outgoing ? to_self : from_self).push_back(&t);
    else
      (t.outgoing ? sending : receiving)[t.peer].queue.push_back(&t);
  }
  if (to_self.size() != from_self.size())
    return c.fail(op_, "the sends to this rank itself do not match its receives");
  for (size_t i = 0; i < to_self.size(); ++i) {
    if (to_self[i]->bytes != from_self[i]->bytes)
      return c.fail(op_, "a send to this rank itself differs in size from its receive");
    if (to_self[i]->bytes > 0)
      std::memmove(from_self[i]->data, to_self[i]->data, to_self[i]->bytes);
  }
  std::vector<pollfd> polled;
  std::vector<int> peers;
  for (;;) {
    polled.clear();
    peers.clear();
    for (int j = 0; j < c.size(); ++j) {
      const short events =
          (sending[j].movable(receiving[j]) ? POLLOUT : 0) | (receiving[j].busy() ? POLLIN : 0);
      if (events == 0) continue;
      polled.push_back({c.fds_[j], events, 0});
      peers.push_back(j);
    }
    if (polled.empty()) return {};
    polled.push_back({c.wake_, POLLIN, 0});
    if (::poll(polled.data(), polled.size(), millis_left(until_, 1000)) < 0 && errno != EINTR)
      return c.broke(c.fail(op_, system_error("poll")));
    if (c.revoked_.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> lock(c.revoke_mutex_);
      return c.broke(c.fail(op_, "the communicator was revoked: " + c.revoke_reason_));
    }
    for (size_t i = 0; i < peers.size(); ++i) {
      const short ready = polled[i].revents;
      if (ready == 0) continue;
      const int j = peers[i];
      Status s;
      if ((ready & (POLLIN | POLLHUP | POLLERR)) && receiving[j].busy())
        s = step(receiving[j], sending[j], j, false);
      if (s.ok() && (ready & (POLLOUT | POLLHUP | POLLERR)) && sending[j].movable(receiving[j]))
        s = step(sending[j], receiving[j], j, true);
      if (!s.ok()) return c.broke(s);
    }
    if (Clock::now() > until_) {
      std::string waiting;
      for (int j : peers) waiting += (waiting.empty() ? "" : ", ") + std::to_string(j);
      char seconds[32];
      std::snprintf(seconds, sizeof seconds, "%g", c.timeout_);
      return c.broke(c.fail(op_, std::string("did not complete within ") + seconds +
                                     " s, waiting for rank(s) " + waiting +
                                     "; a peer may have hung or not entered the same collective"));
    }
  }
}

// Moves as much of the lane's current transfers as the socket takes without waiting.
Status TcpCommunicator::Operation::step(Lane& lane, const Lane& opposite, int peer, bool outgoing) {
  TcpCommunicator& c = comm_;
  const int fd = c.fds_[peer];
  constexpr int64_t kFrameBytes = sizeof(Frame);
  while (lane.movable(opposite)) {
    const Transfer& t = *lane.queue[lane.next];
    if (lane.moved == 0 && outgoing) lane.frame = Frame{kFrame, code_, uint64_t(t.bytes)};
    ssize_t n;
    if (outgoing) {
      iovec parts[2];
      int count = 0;
      if (lane.moved < kFrameBytes)
        parts[count++] = {reinterpret_cast<char*>(&lane.frame) + lane.moved,
                          size_t(kFrameBytes - lane.moved)};
      const int64_t sent = std::max<int64_t>(lane.moved - kFrameBytes, 0);
      if (t.bytes > sent) parts[count++] = {t.data + sent, size_t(t.bytes - sent)};
      msghdr message{};
      message.msg_iov = parts;
      message.msg_iovlen = count;
      n = ::sendmsg(fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
    } else if (lane.moved < kFrameBytes) {
      n = ::recv(fd, reinterpret_cast<char*>(&lane.frame) + lane.moved, kFrameBytes - lane.moved,
                 MSG_DONTWAIT);
    } else {
      const int64_t received = lane.moved - kFrameBytes;
      n = ::recv(fd, t.data + received, t.bytes - received, MSG_DONTWAIT);
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return {};
    if (n <= 0)
      return c.fail(
          op_, n == 0 ? "rank " + std::to_string(peer) +
                            " closed its connection (it died, or its own operation "
                            "failed or was revoked)"
                      : system_error("the connection to rank " + std::to_string(peer) + " failed"));
    const bool had_frame = lane.moved >= kFrameBytes;
    lane.moved += n;
    if (!outgoing && !had_frame && lane.moved >= kFrameBytes &&
        (lane.frame.magic != kFrame || lane.frame.operation != code_ ||
         lane.frame.bytes != uint64_t(t.bytes)))
      return c.fail(op_, "rank " + std::to_string(peer) + " sent " +
                             std::to_string(lane.frame.bytes) + " bytes of " +
                             (lane.frame.operation == code_ ? "the same" : "another") +
                             " operation where this rank expected " + std::to_string(t.bytes) +
                             ": the ranks did not call the same collectives in the same order");
    if (lane.moved == kFrameBytes + t.bytes) {
      ++lane.next;
      lane.moved = 0;
    }
  }
  return {};
}

void check_status(const Status& s, const char* op) {
  if (!s.ok()) throw std::runtime_error(std::string(op) + ": " + s.message);
}

const TcpCommunicator& as_tcp(const Communicator& comm, const char* op) {
  const auto* tcp = dynamic_cast<const TcpCommunicator*>(&comm);
  if (!tcp) throw std::invalid_argument(std::string(op) + ": not a TCP communicator");
  return *tcp;
}

}  // namespace

std::string tcp_listen(const std::string& host) { return tcp::listen(host); }

void tcp_abandon(const std::string& token) { tcp::abandon(token); }

std::shared_ptr<Communicator> tcp_build(const std::string& token, int rank,
                                        const std::vector<std::string>& addresses,
                                        const std::string& name, double timeout_seconds) {
  const int size = static_cast<int>(addresses.size());
  if (rank < 0 || rank >= size)
    throw std::invalid_argument("tcp_build: rank " + std::to_string(rank) + " is not a rank of " +
                                std::to_string(size));
  if (token.empty() || token.size() > kLongestToken)
    throw std::invalid_argument("tcp_build: the token must have 1.." +
                                std::to_string(kLongestToken) + " bytes");
  const auto until = deadline_after(timeout_seconds);
  std::vector<int> fds(size, -1);
  auto fail = [&](const std::string& what) {
    for (int fd : fds)
      if (fd >= 0) ::close(fd);
    abandon(token);  // the connections other ranks made for it, parked here, are closed
    throw std::runtime_error("tcp_build of '" + name + "' (rank " + std::to_string(rank) + " of " +
                             std::to_string(size) + "): " + what);
  };
  for (int j = 0; j < rank; ++j) {
    std::string error;
    fds[j] = tcp::connect(addresses[j], token, rank, until, &error);
    if (fds[j] < 0) fail("rank " + std::to_string(j) + ": " + error);
  }
  std::vector<int> above;
  for (int j = rank + 1; j < size; ++j) above.push_back(j);
  if (Status s = tcp::accept(token, above, fds, until); !s.ok()) fail(s.message);
  return std::make_shared<TcpCommunicator>(std::move(fds), rank, addresses, token, name,
                                           timeout_seconds);
}

std::shared_ptr<Communicator> tcp_shrink(Communicator& parent, const std::vector<int>& members,
                                         const std::string& name) {
  const TcpCommunicator& tcp = as_tcp(parent, "tcp_shrink");
  std::vector<std::string> addresses;
  std::string what = "shrink/" + name;
  int rank = -1;
  for (int m : members) {
    if (m < 0 || m >= tcp.size())
      throw std::invalid_argument("tcp_shrink: member " + std::to_string(m) + " is not a rank of " +
                                  std::to_string(tcp.size()));
    if (m == tcp.rank()) rank = static_cast<int>(addresses.size());
    addresses.push_back(tcp.addresses()[m]);
    what += "/" + std::to_string(m);
  }
  if (rank < 0) throw std::invalid_argument("tcp_shrink: this rank is not one of the members");
  return tcp_build(tcp.derived_token(what), rank, addresses, name, tcp.timeout());
}

std::shared_ptr<Communicator> tcp_split(Communicator& parent, int color, int key,
                                        const std::string& name) {
  const TcpCommunicator& tcp = as_tcp(parent, "tcp_split");
  const int64_t mine[2] = {color, key};
  std::vector<int64_t> all(2 * tcp.size());
  check_status(parent.allgather(mine, all.data(), 2, DType::kI64, nullptr), "tcp_split");
  std::vector<std::pair<int64_t, int>> group;  // (key, parent rank) of the ranks of this color
  for (int j = 0; j < tcp.size(); ++j)
    if (all[2 * j] == color) group.emplace_back(all[2 * j + 1], j);
  std::sort(group.begin(), group.end());
  std::vector<std::string> addresses;
  int rank = 0;
  for (const auto& [ignored, j] : group) {
    if (j == tcp.rank()) rank = static_cast<int>(addresses.size());
    addresses.push_back(tcp.addresses()[j]);
  }
  return tcp_build(tcp.derived_token("split/" + name + "/" + std::to_string(color)), rank,
                   addresses, name, tcp.timeout());
}

const std::vector<std::string>& tcp_addresses(const Communicator& comm) {
  return as_tcp(comm, "tcp_addresses").addresses();
}

double tcp_timeout(const Communicator& comm) { return as_tcp(comm, "tcp_timeout").timeout(); }

void set_tcp_average_divisor(Communicator& comm, int ranks) {
  const_cast<TcpCommunicator&>(as_tcp(comm, "set_tcp_average_divisor")).set_average_divisor(ranks);
}

}  // namespace bagua
