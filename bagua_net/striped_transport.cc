#include "striped_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>

#include "connection.h"
#include "socket_io.h"

namespace bagua_net {
namespace {

constexpr int kWorkerThreads = 2;

}  // namespace

// ---------------------------------------------------------------------------
// The shared epoll threads

class Worker {
 public:
  Worker() {
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    epoll_event e{};
    e.events = EPOLLIN;
    e.data.u64 = UINT64_MAX;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &e);
    thread_ = std::thread([this] { run(); });
  }
  ~Worker() {
    uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof(one));
    thread_.join();
    ::close(wake_fd_);
    ::close(epoll_fd_);
  }

  void attach(const std::shared_ptr<Connection>& comm) {
    std::lock_guard<std::mutex> lock(mutex_);
    comms_[comm->id] = comm;
    for (size_t i = 0; i < comm->streams.size(); ++i) {
      epoll_event e{};
      e.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
      e.data.u64 = comm->id << 7 | i;
      epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, comm->streams[i].fd, &e);
    }
  }

  std::shared_ptr<Connection> detach(uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = comms_.find(id);
    std::shared_ptr<Connection> comm = found->second;
    comms_.erase(found);
    for (Stream& s : comm->streams) epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, s.fd, nullptr);
    return comm;
  }

 private:
  void run() {
    epoll_event events[64];
    for (;;) {
      int n = epoll_wait(epoll_fd_, events, 64, -1);
      if (n < 0) continue;
      for (int i = 0; i < n; ++i) {
        if (events[i].data.u64 == UINT64_MAX) return;
        uint64_t id = events[i].data.u64 >> 7;
        size_t stream = events[i].data.u64 & 127;
        std::shared_ptr<Connection> comm;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          auto found = comms_.find(id);
          if (found == comms_.end()) continue;
          comm = found->second;
        }
        std::lock_guard<std::mutex> lock(comm->mutex);
        if (stream + 1 == comm->streams.size()) comm->check_control();
        comm->pump();
      }
    }
  }

  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::thread thread_;
  std::mutex mutex_;
  std::unordered_map<uint64_t, std::shared_ptr<Connection>> comms_;
};

// Threads run while connections exist, so that unloading the plugin after its last
// close leaves no thread behind in unmapped code.
class Engine {
 public:
  static Engine& instance() {
    static Engine* engine =
        new Engine();  // never destroyed: comms may outlive static destruction order
    return *engine;
  }

  Connection* attach(std::unique_ptr<Connection> owned) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (workers_.empty())
      for (int i = 0; i < kWorkerThreads; ++i) workers_.push_back(std::make_unique<Worker>());
    std::shared_ptr<Connection> comm(std::move(owned));
    comm->id = ++next_id_;
    Connection* raw = comm.get();
    worker_of(raw->id).attach(comm);
    ++live_;
    return raw;
  }

  void detach(Connection* comm) {
    std::shared_ptr<Connection> held;
    std::lock_guard<std::mutex> lock(mutex_);
    held = worker_of(comm->id).detach(comm->id);
    if (--live_ == 0) workers_.clear();
  }

 private:
  Worker& worker_of(uint64_t id) { return *workers_[id % workers_.size()]; }

  std::mutex mutex_;
  std::vector<std::unique_ptr<Worker>> workers_;
  uint64_t next_id_ = 0;
  int live_ = 0;
};

// ---------------------------------------------------------------------------
// Connection setup

struct PendingSocket {
  int fd;
  Hello hello{};
  size_t read = 0;
};

class ListenComm {
 public:
  ~ListenComm() {
    ::close(fd);
    for (PendingSocket& p : pending) ::close(p.fd);
  }
  int fd = -1;
  std::vector<PendingSocket> pending;  // accepted sockets, hello read or still arriving
};

