// expert-arena load: load the arena, or attach when another engine loaded it.
#include <poll.h>
#include <signal.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "../kernel_json.h"
#include "../numa_json.h"
#include "commands.h"
#include "common/escape.h"
#include "expert_arena/arena.h"
#include "expert_arena/cli.h"
#include "expert_arena/gpu.h"

namespace expert_arena::cli {
namespace {

struct LoadArgs {
  std::vector<std::string> models;
  std::string format = "auto";
  std::string arena;
  std::string select;
  bool all = false;
  std::string gpu = "none";
  bool gpu_required = false;
  uint64_t pin_budget = 0;
  std::string huge = "auto";
  std::string numa = "auto";
  bool pages_first = false;
  double wait_timeout = 600;
  bool hold = false;
  bool json = false;
  std::string reader = "auto";
  uint64_t alignment = 4096;
  std::string from_peer;
  std::string token;
  bool insecure_no_token = false;
  double peer_stall = 30;
  std::string peer_transport = "auto";
  std::string mode = "0600";
  bool allow_foreign_owner = false;
  bool allow_world_writable = false;
};

// Blocks until SIGINT/SIGTERM arrives or stdin closes. Closing counts only for a stdin that
// can close (a pipe, a socket, a terminal): under a service manager or `nohup ... </dev/null`
// stdin is /dev/null, which reads as closed at once, and the hold would end before it began.
void HoldUntilReleased() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigprocmask(SIG_BLOCK, &set, nullptr);
  struct stat st;
  const bool watch_stdin = fstat(STDIN_FILENO, &st) == 0 &&
                           (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode) || isatty(STDIN_FILENO));
  struct pollfd fds[1] = {{watch_stdin ? STDIN_FILENO : -1, POLLIN, 0}};
  for (;;) {
    struct timespec tick = {0, 100 * 1000 * 1000};
    siginfo_t info;
    if (sigtimedwait(&set, &info, &tick) > 0) return;
    if (poll(fds, 1, 0) > 0) {
      char buf[256];
      ssize_t n = read(STDIN_FILENO, buf, sizeof buf);
      if (n <= 0) return;  // stdin closed
    }
  }
}

int RunLoad(const LoadArgs& args) {
  if (args.models.empty() && args.from_peer.empty()) {
    std::fprintf(stderr, "expert-arena load: --model is required (or --from-peer HOST:PORT)\n");
    return 2;
  }
  ModelSpec model;
  model.words = OptionWords::kCli;
  model.files = args.models;
  for (ModelFormat format :
       {ModelFormat::kAuto, ModelFormat::kGguf, ModelFormat::kSafetensors, ModelFormat::kRaw}) {
    if (args.format == ModelFormatName(format)) model.format = format;
  }
  model.select = args.select;
  model.select_all = args.all;
  model.alignment = args.alignment;
  ArenaOptions options;
  options.shared_path = args.arena;
  options.huge = args.huge == "on"    ? HugePages::kOn
                 : args.huge == "off" ? HugePages::kOff
                                      : HugePages::kAuto;
  if (Status numa = ParseNumaPlacement(args.numa, &options.numa, &options.numa_node); !numa.ok()) {
    std::fprintf(stderr, "expert-arena load: %s\n", numa.message().c_str());
    return 2;
  }
  options.pages_alongside_load = !args.pages_first;
  options.wait_timeout_seconds = args.wait_timeout;
  // Validated by the parser (--gpu, --reader, --peer-transport); parsed here into their types.
  auto gpu = ParseGpuDevice(args.gpu);
  auto reader = ParseModelReader(args.reader);
  auto transport = ParsePeerTransport(args.peer_transport);
  for (const Status& s : {gpu.status(), reader.status(), transport.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "expert-arena load: %s\n", s.message().c_str());
      return 2;
    }
  }
  options.gpu = *gpu;
  options.gpu_required = args.gpu_required;
  options.pin_budget_bytes = args.pin_budget;
  options.reader = *reader;
  options.file_mode = static_cast<mode_t>(std::strtoul(args.mode.c_str(), nullptr, 8));
  options.allow_foreign_owner = args.allow_foreign_owner;
  options.allow_world_writable = args.allow_world_writable;
  options.progress = !args.json && isatty(STDERR_FILENO);
  options.from_peer = args.from_peer;
  options.peer_token = args.token;
  if (options.peer_token.empty()) {
    const char* token = std::getenv("EXPERT_ARENA_TOKEN");
    if (token != nullptr) options.peer_token = token;
  }
  options.peer_allow_no_token = args.insecure_no_token;
  options.peer_stall_seconds = args.peer_stall;
  options.peer_transport = *transport;
  auto result = Arena::Open(model, options);
  if (!result.ok()) {
    std::fprintf(stderr, "expert-arena load: %s\n",
                 EscapeForDisplay(result.status().message()).c_str());
    return 1;
  }
  const ArenaReport& r = result->report();
  if (args.json) {
    nlohmann::json j;
    j["role"] = ArenaRoleName(r.role);
    // Texts from the user, the model files and the kernel, escaped as every output shows them
    // (common/escape.h): a path may hold any byte, and JSON takes only UTF-8.
    j["arena"] = EscapeForDisplay(r.path);
    j["backing"] = r.backing;
    j["data_bytes"] = r.data_bytes;
    j["tensor_bytes"] = r.tensor_bytes;
    j["tensors"] = r.tensors;
    j["model_tensors"] = r.model_tensors;
    j["huge_bytes"] = r.huge_bytes;
    j["page_bytes"] = r.page_bytes;
    j["seconds"] = r.seconds;
    j["load_seconds"] = r.load_seconds;
    j["wait_seconds"] = r.wait_seconds;
    j["collapse_seconds"] = r.collapse_seconds;
    j["bytes_read"] = r.bytes_read;
    j["reader"] = r.reader;
    j["reader_note"] = EscapeForDisplay(r.reader_note);
    j["identity"] = EscapeForDisplay(r.identity);
    char hash[32];
    std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(r.identity_hash));
    j["identity_hash"] = hash;
    j["huge_note"] = EscapeForDisplay(r.huge_note);
    j["charge"] = EscapeForDisplay(r.charge_note);
    j["gpu"] = EscapeForDisplay(r.gpu_note);
    j["gpu_registered_bytes"] = r.gpu_registered_bytes;
    // What this build's GPU backends were compiled against (which CUDA: toolkit or wheel).
    nlohmann::json backends = nlohmann::json::object();
    for (auto backend : {GpuBackend::kCuda, GpuBackend::kHip}) {
      if (GpuBackendBuilt(backend)) backends[GpuBackendName(backend)] = GpuBackendBuildNote(backend);
    }
    j["gpu_backends"] = backends;
    j["kernel"] = tools::KernelJson(r);
    j["numa"] = tools::NumaJson(r);
    j["pid"] = getpid();
    if (!args.from_peer.empty()) {
      // Empty when the fill failed and the files were read.
      j["from_peer"] = EscapeForDisplay(r.from_peer);
      j["peer_bytes"] = r.peer_bytes;
      j["peer_note"] = EscapeForDisplay(r.peer_note);
      j["peer_transport"] = r.peer_transport;  // "am" or "get"; empty when the files were read
    }
    std::cout << j.dump() << std::endl;
  }
  if (args.hold) HoldUntilReleased();
  return 0;
}

}  // namespace

