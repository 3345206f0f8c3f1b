#include "socket_io.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

namespace bagua_net {

std::string errno_text(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

Outcome system_error(std::string* error, const std::string& text) {
  *error = text;
  return Outcome::kSystemError;
}

void set_nonblocking_nodelay(int fd) {
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

bool read_some(int fd, void* buffer, size_t size, size_t* done, std::string* error, bool* closed) {
  while (*done < size) {
    ssize_t n = ::recv(fd, static_cast<char*>(buffer) + *done, size - *done, 0);
    if (n > 0) {
      *done += static_cast<size_t>(n);
    } else if (n == 0) {
      *error = "the peer closed the connection";
      if (closed != nullptr) *closed = true;
      return false;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return true;
    } else if (errno != EINTR) {
      *error = errno_text("recv");
      return false;
    }
  }
  return true;
}

bool write_some(int fd, const void* buffer, size_t size, size_t* done, std::string* error) {
  while (*done < size) {
    ssize_t n = ::send(fd, static_cast<const char*>(buffer) + *done, size - *done, MSG_NOSIGNAL);
    if (n >= 0) {
      *done += static_cast<size_t>(n);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return true;
    } else if (errno != EINTR) {
      *error = errno_text("send");
      return false;
    }
  }
  return true;
}

}  // namespace bagua_net
