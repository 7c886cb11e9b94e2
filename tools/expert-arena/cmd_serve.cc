// expert-arena serve: serve a published arena to peers over UCX (docs/cross-host.md), from a
// network process of its own.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <iostream>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <optional>
#include <sstream>

#include "commands.h"
#include "common/escape.h"
#include "common/units.h"
#include "expert_arena/arena.h"
#include "metrics/exposition.h"
#include "platform/file.h"
#include "platform/process.h"
#include "common/logging.h"
#include "remote/front_door.h"
#include "remote/net_control.h"
#include "remote/peer_server.h"

namespace expert_arena::cli {
namespace {

struct ServeArgs {
  std::string path;
  std::string listen = "127.0.0.1:0";
  std::string token;
  bool insecure_no_token = false;
  double hello_timeout = 10;
  std::string transport = "am";
  bool json = false;
  std::string metrics_textfile;
};

// The serving side of `serve` runs in the network process (expert-arena-net serve,
// docs/cross-host.md "What runs where"): whatever UCX does there (an assertion on a peer's
// bytes) ends that process only. This process holds the arena (USER, as an engine does, so it
// cannot be replaced or removed while served, through an outage too), starts the network
// process, says where it listens, and starts it again when it ends (0.5 s doubling to 30 s,
// on the same address), until SIGINT/SIGTERM stop both.
struct NetChild {
  pid_t pid = -1;
  platform::UniqueFd control;
};

constexpr int kRequestMs = 5000;

// Peers offered, ranges refused, then the front door's counts.
struct ServeCounts {
  uint64_t peers_offered = 0;
  uint64_t ranges_refused = 0;
  remote::DoorCounters door;
  uint64_t bytes_sent = 0;
  void Add(const ServeCounts& o) {
    peers_offered += o.peers_offered;
    ranges_refused += o.ranges_refused;
    bytes_sent += o.bytes_sent;
    door.admitted += o.door.admitted;
    door.refused += o.door.refused;
    door.timed_out += o.door.timed_out;
    door.dropped += o.door.dropped;
    door.auth_failed += o.door.auth_failed;
  }
};

Result<NetChild> StartNetProcess(const std::string& program, const ServeArgs& args,
                                 const std::string& listen, const std::string& token,
                                 remote::ServeInfo* info) {
  EA_ASSIGN_OR_RETURN(platform::SpawnedChild child,
                      platform::SpawnWithControl(program, {program, "serve", "--parent-pid",
                                                           std::to_string(getpid())}));
  const int fd = child.control.get();
  const std::vector<std::string> frames = {
      "path " + args.path,
      "listen " + listen,
      "token " + token,
      "hello_timeout " + std::to_string(args.hello_timeout),
      "transport " + args.transport,
      "go",
  };
  Status sent = Status::Ok();
  for (const std::string& f : frames) {
    sent = remote::SendFrame(fd, f, kRequestMs);
    if (!sent.ok()) break;
  }
  Result<std::string> ready =
      sent.ok() ? remote::RecvFrame(fd, 60000) : Result<std::string>(sent);
  if (!ready.ok()) {
    std::string how = platform::StopChild(child.pid, 2);
    return Status(ready.status().code(), "the network process " + program + " did not start (" +
                                             how + "; " + ready.status().message() + ")");
  }
  auto [word, rest] = remote::SplitWord(*ready);
  if (word != "ready") {
    (void)platform::StopChild(child.pid, 2);
    auto [code, message] = remote::SplitWord(rest);
    int c = word == "error" ? std::atoi(std::string(code).c_str()) : 0;
    if (c <= 0 || c > static_cast<int>(StatusCode::kInternal)) {
      c = static_cast<int>(StatusCode::kInternal);
    }
    return Status(static_cast<StatusCode>(c),
                  word == "error" ? std::string(message) : "the network process said " + *ready);
  }
  // ready ADDRESS PORT IDENTITY_HASH DATA_BYTES FILE_BYTES TRANSPORT IDENTITY...
  std::istringstream in{std::string(rest)};
  std::string transport;
  in >> info->address >> info->port >> info->identity_hash >> info->data_bytes >>
      info->file_bytes >> transport;
  std::getline(in >> std::ws, info->identity);
  info->path = args.path;
  info->transport = transport == "get" ? remote::PeerTransport::kGet : remote::PeerTransport::kAm;
  return NetChild{child.pid, std::move(child.control)};
}

// The network process' counts now, or nothing when it does not answer.
std::optional<ServeCounts> AskCounts(const NetChild& child) {
  if (!remote::SendFrame(child.control.get(), "counters", kRequestMs).ok()) return std::nullopt;
  auto answer = remote::RecvFrame(child.control.get(), kRequestMs);
  if (!answer.ok()) return std::nullopt;
  std::istringstream in(*answer);
  std::string word;
  ServeCounts c;
  in >> word >> c.peers_offered >> c.ranges_refused >> c.door.admitted >> c.door.refused >>
      c.door.timed_out >> c.door.dropped >> c.door.auth_failed >> c.bytes_sent;
  if (word != "counters" || !in) return std::nullopt;
  return c;
}

// serve's counters for node_exporter's textfile collector (--metrics-textfile), replaced whole
// (temporary file, rename) whenever they change and every kRefreshSeconds (its mtime says serve
// lives): the totals over every network process,
// whether it runs now, and whether serve does (0 in the file it leaves when stopped; a serve
// killed by SIGKILL leaves 1, and node_exporter's node_textfile_mtime_seconds shows the file
// stopped changing).
class ServeMetrics {
 public:
  static constexpr int kRefreshSeconds = 15;

