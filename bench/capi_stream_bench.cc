// capi_stream_bench: what the C interface of tensor streaming (expert_arena_stream.h) costs
// over the C++ API it wraps, measured in the same run.
//
// One round = put one tensor, open its descriptor, release it (the space comes back), in one
// process, through the C calls (ea_stream_put / ea_stream_open / ea_stream_tensor_get_info /
// ea_stream_release) or the C++ ones (StreamProducer::Put / StreamConsumer::Open /
// StreamTensor::Release), on one producer and one consumer of each kind in the same private
// directory. C and C++ rounds alternate, so both see the same machine. Reported per tensor
// size: the median round of each and the ratio C / C++ (the peer).
//
// Usage: flock /tmp/expert-arena-bench.lock build/bin/capi_stream_bench [--rounds N]
//            [--dir /dev/shm]
#include <spdlog/sinks/null_sink.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "expert_arena/expert_arena.h"
#include "expert_arena/stream.h"

namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Fail(const char* what, const std::string& message) {
  std::fprintf(stderr, "capi_stream_bench: %s: %s\n", what, message.c_str());
  return 1;
}

int Run(const std::string& dir, int rounds) {
  ea_stream_params sp;
  ea_stream_params_init(&sp);
  sp.directory = dir.c_str();
  sp.spill_directory = dir.c_str();
  sp.logical_name = "capi_bench";
  sp.segment_bytes = 64ull << 20;
  sp.max_segments = 2;
  sp.sweep_at_start = 0;
  sp.quiet = 1;
  ea_stream_producer* cprod = nullptr;
  ea_stream_consumer* ccons = nullptr;
  if (ea_stream_producer_create(&sp, &cprod) != 0) return Fail("C producer", ea_last_error());
  if (ea_stream_consumer_create(&sp, &ccons) != 0) return Fail("C consumer", ea_last_error());

  expert_arena::StreamOptions so;
  so.directory = dir;
  so.spill_directory = dir;
  so.logical_name = "cxx_bench";
  so.segment_bytes = 64ull << 20;
  so.max_segments = 2;
  so.sweep_at_start = false;
  so.logger =
      std::make_shared<spdlog::logger>("bench", std::make_shared<spdlog::sinks::null_sink_mt>());
  auto cxxprod = expert_arena::StreamProducer::Create(so);
  if (!cxxprod.ok()) return Fail("C++ producer", cxxprod.status().message());
  auto cxxcons = expert_arena::StreamConsumer::Create({.directory = dir, .spill_directory = dir});
  if (!cxxcons.ok()) return Fail("C++ consumer", cxxcons.status().message());

  std::printf(
      "# capi_stream_bench: %d rounds per size; round = put + open + release, one "
      "process\n",
      rounds);
  std::printf("%-10s %14s %14s %10s\n", "bytes", "C median us", "C++ median us", "C / C++");
  for (uint64_t bytes : {uint64_t{4096}, uint64_t{256} << 10, uint64_t{8} << 20}) {
    std::vector<std::byte> data(bytes);
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>(i * 31);
    const uint64_t dims[1] = {bytes};
    std::vector<double> c_us, cxx_us;
    unsigned char desc[EA_STREAM_DESCRIPTOR_MAX];
    for (int r = 0; r < rounds + 20; ++r) {  // the first 20 of each are warm-up
      auto t0 = Clock::now();
      size_t len = 0;
      if (ea_stream_put(cprod, "bench", data.data(), bytes, "u8", dims, 1, 1, desc, sizeof desc,
                        &len) != 0) {
        return Fail("ea_stream_put", ea_last_error());
      }
      ea_stream_tensor* t = nullptr;
      if (ea_stream_open(ccons, desc, len, &t) != 0) return Fail("ea_stream_open", ea_last_error());
      ea_stream_tensor_info info{};
      info.size = sizeof info;
      if (ea_stream_tensor_get_info(t, &info) != 0 || info.bytes != bytes) {
        return Fail("ea_stream_tensor_get_info", ea_last_error());
      }
      ea_stream_release(t);
      auto t1 = Clock::now();

      auto d = cxxprod->Put("bench", data, {.dtype = "u8", .shape = {bytes}});
      if (!d.ok()) return Fail("Put", d.status().message());
      auto ct = cxxcons->Open(*d);
      if (!ct.ok() || ct->bytes().size() != bytes) return Fail("Open", ct.status().message());
      ct->Release();
      auto t2 = Clock::now();
      if (r >= 20) {
        c_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        cxx_us.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
      }
    }
    double c = Median(c_us), cxx = Median(cxx_us);
    std::printf("%-10llu %14.2f %14.2f %10.3f\n", static_cast<unsigned long long>(bytes), c, cxx,
                c / cxx);
  }
  ea_stream_consumer_destroy(ccons);
  ea_stream_producer_destroy(cprod);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 2000;
  std::string base = "/dev/shm";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--rounds") {
      rounds = std::max(1, std::atoi(argv[i + 1]));
    } else if (flag == "--dir") {
      base = argv[i + 1];
    } else {
      std::fprintf(stderr, "usage: %s [--rounds N] [--dir DIR]\n", argv[0]);
      return 2;
    }
  }
  std::string tmpl = base + "/ea-capi-bench-XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) return Fail("mkdtemp", tmpl);
  const std::string dir = tmpl;

  int rc = Run(dir, rounds);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return rc;
}
