// Communicators by integer handle, so that JAX attributes and Python objects
// can name them. Each engine module owns one registry. A handle is a slot:
// `rebind` puts another communicator in it (the survivors' after a membership
// change), so a jitted step that names the handle runs on the new communicator
// without being compiled again.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "communicator.h"

namespace bagua {

class CommunicatorRegistry {
 public:
  static CommunicatorRegistry& instance() {
    static CommunicatorRegistry registry;
    return registry;
  }

  int64_t add(std::shared_ptr<Communicator> comm) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t handle = next_handle_++;
    comms_.emplace(handle, std::move(comm));
    return handle;
  }

  // Null when the handle is unknown (never created, or already destroyed).
  std::shared_ptr<Communicator> get(int64_t handle) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = comms_.find(handle);
    return it == comms_.end() ? nullptr : it->second;
  }

  // A second handle of `handle`'s communicator (0 if unknown): destroying
  // either handle leaves the other.
  int64_t share(int64_t handle) {
    std::shared_ptr<Communicator> comm = get(handle);
    return comm ? add(std::move(comm)) : 0;
  }

  // Moves the communicator registered under `from` into `handle`'s slot (the
  // slot's former communicator is freed once no call uses it) and forgets
  // `from`. False, changing nothing, if either handle is unknown.
  bool rebind(int64_t handle, int64_t from) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto target = comms_.find(handle), source = comms_.find(from);
    if (target == comms_.end() || source == comms_.end()) return false;
    if (handle == from) return true;
    target->second = std::move(source->second);
    comms_.erase(source);
    return true;
  }

  bool remove(int64_t handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    return comms_.erase(handle) > 0;
  }

  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    comms_.clear();
  }

 private:
  mutable std::mutex mutex_;
  int64_t next_handle_ = 1;
  std::unordered_map<int64_t, std::shared_ptr<Communicator>> comms_;
};

inline std::string unknown_handle_message(int64_t handle) {
  return "no communicator with handle " + std::to_string(handle) +
         " (it was never created in this process, or was already destroyed)";
}

}  // namespace bagua