  ServeMetrics(std::string path, const remote::ServeInfo& info)
      : path_(std::move(path)), labels_{{"path", info.path}, {"listen", info.address}},
        started_(static_cast<double>(std::time(nullptr))) {}

  void Write(const ServeCounts& c, uint64_t restarts, bool network_up, bool serving) {
    if (path_.empty()) return;
    metrics::Exposition e;
    auto gauge = [&](const char* name, const char* help, uint64_t v) {
      e.Declare(name, "gauge", help);
      e.Add(name, labels_, v);
    };
    auto counter = [&](const char* name, const char* help, uint64_t v) {
      e.Declare(name, "counter", help);
      e.Add(name, labels_, v);
    };
    gauge("expert_arena_serve_up", "1 while expert-arena serve serves the arena, 0 once stopped.",
          serving ? 1 : 0);
    gauge("expert_arena_serve_network_process_up",
          "1 while serve's network process (front door and UCX) runs, 0 during an outage.",
          network_up ? 1 : 0);
    e.Declare("expert_arena_serve_start_time_seconds", "gauge",
              "When serve started, in seconds since the epoch.");
    e.AddReal("expert_arena_serve_start_time_seconds", labels_, started_);
    counter("expert_arena_serve_peers_served_total", "Peers offered the arena.",
            c.peers_offered);
    counter("expert_arena_serve_sent_bytes_total",
            "Bytes of the arena file sent to peers (--transport am).", c.bytes_sent);
    counter("expert_arena_serve_range_requests_refused_total",
            "Range requests refused (outside the file, before the offer, on a get server).",
            c.ranges_refused);
    counter("expert_arena_serve_peers_admitted_total",
            "Peers the front door admitted (their token proof held).", c.door.admitted);
    counter("expert_arena_serve_peers_refused_total",
            "Peers refused at the front door (limits, throttling, another arena asked).",
            c.door.refused);
    counter("expert_arena_serve_peers_timed_out_total",
            "Peers dropped because a deadline passed (the handshake, the first request).",
            c.door.timed_out);
    counter("expert_arena_serve_peers_dropped_total",
            "Peers dropped for a malformed message, a hang-up mid-handshake or idling.",
            c.door.dropped);
    counter("expert_arena_serve_peers_auth_failed_total",
            "Peers whose token proof did not hold.", c.door.auth_failed);
    counter("expert_arena_serve_network_process_restarts_total",
            "Times the network process was started again after it ended.", restarts);
    const std::string text = e.Text();
    const auto now = std::chrono::steady_clock::now();
    if (text == last_ && now - written_at_ < std::chrono::seconds(kRefreshSeconds)) return;
    Status written = platform::ReplaceFileAtomically(path_, text, 0644);
    if (!written.ok()) {
      if (!warned_) {
        std::fprintf(stderr, "expert-arena serve: --metrics-textfile: %s\n",
                     written.message().c_str());
      }
      warned_ = true;
      return;
    }
    warned_ = false;
    last_ = text;
    written_at_ = now;
  }

