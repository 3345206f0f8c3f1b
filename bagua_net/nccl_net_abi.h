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

// Every version's properties hold these two runs of fields; from v9 force_flush
// stands between them. Nested, they keep NCCL's flat offsets (asserted below).
struct NcclNetIdentity {
  char* name;
  char* pci_path;
  uint64_t guid;
  int ptr_support;
  int reg_is_global;
};

struct NcclNetCapacity {
  int speed_mbps;
  int port;
  float latency;
  int max_comms;
  int max_recvs;
  int net_device_type;
  int net_device_version;
};

struct NcclNetProperties_v8 {
  NcclNetIdentity identity;
  NcclNetCapacity capacity;
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
  NcclNetIdentity identity;
  int force_flush;
  NcclNetCapacity capacity;
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

// NCCL's sizes and offsets on LP64, as its own headers give them.
static_assert(offsetof(NcclNetProperties_v8, capacity) == 32 &&
                  offsetof(NcclNetProperties_v9, force_flush) == 32 &&
                  offsetof(NcclNetProperties_v9, capacity) == 36 &&
                  offsetof(NcclNetProperties_v9, virtual_device) == 64,
              "NCCL layout");
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

// The function table of every version, in NCCL's order. The entries whose
// arguments changed between versions are type parameters; the rest are spelled once.
template <typename Init, typename Properties, typename Listen, typename Connect, typename Isend,
          typename Irecv>
struct NcclNetCalls {
  const char* name;
  Init init;
  NcclResult (*devices)(int* ndev);
  NcclResult (*getProperties)(int dev, Properties* props);
  Listen listen;
  Connect connect;
  NcclResult (*accept)(void* listen_comm, void** recv_comm, NcclNetDeviceHandle** recv_dev_comm);
  NcclResult (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  NcclResult (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                            void** mhandle);
  NcclResult (*deregMr)(void* comm, void* mhandle);
  Isend isend;
  Irecv irecv;
  NcclResult (*iflush)(void* recv_comm, int n, void** data, int* sizes, void** mhandles,
                       void** request);
  NcclResult (*test)(void* request, int* done, int* sizes);
  NcclResult (*closeSend)(void* send_comm);
  NcclResult (*closeRecv)(void* recv_comm);
  NcclResult (*closeListen)(void* listen_comm);
  NcclResult (*getDeviceMr)(void* comm, void* mhandle, void** device_mhandle);
  NcclResult (*irecvConsumed)(void* recv_comm, int n, void* request);
};

// From v9 the table ends with makeVDevice.
template <typename Calls, typename VirtualDevice>
struct NcclNetWithVirtualDevices : Calls {
  NcclResult (*makeVDevice)(int* dev, VirtualDevice* props);
};

// The per-version entries.
using NcclInit_v8 = NcclResult (*)(NcclLogger logger);
using NcclInit_v10 = NcclResult (*)(NcclLogger logger, NcclProfilerCallback profiler);
using NcclInit_v11 = NcclResult (*)(void** ctx, uint64_t comm_id, NcclNetCommConfig* config,
                                    NcclLogger logger, NcclProfilerCallback profiler);
using NcclListen_v8 = NcclResult (*)(int dev, void* handle, void** listen_comm);
using NcclListen_v11 = NcclResult (*)(void* ctx, int dev, void* handle, void** listen_comm);
using NcclConnect_v8 = NcclResult (*)(int dev, void* handle, void** send_comm,
                                      NcclNetDeviceHandle** send_dev_comm);
using NcclConnect_v10 = NcclResult (*)(int dev, NcclNetCommConfig* config, void* handle,
                                       void** send_comm, NcclNetDeviceHandle** send_dev_comm);
using NcclConnect_v11 = NcclResult (*)(void* ctx, int dev, void* handle, void** send_comm,
                                       NcclNetDeviceHandle** send_dev_comm);
// v8 sizes are int; v9 sizes are size_t; v10 adds profiler handles.
using NcclIsend_v8 = NcclResult (*)(void* send_comm, void* data, int size, int tag, void* mhandle,
                                    void** request);
using NcclIsend_v9 = NcclResult (*)(void* send_comm, void* data, size_t size, int tag,
                                    void* mhandle, void** request);
using NcclIsend_v10 = NcclResult (*)(void* send_comm, void* data, size_t size, int tag,
                                     void* mhandle, void* phandle, void** request);
using NcclIrecv_v8 = NcclResult (*)(void* recv_comm, int n, void** data, int* sizes, int* tags,
                                    void** mhandles, void** request);
using NcclIrecv_v9 = NcclResult (*)(void* recv_comm, int n, void** data, size_t* sizes, int* tags,
                                    void** mhandles, void** request);
using NcclIrecv_v10 = NcclResult (*)(void* recv_comm, int n, void** data, size_t* sizes, int* tags,
                                     void** mhandles, void** phandles, void** request);

// v8: int sizes, one global init, no virtual devices.
using NcclNet_v8 = NcclNetCalls<NcclInit_v8, NcclNetProperties_v8, NcclListen_v8, NcclConnect_v8,
                                NcclIsend_v8, NcclIrecv_v8>;
// v9: size_t sizes, virtual devices.
using NcclNet_v9 =
    NcclNetWithVirtualDevices<NcclNetCalls<NcclInit_v8, NcclNetProperties_v9, NcclListen_v8,
                                           NcclConnect_v8, NcclIsend_v9, NcclIrecv_v9>,
                              NcclNetVirtualDevice_v9>;
// v10: a profiler callback at init, a comm config at connect, profiler handles on isend/irecv.
using NcclNet_v10 =
    NcclNetWithVirtualDevices<NcclNetCalls<NcclInit_v10, NcclNetProperties_v9, NcclListen_v8,
                                           NcclConnect_v10, NcclIsend_v10, NcclIrecv_v10>,
                              NcclNetVirtualDevice_v9>;

// v11 and v12: a context per communicator, finalize and setNetAttr. They differ
// only in the properties and virtual-device structs.
template <typename Properties, typename VirtualDevice>
struct NcclNetContextual
    : NcclNetWithVirtualDevices<NcclNetCalls<NcclInit_v11, Properties, NcclListen_v11,
                                             NcclConnect_v11, NcclIsend_v10, NcclIrecv_v10>,
                                VirtualDevice> {
  NcclResult (*finalize)(void* ctx);
  NcclResult (*setNetAttr)(void* ctx, NcclNetAttr* attr);
};

using NcclNet_v11 = NcclNetContextual<NcclNetProperties_v11, NcclNetVirtualDevice_v9>;
using NcclNet_v12 = NcclNetContextual<NcclNetProperties_v12, NcclNetVirtualDevice_v12>;

// NCCL reads the tables by offset: a name and 18 (v8), 19 (v9, v10) or 21 (v11, v12)
// function pointers, nothing between them.
static_assert(sizeof(NcclNet_v8) == 19 * sizeof(void*) && sizeof(NcclNet_v9) == 20 * sizeof(void*),
              "NCCL layout");
static_assert(sizeof(NcclNet_v10) == 20 * sizeof(void*) &&
                  sizeof(NcclNet_v12) == 22 * sizeof(void*),
              "NCCL layout");
