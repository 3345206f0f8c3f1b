// One striped connection's data path: its request slots, its streams and the pump that
// cuts messages into chunks and places arriving chunks, run under the connection's lock.
#pragma once

#include <linux/sockios.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "socket_io.h"
#include "striped_transport.h"

namespace bagua_net {

constexpr int kRequestSlots = 32;  // NCCL_NET_MAX_REQUESTS

struct Request {
  Connection* comm = nullptr;
  bool in_use = false;
  bool done = false;
  uint64_t sequence = 0;
  char* data = nullptr;
  size_t size = 0;   // the posted size
  size_t total = 0;  // the message's size (a receive learns it from the first chunk)
  bool total_known = false;
  size_t transferred = 0;  // bytes received, or bytes of chunks fully handed to the kernel
  size_t cut = 0;          // sender: bytes already cut into chunks
  Clock::time_point deadline;
};

struct Chunk {
  Request* request;
  ChunkHeader header;
  size_t written = 0;  // of sizeof(header) + header.length
};

struct Stream {
  int fd = -1;
  std::deque<Chunk> queue;  // sender: chunks given to this stream, front in progress
  // receiver: the chunk being read
  ChunkHeader header{};
  size_t header_read = 0;
  size_t payload_read = 0;
  Request* target = nullptr;
  bool closed = false;  // the peer closed it at a chunk boundary
};

class Connection {
 public:
  Connection(bool sending, const Settings& settings, int nstreams)
      : sending(sending), settings(settings) {
    streams.resize(static_cast<size_t>(nstreams) + 1);  // the last one is the control stream
    for (Request& r : slots) r.comm = this;
  }
  ~Connection() {
    for (Stream& s : streams)
      if (s.fd >= 0) ::close(s.fd);
  }

  int data_streams() const { return static_cast<int>(streams.size()) - 1; }

  // Moves whatever data the sockets take or offer now. Caller holds `mutex`.
  void pump() {
    if (!error.empty()) return;
    std::string failure;
    bool ok = sending ? pump_send(&failure) : pump_receive(&failure);
    if (!ok) error = failure;
    // A peer that left is an error only for what it still owed: a sender may close as
    // soon as its data is in the kernel, and that data still arrives.
    bool peer_gone = sending ? control_closed
                             : std::all_of(streams.begin(), streams.end() - 1,
                                           [](const Stream& s) { return s.closed; });
    if (error.empty() && peer_gone && unfinished())
      error = sending ? "the receiver closed the connection" : "the sender closed the connection";
  }

  // The control stream carries nothing after the handshake: EOF or an error on it is the peer
  // leaving.
  void check_control() {
    char byte;
    ssize_t n = ::recv(streams.back().fd, &byte, 1, MSG_PEEK);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
      control_closed = true;
  }

  bool unfinished() const {
    return std::any_of(std::begin(slots), std::end(slots),
                       [](const Request& r) { return r.in_use && !r.done; });
  }

  const bool sending;
  const Settings settings;
  uint64_t id = 0;
  std::mutex mutex;
  std::vector<Stream> streams;
  Request slots[kRequestSlots];
  uint64_t next_sequence = 0;
  std::deque<Request*> uncut;  // dynamic sender: messages whose chunks are not all assigned yet
  size_t next_stream = 0;      // static sender: round-robin position
  bool control_closed = false;
  std::string error;

 private:
  bool flush(Stream& s, std::string* failure) {
    while (!s.queue.empty()) {
      Chunk& c = s.queue.front();
      size_t total = sizeof(ChunkHeader) + c.header.length;
      while (c.written < total) {
        iovec parts[2];
        int count = 0;
        if (c.written < sizeof(ChunkHeader)) {
          parts[count++] = {reinterpret_cast<char*>(&c.header) + c.written,
                            sizeof(ChunkHeader) - c.written};
        }
        size_t payload_done = c.written > sizeof(ChunkHeader) ? c.written - sizeof(ChunkHeader) : 0;
        if (c.header.length > payload_done) {
          parts[count++] = {c.request->data + c.header.offset + payload_done,
                            c.header.length - payload_done};
        }
        msghdr message{};
        message.msg_iov = parts;
        message.msg_iovlen = count;
        ssize_t n = ::sendmsg(s.fd, &message, MSG_NOSIGNAL);
        if (n >= 0) {
          c.written += static_cast<size_t>(n);
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
          return true;
        } else if (errno != EINTR) {
          *failure = errno_text("send");
          return false;
        }
      }
      Request* r = c.request;
      r->transferred += c.header.length;
      if (r->transferred == r->total && r->cut == r->total) r->done = true;
      s.queue.pop_front();
    }
    return true;
  }