void RegisterLoad(CLI::App& app, int& exit_code) {
  auto args = std::make_shared<LoadArgs>();
  CLI::App* cmd =
      app.add_subcommand("load", "Load the arena, or attach when another engine loaded it");
  cmd->add_option("--model", args->models,
                  "Model file (repeat for shards); required unless --from-peer");
  cmd->add_option("--format", args->format,
                  "auto|gguf|safetensors|raw: auto reads GGUF, safetensors or an index and "
                  "refuses anything else; raw loads each file's bytes as one u8 tensor")
      ->check(CLI::IsMember({"auto", "gguf", "safetensors", "raw"}));
  cmd->add_option("--arena", args->arena, "Shared arena file (tmpfs or hugetlbfs)")->required();
  CLI::Option* select =
      cmd->add_option("--select", args->select, "Tensors whose names match this regex");
  cmd->add_flag("--all", args->all, "Every tensor of the model")->excludes(select);
  cmd->add_option("--gpu", args->gpu, "none|cuda[:N]|hip[:N]");
  cmd->add_flag("--gpu-required", args->gpu_required,
                "Fail when the GPU registration does not happen (default: reported, skipped)");
  cmd->add_option("--pin-budget", args->pin_budget,
                  "Upper bound on bytes this process pins for the GPU (0: no bound)");
  cmd->add_option("--huge", args->huge, "2 MiB pages: auto|on|off")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  cmd->add_option("--numa", args->numa,
                  "Where a load puts the pages on a host with several NUMA nodes: auto "
                  "(interleave where it can), local (first touch), interleave, node:N, "
                  "replicate (docs/numa.md)")
      ->check(NumaPlacementValidator());
  cmd->add_flag("--pages-first", args->pages_first,
                "On plain tmpfs, make every 2 MiB page before reading (default: alongside)");
  cmd->add_option("--wait-timeout", args->wait_timeout,
                  "Seconds to wait for another engine's load");
  cmd->add_option("--reader", args->reader, "auto|io_uring|pread")
      ->check(CLI::IsMember({"auto", "io_uring", "pread"}));
  cmd->add_option("--alignment", args->alignment, "Tensor alignment in the arena (bytes)");
  cmd->add_option("--mode", args->mode,
                  "Octal mode of an arena file this load creates, whatever the umask (0660: "
                  "engines of the file's group attach)")
      ->check(FileModeValidator());
  cmd->add_flag("--allow-foreign-owner", args->allow_foreign_owner,
                "Attach to an arena file owned by another user (a group-mode arena)");
  cmd->add_flag("--allow-world-writable", args->allow_world_writable,
                "Create (--mode 0666) or attach to an arena file every user may write; any "
                "user could then change the bytes every engine reads");
  cmd->add_flag("--hold", args->hold, "Keep it mapped until SIGINT/SIGTERM or stdin closes");
  cmd->add_flag("--json", args->json, "Print one JSON object");
  cmd->add_option("--from-peer", args->from_peer,
                  "Fill the arena from `expert-arena serve` at HOST:PORT over UCX (checksums "
                  "verified); with --model, falls back to the files if the fill fails");
  cmd->add_option("--token", args->token, "The peer's shared token (default: $EXPERT_ARENA_TOKEN)");
  cmd->add_flag("--insecure-no-token", args->insecure_no_token,
                "Fill from a peer without a token (refused otherwise: nothing would prove who "
                "answers, and UCX here would take its worker address); trusted networks only");
  cmd->add_option("--peer-stall-timeout", args->peer_stall,
                  "Seconds without progress from the peer before the fill is abandoned");
  cmd->add_option("--peer-transport", args->peer_transport,
                  "auto (what the peer offers), am (only ranges the peer checks and sends; a "
                  "get server is refused) or get")
      ->check(CLI::IsMember({"auto", "am", "get"}));
  cmd->callback([args, &exit_code] { exit_code = RunLoad(*args); });
}

}  // namespace expert_arena::cli
