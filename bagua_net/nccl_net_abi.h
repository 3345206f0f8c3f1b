// The NCCL network plugin ABI, versions 8 to 12 (NCCL 2.20 to 2.32), declared from
// the layouts NCCL documents in plugins/net/README.md and checked field by field
// against its net_v8.h ... net_v12.h. Only what a host-memory plugin needs is named;
// every struct keeps NCCL's field order and types exactly, because NCCL reads them
// by offset.
#pragma once

#include <cstddef>
#include <cstdint>

enum NcclResult : int {
  kNcclSuccess = 0,
  kNcclSystemError = 2,
  kNcclInternalError = 3,
  kNcclInvalidArgument = 4,
  kNcclInvalidUsage = 5,
  kNcclRemoteError = 6,
};

enum NcclLogLevel : int {
  kNcclLogNone = 0,
  kNcclLogVersion = 1,
  kNcclLogWarn = 2,
  kNcclLogInfo = 3
};
constexpr unsigned long kNcclLogSubsystemNet = 16;

using NcclLogger = void (*)(NcclLogLevel level, unsigned long subsystems, const char* file,
                            int line, const char* format, ...);
using NcclProfilerCallback = NcclResult (*)(void** event, int type, void* profiler_handle,
                                            int64_t plugin_id, void* extra);

constexpr int kNcclNetHandleMaxSize = 128;
constexpr int kNcclNetMaxRequests = 32;
constexpr int kNcclPtrHost = 0x1;
constexpr int kNcclNetDeviceHost = 0;  // ncclNetDeviceType: no device offload
constexpr int kNcclNetIdUndefined = -1;

// Identical in every version from 7 to 12: NCCL passes it only to ask for offload.
struct NcclNetDeviceHandle {
  int device_type;
  int device_version;
  void* handle;
  size_t size;
  int needs_proxy_progress;
};

struct NcclNetProperties_v8 {
  char* name;
  char* pci_path;
  uint64_t guid;
  int ptr_support;
  int reg_is_global;
  int speed_mbps;
  int port;
  float latency;
  int max_comms;
  int max_recvs;
  int net_device_type;
  int net_device_version;
};

struct NcclNetVirtualDevice_v9 {  // v9 to v11: at most 4 devices per virtual NIC
  int ndevs;
  int devs[4];
};

struct NcclNetVirtualDevice_v12 {  // v12: at most 8
  int ndevs;
  int devs[8];
};

// v9 and v10 use these properties as they are; v11 and v12 append fields.
template <typename VirtualDevice>
struct NcclNetPropertiesSince_v9 {
  char* name;
  char* pci_path;
  uint64_t guid;
  int ptr_support;
  int reg_is_global;
  int force_flush;
  int speed_mbps;
  int port;
  float latency;
  int max_comms;
  int max_recvs;
  int net_device_type;
  int net_device_version;
  VirtualDevice virtual_device;
  size_t max_p2p_bytes;
  size_t max_coll_bytes;
};

using NcclNetProperties_v9 = NcclNetPropertiesSince_v9<NcclNetVirtualDevice_v9>;

struct NcclNetProperties_v11 : NcclNetPropertiesSince_v9<NcclNetVirtualDevice_v9> {
  int max_multi_request_size;
};

struct NcclNetProperties_v12 : NcclNetPropertiesSince_v9<NcclNetVirtualDevice_v12> {
  int max_multi_request_size;
  int16_t rail_id;
  int16_t plane_id;
};

// NCCL's sizes on LP64, as its own headers give them.
static_assert(sizeof(NcclNetProperties_v8) == 64 && sizeof(NcclNetProperties_v9) == 104,
              "NCCL layout");
static_assert(sizeof(NcclNetProperties_v11) == 112 && sizeof(NcclNetProperties_v12) == 128,
              "NCCL layout");

struct NcclNetCommConfig {
  int traffic_class;
};

struct NcclNetCommAttr {
  int32_t max_concurrent_peers;
  int32_t min_concurrent_peers;
  int32_t max_flows_per_peer;
  int32_t min_flows_per_peer;
};

struct NcclNetAttr {
  NcclNetCommAttr send_comm;
  NcclNetCommAttr recv_comm;
  uint32_t op;
  uint32_t algo;
  uint32_t proto;
};