 private:
  std::string path_;
  metrics::Labels labels_;
  double started_;
  std::string last_;
  std::chrono::steady_clock::time_point written_at_{};
  bool warned_ = false;
};

int RunServe(const ServeArgs& args) {
  std::string token = args.token;
  if (token.empty()) {
    const char* env = std::getenv("EXPERT_ARENA_TOKEN");
    if (env != nullptr) token = env;
  }
  // Before anything is attached or started: an address other hosts reach needs a token.
  Status exposed = remote::CheckListenToken(args.listen, token, args.insecure_no_token,
                                            "expert-arena serve", "--insecure-no-token",
                                            *ResolveLogger(nullptr));
  if (!exposed.ok()) {
    std::fprintf(stderr, "expert-arena serve: %s\n", exposed.message().c_str());
    return 1;
  }
  // SIGINT/SIGTERM are taken synchronously between rounds (the network process starts with
  // an empty mask and ignores SIGINT: this process stops it).
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigprocmask(SIG_BLOCK, &set, nullptr);
  ArenaOptions attach;
  attach.shared_path = args.path;
  auto held = Arena::AttachExisting(args.path, attach);
  if (!held.ok()) {
    std::fprintf(stderr, "expert-arena serve: %s\n",
                 EscapeForDisplay(held.status().message()).c_str());
    return 1;
  }
  auto program = remote::FindNetProcess();
  if (!program.ok()) {
    std::fprintf(stderr, "expert-arena serve: %s\n", program.status().message().c_str());
    return 1;
  }
  remote::ServeInfo info;
  auto started = StartNetProcess(*program, args, args.listen, token, &info);
  if (!started.ok()) {
    std::fprintf(stderr, "expert-arena serve: %s\n", started.status().message().c_str());
    return 1;
  }
  NetChild child = std::move(started).value();
  // The arena's path (any bytes) and identity (the file's) are shown escaped, the same in
  // text, JSON and metrics label values (common/escape.h); nothing below uses them otherwise.
  info.path = EscapeForDisplay(info.path);
  info.identity = EscapeForDisplay(info.identity);
  // The file exists before serve says it listens.
  ServeMetrics metrics(args.metrics_textfile, info);
  metrics.Write(ServeCounts{}, 0, true, true);
  if (args.json) {
    nlohmann::json j;
    j["serving"] = info.path;
    j["address"] = info.address;
    j["port"] = info.port;
    j["identity"] = info.identity;
    char hash[32];
    std::snprintf(hash, sizeof hash, "%016llx",
                  static_cast<unsigned long long>(info.identity_hash));
    j["identity_hash"] = hash;
    j["data_bytes"] = info.data_bytes;
    j["token"] = !token.empty();
    j["transport"] = remote::PeerTransportName(info.transport);
    j["pid"] = getpid();
    j["net_pid"] = child.pid;
    std::cout << j.dump() << std::endl;
  } else {
    std::cout << "expert-arena serve: serving " << info.path << " on " << info.address << " ("
              << info.identity << ") by " << remote::PeerTransportName(info.transport)
              << (token.empty() ? "" : ", token required") << "; network process pid "
              << child.pid << std::endl;
  }

  using Clock = std::chrono::steady_clock;
  ServeCounts ended;  // the ended network processes' counts
  ServeCounts last;   // the running one's, as last read
  uint64_t restarts = 0;
  auto totals = [&] {
    ServeCounts t = ended;
    t.Add(last);
    return t;
  };
  const double first_backoff = remote::NetRestartFirstSeconds();
  double backoff = first_backoff;
  auto up_since = Clock::now();
  auto last_read = Clock::now();
  std::optional<Clock::time_point> restart_at;
  while (true) {
    timespec tick{0, 100 * 1000 * 1000};
    siginfo_t si;
    if (sigtimedwait(&set, &si, &tick) > 0) break;
    if (child.pid > 0) {
      std::optional<std::string> how = platform::ReapIfExited(child.pid);
      if (!how) {
        if (Clock::now() - last_read > std::chrono::seconds(1)) {
          if (auto c = AskCounts(child)) last = *c;
          last_read = Clock::now();
          metrics.Write(totals(), restarts, true, true);
        }
        continue;
      }
      if (Clock::now() - up_since > std::chrono::seconds(60)) backoff = first_backoff;
      std::fprintf(stderr,
                   "expert-arena serve: the network process (pid %d) ended (%s); peers are "
                   "refused until it is restarted in %.1f s\n",
                   static_cast<int>(child.pid), how->c_str(), backoff);
      ended.Add(last);
      last = ServeCounts{};
      child = NetChild{};
      metrics.Write(totals(), restarts, false, true);
      restart_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(backoff));
      backoff = std::min(backoff * 2, remote::kNetRestartMaxSeconds);
      continue;
    }
    if (!restart_at || Clock::now() < *restart_at) continue;
    remote::ServeInfo again;
    auto restarted = StartNetProcess(*program, args, info.address, token, &again);
    if (!restarted.ok()) {
      std::fprintf(stderr, "expert-arena serve: restarting the network process failed (%s); "
                   "next try in %.1f s\n", restarted.status().message().c_str(), backoff);
      restart_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(backoff));
      backoff = std::min(backoff * 2, remote::kNetRestartMaxSeconds);
      continue;
    }
    child = std::move(restarted).value();
    restart_at.reset();
    ++restarts;
    up_since = Clock::now();
    metrics.Write(totals(), restarts, true, true);
    std::fprintf(stderr, "expert-arena serve: the network process restarted (pid %d) on %s\n",
                 static_cast<int>(child.pid), info.address.c_str());
    if (args.json) {
      nlohmann::json j;
      j["restarted"] = info.address;
      j["net_pid"] = child.pid;
      j["restarts"] = restarts;
      std::cout << j.dump() << std::endl;
    }
  }
  if (child.pid > 0) {
    if (auto c = AskCounts(child)) last = *c;
    (void)remote::SendFrame(child.control.get(), "stop", kRequestMs);
    child.control.Reset();
    (void)platform::StopChild(child.pid, 10);
  }
  ended.Add(last);
  metrics.Write(ended, restarts, false, false);
  const remote::DoorCounters& c = ended.door;
  auto n = [](uint64_t v) { return static_cast<unsigned long long>(v); };
  auto count = [](uint64_t v, const char* one) {
    return std::to_string(v) + " " + one + (v == 1 ? "" : "s");
  };
  std::fprintf(stderr,
               "expert-arena serve: stopped after offering %s to %s (%s sent; %s refused; "
               "front door: %llu admitted, %llu refused, %llu timed out, %llu dropped, "
               "%llu failed the token; network process restarted %s)\n",
               info.path.c_str(), count(ended.peers_offered, "peer").c_str(),
               FormatBytes(ended.bytes_sent).c_str(),
               count(ended.ranges_refused, "range request").c_str(), n(c.admitted),
               n(c.refused), n(c.timed_out), n(c.dropped), n(c.auth_failed),
               count(restarts, "time").c_str());
  if (args.json) {
    // The final summary, on a line of its own.
    nlohmann::json j;
    j["stopped"] = info.path;
    j["peers_offered"] = ended.peers_offered;
    j["ranges_refused"] = ended.ranges_refused;
    j["bytes_sent"] = ended.bytes_sent;
    j["admitted"] = c.admitted;
    j["refused"] = c.refused;
    j["timed_out"] = c.timed_out;
    j["dropped"] = c.dropped;
    j["auth_failed"] = c.auth_failed;
    j["restarts"] = restarts;
    std::cout << j.dump() << std::endl;
  }
  return 0;
}

}  // namespace