  // A stream may take the next chunk when its own queue is empty and the kernel would
  // accept data now (with TCP_NOTSENT_LOWAT, when its unsent bytes are below two chunks).
  // poll() also arms the kernel to wake epoll once the stream drains.
  long unsent_if_ready(Stream& s) {
    if (!s.queue.empty()) return -1;
    pollfd p{s.fd, POLLOUT, 0};
    if (::poll(&p, 1, 0) != 1 || !(p.revents & POLLOUT)) return -1;
    int unsent = 0;
    if (ioctl(s.fd, SIOCOUTQNSD, &unsent) != 0) return 0;
    return unsent;
  }

  Chunk cut_chunk(Request* r, size_t length) {
    Chunk c{r,
            ChunkHeader{r->sequence, r->cut, r->total, static_cast<uint32_t>(length), kChunkMagic}};
    r->cut += length;
    return c;
  }

  bool pump_send(std::string* failure) {
    int n = data_streams();
    for (int i = 0; i < n; ++i)
      if (!flush(streams[i], failure)) return false;
    while (!uncut.empty()) {
      int best = -1;
      long best_unsent = 0;
      for (int i = 0; i < n; ++i) {
        long unsent = unsent_if_ready(streams[i]);
        if (unsent >= 0 && (best < 0 || unsent < best_unsent)) {
          best = i;
          best_unsent = unsent;
        }
      }
      if (best < 0) break;
      Request* r = uncut.front();
      size_t length = std::min(settings.chunk_bytes, r->total - r->cut);
      streams[best].queue.push_back(cut_chunk(r, length));
      if (r->cut == r->total) uncut.pop_front();
      if (!flush(streams[best], failure)) return false;
    }
    return true;
  }

  Request* posted(uint64_t sequence) {
    for (Request& r : slots)
      if (r.in_use && r.sequence == sequence) return &r;
    return nullptr;
  }

  bool pump_receive(std::string* failure) {
    int n = data_streams();
    for (int i = 0; i < n; ++i) {
      Stream& s = streams[i];
      while (!s.closed) {
        if (s.target == nullptr) {
          bool closed = false;
          if (!read_some(s.fd, &s.header, sizeof(ChunkHeader), &s.header_read, failure, &closed)) {
            if (!closed || s.header_read != 0) return false;
            failure->clear();
            s.closed = true;
            break;
          }
          if (s.header_read < sizeof(ChunkHeader)) break;
          const ChunkHeader& h = s.header;
          if (h.magic != kChunkMagic || h.offset > h.total || h.length > h.total - h.offset) {
            *failure = "malformed chunk header from the peer";
            return false;
          }
          Request* r = posted(h.sequence);
          if (r == nullptr) {
            if (h.sequence < next_sequence) {
              *failure = "chunk for a message that is already complete";
              return false;
            }
            break;  // its receive is not posted yet: leave the data in the socket
          }
          if (h.total > r->size) {
            *failure = "message of " + std::to_string(h.total) + " bytes for a receive of " +
                       std::to_string(r->size) + " bytes";
            return false;
          }
          if (r->total_known && r->total != h.total) {
            *failure = "chunks disagree about the message size";
            return false;
          }
          r->total = h.total;
          r->total_known = true;
          s.target = r;
          s.payload_read = 0;
        }
        Request* r = s.target;
        if (!read_some(s.fd, r->data + s.header.offset, s.header.length, &s.payload_read, failure))
          return false;
        if (s.payload_read < s.header.length) break;
        r->transferred += s.header.length;
        if (r->transferred == r->total) r->done = true;
        s.target = nullptr;
        s.header_read = 0;
      }
    }
    return true;
  }
};

}  // namespace bagua_net
