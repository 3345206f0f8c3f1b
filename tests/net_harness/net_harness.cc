// Drives a NCCL net plugin the way NCCL's proxy thread does: dlopen, init, listen,
// the handle passed to the peer process over a pipe, connect/accept polled until
// they return a comm, regMr of host memory, isend/irecv/test, close, finalize.
// Usage: net_harness SCENARIO PLUGIN.so [ARGS]; prints "ok" and exits 0 on success.
#include <dlfcn.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "nccl_net_abi.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

[[noreturn]] void fail(const char* format, ...) {
  char text[512];
  va_list args;
  va_start(args, format);
  vsnprintf(text, sizeof(text), format, args);
  va_end(args);
  throw std::runtime_error(text);
}

void expect(bool condition, const char* what) {
  if (!condition) fail("expected: %s", what);
}

void log_to_stderr(NcclLogLevel level, unsigned long, const char*, int, const char* format, ...) {
  if (level > kNcclLogWarn) return;
  va_list args;
  va_start(args, format);
  std::fprintf(stderr, "[pid %d] plugin: ", static_cast<int>(getpid()));
  std::vfprintf(stderr, format, args);
  std::fputc('\n', stderr);
  va_end(args);
}

// One plugin version's function table behind a version-neutral face.
class Net {
 public:
  Net(void* library, int version) : version_(version) {
    std::string symbol = "ncclNetPlugin_v" + std::to_string(version);
    table_ = dlsym(library, symbol.c_str());
    if (table_ == nullptr) fail("%s is not exported", symbol.c_str());
  }

  int version() const { return version_; }

  template <typename F>
  auto call(F&& f) {
    switch (version_) {
      case 8:
        return f(static_cast<NcclNet_v8*>(table_));
      case 9:
        return f(static_cast<NcclNet_v9*>(table_));
      case 10:
        return f(static_cast<NcclNet_v10*>(table_));
      case 11:
        return f(static_cast<NcclNet_v11*>(table_));
      default:
        return f(static_cast<NcclNet_v12*>(table_));
    }
  }

  const char* name() {
    return call([](auto* t) { return t->name; });
  }

  void init() {
    NcclResult r;
    if (version_ >= 11) {
      r = version_ == 11
              ? static_cast<NcclNet_v11*>(table_)->init(&ctx_, 1, nullptr, log_to_stderr, nullptr)
              : static_cast<NcclNet_v12*>(table_)->init(&ctx_, 1, nullptr, log_to_stderr, nullptr);
    } else if (version_ == 10) {
      r = static_cast<NcclNet_v10*>(table_)->init(log_to_stderr, nullptr);
    } else {
      r = call([](auto* t) {
        if constexpr (std::is_same_v<decltype(t->init), NcclResult (*)(NcclLogger)>)
          return t->init(log_to_stderr);
        return kNcclInternalError;
      });
    }
    if (r != kNcclSuccess) fail("init failed: %d", r);
  }

  void finalize() {
    if (version_ == 11) check(static_cast<NcclNet_v11*>(table_)->finalize(ctx_), "finalize");
    if (version_ == 12) check(static_cast<NcclNet_v12*>(table_)->finalize(ctx_), "finalize");
  }

  int devices() {
    int n = 0;
    check(call([&](auto* t) { return t->devices(&n); }), "devices");
    return n;
  }

  // Properties every version has, read through that version's struct.
  struct Common {
    std::string name;
    int ptr_support, max_recvs, speed, max_comms;
  };
  Common properties(int dev) {
    return call([&](auto* t) {
      std::remove_pointer_t<typename FirstArg<decltype(t->getProperties)>::type> props{};
      check(t->getProperties(dev, &props), "getProperties");
      return Common{props.identity.name ? props.identity.name : "", props.identity.ptr_support,
                    props.capacity.max_recvs, props.capacity.speed_mbps, props.capacity.max_comms};
    });
  }

  void* listen(char* handle) {
    void* comm = nullptr;
    NcclResult r;
    if (version_ >= 11)
      r = call([&](auto* t) {
        if constexpr (std::is_same_v<decltype(t->listen),
                                     NcclResult (*)(void*, int, void*, void**)>)
          return t->listen(ctx_, 0, handle, &comm);
        return kNcclInternalError;
      });
    else
      r = call([&](auto* t) {
        if constexpr (std::is_same_v<decltype(t->listen), NcclResult (*)(int, void*, void**)>)
          return t->listen(0, handle, &comm);
        return kNcclInternalError;
      });
    check(r, "listen");
    return comm;
  }

  NcclResult connect(char* handle, void** comm) {
    NcclNetDeviceHandle* device = nullptr;
    switch (version_) {
      case 8:
        return static_cast<NcclNet_v8*>(table_)->connect(0, handle, comm, &device);
      case 9:
        return static_cast<NcclNet_v9*>(table_)->connect(0, handle, comm, &device);
      case 10: {
        NcclNetCommConfig config{-1};
        return static_cast<NcclNet_v10*>(table_)->connect(0, &config, handle, comm, &device);
      }
      case 11:
        return static_cast<NcclNet_v11*>(table_)->connect(ctx_, 0, handle, comm, &device);
      default:
        return static_cast<NcclNet_v12*>(table_)->connect(ctx_, 0, handle, comm, &device);
    }
  }

