// moe-engine: the example engine. It opens its experts through expert-arena (a private
// arena by default; --shared-expert-arena PATH shares one copy between engines), routes a
// deterministic stream of tokens top-k over the experts and runs each chosen expert's FFN on
// the CPU straight from the arena's views, then prints its start line and an output checksum
// that is the same whether the arena was private, loaded or attached.
//
// Exit codes: 0 success, 1 a refusal or failure (the message says which), 2 bad usage.
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../kernel_json.h"
#include "../numa_json.h"
#include "common/units.h"
#include "expert_arena/arena.h"
#include "expert_arena/cli.h"
#include "expert_table.h"
#include "forward.h"
#include "gpu_copy.h"
#include "platform/process_memory.h"
#include "platform/system_info.h"

namespace expert_arena::moe {
namespace {

struct EngineArgs {
  std::vector<std::string> models;
  cli::SharedArenaFlags arena;
  ForwardOptions forward;
  bool json = false;
  bool hold = false;
  std::string outputs_path;  // --outputs: the final states, for comparisons with other engines
};

std::string Hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

sigset_t HoldSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

// Blocks until SIGINT or SIGTERM: the arena stays mapped (and this engine's USER lock held)
// so that tests and the demo can look at two engines sharing it. The signals were blocked
// before the report was printed, so one sent as soon as the report appears is not lost.
void HoldUntilSignalled() {
  sigset_t set = HoldSignals();
  int sig = 0;
  sigwait(&set, &sig);
}

struct MemoryReport {
  uint64_t rss = 0;        // the whole process
  uint64_t arena_rss = 0;  // of the arena mapping, which other engines may share
  uint64_t shared = 0;     // arena pages that another process maps too
  uint64_t huge = 0;
};

MemoryReport MeasureMemory(const Arena& arena) {
  MemoryReport m;
  if (auto rss = platform::ResidentBytes(); rss.ok()) m.rss = *rss;
  auto data = arena.data();
  if (auto range = platform::MemoryOfMappingsOverlapping(data.data(), data.size()); range.ok()) {
    m.arena_rss = range->rss;
    m.shared = range->shared;
    m.huge = range->huge;
  }
  return m;
}

int Run(EngineArgs& args) {
  ModelSpec model;
  model.files = args.models;
  ArenaOptions options;
  args.arena.ApplyTo(options);
  options.progress = !args.json && isatty(STDERR_FILENO);
  auto arena = Arena::Open(model, options);
  if (!arena.ok()) {
    std::fprintf(stderr, "moe-engine: %s\n", arena.status().message().c_str());
    return 1;
  }
  const ArenaReport& r = arena->report();

  std::vector<TensorView> views;
  views.reserve(arena->tensor_count());
  for (size_t i = 0; i < arena->tensor_count(); ++i) views.push_back(arena->tensor(i));
  auto table = ExpertTable::Build(views);
  if (!table.ok()) {
    std::fprintf(stderr, "moe-engine: %s\n", table.status().message().c_str());
    return 1;
  }
  auto result = RunForward(*table, args.forward);
  if (!result.ok()) {
    std::fprintf(stderr, "moe-engine: %s\n", result.status().message().c_str());
    return 1;
  }
  if (!args.outputs_path.empty()) {
    std::FILE* f = std::fopen(args.outputs_path.c_str(), "wb");
    size_t n = result->outputs.size();
    bool written = f != nullptr && std::fwrite(result->outputs.data(), sizeof(float), n, f) == n;
    if (f != nullptr && std::fclose(f) != 0) written = false;
    if (!written) {
      std::fprintf(stderr, "moe-engine: cannot write --outputs %s\n", args.outputs_path.c_str());
      return 1;
    }
  }
  // With a registered device, the experts this run used go to the device from the arena.
  GpuCopyReport gpu = CopyUsedExpertsToDevice(*arena, *table, result->expert_hits, args.arena.gpu);
  MemoryReport mem = MeasureMemory(*arena);
  if (args.hold) {
    sigset_t set = HoldSignals();
    sigprocmask(SIG_BLOCK, &set, nullptr);
  }
  const char* role = ArenaRoleName(r.role);
  // A loader's rate is its reading rate (seconds also hold page collapsing and GPU
  // registration); an attacher's is how fast the experts became usable.
  const std::string rate =
      FormatRate(r.tensor_bytes, r.role == ArenaRole::kAttached ? r.seconds : r.load_seconds);

  if (args.json) {
    nlohmann::json j;
    j["role"] = role;
    j["kernel"] = expert_arena::tools::KernelJson(r);
    j["numa"] = expert_arena::tools::NumaJson(r);
    j["checksum"] = Hex(result->checksum);
    j["seconds"] = r.seconds;
    j["bytes_read"] = r.bytes_read;
    j["rss_bytes"] = mem.rss;
    j["shared_bytes"] = mem.shared;
    j["arena_rss_bytes"] = mem.arena_rss;
    j["private_rss_bytes"] = mem.rss > mem.arena_rss ? mem.rss - mem.arena_rss : 0;
    j["huge_bytes"] = r.huge_bytes;
    j["arena"] = r.path;
    j["backing"] = r.backing;
    j["data_bytes"] = r.data_bytes;
    j["mapped_bytes"] = r.mapped_bytes;
    j["tensor_bytes"] = r.tensor_bytes;
    j["tensors"] = r.tensors;
    j["load_seconds"] = r.load_seconds;
    j["wait_seconds"] = r.wait_seconds;
    j["reader"] = r.reader;
    j["charge"] = r.charge_note;
    j["identity"] = Hex(r.identity_hash);
    j["gpu"] = r.gpu_note.empty() ? "none" : r.gpu_note;
    j["gpu_registered_bytes"] = r.gpu_registered_bytes;
    j["gpu_copied_bytes"] = gpu.copied_bytes;
    j["gpu_copy_seconds"] = gpu.seconds;
    j["gpu_copy_verified"] = gpu.verified;
    j["gpu_copy_note"] = gpu.note;
    j["naming"] = table->naming();
    j["layers"] = table->layers();
    j["experts"] = table->experts();
    j["hidden"] = table->hidden();
    j["ffn"] = table->ffn();
    j["dtype"] = table->dtype_name();
    j["tokens"] = args.forward.tokens;
    j["top_k"] = args.forward.top_k;
    j["threads"] = args.forward.threads;
    j["experts_used"] = result->experts_used;
    j["expert_calls"] = result->expert_calls;
    j["compute_seconds"] = result->seconds;
    j["pid"] = getpid();
    std::cout << j.dump() << std::endl;
  } else {
    std::printf(
        "moe-engine: %s %s in %s (%s%s%s), %s of %s on 2 MiB pages, %llu model bytes read; "
        "gpu: %s\n",
        role, FormatBytes(r.tensor_bytes).c_str(), FormatDuration(r.seconds).c_str(), rate.c_str(),
        r.role == ArenaRole::kAttached ? "" : " reading, ", r.reader.c_str(),
        FormatBytes(r.huge_bytes).c_str(), FormatBytes(r.mapped_bytes).c_str(),
        static_cast<unsigned long long>(r.bytes_read),
        r.gpu_note.empty() ? "none" : r.gpu_note.c_str());
    std::printf("moe-engine: %s model, %llu layers x %llu experts, hidden %llu, ffn %llu, %s\n",
                table->naming().c_str(), static_cast<unsigned long long>(table->layers()),
                static_cast<unsigned long long>(table->experts()),
                static_cast<unsigned long long>(table->hidden()),
                static_cast<unsigned long long>(table->ffn()), table->dtype_name().c_str());
    std::printf(
        "moe-engine: %llu tokens, top-%llu: %llu expert FFNs (%llu of %llu experts used) in "
        "%.3f s\n",
        static_cast<unsigned long long>(args.forward.tokens),
        static_cast<unsigned long long>(args.forward.top_k),
        static_cast<unsigned long long>(result->expert_calls),
        static_cast<unsigned long long>(result->experts_used),
        static_cast<unsigned long long>(table->layers() * table->experts()), result->seconds);
    if (!gpu.note.empty()) std::printf("moe-engine: gpu: %s\n", gpu.note.c_str());
    std::printf(
        "moe-engine: memory: rss %.1f MiB, arena %.1f MiB resident of which %.1f MiB "
        "shared with other processes\n",
        static_cast<double>(mem.rss) / (1 << 20), static_cast<double>(mem.arena_rss) / (1 << 20),
        static_cast<double>(mem.shared) / (1 << 20));
    std::printf("moe-engine: checksum %s\n", Hex(result->checksum).c_str());
  }
  std::fflush(stdout);
  if (args.hold) HoldUntilSignalled();
  return 0;
}

}  // namespace
}  // namespace expert_arena::moe

