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

// When a wait of a build ends: at `until`, or as soon as the build's `token` is abandoned.
struct Deadline {
  Clock::time_point until;
  const std::string* token = nullptr;  // none: only `until`
  bool passed() const;
};

// Sends or receives exactly `bytes` on the non-blocking socket `fd` before the deadline.
bool move_all(int fd, char* data, size_t bytes, bool sending, const Deadline& deadline);

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
// Makes this process's waits of the build `token` end at once (accept, connect: "abandoned"), now
// and later, and closes the connections parked for it: a build whose members changed meanwhile, or
// that failed (its other ranks' connections would wait for it forever).
void abandon(const std::string& token);
bool abandoned(const std::string& token);

}  // namespace bagua::tcp
