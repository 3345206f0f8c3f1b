// Striped TCP: one logical connection carried by several TCP streams plus a control
// stream. A message is cut into self-describing chunks {sequence, offset, length,
// total}, so the receiver places each chunk wherever it lands and needs no ordering
// between streams. The sender gives each chunk to the stream with the least unsent
// data (dynamic scheduling), or splits each message equally over the streams the way
// NCCL's socket transport does (static, kept for comparison). Shared epoll threads do
// all data movement; connect and accept are non-blocking state machines polled by the
// caller; every request has a deadline, so a dead peer is an error, never a hang.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace bagua_net {

enum class Outcome { kOk, kSystemError, kInvalidArgument, kInvalidUsage, kInternalError };

// What the environment asks for, read once per connection.
struct Settings {
  int nstreams = 4;                // BAGUA_NET_NSTREAMS: data streams per connection
  size_t chunk_bytes = 128 << 10;  // BAGUA_NET_CHUNK: bytes per chunk
  bool dynamic = true;             // BAGUA_NET_SCHEDULE: dynamic (default) or static
  double timeout_seconds = 600.0;  // BAGUA_NET_TIMEOUT: a request's deadline after posting

  static Outcome from_environment(Settings* settings, std::string* error);
};

struct Device {
  std::string interface_name;
  std::string pci_path;  // empty for virtual interfaces
  sockaddr_storage address{};
  socklen_t address_length = 0;
  int speed_mbps = 10000;
};

// The interfaces NCCL_SOCKET_IFNAME selects (NCCL's syntax: prefixes, '^' excludes,
// '=' matches exactly); without it every interface that is up except loopback and
// docker bridges, or loopback when there is nothing else.
const std::vector<Device>& devices();

class ListenComm;
class ConnectAttempt;
class Connection;
struct Request;

// The handle a listener publishes and a connector reads back; it also carries the
// connector's state between polls, as NCCL keeps passing the same handle buffer.
struct ConnectHandle {
  uint64_t magic;
  uint64_t attempt;  // the connector's ConnectAttempt*, 0 until the first poll
  union {
    sockaddr_in v4;
    sockaddr_in6 v6;
  } address;
};
static_assert(sizeof(ConnectHandle) <= 128, "NCCL handles are at most 128 bytes");

Outcome listen(int device, ConnectHandle* handle, ListenComm** listener, std::string* error);
// Both return kOk with *comm == nullptr until the connection is ready; call again.
Outcome connect(ConnectHandle* handle, Connection** send_comm, std::string* error);
Outcome accept(ListenComm* listener, Connection** recv_comm, std::string* error);

// *request == nullptr with kOk means "all request slots are busy, post again later".
Outcome isend(Connection* comm, const void* data, size_t size, Request** request,
              std::string* error);
Outcome irecv(Connection* comm, void* data, size_t size, Request** request, std::string* error);
// On completion *done = 1, *size = the bytes the message really had, and the request is freed.
Outcome test(Request* request, int* done, size_t* size, std::string* error);

void close_listener(ListenComm* listener);
void close_connection(Connection* comm);

}  // namespace bagua_net