class ConnectAttempt {
 public:
  ~ConnectAttempt() {
    for (int fd : fds)
      if (fd >= 0) ::close(fd);
  }
  Settings settings;
  std::vector<int> fds;  // data streams, then control
  std::vector<bool> connected;
  std::vector<Hello> hellos;
  std::vector<size_t> hello_written;
  size_t ack_read = 0;
  char ack = 0;
  Clock::time_point deadline;
};

namespace {

uint64_t random_id() {
  static std::mutex mutex;
  static std::mt19937_64 generator{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mutex);
  return generator();
}

Clock::time_point deadline_after(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace

Outcome listen(int device, ConnectHandle* handle, ListenComm** listener, std::string* error) {
  const std::vector<Device>& all = devices();
  if (device < 0 || device >= static_cast<int>(all.size())) {
    *error = "no network device " + std::to_string(device);
    return Outcome::kInvalidArgument;
  }
  const Device& d = all[device];
  int fd = ::socket(d.address.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return system_error(error, errno_text("socket"));
  auto owned = std::make_unique<ListenComm>();
  owned->fd = fd;
  sockaddr_storage address = d.address;
  if (address.ss_family == AF_INET)
    reinterpret_cast<sockaddr_in*>(&address)->sin_port = 0;
  else
    reinterpret_cast<sockaddr_in6*>(&address)->sin6_port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), d.address_length) != 0)
    return system_error(error, errno_text("bind"));
  if (::listen(fd, SOMAXCONN) != 0) return system_error(error, errno_text("listen"));
  socklen_t length = sizeof(address);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0)
    return system_error(error, errno_text("getsockname"));
  std::memset(handle, 0, sizeof(*handle));
  handle->magic = kHandleMagic;
  std::memcpy(&handle->address, &address, std::min<size_t>(length, sizeof(handle->address)));
  *listener = owned.release();
  return Outcome::kOk;
}

Outcome connect(ConnectHandle* handle, Connection** send_comm, std::string* error) {
  *send_comm = nullptr;
  if (handle->magic != kHandleMagic) {
    *error = "not a Bagua-Net handle";
    return Outcome::kInvalidArgument;
  }
  auto* attempt = reinterpret_cast<ConnectAttempt*>(handle->attempt);
  if (attempt == nullptr) {
    auto fresh = std::make_unique<ConnectAttempt>();
    Outcome parsed = Settings::from_environment(&fresh->settings, error);
    if (parsed != Outcome::kOk) return parsed;
    int sockets = fresh->settings.nstreams + 1;
    uint64_t connection = random_id();
    const sockaddr* peer = reinterpret_cast<const sockaddr*>(&handle->address);
    socklen_t peer_length = peer->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    for (int i = 0; i < sockets; ++i) {
      int fd = ::socket(peer->sa_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) return system_error(error, errno_text("socket"));
      fresh->fds.push_back(fd);
      set_nonblocking_nodelay(fd);
      if (::connect(fd, peer, peer_length) != 0 && errno != EINPROGRESS)
        return system_error(error, errno_text("connect"));
      fresh->hellos.push_back(Hello{kHelloMagic, static_cast<uint32_t>(i),
                                    static_cast<uint32_t>(fresh->settings.nstreams), 0,
                                    connection});
    }
    fresh->connected.assign(sockets, false);
    fresh->hello_written.assign(sockets, 0);
    fresh->deadline = deadline_after(fresh->settings.timeout_seconds);
    attempt = fresh.release();
    handle->attempt = reinterpret_cast<uint64_t>(attempt);
  }
  auto give_up = [&](Outcome outcome) {
    delete attempt;
    handle->attempt = 0;
    return outcome;
  };
  size_t sockets = attempt->fds.size();
  bool all_sent = true;
  for (size_t i = 0; i < sockets; ++i) {
    int fd = attempt->fds[i];
    if (!attempt->connected[i]) {
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, 0) != 1) {
        all_sent = false;
        continue;
      }
      int failure = 0;
      socklen_t length = sizeof(failure);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &failure, &length);
      if (failure != 0) {
        *error = std::string("connect: ") + std::strerror(failure);
        return give_up(Outcome::kSystemError);
      }
      attempt->connected[i] = true;
    }
    if (!write_some(fd, &attempt->hellos[i], sizeof(Hello), &attempt->hello_written[i], error))
      return give_up(Outcome::kSystemError);
    if (attempt->hello_written[i] < sizeof(Hello)) all_sent = false;
  }
  // The acceptor answers on the control stream once it holds every stream of this connection.
  if (all_sent && !read_some(attempt->fds.back(), &attempt->ack, 1, &attempt->ack_read, error))
    return give_up(Outcome::kSystemError);
  if (!all_sent || attempt->ack_read == 0) {
    if (Clock::now() > attempt->deadline) {
      *error = "connect: the peer did not accept in time";
      return give_up(Outcome::kSystemError);
    }
    return Outcome::kOk;
  }
  const Settings& settings = attempt->settings;
  if (settings.dynamic) {
    // Room for the chunk being sent and one behind it, so a stream does not idle when
    // the epoll thread is late, while a slow stream still holds little unsent data.
    int lowat = static_cast<int>(2 * settings.chunk_bytes);
    for (size_t i = 0; i + 1 < sockets; ++i)
      setsockopt(attempt->fds[i], IPPROTO_TCP, TCP_NOTSENT_LOWAT, &lowat, sizeof(lowat));
  }
  auto comm = std::make_unique<Connection>(true, settings, settings.nstreams);
  for (size_t i = 0; i < sockets; ++i) {
    comm->streams[i].fd = attempt->fds[i];
    attempt->fds[i] = -1;
  }
  give_up(Outcome::kOk);
  *send_comm = Engine::instance().attach(std::move(comm));
  return Outcome::kOk;
}

