// The bytes on a striped connection's sockets and the non-blocking calls that move them:
// each socket's Hello, each chunk's header, and reads and writes that take what the
// socket takes now.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "striped_transport.h"

namespace bagua_net {

constexpr uint64_t kHandleMagic = 0x6261677561546370ULL;  // "baguaTcp"
constexpr uint32_t kHelloMagic = 0x62616775;
constexpr uint32_t kChunkMagic = 0x43484e4b;
constexpr int kMaxStreams = 64;

using Clock = std::chrono::steady_clock;

// Sent once on every socket of a connection: which connection and which stream it is.
struct Hello {
  uint32_t magic;
  uint32_t stream;
  uint32_t nstreams;
  uint32_t reserved;
  uint64_t connection;
};

// Precedes every chunk on a data stream.
struct ChunkHeader {
  uint64_t sequence;
  uint64_t offset;
  uint64_t total;
  uint32_t length;
  uint32_t magic;
};

std::string errno_text(const char* what);
Outcome system_error(std::string* error, const std::string& text);

void set_nonblocking_nodelay(int fd);

// Reads or writes what the socket takes now; false on a closed or failed socket
// (*closed tells the peer's orderly close from an error).
bool read_some(int fd, void* buffer, size_t size, size_t* done, std::string* error,
               bool* closed = nullptr);
bool write_some(int fd, const void* buffer, size_t size, size_t* done, std::string* error);

}  // namespace bagua_net