  NcclResult accept(void* listener, void** comm) {
    NcclNetDeviceHandle* device = nullptr;
    return call([&](auto* t) { return t->accept(listener, comm, &device); });
  }

  void* reg_mr(void* comm, void* data, size_t size) {
    void* mhandle = nullptr;
    check(call([&](auto* t) { return t->regMr(comm, data, size, kNcclPtrHost, &mhandle); }),
          "regMr");
    return mhandle;
  }

  void dereg_mr(void* comm, void* mhandle) {
    check(call([&](auto* t) { return t->deregMr(comm, mhandle); }), "deregMr");
  }

  NcclResult isend(void* comm, void* data, size_t size, void* mhandle, void** request) {
    switch (version_) {
      case 8:
        return static_cast<NcclNet_v8*>(table_)->isend(comm, data, static_cast<int>(size), 0,
                                                       mhandle, request);
      case 9:
        return static_cast<NcclNet_v9*>(table_)->isend(comm, data, size, 0, mhandle, request);
      case 10:
        return static_cast<NcclNet_v10*>(table_)->isend(comm, data, size, 0, mhandle, nullptr,
                                                        request);
      case 11:
        return static_cast<NcclNet_v11*>(table_)->isend(comm, data, size, 0, mhandle, nullptr,
                                                        request);
      default:
        return static_cast<NcclNet_v12*>(table_)->isend(comm, data, size, 0, mhandle, nullptr,
                                                        request);
    }
  }

  NcclResult irecv(void* comm, void* data, size_t size, void* mhandle, void** request) {
    int tag = 0;
    if (version_ == 8) {
      int size_int = static_cast<int>(size);
      return static_cast<NcclNet_v8*>(table_)->irecv(comm, 1, &data, &size_int, &tag, &mhandle,
                                                     request);
    }
    if (version_ == 9)
      return static_cast<NcclNet_v9*>(table_)->irecv(comm, 1, &data, &size, &tag, &mhandle,
                                                     request);
    void* phandle = nullptr;
    switch (version_) {
      case 10:
        return static_cast<NcclNet_v10*>(table_)->irecv(comm, 1, &data, &size, &tag, &mhandle,
                                                        &phandle, request);
      case 11:
        return static_cast<NcclNet_v11*>(table_)->irecv(comm, 1, &data, &size, &tag, &mhandle,
                                                        &phandle, request);
      default:
        return static_cast<NcclNet_v12*>(table_)->irecv(comm, 1, &data, &size, &tag, &mhandle,
                                                        &phandle, request);
    }
  }

  NcclResult test(void* request, int* done, int* size) {
    return call([&](auto* t) { return t->test(request, done, size); });
  }

  void close_send(void* comm) {
    check(call([&](auto* t) { return t->closeSend(comm); }), "closeSend");
  }
  void close_recv(void* comm) {
    check(call([&](auto* t) { return t->closeRecv(comm); }), "closeRecv");
  }
  void close_listen(void* comm) {
    check(call([&](auto* t) { return t->closeListen(comm); }), "closeListen");
  }

  static void check(NcclResult r, const char* what) {
    if (r != kNcclSuccess) fail("%s returned %d", what, r);
  }

 private:
  template <typename T>
  struct FirstArg;
  template <typename P>
  struct FirstArg<NcclResult (*)(int, P)> {
    using type = P;
  };

  void* table_;
  int version_;
  void* ctx_ = nullptr;
};

void* open_plugin(const char* path) {
  void* library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) fail("dlopen: %s", dlerror());
  return library;
}

// ---------------------------------------------------------------------------
// Two processes joined by pipes

class Pipe {
 public:
  Pipe() {
    if (pipe(fds_) != 0) fail("pipe");
  }
  void keep_read_end() {
    ::close(fds_[1]);
    fds_[1] = -1;
  }
  void keep_write_end() {
    ::close(fds_[0]);
    fds_[0] = -1;
  }

  void write_all(const void* data, size_t size) {
    const char* p = static_cast<const char*>(data);
    while (size > 0) {
      ssize_t n = ::write(fds_[1], p, size);
      if (n <= 0) fail("pipe write");
      p += n;
      size -= static_cast<size_t>(n);
    }
  }
  void read_all(void* data, size_t size, double timeout_s = 30) {
    char* p = static_cast<char*>(data);
    while (size > 0) {
      pollfd pfd{fds_[0], POLLIN, 0};
      if (::poll(&pfd, 1, static_cast<int>(timeout_s * 1000)) != 1)
        fail("the peer did not answer in time");
      ssize_t n = ::read(fds_[0], p, size);
      if (n <= 0) fail("the peer exited");
      p += n;
      size -= static_cast<size_t>(n);
    }
  }
  void signal(char c) { write_all(&c, 1); }
  void wait_for(char c) {
    char got = 0;
    read_all(&got, 1);
    if (got != c) fail("expected signal %c, got %c", c, got);
  }

