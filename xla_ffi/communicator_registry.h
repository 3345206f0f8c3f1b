// Communicators by integer handle, so that JAX attributes and Python objects
// can name them. Each engine module owns one registry.
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