// v8: int sizes, one global init, no virtual devices.
struct NcclNet_v8 {
  const char* name;
  NcclResult (*init)(NcclLogger logger);
  NcclResult (*devices)(int* ndev);
  NcclResult (*getProperties)(int dev, NcclNetProperties_v8* props);
  NcclResult (*listen)(int dev, void* handle, void** listen_comm);
  NcclResult (*connect)(int dev, void* handle, void** send_comm,
                        NcclNetDeviceHandle** send_dev_comm);
  NcclResult (*accept)(void* listen_comm, void** recv_comm, NcclNetDeviceHandle** recv_dev_comm);
  NcclResult (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  NcclResult (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                            void** mhandle);
  NcclResult (*deregMr)(void* comm, void* mhandle);
  NcclResult (*isend)(void* send_comm, void* data, int size, int tag, void* mhandle,
                      void** request);
  NcclResult (*irecv)(void* recv_comm, int n, void** data, int* sizes, int* tags, void** mhandles,
                      void** request);
  NcclResult (*iflush)(void* recv_comm, int n, void** data, int* sizes, void** mhandles,
                       void** request);
  NcclResult (*test)(void* request, int* done, int* sizes);
  NcclResult (*closeSend)(void* send_comm);
  NcclResult (*closeRecv)(void* recv_comm);
  NcclResult (*closeListen)(void* listen_comm);
  NcclResult (*getDeviceMr)(void* comm, void* mhandle, void** device_mhandle);
  NcclResult (*irecvConsumed)(void* recv_comm, int n, void* request);
};

// v9: size_t sizes, virtual devices.
struct NcclNet_v9 {
  const char* name;
  NcclResult (*init)(NcclLogger logger);
  NcclResult (*devices)(int* ndev);
  NcclResult (*getProperties)(int dev, NcclNetProperties_v9* props);
  NcclResult (*listen)(int dev, void* handle, void** listen_comm);
  NcclResult (*connect)(int dev, void* handle, void** send_comm,
                        NcclNetDeviceHandle** send_dev_comm);
  NcclResult (*accept)(void* listen_comm, void** recv_comm, NcclNetDeviceHandle** recv_dev_comm);
  NcclResult (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  NcclResult (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                            void** mhandle);
  NcclResult (*deregMr)(void* comm, void* mhandle);
  NcclResult (*isend)(void* send_comm, void* data, size_t size, int tag, void* mhandle,
                      void** request);
  NcclResult (*irecv)(void* recv_comm, int n, void** data, size_t* sizes, int* tags,
                      void** mhandles, void** request);
  NcclResult (*iflush)(void* recv_comm, int n, void** data, int* sizes, void** mhandles,
                       void** request);
  NcclResult (*test)(void* request, int* done, int* sizes);
  NcclResult (*closeSend)(void* send_comm);
  NcclResult (*closeRecv)(void* recv_comm);
  NcclResult (*closeListen)(void* listen_comm);
  NcclResult (*getDeviceMr)(void* comm, void* mhandle, void** device_mhandle);
  NcclResult (*irecvConsumed)(void* recv_comm, int n, void* request);
  NcclResult (*makeVDevice)(int* dev, NcclNetVirtualDevice_v9* props);
};

// v10: a profiler callback at init, a comm config at connect, profiler handles on isend/irecv.
struct NcclNet_v10 {
  const char* name;
  NcclResult (*init)(NcclLogger logger, NcclProfilerCallback profiler);
  NcclResult (*devices)(int* ndev);
  NcclResult (*getProperties)(int dev, NcclNetProperties_v9* props);
  NcclResult (*listen)(int dev, void* handle, void** listen_comm);
  NcclResult (*connect)(int dev, NcclNetCommConfig* config, void* handle, void** send_comm,
                        NcclNetDeviceHandle** send_dev_comm);
  NcclResult (*accept)(void* listen_comm, void** recv_comm, NcclNetDeviceHandle** recv_dev_comm);
  NcclResult (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  NcclResult (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                            void** mhandle);
  NcclResult (*deregMr)(void* comm, void* mhandle);
  NcclResult (*isend)(void* send_comm, void* data, size_t size, int tag, void* mhandle,
                      void* phandle, void** request);
  NcclResult (*irecv)(void* recv_comm, int n, void** data, size_t* sizes, int* tags,
                      void** mhandles, void** phandles, void** request);
  NcclResult (*iflush)(void* recv_comm, int n, void** data, int* sizes, void** mhandles,
                       void** request);
  NcclResult (*test)(void* request, int* done, int* sizes);
  NcclResult (*closeSend)(void* send_comm);
  NcclResult (*closeRecv)(void* recv_comm);
  NcclResult (*closeListen)(void* listen_comm);
  NcclResult (*getDeviceMr)(void* comm, void* mhandle, void** device_mhandle);
  NcclResult (*irecvConsumed)(void* recv_comm, int n, void* request);
  NcclResult (*makeVDevice)(int* dev, NcclNetVirtualDevice_v9* props);
};

// v11 and v12 share the function table: a context per communicator, finalize and
// setNetAttr. They differ only in the properties and virtual-device structs.
template <typename Properties, typename VirtualDevice>
struct NcclNetContextual {
  const char* name;
  NcclResult (*init)(void** ctx, uint64_t comm_id, NcclNetCommConfig* config, NcclLogger logger,
                     NcclProfilerCallback profiler);
  NcclResult (*devices)(int* ndev);
  NcclResult (*getProperties)(int dev, Properties* props);
  NcclResult (*listen)(void* ctx, int dev, void* handle, void** listen_comm);
  NcclResult (*connect)(void* ctx, int dev, void* handle, void** send_comm,
                        NcclNetDeviceHandle** send_dev_comm);
  NcclResult (*accept)(void* listen_comm, void** recv_comm, NcclNetDeviceHandle** recv_dev_comm);
  NcclResult (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  NcclResult (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                            void** mhandle);
  NcclResult (*deregMr)(void* comm, void* mhandle);
  NcclResult (*isend)(void* send_comm, void* data, size_t size, int tag, void* mhandle,
                      void* phandle, void** request);
  NcclResult (*irecv)(void* recv_comm, int n, void** data, size_t* sizes, int* tags,
                      void** mhandles, void** phandles, void** request);
  NcclResult (*iflush)(void* recv_comm, int n, void** data, int* sizes, void** mhandles,
                       void** request);
  NcclResult (*test)(void* request, int* done, int* sizes);
  NcclResult (*closeSend)(void* send_comm);
  NcclResult (*closeRecv)(void* recv_comm);
  NcclResult (*closeListen)(void* listen_comm);
  NcclResult (*getDeviceMr)(void* comm, void* mhandle, void** device_mhandle);
  NcclResult (*irecvConsumed)(void* recv_comm, int n, void* request);
  NcclResult (*makeVDevice)(int* dev, VirtualDevice* props);
  NcclResult (*finalize)(void* ctx);
  NcclResult (*setNetAttr)(void* ctx, NcclNetAttr* attr);
};

using NcclNet_v11 = NcclNetContextual<NcclNetProperties_v11, NcclNetVirtualDevice_v9>;
using NcclNet_v12 = NcclNetContextual<NcclNetProperties_v12, NcclNetVirtualDevice_v12>;