 private:
  int fds_[2];
};

struct Peer {
  pid_t pid;
  Pipe to_child, to_parent;
};

// Runs `child` in a forked process (before any plugin thread exists); the parent
// talks to it through `peer`. The child's failures are its exit status.
void start_child(Peer* peer, const std::function<void(Pipe& in, Pipe& out)>& child) {
  std::fflush(nullptr);
  peer->pid = fork();
  if (peer->pid < 0) fail("fork");
  if (peer->pid == 0) {
    peer->to_child.keep_read_end();
    peer->to_parent.keep_write_end();
    int status = 0;
    try {
      child(peer->to_child, peer->to_parent);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
      status = 1;
    }
    std::fflush(nullptr);
    _exit(status);
  }
  peer->to_child.keep_write_end();
  peer->to_parent.keep_read_end();
}

void wait_child(Peer* peer) {
  int status = 0;
  if (waitpid(peer->pid, &status, 0) != peer->pid) fail("waitpid");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    fail("the child process failed (status %d)", status);
}

// Calls `attempt(&comm)` until it yields a communicator; `what` names the call.
template <typename Attempt>
void* poll_comm(const char* what, double timeout_s, Attempt&& attempt) {
  void* comm = nullptr;
  Clock::time_point start = Clock::now();
  while (comm == nullptr) {
    Net::check(attempt(&comm), what);
    if (seconds_since(start) > timeout_s) fail("%s did not complete", what);
  }
  return comm;
}

// Listens and publishes the handle, then polls accept; the peer connects.
void* accept_from(Net& net, Pipe& out, double timeout_s = 20) {
  char handle[kNcclNetHandleMaxSize] = {};
  void* listener = net.listen(handle);
  out.write_all(handle, sizeof(handle));
  void* comm =
      poll_comm("accept", timeout_s, [&](void** comm) { return net.accept(listener, comm); });
  net.close_listen(listener);
  return comm;
}

void* connect_to(Net& net, Pipe& in, double timeout_s = 20) {
  char handle[kNcclNetHandleMaxSize];
  in.read_all(handle, sizeof(handle));
  return poll_comm("connect", timeout_s, [&](void** comm) { return net.connect(handle, comm); });
}

// ---------------------------------------------------------------------------
// Payloads both sides can generate and check independently

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

void fill(std::vector<char>& buffer, size_t size, uint64_t message) {
  uint64_t state = mix(message);
  for (size_t i = 0; i < size; i += 8) {
    state = mix(state);
    std::memcpy(buffer.data() + i, &state, std::min<size_t>(8, size - i));
  }
}

uint64_t checksum(const char* data, size_t size) {
  uint64_t h = 1469598103934665603ULL;
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    uint64_t word;
    std::memcpy(&word, data + i, 8);
    h = (h ^ word) * 1099511628211ULL;
  }
  for (; i < size; ++i) h = (h ^ static_cast<unsigned char>(data[i])) * 1099511628211ULL;
  return h ^ size;
}

uint64_t expected_checksum(size_t size, uint64_t message) {
  std::vector<char> reference(size + 8);
  fill(reference, size, message);
  return checksum(reference.data(), size);
}

// Tests until done; returns the reported size.
int wait_done(Net& net, void* request, double timeout_s = 20) {
  Clock::time_point start = Clock::now();
  for (;;) {
    int done = 0, size = -1;
    Net::check(net.test(request, &done, &size), "test");
    if (done) return size;
    if (seconds_since(start) > timeout_s) fail("request did not complete in %.0f s", timeout_s);
  }
}

// Moves one message through `comm` in a registered buffer of `posted` bytes (plus 8
// spare): posts with `post` until the plugin accepts the request, waits for it and
// checks the size it reports. `what` is "send" or "receive".
template <typename Post>
void transfer(Net& net, void* comm, const char* what, std::vector<char>& data, size_t size,
              Post&& post) {
  void* mhandle = net.reg_mr(comm, data.data(), data.size());
  void* request = nullptr;
  while (request == nullptr) post(mhandle, &request);
  int reported = wait_done(net, request);
  if (static_cast<size_t>(reported) != size)
    fail("%s reported %d bytes, expected %zu", what, reported, size);
  net.dereg_mr(comm, mhandle);
}

void send_message(Net& net, void* comm, size_t size, uint64_t message) {
  std::vector<char> data(size + 8);
  fill(data, size, message);
  transfer(net, comm, "send", data, size, [&](void* mhandle, void** request) {
    Net::check(net.isend(comm, data.data(), size, mhandle, request), "isend");
  });
}

