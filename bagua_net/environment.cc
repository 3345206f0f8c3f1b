// What the environment asks of Bagua-Net: its settings (BAGUA_NET_*) and the network
// interfaces it may use (NCCL_SOCKET_IFNAME).
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "socket_io.h"
#include "striped_transport.h"

namespace bagua_net {
namespace {

bool parse_integer(const char* name, long long min, long long max, long long* value,
                   std::string* error) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return true;
  char* end = nullptr;
  errno = 0;
  long long parsed = std::strtoll(text, &end, 10);
  if (errno != 0 || *end != '\0' || parsed < min || parsed > max) {
    *error = std::string(name) + "=" + text + ": expected an integer from " + std::to_string(min) +
             " to " + std::to_string(max);
    return false;
  }
  *value = parsed;
  return true;
}

bool interface_selected(const std::string& name, const char* spec) {
  if (spec == nullptr || *spec == '\0') return name != "lo" && name.rfind("docker", 0) != 0;
  bool exclude = *spec == '^';
  if (exclude) ++spec;
  bool exact = *spec == '=';
  if (exact) ++spec;
  bool listed = false;
  std::string list(spec);
  size_t start = 0;
  while (start <= list.size()) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    std::string item = list.substr(start, end - start);
    if (!item.empty() && (exact ? name == item : name.rfind(item, 0) == 0)) listed = true;
    start = end + 1;
  }
  return listed != exclude;
}

std::vector<Device> find_devices(const char* spec) {
  std::vector<Device> found;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return found;
  for (ifaddrs* entry = list; entry != nullptr && found.size() < 16; entry = entry->ifa_next) {
    if (entry->ifa_addr == nullptr || !(entry->ifa_flags & IFF_UP)) continue;
    int family = entry->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    if (family == AF_INET6 &&
        IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<sockaddr_in6*>(entry->ifa_addr)->sin6_addr))
      continue;
    std::string name(entry->ifa_name);
    if (!interface_selected(name, spec)) continue;
    bool seen = std::any_of(found.begin(), found.end(),
                            [&](const Device& d) { return d.interface_name == name; });
    if (seen) continue;
    Device device;
    device.interface_name = name;
    device.address_length = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    std::memcpy(&device.address, entry->ifa_addr, device.address_length);
    char resolved[PATH_MAX];
    std::string sys = "/sys/class/net/" + name + "/device";
    if (realpath(sys.c_str(), resolved) != nullptr) device.pci_path = resolved;
    std::ifstream speed("/sys/class/net/" + name + "/speed");
    int mbps = 0;
    if (speed >> mbps && mbps > 0) device.speed_mbps = mbps;
    found.push_back(device);
  }
  freeifaddrs(list);
  return found;
}

}  // namespace

Outcome Settings::from_environment(Settings* settings, std::string* error) {
  Settings parsed;
  long long nstreams = parsed.nstreams, chunk = static_cast<long long>(parsed.chunk_bytes);
  long long timeout = static_cast<long long>(parsed.timeout_seconds);
  // Chunks below 1 KiB would spend more on headers and system calls than on data.
  if (!parse_integer("BAGUA_NET_NSTREAMS", 1, kMaxStreams, &nstreams, error) ||
      !parse_integer("BAGUA_NET_CHUNK", 1024, 1LL << 30, &chunk, error) ||
      !parse_integer("BAGUA_NET_TIMEOUT", 1, 1LL << 31, &timeout, error))
    return Outcome::kInvalidArgument;
  const char* schedule = std::getenv("BAGUA_NET_SCHEDULE");
  if (schedule != nullptr && *schedule != '\0' && std::strcmp(schedule, "dynamic") != 0 &&
      std::strcmp(schedule, "static") != 0) {
    *error = std::string("BAGUA_NET_SCHEDULE=") + schedule + ": expected dynamic or static";
    return Outcome::kInvalidArgument;
  }
  parsed.nstreams = static_cast<int>(nstreams);
  parsed.chunk_bytes = static_cast<size_t>(chunk);
  parsed.timeout_seconds = static_cast<double>(timeout);
  parsed.dynamic = schedule == nullptr || std::strcmp(schedule, "static") != 0;
  *settings = parsed;
  return Outcome::kOk;
}

const std::vector<Device>& devices() {
  static const std::vector<Device> found = [] {
    const char* spec = std::getenv("NCCL_SOCKET_IFNAME");
    std::vector<Device> selected = find_devices(spec);
    if (selected.empty() && (spec == nullptr || *spec == '\0')) selected = find_devices("=lo");
    return selected;
  }();
  return found;
}

}  // namespace bagua_net
