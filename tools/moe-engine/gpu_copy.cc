#include "gpu_copy.h"

#include <chrono>
#include <cstdio>
#include <cstring>

#include "expert_arena/gpu.h"

namespace expert_arena::moe {
namespace {

std::string Mib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

}  // namespace

GpuCopyReport CopyUsedExpertsToDevice(const Arena& arena, const ExpertTable& table,
                                      const std::vector<uint32_t>& expert_hits,
                                      const std::string& requested) {
  GpuCopyReport report;
  if (requested.empty() || requested == "none") return report;
  const std::string cpu = "; the experts are computed on the CPU";
  auto device = ParseGpuDevice(requested);
  if (!device.ok()) {
    report.note = "no device copy: " + device.status().message() + cpu;
    return report;
  }
  if (!GpuBackendBuilt(device->backend)) {
    report.note = std::string("no device copy: this build has no ") +
                  GpuBackendName(device->backend) + " backend" + cpu;
    return report;
  }
  auto count = GpuDeviceCount(device->backend);
  if (!count.ok()) {
    report.note = "no device copy: " + count.status().message() + cpu;
    return report;
  }
  if (device->index >= *count) {
    report.note = "no device copy: " + device->ToString() + " does not exist (" +
                  std::to_string(*count) + " devices)" + cpu;
    return report;
  }

  // Every matrix of every expert the run routed to, one after another in one buffer.
  std::vector<std::span<const std::byte>> parts;
  uint64_t used_bytes = 0, experts = 0;
  for (uint64_t l = 0; l < table.layers(); ++l) {
    for (uint64_t e = 0; e < table.experts(); ++e) {
      if (expert_hits[l * table.experts() + e] == 0) continue;
      const ExpertWeights& w = table.at(l, e);
      for (const Matrix* m : {&w.gate, &w.up, &w.down}) {
        parts.push_back(MatrixBytes(*m));
        used_bytes += parts.back().size();
      }
      ++experts;
    }
  }
  if (used_bytes == 0) return report;
  auto buffer = DeviceBuffer::Allocate(*device, used_bytes);
  if (!buffer.ok()) {
    report.note = "no device copy: " + buffer.status().message() + cpu;
    return report;
  }
  auto start = std::chrono::steady_clock::now();
  std::vector<CopyEvent> events;
  uint64_t offset = 0;
  for (const auto& part : parts) {
    auto copied =
        CopyToDeviceAsync(*device, part, static_cast<std::byte*>(buffer->data()) + offset, nullptr);
    if (!copied.ok()) {
      report.note = "device copy failed: " + copied.status().message() + cpu;
      return report;
    }
    events.push_back(std::move(*copied));
    offset += part.size();
  }
  for (const CopyEvent& event : events) {
    Status s = event.Wait();
    if (!s.ok()) {
      report.note = "device copy failed: " + s.message() + cpu;
      return report;
    }
  }
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report.copied_bytes = used_bytes;

  // Read the last expert's down matrix back: the device holds the arena's bytes.
  std::vector<std::byte> back(parts.back().size());
  Status s =
      CopyToHost(*device, static_cast<std::byte*>(buffer->data()) + used_bytes - back.size(), back);
  bool same = s.ok() && std::memcmp(back.data(), parts.back().data(), back.size()) == 0;
  const ArenaReport& r = arena.report();
  char rate[64];
  std::snprintf(rate, sizeof rate, "%.3f s (%.1f GB/s)", report.seconds,
                report.seconds > 0 ? static_cast<double>(used_bytes) / report.seconds / 1e9 : 0.0);
  report.note = "copied " + std::to_string(experts) + " used experts (" + Mib(used_bytes) +
                ") to " + device->ToString() + " in " + rate + ", " +
                (r.gpu_registered_bytes > 0 ? "DMA from the registered arena"
                                            : "staged (the arena is not registered)") +
                "; " +
                (same ? "read-back matches the arena"
                      : "READ-BACK DIFFERS" + (s.ok() ? "" : ": " + s.message())) +
                "; the FFNs are computed on the CPU";
  report.verified = same;
  return report;
}

}  // namespace expert_arena::moe