void receive_message(Net& net, void* comm, size_t posted, size_t size, uint64_t message) {
  std::vector<char> data(posted + 8);
  transfer(net, comm, "receive", data, size, [&](void* mhandle, void** request) {
    Net::check(net.irecv(comm, data.data(), posted, mhandle, request), "irecv");
  });
  if (checksum(data.data(), size) != expected_checksum(size, message))
    fail("message %llu corrupted", (unsigned long long)message);
}

// ---------------------------------------------------------------------------
// Scenarios

// Every exported version resolves, names itself, reports host-only properties and moves data.
void scenario_symbols(const char* path) {
  void* library = open_plugin(path);
  for (int version = 8; version <= 12; ++version) {
    Net net(library, version);
    if (std::strcmp(net.name(), "Bagua") != 0) fail("v%d is named %s", version, net.name());
    net.init();
    int n = net.devices();
    if (n < 1) fail("v%d reports no devices", version);
    Net::Common p = net.properties(0);
    if (p.ptr_support != kNcclPtrHost || p.max_recvs != 1 || p.speed <= 0 || p.max_comms < 1 ||
        p.name.empty())
      fail("v%d properties: ptrSupport=%d maxRecvs=%d speed=%d", version, p.ptr_support,
           p.max_recvs, p.speed);
    bool no_vnic = net.call([](auto* t) {
      if constexpr (std::is_same_v<decltype(t), NcclNet_v8*>)
        return true;
      else
        return t->makeVDevice == nullptr;
    });
    if (!no_vnic) fail("v%d offers makeVDevice, which would let NCCL try to fuse NICs", version);
    std::printf("v%d name=%s devices=%d dev0=%s speed=%d\n", version, net.name(), n, p.name.c_str(),
                p.speed);
    net.finalize();
  }
  if (dlsym(library, "ncclNetPlugin_v7") != nullptr) fail("v7 is exported but not implemented");
  for (int version = 8; version <= 12; ++version) {
    Peer peer;
    start_child(&peer, [&](Pipe& in, Pipe&) {
      Net net(open_plugin(path), version);
      net.init();
      void* comm = connect_to(net, in);
      send_message(net, comm, 3 << 20, 1);
      send_message(net, comm, 0, 2);
      net.close_send(comm);
      net.finalize();
    });
    Net net(library, version);
    net.init();
    void* comm = accept_from(net, peer.to_child);
    receive_message(net, comm, 4 << 20, 3 << 20, 1);
    receive_message(net, comm, 16, 0, 2);
    net.close_recv(comm);
    net.finalize();
    wait_child(&peer);
  }
}

// connect and accept must not block. Each call is timed against 5 ms; on a loaded
// machine the scheduler alone can exceed that now and then, so a few slow calls are
// tolerated, but not a slow majority nor any call long enough to be a blocking wait.
class CallTimer {
 public:
  explicit CallTimer(const char* what) : what_(what) {}
  ~CallTimer() noexcept(false) {
    if (calls_ > 0 && slow_ * 10 > calls_)
      fail("%s: %d of %d calls took over 5 ms", what_, slow_, calls_);
  }
  void record(Clock::time_point start) {
    double ms = seconds_since(start) * 1e3;
    ++calls_;
    if (ms > 5.0) ++slow_;
    if (ms > 250.0) fail("%s blocked for %.0f ms", what_, ms);
  }

 private:
  const char* what_;
  int calls_ = 0, slow_ = 0;
};

// Posts `count` messages on each comm at once, then completes them all.
// Posts `count` messages on each comm at once, completes all but each comm's first (tests
// may come in any order), posts one more per comm in the freed room, then completes the rest.
void many_in_flight(Net& net, const std::vector<void*>& comms, bool sending, int count) {
  struct Posted {
    std::vector<char> buffer;
    void* request;
    size_t size;
    uint64_t message;
  };
  std::vector<Posted> posted;
  constexpr size_t kPosted = 256 << 10;
  auto post = [&](size_t c, int i) {
    size_t size = (static_cast<size_t>(i) * 7919 + c * 104729) % kPosted;
    Posted p{std::vector<char>(kPosted + 8), nullptr, size,
             1000 + c * 100 + static_cast<uint64_t>(i)};
    if (sending) fill(p.buffer, size, p.message);
    Net::check(sending ? net.isend(comms[c], p.buffer.data(), size, nullptr, &p.request)
                       : net.irecv(comms[c], p.buffer.data(), kPosted, nullptr, &p.request),
               "post");
    if (p.request == nullptr) fail("request %d on comm %zu was refused", i, c);
    posted.push_back(std::move(p));
  };
  auto complete = [&](Posted& p) {
    int size = wait_done(net, p.request);
    if (static_cast<size_t>(size) != p.size)
      fail("message %llu reported %d bytes, expected %zu", (unsigned long long)p.message, size,
           p.size);
    if (!sending && checksum(p.buffer.data(), p.size) != expected_checksum(p.size, p.message))
      fail("message %llu arrived out of order or corrupted", (unsigned long long)p.message);
  };
  for (size_t c = 0; c < comms.size(); ++c) {
    for (int i = 0; i < count; ++i) post(c, i);
    // The comm is full: one more is refused, not queued or failed.
    std::vector<char> extra(16);
    void* request = nullptr;
    Net::check(sending ? net.isend(comms[c], extra.data(), 1, nullptr, &request)
                       : net.irecv(comms[c], extra.data(), 16, nullptr, &request),
               "post beyond the limit");
    if (request != nullptr) fail("request %d on a full comm was accepted", count + 1);
  }
  for (size_t k = 0; k < posted.size(); ++k)
    if (k % count != 0) complete(posted[k]);
  size_t first_extra = posted.size();
  for (size_t c = 0; c < comms.size(); ++c) post(c, count);
  for (size_t k = 0; k < first_extra; k += count) complete(posted[k]);
  for (size_t k = first_extra; k < posted.size(); ++k) complete(posted[k]);
}