Outcome accept(ListenComm* listener, Connection** recv_comm, std::string* error) {
  *recv_comm = nullptr;
  for (;;) {
    int fd = ::accept4(listener->fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) break;
      return system_error(error, errno_text("accept"));
    }
    set_nonblocking_nodelay(fd);
    listener->pending.push_back(PendingSocket{fd});
  }
  auto& pending = listener->pending;
  for (size_t i = 0; i < pending.size();) {
    PendingSocket& p = pending[i];
    std::string failure;
    bool alive = read_some(p.fd, &p.hello, sizeof(Hello), &p.read, &failure);
    bool complete = p.read == sizeof(Hello);
    bool valid =
        !complete || (p.hello.magic == kHelloMagic && p.hello.nstreams >= 1 &&
                      p.hello.nstreams <= kMaxStreams && p.hello.stream <= p.hello.nstreams);
    if (!alive || !valid) {  // a stray or broken connection: drop it, keep listening
      ::close(p.fd);
      pending.erase(pending.begin() + static_cast<long>(i));
      continue;
    }
    ++i;
  }
  for (const PendingSocket& first : pending) {
    if (first.read < sizeof(Hello)) continue;
    uint64_t connection = first.hello.connection;
    int nstreams = static_cast<int>(first.hello.nstreams);
    std::vector<int> fds(nstreams + 1, -1);
    int found = 0;
    for (const PendingSocket& p : pending) {
      if (p.read == sizeof(Hello) && p.hello.connection == connection &&
          p.hello.stream < fds.size() && fds[p.hello.stream] < 0) {
        fds[p.hello.stream] = p.fd;
        ++found;
      }
    }
    if (found < nstreams + 1) continue;
    char ack = 1;
    size_t written = 0;
    if (!write_some(fds.back(), &ack, 1, &written, error) || written != 1) {
      if (error->empty()) *error = "accept: could not acknowledge the connection";
      return Outcome::kSystemError;
    }
    Settings settings;
    Outcome parsed = Settings::from_environment(&settings, error);
    if (parsed != Outcome::kOk) return parsed;
    auto comm = std::make_unique<Connection>(false, settings, nstreams);
    for (int i = 0; i <= nstreams; ++i) comm->streams[i].fd = fds[i];
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [&](const PendingSocket& p) {
                                   return std::find(fds.begin(), fds.end(), p.fd) != fds.end();
                                 }),
                  pending.end());
    *recv_comm = Engine::instance().attach(std::move(comm));
    return Outcome::kOk;
  }
  return Outcome::kOk;
}

