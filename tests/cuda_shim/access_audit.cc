// The memory accesses of every CUDA kernel of xla_ffi/kernels_cuda.cu, from the
// CPU shim's access log: for each kernel and each buffer it touches, how often
// each byte is read and written, what share of the bytes moves in 16-byte
// accesses, and what share in coalesced warp accesses. tests/test_cuda_shim.py
// compares these with each kernel's design (tests/cuda_design.py).
//
// A warp access is the accesses of one warp's lanes with the same sequence number
// (each lane's n-th access of the launch). It is coalesced when its lanes' bytes
// are one contiguous run. A byte read twice by one warp access (lanes sharing a
// byte) counts once, as the hardware merges them.
//
// Usage: access_audit. Prints one line per (kernel, dtype, buffer):
//   kernel dtype buffer bytes reads_min reads_max writes_min writes_max wide coalesced
// where `bytes` is the buffer's size, reads and writes are per byte over the
// whole buffer, `wide` the share of its moved bytes in 16-byte accesses and
// `coalesced` the share in coalesced warp accesses.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_runtime.h"
#include "kernels.h"
#include "layout.h"

namespace {

using bagua::BFloat16;
using bagua::Chunking;
using bagua::Cuda;
using bagua::Format;
namespace gpu = bagua::kernels;

// A named range of memory whose accesses are counted.
struct Region {
  std::string name;
  uintptr_t begin, end;
};

// Accesses of one kernel run, counted per region.
struct Counts {
  std::vector<int> reads, writes;  // per byte
  double moved = 0, wide = 0, coalesced = 0;
};

void report(const std::string& kernel, const char* dtype, const std::vector<Region>& regions,
            const std::vector<cuda_shim::Access>& log) {
  std::vector<Counts> counts(regions.size());
  for (std::size_t r = 0; r < regions.size(); ++r) {
    counts[r].reads.assign(regions[r].end - regions[r].begin, 0);
    counts[r].writes.assign(regions[r].end - regions[r].begin, 0);
  }
  const auto region_of = [&](uintptr_t a) -> int {
    for (std::size_t r = 0; r < regions.size(); ++r)
      if (a >= regions[r].begin && a < regions[r].end) return static_cast<int>(r);
    return -1;
  };
  // Warp accesses: (launch, block, warp, sequence, write) -> the lanes' accesses.
  std::map<std::tuple<uint32_t, uint32_t, uint32_t, uint32_t, bool>,
           std::vector<const cuda_shim::Access*>>
      warps;
  for (const cuda_shim::Access& a : log)
    warps[{a.launch, a.block, a.thread / 32, a.sequence, a.write}].push_back(&a);
  for (const auto& [key, lanes] : warps) {
    std::vector<std::pair<uintptr_t, uintptr_t>> runs;
    for (const cuda_shim::Access* a : lanes) runs.emplace_back(a->address, a->address + a->bytes);
    std::sort(runs.begin(), runs.end());
    runs.erase(std::unique(runs.begin(), runs.end()), runs.end());  // lanes sharing an address
    bool contiguous = true;
    for (std::size_t i = 1; i < runs.size(); ++i) contiguous &= runs[i].first == runs[i - 1].second;
    for (const auto& [begin, end] : runs) {
      const int r = region_of(begin);
      if (r < 0) {
        std::fprintf(stderr, "access_audit: %s touches memory outside its buffers\n",
                     kernel.c_str());
        std::exit(2);
      }
      Counts& c = counts[r];
      for (uintptr_t b = begin; b < end; ++b) {
        if (region_of(b) != r) {
          std::fprintf(stderr, "access_audit: %s: an access spans two buffers\n", kernel.c_str());
          std::exit(2);
        }
        ++(std::get<4>(key) ? c.writes : c.reads)[b - regions[r].begin];
      }
      c.moved += static_cast<double>(end - begin);
      if (end - begin == 16) c.wide += 16;
      if (contiguous) c.coalesced += static_cast<double>(end - begin);
    }
  }
  // Regions of one name (a compressed buffer's headers, its payloads) are one line.
  std::vector<std::string> names;
  for (const Region& r : regions)
    if (std::find(names.begin(), names.end(), r.name) == names.end()) names.push_back(r.name);
  for (const std::string& name : names) {
    std::size_t bytes = 0;
    int rmin = 1 << 30, rmax = 0, wmin = 1 << 30, wmax = 0;
    double moved = 0, wide = 0, coalesced = 0;
    for (std::size_t r = 0; r < regions.size(); ++r) {
      if (regions[r].name != name) continue;
      const Counts& c = counts[r];
      bytes += c.reads.size();
      for (std::size_t b = 0; b < c.reads.size(); ++b) {
        rmin = std::min(rmin, c.reads[b]);
        rmax = std::max(rmax, c.reads[b]);
        wmin = std::min(wmin, c.writes[b]);
        wmax = std::max(wmax, c.writes[b]);
      }
      moved += c.moved;
      wide += c.wide;
      coalesced += c.coalesced;
    }
    if (bytes == 0) rmin = wmin = 0;
    std::printf("%s %s %s %zu %d %d %d %d %.4f %.4f\n", kernel.c_str(), dtype, name.c_str(), bytes,
                rmin, rmax, wmin, wmax, moved > 0 ? wide / moved : 0.0,
                moved > 0 ? coalesced / moved : 0.0);
  }
}

template <typename T>
Region region(const char* name, const std::vector<T>& v) {
  return {name, reinterpret_cast<uintptr_t>(v.data()),
          reinterpret_cast<uintptr_t>(v.data() + v.size())};
}

// The headers and payloads of a compressed buffer, as separate regions.
std::vector<Region> compressed_regions(const char* name, Format format, int64_t n, int64_t k,
                                       const std::vector<uint8_t>& buffer) {
  const Chunking chunking{format, n, k};
  std::vector<Region> regions;
  const uintptr_t base = reinterpret_cast<uintptr_t>(buffer.data());
  for (int64_t g = 0; g < chunking.group_count(); ++g) {
    const bagua::Group group = chunking.group(g);
    const uintptr_t header = base + group.offset;
    regions.push_back({std::string(name) + ".header", header, header + bagua::kHeaderBytes});
    regions.push_back({std::string(name) + ".payload", header + bagua::kHeaderBytes,
                       header + bagua::group_bytes(format, group.length)});
  }
  return regions;
}

template <typename T>
const char* dtype_name() {
  return std::is_same_v<T, float> ? "f32" : "bf16";
}

// Runs `run` with the access log on and returns the log.
template <typename F>
std::vector<cuda_shim::Access> logged(F&& run) {
  std::vector<cuda_shim::Access> log;
  cuda_shim::set_access_log(&log);
  const bagua::Status s = run();
  cuda_shim::set_access_log(nullptr);
  if (!s.ok()) {
    std::fprintf(stderr, "access_audit: a kernel failed: %s\n", s.message.c_str());
    std::exit(2);
  }
  return log;
}

template <typename T>
void audit(int64_t n, int64_t k) {
  const char* dtype = dtype_name<T>();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<T> x(n), y(n), z(n), out(n);
  std::vector<float> residual(n), residual_out(n);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = bagua::from_float<T>(normal(rng));
    y[i] = bagua::from_float<T>(normal(rng));
    z[i] = bagua::from_float<T>(normal(rng));
    residual[i] = normal(rng) * 0.1f;
  }
  const Cuda cuda{nullptr};
  struct Codec {
    const char* name;
    Format format;
  };
  for (const Codec& codec :
       {Codec{"minmax_uint8", Format::kMinMaxUInt8}, Codec{"minmax_uint4", Format::kMinMaxUInt4},
        Codec{"sign", Format::kSign}}) {
    std::vector<uint8_t> packed(bagua::compressed_bytes(codec.format, n, k));
    const auto compress = [&](const float* r, float* ro) {
      switch (codec.format) {
        case Format::kMinMaxUInt8:
          return gpu::minmax_compress(cuda, x.data(), r, n, k, packed.data(), ro);
        case Format::kMinMaxUInt4:
          return gpu::minmax_uint4_compress(cuda, x.data(), r, n, k, packed.data(), ro);
        default:
          return gpu::sign_compress(cuda, x.data(), r, n, k, packed.data(), ro);
      }
    };
    const std::string name = codec.name;
    std::vector<Region> regions = compressed_regions("compressed", codec.format, n, k, packed);
    regions.push_back(region("x", x));
    report(name + "_compress", dtype, regions, logged([&] { return compress(nullptr, nullptr); }));
    regions.push_back(region("residual", residual));
    regions.push_back(region("residual_out", residual_out));
    report(name + "_compress_feedback", dtype, regions,
           logged([&] { return compress(residual.data(), residual_out.data()); }));

    std::vector<Region> decode = compressed_regions("compressed", codec.format, n, k, packed);
    decode.push_back(region("out", out));
    report(name + "_decompress", dtype, decode, logged([&] {
             switch (codec.format) {
               case Format::kMinMaxUInt8:
                 return gpu::minmax_decompress(cuda, packed.data(), n, k, out.data());
               case Format::kMinMaxUInt4:
                 return gpu::minmax_uint4_decompress(cuda, packed.data(), n, k, out.data());
               default:
                 return gpu::sign_decompress(cuda, packed.data(), n, k, out.data());
             }
           }));

    // k single-chunk buffers of m elements: the compressed tensor itself.
    const int64_t m = n / k;
    std::vector<T> reduced(m);
    std::vector<Region> reduce = compressed_regions("compressed", codec.format, n, k, packed);
    reduce.push_back(region("out", reduced));
    report(
        name + "_decompress_reduce", dtype, reduce, logged([&] {
          switch (codec.format) {
            case Format::kMinMaxUInt8:
              return gpu::minmax_decompress_reduce(cuda, packed.data(), m, k, true, reduced.data());
            case Format::kMinMaxUInt4:
              return gpu::minmax_uint4_decompress_reduce(cuda, packed.data(), m, k, true,
                                                         reduced.data());
            default:
              return gpu::sign_decompress_reduce(cuda, packed.data(), m, k, true, reduced.data());
          }
        }));
  }
  const std::vector<Region> two = {region("x", x), region("y", y), region("out", out)};
  report("axpy", dtype, two,
         logged([&] { return gpu::axpy(cuda, x.data(), 0.5f, y.data(), n, out.data()); }));
  const std::vector<Region> three = {region("x", x), region("y", y), region("z", z),
                                     region("out", out)};
  report("async_average", dtype, three, logged([&] {
           return gpu::async_average(cuda, x.data(), y.data(), z.data(), 4.0f, n, out.data());
         }));
}

}  // namespace

int main() {
  cuda_shim::device() = {8, 1 << 20, 1, 2, false};  // 8 blocks: kernels stride over their tiles
  // Two chunks of 12800 elements: a full group and a partial one each.
  audit<float>(25600, 2);
  audit<BFloat16>(25600, 2);
  return 0;
}