void scenario_contract(const char* path) {
  Peer peer;
  start_child(&peer, [&](Pipe& in, Pipe& out) {
    Net net(open_plugin(path), 12);
    net.init();
    char handle[kNcclNetHandleMaxSize];
    in.read_all(handle, sizeof(handle));
    void* comm = nullptr;
    // The peer has not accepted yet: connect must return promptly and without a comm.
    {
      CallTimer timer("connect");
      Clock::time_point polling = Clock::now();
      while (seconds_since(polling) < 0.1) {
        Clock::time_point start = Clock::now();
        Net::check(net.connect(handle, &comm), "connect");
        timer.record(start);
        if (comm != nullptr) fail("connect returned a comm before the peer accepted");
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      out.signal('c');
      polling = Clock::now();
      while (comm == nullptr) {
        Clock::time_point start = Clock::now();
        Net::check(net.connect(handle, &comm), "connect");
        timer.record(start);
        if (seconds_since(polling) > 10) fail("connect never completed");
      }
    }
    // An isend posted before the matching irecv.
    std::vector<char> early(1 << 20);
    fill(early, early.size(), 7);
    void* request = nullptr;
    Net::check(net.isend(comm, early.data(), early.size(), nullptr, &request), "isend");
    expect(request != nullptr, "an isend slot");
    out.signal('s');
    wait_done(net, request);
    // A 0-byte message right behind a large one that is still being cut into chunks; the
    // receiver posts its receive only once the large one completed.
    std::vector<char> large((16 << 20) + 8);
    fill(large, 16 << 20, 9);
    void* large_request = nullptr;
    void* empty_request = nullptr;
    Net::check(net.isend(comm, large.data(), 16 << 20, nullptr, &large_request), "isend");
    Net::check(net.isend(comm, large.data(), 0, nullptr, &empty_request), "isend");
    wait_done(net, large_request);
    wait_done(net, empty_request);
    send_message(net, comm, 1000, 8);  // into a larger receive
    for (size_t i = 0; i < 6; ++i) send_message(net, comm, i % 2 ? 0 : 70000 * i, 20 + i);
    char second_handle[kNcclNetHandleMaxSize];
    in.read_all(second_handle, sizeof(second_handle));
    void* second = nullptr;
    while (second == nullptr) Net::check(net.connect(second_handle, &second), "connect");
    in.wait_for('r');
    many_in_flight(net, {comm, second}, true, kNcclNetMaxRequests);
    net.close_send(comm);
    net.close_send(second);
    net.finalize();
  });
  Net net(open_plugin(path), 12);
  net.init();
  char handle[kNcclNetHandleMaxSize] = {};
  void* listener = net.listen(handle);
  void* comm = nullptr;
  {
    CallTimer timer("accept");
    for (int i = 0; i < 20; ++i) {
      Clock::time_point start = Clock::now();
      Net::check(net.accept(listener, &comm), "accept");
      timer.record(start);
      if (comm != nullptr) fail("accept returned a comm before anyone connected");
    }
    peer.to_child.write_all(handle, sizeof(handle));
    peer.to_parent.wait_for('c');
    Clock::time_point polling = Clock::now();
    while (comm == nullptr) {
      Clock::time_point start = Clock::now();
      Net::check(net.accept(listener, &comm), "accept");
      timer.record(start);
      if (seconds_since(polling) > 10) fail("accept never completed");
    }
  }
  net.close_listen(listener);
  peer.to_parent.wait_for('s');
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  receive_message(net, comm, 1 << 20, 1 << 20, 7);
  receive_message(net, comm, 16 << 20, 16 << 20, 9);
  receive_message(net, comm, 16, 0, 10);
  receive_message(net, comm, 4 << 20, 1000, 8);
  for (size_t i = 0; i < 6; ++i) receive_message(net, comm, 400000, i % 2 ? 0 : 70000 * i, 20 + i);
  void* second = accept_from(net, peer.to_child);
  peer.to_child.signal('r');
  many_in_flight(net, {comm, second}, false, kNcclNetMaxRequests);
  net.close_recv(comm);
  net.close_recv(second);
  net.finalize();
  wait_child(&peer);
}

// Random sizes (0 to 2^max_log bytes) in random interleavings of posts and tests.
void scenario_fuzz(const char* path, uint64_t seed, int messages, int max_log) {
  std::mt19937_64 plan(seed);
  std::vector<size_t> sizes(messages), posted(messages);
  for (int i = 0; i < messages; ++i) {
    std::uniform_real_distribution<double> log_size(0, max_log);
    sizes[i] = plan() % 8 == 0 ? 0 : static_cast<size_t>(std::exp2(log_size(plan)));
    posted[i] = plan() % 3 == 0 ? sizes[i] + plan() % 4096 : sizes[i];
  }
  auto run = [&](Net& net, void* comm, bool sending, uint64_t interleaving) {
    std::mt19937_64 choice(interleaving);
    struct Pending {
      std::vector<char> buffer;
      void* request;
      int index;
    };
    std::vector<Pending> pending;
    size_t bytes_in_flight = 0;
    int next = 0, completed = 0;
    Clock::time_point start = Clock::now();
    while (completed < messages) {
      if (seconds_since(start) > 60)
        fail("fuzz stalled after %d of %d messages", completed, messages);
      bool can_post = next < messages && pending.size() < 8 && bytes_in_flight < (160u << 20);
      if (can_post && (pending.empty() || choice() % 2 == 0)) {
        Pending p{std::vector<char>(posted[next] + 8), nullptr, next};
        if (sending) fill(p.buffer, sizes[next], static_cast<uint64_t>(next));
        NcclResult r = sending
                           ? net.isend(comm, p.buffer.data(), sizes[next], nullptr, &p.request)
                           : net.irecv(comm, p.buffer.data(), posted[next], nullptr, &p.request);
        Net::check(r, "post");
        if (p.request == nullptr) fail("post %d refused", next);
        bytes_in_flight += posted[next];
        pending.push_back(std::move(p));
        ++next;
        continue;
      }
      size_t k = choice() % pending.size();
      int done = 0, size = -1;
      Net::check(net.test(pending[k].request, &done, &size), "test");
      if (!done) continue;
      int i = pending[k].index;
      if (static_cast<size_t>(size) != sizes[i])
        fail("message %d: reported %d bytes, sent %zu", i, size, sizes[i]);
      if (!sending &&
          checksum(pending[k].buffer.data(), sizes[i]) != expected_checksum(sizes[i], i))
        fail("message %d (%zu bytes) corrupted", i, sizes[i]);
      bytes_in_flight -= posted[i];
      pending.erase(pending.begin() + static_cast<long>(k));
      ++completed;
    }
  };
  Peer peer;
  start_child(&peer, [&](Pipe& in, Pipe&) {
    Net net(open_plugin(path), 12);
    net.init();
    void* comm = connect_to(net, in);
    run(net, comm, true, seed * 3 + 1);
    net.close_send(comm);
    net.finalize();
  });
  Net net(open_plugin(path), 12);
  net.init();
  void* comm = accept_from(net, peer.to_child);
  run(net, comm, false, seed * 5 + 2);
  net.close_recv(comm);
  net.finalize();
  wait_child(&peer);
  size_t total = 0;
  for (size_t s : sizes) total += s;
  std::printf("fuzz: %d messages, %zu bytes\n", messages, total);
}

// Streams 4 MiB messages until the test fails; returns how many completed.
int stream_until_failure(Net& net, void* comm, bool sending, Pipe* progress, double* failed_after) {
  std::vector<char> buffer((4 << 20) + 8);
  int completed = 0;
  Clock::time_point last = Clock::now();
  for (;;) {
    void* request = nullptr;
    NcclResult r = sending ? net.isend(comm, buffer.data(), 4 << 20, nullptr, &request)
                           : net.irecv(comm, buffer.data(), 4 << 20, nullptr, &request);
    if (r != kNcclSuccess) break;
    if (request == nullptr) continue;
    int done = 0, size = 0;
    while (!done && (r = net.test(request, &done, &size)) == kNcclSuccess) {
      if (seconds_since(last) > 60) fail("neither completion nor failure after 60 s");
    }
    if (r != kNcclSuccess) break;
    ++completed;
    last = Clock::now();
    if (progress != nullptr && completed == 20) progress->signal('p');
  }
  *failed_after = seconds_since(last);
  return completed;
}

// The peer is killed (or stopped) mid-transfer: test must fail, within `limit_s`.
void scenario_peer_lost(const char* path, const std::string& how, double limit_s) {
  bool child_sends = how == "sender-killed";
  Peer peer;
  start_child(&peer, [&](Pipe& in, Pipe& out) {
    Net net(open_plugin(path), 12);
    net.init();
    void* comm = child_sends ? connect_to(net, in) : accept_from(net, out);
    if (how == "receiver-stopped") {
      receive_message(net, comm, 4 << 20, 4 << 20, 0);
      out.signal('p');
      pause();
    }
    double unused;
    stream_until_failure(net, comm, child_sends, &out, &unused);
    pause();
  });
  Net net(open_plugin(path), 12);
  net.init();
  void* comm = child_sends ? accept_from(net, peer.to_child) : connect_to(net, peer.to_parent);
  if (how == "receiver-stopped") send_message(net, comm, 4 << 20, 0);
  std::thread killer([&] {
    peer.to_parent.wait_for('p');
    if (how == "receiver-stopped")
      kill(peer.pid, SIGSTOP);
    else
      kill(peer.pid, SIGKILL);
  });
  double failed_after = 0;
  int completed = 0;
  try {
    completed = stream_until_failure(net, comm, !child_sends, nullptr, &failed_after);
  } catch (...) {
    kill(peer.pid, SIGKILL);
    killer.join();
    throw;
  }
  killer.join();
  kill(peer.pid, SIGKILL);
  waitpid(peer.pid, nullptr, 0);
  std::printf("%s: test failed %.2f s after the last completion (%d completed)\n", how.c_str(),
              failed_after, completed);
  if (failed_after > limit_s) fail("the failure took %.1f s, limit %.1f s", failed_after, limit_s);
  // A receiver stopped at once may leave the socket buffers too little room for one more 4 MiB
  // message; the message sent before the stream began already showed the connection worked.
  int needed = child_sends ? 20 : how == "receiver-killed" ? 1 : 0;
  if (completed < needed) fail("only %d messages before the failure", completed);
  if (child_sends)
    net.close_recv(comm);
  else
    net.close_send(comm);
  net.finalize();
}

// A message larger than its receive is an error from test, and nothing is written past the buffer.
void scenario_truncation(const char* path) {
  Peer peer;
  start_child(&peer, [&](Pipe& in, Pipe&) {
    Net net(open_plugin(path), 12);
    net.init();
    void* comm = connect_to(net, in);
    std::vector<char> data(2 << 20);
    void* request = nullptr;
    Net::check(net.isend(comm, data.data(), data.size(), nullptr, &request), "isend");
    int done = 0, size = 0;
    while (!done && net.test(request, &done, &size) == kNcclSuccess) {
    }
    net.close_send(comm);
    net.finalize();
  });
  Net net(open_plugin(path), 12);
  net.init();
  void* comm = accept_from(net, peer.to_child);
  std::vector<char> buffer(1 << 20);
  void* request = nullptr;
  Net::check(net.irecv(comm, buffer.data(), buffer.size(), nullptr, &request), "irecv");
  Clock::time_point start = Clock::now();
  int done = 0, size = 0;
  NcclResult r;
  while ((r = net.test(request, &done, &size)) == kNcclSuccess && !done) {
    if (seconds_since(start) > 20) fail("neither completion nor failure");
  }
  if (r == kNcclSuccess)
    fail("a 2 MiB message completed a 1 MiB receive (reported %d bytes)", size);
  net.close_recv(comm);
  net.finalize();
  wait_child(&peer);
}

// Two threads, each with its own comm, moving data at the same time.
void scenario_threads(const char* path) {
  constexpr int kMessages = 40;
  auto sizes = [](int t, int i) { return static_cast<size_t>((i * 65537 + t * 4099) % (3 << 20)); };
  Peer peer;
  start_child(&peer, [&](Pipe& in, Pipe&) {
    Net net(open_plugin(path), 12);
    net.init();
    void* comms[2] = {connect_to(net, in), connect_to(net, in)};
    std::vector<std::thread> threads;
    for (int t = 0; t < 2; ++t)
      threads.emplace_back([&, t] {
        for (int i = 0; i < kMessages; ++i) send_message(net, comms[t], sizes(t, i), t * 1000 + i);
      });
    for (auto& thread : threads) thread.join();
    net.close_send(comms[0]);
    net.close_send(comms[1]);
    net.finalize();
  });
  Net net(open_plugin(path), 12);
  net.init();
  void* comms[2] = {accept_from(net, peer.to_child), accept_from(net, peer.to_child)};
  std::vector<std::string> failures(2);
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t)
    threads.emplace_back([&, t] {
      try {
        for (int i = 0; i < kMessages; ++i)
          receive_message(net, comms[t], 3 << 20, sizes(t, i), t * 1000 + i);
      } catch (const std::exception& e) {
        failures[t] = e.what();
      }
    });
  for (auto& thread : threads) thread.join();
  for (const std::string& f : failures)
    if (!f.empty()) fail("receiver thread: %s", f.c_str());
  net.close_recv(comms[0]);
  net.close_recv(comms[1]);
  net.finalize();
  wait_child(&peer);
}

