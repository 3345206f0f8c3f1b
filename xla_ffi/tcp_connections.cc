#include "tcp_connections.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <utility>

namespace bagua::tcp {

Clock::time_point deadline_after(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

int millis_left(Clock::time_point until, int cap) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, cap));
}

std::string system_error(const std::string& what) { return what + ": " + std::strerror(errno); }

void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

bool Deadline::passed() const { return Clock::now() > until || (token && abandoned(*token)); }

bool move_all(int fd, char* data, size_t bytes, bool sending, const Deadline& deadline) {
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = sending ? ::send(fd, data + done, bytes - done, MSG_NOSIGNAL)
                              : ::recv(fd, data + done, bytes - done, 0);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return false;
    pollfd p{fd, static_cast<short>(sending ? POLLOUT : POLLIN), 0};
    if (::poll(&p, 1, millis_left(deadline.until, deadline.token ? 50 : 1000)) == 0 &&
        deadline.passed())
      return false;
  }
  return true;
}

namespace {

// How a connection introduces itself: kHello, the token's length and bytes, the connector's rank.
// The acceptor answers kWelcome once a build in this process takes the connection.
constexpr uint32_t kHello = 0x42475431;  // "BGT1"
constexpr char kWelcome = 'W';

// The process's listening socket, and the connections it accepted for a build that has not asked
// for them yet (two builds may wait on it at once, each from its own thread).
class Listener {
 public:
  static Listener& instance() {
    static Listener* listener = new Listener;  // never destroyed: builds may run at exit
    return *listener;
  }

  std::string open(const std::string& host) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (fd_ >= 0) {
      if (host != host_)
        throw std::invalid_argument("tcp_listen: this process listens on " + host_ +
                                    " already, not " + host);
      return address_;
    }
    addrinfo hints{}, *found = nullptr;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host.c_str(), "0", &hints, &found) != 0)
      throw std::invalid_argument("tcp_listen: cannot resolve " + host + " to an IPv4 address");
    sockaddr_in where = *reinterpret_cast<sockaddr_in*>(found->ai_addr);
    freeaddrinfo(found);
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw std::runtime_error(system_error("tcp_listen: socket"));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&where), sizeof where) != 0 ||
        ::listen(fd, 128) != 0) {
      const std::string error = system_error("tcp_listen: cannot listen on " + host);
      ::close(fd);
      throw std::runtime_error(error);
    }
    socklen_t length = sizeof where;
    getsockname(fd, reinterpret_cast<sockaddr*>(&where), &length);
    set_nonblocking(fd);
    fd_ = fd;
    host_ = host;
    char numeric[INET_ADDRSTRLEN] = "";
    inet_ntop(AF_INET, &where.sin_addr, numeric, sizeof numeric);
    address_ = std::string(numeric) + ":" + std::to_string(ntohs(where.sin_port));
    return address_;
  }

  // Fills fds[j] for every j in `ranks` with the connection rank j opened for `token`.
  Status accept(const std::string& token, const std::vector<int>& ranks, std::vector<int>& fds,
                Clock::time_point until) {
    for (;;) {
      bool complete = true;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (fd_ < 0) return {"the process does not listen (tcp_listen was not called)"};
        if (abandoned_.count(token)) return {"the build was abandoned"};
        for (int j : ranks) {
          auto parked = waiting_.find({token, j});
          if (fds[j] < 0 && parked != waiting_.end()) {
            fds[j] = parked->second;
            waiting_.erase(parked);
            const char welcome = kWelcome;
            if (!move_all(fds[j], const_cast<char*>(&welcome), 1, true, Deadline{until})) {
              ::close(fds[j]);
              fds[j] = -1;
            }
          }
          complete = complete && fds[j] >= 0;
        }
      }
      if (complete) return {};
      if (Clock::now() > until) {
        std::string missing;
        for (int j : ranks)
          if (fds[j] < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(j);
        return {"rank(s) " + missing + " did not connect in time"};
      }
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, millis_left(until, 50)) > 0) take_one(until);
    }
  }

  void abandon(const std::string& token) {
    std::lock_guard<std::mutex> lock(mutex_);
    abandoned_.insert(token);
    for (auto parked = waiting_.lower_bound({token, std::numeric_limits<int>::min()});
         parked != waiting_.end() && parked->first.first == token;) {
      ::close(parked->second);
      parked = waiting_.erase(parked);
    }
  }

  bool abandoned(const std::string& token) {
    std::lock_guard<std::mutex> lock(mutex_);
    return abandoned_.count(token) > 0;
  }

 private:
  // Accepts one connection and parks it under the token and rank it brings (closed if it brings
  // none within a second, or a duplicate).
  void take_one(Clock::time_point until) {
    const int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;  // another build's thread took it
    const Deadline introduction{std::min(until, deadline_after(1.0))};
    uint32_t hello = 0, length = 0;
    int32_t rank = -1;
    std::string token;
    bool ok = move_all(fd, reinterpret_cast<char*>(&hello), 4, false, introduction) &&
              hello == kHello &&
              move_all(fd, reinterpret_cast<char*>(&length), 4, false, introduction) &&
              length <= kLongestToken;
    if (ok) {
      token.resize(length);
      ok = move_all(fd, token.data(), length, false, introduction) &&
           move_all(fd, reinterpret_cast<char*>(&rank), 4, false, introduction);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (!ok || abandoned_.count(token) || !waiting_.emplace(std::make_pair(token, rank), fd).second)
      ::close(fd);
  }

  std::mutex mutex_;
  int fd_ = -1;
  std::string host_, address_;
  std::map<std::pair<std::string, int>, int> waiting_;
  std::set<std::string> abandoned_;  // a few short tokens per change of members
};

}  // namespace

