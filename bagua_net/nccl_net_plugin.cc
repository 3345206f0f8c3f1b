// libnccl-net-bagua.so: the striped transport behind NCCL's network plugin ABI.
// One implementation; ncclNetPlugin_v8 ... v12 are thin adapters that differ only in
// the argument lists and property structs each NCCL release expects (NCCL 2.20-2.32+).
#include <atomic>
#include <climits>
#include <cstring>
#include <string>
#include <type_traits>

#include "nccl_net_abi.h"
#include "striped_transport.h"

namespace {

using bagua_net::Outcome;

constexpr char kName[] = "Bagua";
std::atomic<NcclLogger> logger{nullptr};

void log_warning(const char* message) {
  if (NcclLogger log = logger.load())
    log(kNcclLogWarn, kNcclLogSubsystemNet, __FILE__, __LINE__, "%s", message);
}

NcclResult result_of(Outcome outcome, const std::string& error) {
  if (outcome != Outcome::kOk && !error.empty()) log_warning(("Bagua-Net: " + error).c_str());
  switch (outcome) {
    case Outcome::kOk:
      return kNcclSuccess;
    case Outcome::kSystemError:
      return kNcclSystemError;
    case Outcome::kInvalidArgument:
      return kNcclInvalidArgument;
    case Outcome::kInvalidUsage:
      return kNcclInvalidUsage;
    case Outcome::kInternalError:
      break;
  }
  return kNcclInternalError;
}

NcclResult init(NcclLogger log) {
  logger.store(log);
  bagua_net::Settings settings;
  std::string error;
  Outcome parsed = bagua_net::Settings::from_environment(&settings, &error);
  if (parsed != Outcome::kOk) return result_of(parsed, error);
  if (bagua_net::devices().empty()) {
    log_warning("Bagua-Net: no network interface matches NCCL_SOCKET_IFNAME");
    return kNcclSystemError;
  }
  return kNcclSuccess;
}

NcclResult devices(int* ndev) {
  *ndev = static_cast<int>(bagua_net::devices().size());
  return kNcclSuccess;
}

// The newest properties; older versions copy the fields they have.
NcclResult properties(int dev, NcclNetProperties_v12* props) {
  const auto& all = bagua_net::devices();
  if (dev < 0 || dev >= static_cast<int>(all.size())) return kNcclInvalidArgument;
  const bagua_net::Device& d = all[dev];
  std::memset(props, 0, sizeof(*props));
  props->identity = {const_cast<char*>(d.interface_name.c_str()),
                     d.pci_path.empty() ? nullptr : const_cast<char*>(d.pci_path.c_str()),
                     static_cast<uint64_t>(dev), kNcclPtrHost, /*reg_is_global=*/0};
  props->force_flush = 0;
  props->capacity = {d.speed_mbps,
                     /*port=*/0,
                     /*latency=*/0,
                     /*max_comms=*/65536,
                     /*max_recvs=*/1,
                     kNcclNetDeviceHost,
                     /*net_device_version=*/0};
  props->virtual_device.ndevs = 1;
  props->virtual_device.devs[0] = dev;
  props->max_p2p_bytes = INT_MAX;  // v8 sizes are ints; one limit for every version
  props->max_coll_bytes = INT_MAX;
  props->max_multi_request_size = 1;
  props->rail_id = kNcclNetIdUndefined;
  props->plane_id = kNcclNetIdUndefined;
  return kNcclSuccess;
}

template <typename Props>
NcclResult properties_as(int dev, Props* props) {
  NcclNetProperties_v12 full;
  NcclResult r = properties(dev, &full);
  if (r != kNcclSuccess) return r;
  std::memset(props, 0, sizeof(*props));
  props->identity = full.identity;
  props->capacity = full.capacity;
  if constexpr (!std::is_same_v<Props, NcclNetProperties_v8>) {
    props->force_flush = full.force_flush;
    props->virtual_device.ndevs = full.virtual_device.ndevs;
    props->virtual_device.devs[0] = full.virtual_device.devs[0];
    props->max_p2p_bytes = full.max_p2p_bytes;
    props->max_coll_bytes = full.max_coll_bytes;
  }
  if constexpr (std::is_same_v<Props, NcclNetProperties_v11>)
    props->max_multi_request_size = full.max_multi_request_size;
  return kNcclSuccess;
}

NcclResult listen(int dev, void* handle, void** listen_comm) {
  std::string error;
  bagua_net::ListenComm* listener = nullptr;
  Outcome o =
      bagua_net::listen(dev, static_cast<bagua_net::ConnectHandle*>(handle), &listener, &error);
  *listen_comm = listener;
  return result_of(o, error);
}

NcclResult connect(int, void* handle, void** send_comm, NcclNetDeviceHandle** send_dev_comm) {
  if (send_dev_comm != nullptr) *send_dev_comm = nullptr;  // no device offload
  std::string error;
  bagua_net::Connection* comm = nullptr;
  Outcome o = bagua_net::connect(static_cast<bagua_net::ConnectHandle*>(handle), &comm, &error);
  *send_comm = comm;
  return result_of(o, error);
}

NcclResult accept(void* listen_comm, void** recv_comm, NcclNetDeviceHandle** recv_dev_comm) {
  if (recv_dev_comm != nullptr) *recv_dev_comm = nullptr;
  std::string error;
  bagua_net::Connection* comm = nullptr;
  Outcome o = bagua_net::accept(static_cast<bagua_net::ListenComm*>(listen_comm), &comm, &error);
  *recv_comm = comm;
  return result_of(o, error);
}

// Host memory needs no registration; NCCL only needs a handle to pass back.
int registered_memory;

NcclResult reg_mr(void*, void*, size_t, int type, void** mhandle) {
  if (type != kNcclPtrHost) return kNcclInternalError;
  *mhandle = &registered_memory;
  return kNcclSuccess;
}

NcclResult reg_mr_dma_buf(void*, void*, size_t, int, uint64_t, int, void**) {
  return kNcclInternalError;
}

NcclResult dereg_mr(void*, void*) { return kNcclSuccess; }

NcclResult isend(void* send_comm, void* data, size_t size, int, void*, void** request) {
  std::string error;
  bagua_net::Request* r = nullptr;
  Outcome o =
      bagua_net::isend(static_cast<bagua_net::Connection*>(send_comm), data, size, &r, &error);
  *request = r;
  return result_of(o, error);
}

NcclResult irecv(void* recv_comm, int n, void** data, size_t* sizes, int*, void**, void** request) {
  *request = nullptr;
  if (n != 1) return kNcclInternalError;  // maxRecvs is 1: NCCL never groups receives here
  std::string error;
  bagua_net::Request* r = nullptr;
  Outcome o = bagua_net::irecv(static_cast<bagua_net::Connection*>(recv_comm), data[0], sizes[0],
                               &r, &error);
  *request = r;
  return result_of(o, error);
}

NcclResult iflush(void*, int, void**, int*, void**, void** request) {
  *request = nullptr;  // host memory: nothing to flush
  return kNcclSuccess;
}

NcclResult test(void* request, int* done, int* sizes) {
  std::string error;
  size_t size = 0;
  Outcome o = bagua_net::test(static_cast<bagua_net::Request*>(request), done, &size, &error);
  if (o == Outcome::kOk && *done && sizes != nullptr) *sizes = static_cast<int>(size);
  return result_of(o, error);
}

NcclResult close_comm(void* comm) {
  bagua_net::close_connection(static_cast<bagua_net::Connection*>(comm));
  return kNcclSuccess;
}

NcclResult close_listen(void* listen_comm) {
  bagua_net::close_listener(static_cast<bagua_net::ListenComm*>(listen_comm));
  return kNcclSuccess;
}

NcclResult get_device_mr(void*, void*, void** device_mhandle) {
  *device_mhandle = nullptr;
  return kNcclInternalError;
}

NcclResult irecv_consumed(void*, int, void*) { return kNcclSuccess; }

// The entries whose arguments changed, as the older and newer versions spell them.

NcclResult isend_v8(void* comm, void* data, int size, int tag, void* mhandle, void** request) {
  if (size < 0) return kNcclInvalidArgument;
  return isend(comm, data, static_cast<size_t>(size), tag, mhandle, request);
}

NcclResult irecv_v8(void* comm, int n, void** data, int* sizes, int* tags, void** mhandles,
                    void** request) {
  if (n != 1 || sizes[0] < 0) return kNcclInternalError;
  size_t size = static_cast<size_t>(sizes[0]);
  return irecv(comm, n, data, &size, tags, mhandles, request);
}

NcclResult isend_v10(void* comm, void* data, size_t size, int tag, void* mhandle, void*,
                     void** request) {
  return isend(comm, data, size, tag, mhandle, request);
}

NcclResult irecv_v10(void* comm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                     void**, void** request) {
  return irecv(comm, n, data, sizes, tags, mhandles, request);
}

NcclResult init_v10(NcclLogger log, NcclProfilerCallback) { return init(log); }

NcclResult connect_v10(int dev, NcclNetCommConfig*, void* handle, void** send_comm,
                       NcclNetDeviceHandle** send_dev_comm) {
  return connect(dev, handle, send_comm, send_dev_comm);
}

// From v11 NCCL creates a context per communicator; the transport's state is global.
int context;

NcclResult init_v11(void** ctx, uint64_t, NcclNetCommConfig*, NcclLogger log,
                    NcclProfilerCallback) {
  *ctx = &context;
  return init(log);
}

NcclResult listen_v11(void*, int dev, void* handle, void** listen_comm) {
  return listen(dev, handle, listen_comm);
}

NcclResult connect_v11(void*, int dev, void* handle, void** send_comm,
                       NcclNetDeviceHandle** send_dev_comm) {
  return connect(dev, handle, send_comm, send_dev_comm);
}

NcclResult finalize(void*) { return kNcclSuccess; }

NcclResult set_net_attr(void*, NcclNetAttr*) { return kNcclSuccess; }

// One version's table: the entries every version shares, the ones given here, and
// from v11 finalize and setNetAttr. makeVDevice stays NULL: NCCL then uses each
// interface as it is instead of fusing NICs into virtual ones, which this
// transport does not do.
template <typename Table>
constexpr Table table(decltype(Table::init) init, decltype(Table::getProperties) get_properties,
                      decltype(Table::listen) listen, decltype(Table::connect) connect,
                      decltype(Table::isend) isend, decltype(Table::irecv) irecv) {
  Table t{};
  t.name = kName;
  t.init = init;
  t.devices = devices;
  t.getProperties = get_properties;
  t.listen = listen;
  t.connect = connect;
  t.accept = accept;
  t.regMr = reg_mr;
  t.regMrDmaBuf = reg_mr_dma_buf;
  t.deregMr = dereg_mr;
  t.isend = isend;
  t.irecv = irecv;
  t.iflush = iflush;
  t.test = test;
  t.closeSend = close_comm;
  t.closeRecv = close_comm;
  t.closeListen = close_listen;
  t.getDeviceMr = get_device_mr;
  t.irecvConsumed = irecv_consumed;
  if constexpr (std::is_same_v<decltype(Table::init), NcclInit_v11>) {
    t.finalize = finalize;
    t.setNetAttr = set_net_attr;
  }
  return t;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) NcclNet_v12 ncclNetPlugin_v12 =
    table<NcclNet_v12>(init_v11, properties, listen_v11, connect_v11, isend_v10, irecv_v10);

__attribute__((visibility("default"))) NcclNet_v11 ncclNetPlugin_v11 = table<NcclNet_v11>(
    init_v11, properties_as<NcclNetProperties_v11>, listen_v11, connect_v11, isend_v10, irecv_v10);

__attribute__((visibility("default"))) NcclNet_v10 ncclNetPlugin_v10 = table<NcclNet_v10>(
    init_v10, properties_as<NcclNetProperties_v9>, listen, connect_v10, isend_v10, irecv_v10);

__attribute__((visibility("default"))) NcclNet_v9 ncclNetPlugin_v9 =
    table<NcclNet_v9>(init, properties_as<NcclNetProperties_v9>, listen, connect, isend, irecv);

__attribute__((visibility("default"))) NcclNet_v8 ncclNetPlugin_v8 = table<NcclNet_v8>(
    init, properties_as<NcclNetProperties_v8>, listen, connect, isend_v8, irecv_v8);

}  // extern "C"