// ---------------------------------------------------------------------------
// Benchmark traffic: NCCL's shape, 2 channels (comms) x 8 steps of 512 KiB in flight,
// between two processes that may sit in different network namespaces. The receiver
// prints its handle in hex, then "t=<monotonic s> bytes=<received> cpu=<process CPU s>"
// every 100 ms; the sender prints "t=... cpu=...". Both run for `seconds`.

constexpr int kChannels = 2, kSteps = 8;
constexpr size_t kStepBytes = 512 << 10;

double monotonic_seconds() {
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<double>(now.tv_sec) + now.tv_nsec * 1e-9;
}

double process_cpu_seconds() {
  rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         (usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) * 1e-6;
}

void bench_traffic(Net& net, void* const* comms, bool sending, double seconds) {
  std::vector<char> buffers(static_cast<size_t>(kChannels) * kSteps * kStepBytes);
  void* requests[kChannels][kSteps] = {};
  uint64_t bytes = 0;
  double start = monotonic_seconds(), next_report = start;
  while (monotonic_seconds() - start < seconds) {
    for (int c = 0; c < kChannels; ++c) {
      for (int k = 0; k < kSteps; ++k) {
        void*& request = requests[c][k];
        if (request != nullptr) {
          int done = 0, size = 0;
          Net::check(net.test(request, &done, &size), "test");
          if (!done) continue;
          bytes += static_cast<uint64_t>(size);
          request = nullptr;
        }
        char* data = buffers.data() + (static_cast<size_t>(c) * kSteps + k) * kStepBytes;
        NcclResult r = sending ? net.isend(comms[c], data, kStepBytes, nullptr, &request)
                               : net.irecv(comms[c], data, kStepBytes, nullptr, &request);
        Net::check(r, "post");
      }
    }
    double now = monotonic_seconds();
    if (now >= next_report) {
      std::printf("t=%.4f bytes=%llu cpu=%.4f\n", now, static_cast<unsigned long long>(bytes),
                  process_cpu_seconds());
      std::fflush(stdout);
      next_report = now + 0.1;
    }
    std::this_thread::sleep_for(
        std::chrono::microseconds(50));  // NCCL's proxy also yields between sweeps
  }
}