std::string listen(const std::string& host) { return Listener::instance().open(host); }

Status accept(const std::string& token, const std::vector<int>& ranks, std::vector<int>& fds,
              Clock::time_point until) {
  return Listener::instance().accept(token, ranks, fds, until);
}

void abandon(const std::string& token) { Listener::instance().abandon(token); }

bool abandoned(const std::string& token) { return Listener::instance().abandoned(token); }

int connect(const std::string& address, const std::string& token, int rank, Clock::time_point until,
            std::string* error) {
  const Deadline deadline{until, &token};
  const size_t colon = address.rfind(':');
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (colon == std::string::npos ||
      getaddrinfo(address.substr(0, colon).c_str(), address.substr(colon + 1).c_str(), &hints,
                  &found) != 0) {
    *error = "cannot resolve " + address;
    return -1;
  }
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int rc = ::connect(fd, found->ai_addr, found->ai_addrlen);
  freeaddrinfo(found);
  if (rc != 0 && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    while ((rc = ::poll(&p, 1, millis_left(until, 50))) == 0 && !deadline.passed()) {
    }
    rc = rc == 1 ? 0 : -1;
    int status = rc == 0 ? 0 : ETIMEDOUT;
    socklen_t length = sizeof status;
    if (rc == 0) getsockopt(fd, SOL_SOCKET, SO_ERROR, &status, &length);
    errno = status;
    rc = status == 0 ? 0 : -1;
  }
  if (rc != 0) {
    *error =
        abandoned(token) ? "the build was abandoned" : system_error("cannot connect to " + address);
    ::close(fd);
    return -1;
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  std::string hello(12 + token.size(), '\0');
  const uint32_t length = static_cast<uint32_t>(token.size());
  const int32_t from = rank;
  std::memcpy(hello.data(), &kHello, 4);
  std::memcpy(hello.data() + 4, &length, 4);
  std::memcpy(hello.data() + 8, token.data(), token.size());
  std::memcpy(hello.data() + 8 + token.size(), &from, 4);
  char welcome = 0;
  if (!move_all(fd, hello.data(), hello.size(), true, deadline) ||
      !move_all(fd, &welcome, 1, false, deadline) || welcome != kWelcome) {
    *error = abandoned(token)
                 ? "the build was abandoned"
                 : "the process at " + address + " did not take the connection in time";
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace bagua::tcp