void RegisterServe(CLI::App& app, int& exit_code) {
  auto args = std::make_shared<ServeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "serve", "Serve a published arena to peers over UCX (load --from-peer) until SIGINT/SIGTERM");
  cmd->add_option("path", args->path, "Published arena file")->required();
  cmd->add_option("--listen", args->listen,
                  "ADDR:PORT to listen on (default 127.0.0.1:0, a free port on loopback; no "
                  "default on all interfaces)");
  cmd->add_option("--token", args->token,
                  "Shared token a peer must present before it is served (default: "
                  "$EXPERT_ARENA_TOKEN)");
  cmd->add_flag("--insecure-no-token", args->insecure_no_token,
                "Serve on an address other than loopback without a token (refused otherwise: "
                "every host that reaches it could read the arena); trusted networks only");
  cmd->add_option("--hello-timeout", args->hello_timeout,
                  "Seconds a connected peer has to prove the token at the front door (and then to "
                  "send its first message)");
  cmd->add_option("--transport", args->transport,
                  "am (default): send only the ranges of the arena file a peer asks for, each "
                  "checked; get: peers read the registered mapping with ucp_get (on UCX's tcp "
                  "transport a get carries no key: needs a token, trusted networks only)")
      ->check(CLI::IsMember({"am", "get"}));
  cmd->add_option("--metrics-textfile", args->metrics_textfile,
                  "Keep serve's counters (peers served, bytes sent, refused, timed out, dropped, "
                  "restarts) in this file in Prometheus' text format, replaced whole as they "
                  "change: a .prom file in node_exporter's --collector.textfile.directory");
  cmd->add_flag("--json", args->json,
                "Print one JSON line once listening, and one with the counts when stopped");
  cmd->callback([args, &exit_code] { exit_code = RunServe(*args); });
}

}  // namespace expert_arena::cli