void scenario_bench_receive(const char* path, double seconds) {
  Net net(open_plugin(path), 12);
  net.init();
  void* comms[kChannels] = {};
  void* listeners[kChannels];
  for (void*& listener : listeners) {
    char handle[kNcclNetHandleMaxSize] = {};
    listener = net.listen(handle);
    std::printf("handle=");
    for (char byte : handle) std::printf("%02x", static_cast<unsigned char>(byte));
    std::printf("\n");
  }
  std::fflush(stdout);
  Clock::time_point start = Clock::now();
  for (int c = 0; c < kChannels; ++c) {
    while (comms[c] == nullptr) {
      Net::check(net.accept(listeners[c], &comms[c]), "accept");
      if (seconds_since(start) > 30) fail("accept did not complete");
    }
    net.close_listen(listeners[c]);
  }
  bench_traffic(net, comms, false, seconds);
}

void scenario_bench_send(const char* path, const std::vector<std::string>& handles,
                         double seconds) {
  Net net(open_plugin(path), 12);
  net.init();
  void* comms[kChannels];
  for (int c = 0; c < kChannels; ++c) {
    char handle[kNcclNetHandleMaxSize];
    if (handles[c].size() != 2 * sizeof(handle)) fail("bad handle");
    for (size_t i = 0; i < sizeof(handle); ++i)
      handle[i] = static_cast<char>(std::stoi(handles[c].substr(2 * i, 2), nullptr, 16));
    comms[c] = nullptr;
    Clock::time_point start = Clock::now();
    while (comms[c] == nullptr) {
      Net::check(net.connect(handle, &comms[c]), "connect");
      if (seconds_since(start) > 30) fail("connect did not complete");
    }
  }
  bench_traffic(net, comms, true, seconds);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(
        stderr,
        "usage: %s symbols|contract|truncation|threads PLUGIN\n"
        "       %s fuzz PLUGIN SEED MESSAGES MAX_LOG2_SIZE\n"
        "       %s peer-lost PLUGIN sender-killed|receiver-killed|receiver-stopped LIMIT_S\n"
        "       %s bench-receive PLUGIN SECONDS | bench-send PLUGIN HANDLE0 HANDLE1 SECONDS\n",
        argv[0], argv[0], argv[0], argv[0]);
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  std::string scenario = argv[1];
  const char* path = argv[2];
  try {
    if (scenario == "symbols")
      scenario_symbols(path);
    else if (scenario == "contract")
      scenario_contract(path);
    else if (scenario == "threads")
      scenario_threads(path);
    else if (scenario == "truncation")
      scenario_truncation(path);
    else if (scenario == "fuzz" && argc == 6)
      scenario_fuzz(path, std::strtoull(argv[3], nullptr, 10), std::atoi(argv[4]),
                    std::atoi(argv[5]));
    else if (scenario == "peer-lost" && argc == 5)
      scenario_peer_lost(path, argv[3], std::atof(argv[4]));
    else if (scenario == "bench-receive" && argc == 4)
      scenario_bench_receive(path, std::atof(argv[3]));
    else if (scenario == "bench-send" && argc == 6)
      scenario_bench_send(path, {argv[3], argv[4]}, std::atof(argv[5]));
    else
      fail("unknown scenario or wrong arguments: %s", scenario.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED %s: %s\n", scenario.c_str(), e.what());
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