int main(int argc, char** argv) {
  using expert_arena::moe::EngineArgs;
  CLI::App app{
      "moe-engine: the expert-arena example engine. Routes a deterministic token stream over a "
      "MoE model's experts and prints an output checksum."};
  EngineArgs args;
  app.add_option("--model", args.models, "Model file (repeat for shards or a split GGUF)")
      ->required();
  expert_arena::cli::AddSharedArenaOptions(app, args.arena);
  app.add_option("--tokens", args.forward.tokens, "Tokens to route and compute")
      ->check(CLI::Range(uint64_t{0}, uint64_t{1} << 24));
  app.add_option("--top-k", args.forward.top_k,
                 "Experts per token and layer (the model's expert_used_count)")
      ->check(CLI::Range(1, 64));
  app.add_option("--seed", args.forward.seed, "Seed of the hidden states and the router");
  app.add_option("--threads", args.forward.threads,
                 "Compute threads (the checksum does not depend on it)")
      ->check(CLI::Range(1, 256));
  app.add_flag("--json", args.json, "Print one JSON object instead of text");
  app.add_option("--outputs", args.outputs_path,
                 "Write the final hidden states (tokens x hidden float32, host byte order) to "
                 "this file, to compare with another engine (tools/python/moe_engine.py)");
  app.add_flag("--hold", args.hold,
               "After printing, keep the arena mapped until SIGINT or SIGTERM");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  }
  return expert_arena::moe::Run(args);
}