// ---------------------------------------------------------------------------
// Data

namespace {

// Any free slot: requests may be tested in any order, so a slot frees whenever its own
// request is collected, and up to kRequestSlots are in flight whatever the order.
Request* claim_slot(Connection* comm, void* data, size_t size) {
  Request* free_slot = nullptr;
  for (Request& candidate : comm->slots)
    if (!candidate.in_use) {
      free_slot = &candidate;
      break;
    }
  if (free_slot == nullptr) return nullptr;
  Request& r = *free_slot;
  Request fresh;
  fresh.comm = comm;
  fresh.in_use = true;
  fresh.sequence = comm->next_sequence++;
  fresh.data = static_cast<char*>(data);
  fresh.size = size;
  fresh.deadline = deadline_after(comm->settings.timeout_seconds);
  r = fresh;
  return &r;
}

}  // namespace

Outcome isend(Connection* comm, const void* data, size_t size, Request** request,
              std::string* error) {
  std::lock_guard<std::mutex> lock(comm->mutex);
  *request = nullptr;
  if (!comm->error.empty()) return system_error(error, comm->error);
  Request* r = claim_slot(comm, const_cast<void*>(data), size);
  if (r == nullptr) return Outcome::kOk;
  r->total = size;
  r->total_known = true;
  int n = comm->data_streams();
  if (comm->settings.dynamic) {
    // Every message, 0 bytes too, waits its turn here: chunks reach each stream in posting
    // order, so a receiver that has not yet posted a later message never holds up an earlier one.
    comm->uncut.push_back(r);
  } else {
    // NCCL's socket transport: equal pieces, one per stream, at least 64 KiB each.
    size_t piece = std::min<size_t>(std::max<size_t>(64 << 10, (size + n - 1) / n), 1 << 30);
    do {
      size_t length = std::min(piece, size - r->cut);
      Chunk c{r,
              ChunkHeader{r->sequence, r->cut, size, static_cast<uint32_t>(length), kChunkMagic}};
      r->cut += length;
      comm->streams[comm->next_stream++ % n].queue.push_back(c);
    } while (r->cut < size);
  }
  comm->pump();
  *request = r;
  return Outcome::kOk;
}

Outcome irecv(Connection* comm, void* data, size_t size, Request** request, std::string* error) {
  std::lock_guard<std::mutex> lock(comm->mutex);
  *request = nullptr;
  if (!comm->error.empty()) return system_error(error, comm->error);
  Request* r = claim_slot(comm, data, size);
  if (r == nullptr) return Outcome::kOk;
  comm->pump();
  *request = r;
  return Outcome::kOk;
}

Outcome test(Request* request, int* done, size_t* size, std::string* error) {
  Connection* comm = request->comm;
  std::lock_guard<std::mutex> lock(comm->mutex);
  *done = 0;
  if (!request->in_use) {
    *error = "test of a request that is not in flight";
    return Outcome::kInvalidUsage;
  }
  if (request->done) {
    *done = 1;
    *size = request->total;
    request->in_use = false;
    return Outcome::kOk;
  }
  std::string failure = comm->error;
  if (failure.empty() && Clock::now() > request->deadline)
    failure = "no completion within BAGUA_NET_TIMEOUT=" +
              std::to_string(std::lround(comm->settings.timeout_seconds)) + " s";
  if (failure.empty()) return Outcome::kOk;
  request->in_use = false;
  comm->error = failure;
  *error = (comm->sending ? "send: " : "receive: ") + failure;
  return Outcome::kSystemError;
}

void close_listener(ListenComm* listener) { delete listener; }

void close_connection(Connection* comm) {
  if (comm != nullptr) Engine::instance().detach(comm);
}

}  // namespace bagua_net
