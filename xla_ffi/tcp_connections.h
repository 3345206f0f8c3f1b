// How the TCP engine's connections are made (tcp_communicator.h): the process's one listening
// socket, and connections introduced by a build's token and the connecting rank, which the
// listener hands to the build that asks for them (two builds may wait on it at once).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels.h"

namespace bagua::tcp {

using Clock = std::chrono::steady_clock;

Clock::time_point deadline_after(double seconds);
// Milliseconds left before `until` (0 once past it), at most `cap`.
int millis_left(Clock::time_point until, int cap);
// `what`, then errno's text.
std::string system_error(const std::string& what);
void set_nonblocking(int fd);
// Sends or receives exactly `bytes` on the non-blocking socket `fd` before `until`.
bool move_all(int fd, char* data, size_t bytes, bool sending, Clock::time_point until);

constexpr uint32_t kLongestToken = 256;

// Opens the process's listening socket on `host` once; returns its "address:port".
std::string listen(const std::string& host);
// Fills fds[j] for every j in `ranks` with the connection rank j opened for `token`.
Status accept(const std::string& token, const std::vector<int>& ranks, std::vector<int>& fds,
              Clock::time_point until);
// Connects to `address` ("host:port") as `rank` of the build `token`, once the process there took
// the connection; -1 with `error` set if it refused or did not take it before `until`.
int connect(const std::string& address, const std::string& token, int rank, Clock::time_point until,
            std::string* error);

}  // namespace bagua::tcp
