// expert-arena-net: the network process of a listening stream producer (`stream`) and of
// `expert-arena serve` (`serve`); docs/cross-host.md "What runs where".
//
// Started by its parent with posix_spawn and a control socket as fd 3 (platform/process.h);
// never by hand. It reads its options as frames (net_control.h), loads the UCX transport
// plugin (the one beside it first: ucx_plugin.h), starts the server, answers "ready ..." (or
// "error CODE MESSAGE", the start's Status), then answers its parent's requests until the
// channel closes (EOF) or "stop". It dies with its parent's thread (PR_SET_PDEATHSIG) and
// ignores SIGINT (a terminal's ^C goes to the parent, which stops it). Whatever UCX does to
// this process (an assertion on a peer's bytes), the parent lives on and starts another.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "common/logging.h"
#include "platform/net.h"
#include "platform/process.h"
#include "remote/net_control.h"
#include "remote/peer_server.h"
#include "stream/stream_remote.h"

namespace expert_arena::remote {
namespace {

constexpr int fd = platform::kChildControlFd;
constexpr int kReplyMs = 5000;

std::string Counts(const DoorCounters& c) {
  return std::to_string(c.admitted) + " " + std::to_string(c.refused) + " " +
         std::to_string(c.timed_out) + " " + std::to_string(c.dropped) + " " +
         std::to_string(c.auth_failed);
}

spdlog::level::level_enum LogLevel(const std::string& v) {
  return static_cast<spdlog::level::level_enum>(std::atoi(v.c_str()));
}

int Refuse(const Status& s) {
  (void)SendFrame(fd, "error " + std::to_string(static_cast<int>(s.code())) + " " + s.message(),
                  kReplyMs);
  return 1;
}

// The next request, or "" when the parent closed the channel (or broke it). Waits up to
// `wait_ms` for one to start (0: only one already there; "idle" when none).
std::string NextRequest(int wait_ms) {
  auto readable = platform::WaitReadable(fd, wait_ms);
  if (!readable.ok()) return "";
  if (!*readable) return "idle";
  auto frame = RecvFrame(fd, kReplyMs);
  if (!frame.ok()) return "";
  return frame->empty() ? std::string("idle") : *frame;
}

// Reads the "KEY VALUE" option frames the parent sends until "go", handing each to `take`;
// false when the control socket failed first.
template <typename Take>
bool ReadOptions(Take take) {
  while (true) {
    auto frame = RecvFrame(fd, kReplyMs);
    if (!frame.ok()) return false;
    auto [key, value] = SplitWord(*frame);
    if (key == "go") return true;
    take(key, std::string(value));
  }
}

int RunStream(const std::shared_ptr<spdlog::logger>& log) {
  StreamServerOptions o;
  o.logger = log;
  std::vector<std::string> aborted;
  bool read = ReadOptions([&](std::string_view key, const std::string& v) {
    if (key == "listen") o.listen = v;
    if (key == "token") o.token = v;
    if (key == "lease") o.lease_seconds = std::strtod(v.c_str(), nullptr);
    if (key == "directory") o.directory = v;
    if (key == "spill") o.spill_directory = v;
    if (key == "prefix") o.segment_prefix = v;
    if (key == "instance") o.instance_id = std::strtoull(v.c_str(), nullptr, 10);
    if (key == "log_level") log->set_level(LogLevel(v));
    if (key == "aborted") aborted.push_back(v);
  });
  if (!read) return 1;
  auto server = StartStreamServerInProcess(o);
  if (!server.ok()) return Refuse(server.status());
  for (const std::string& k : aborted) (*server)->Aborted(k);
  Status ready = SendFrame(
      fd, "ready " + (*server)->address() + " " + std::to_string((*server)->instance_id()),
      kReplyMs);
  if (!ready.ok()) return 1;
  while (true) {
    std::string request = NextRequest(1000);
    if (request.empty() || request == "stop") break;
    if (request == "idle") continue;
    auto [word, rest] = SplitWord(request);
    Status s = Status::Ok();
    if (word == "aborted") {
      (*server)->Aborted(rest);
    } else if (word == "holds") {
      std::string out = "holds";
      for (const RemoteHold& h : (*server)->Holds())
        out += "\n" + h.segment + " " + std::to_string(h.slot);
      s = SendFrame(fd, out, kReplyMs);
    } else if (word == "counters") {
      s = SendFrame(fd, "counters " + Counts((*server)->counters()), kReplyMs);
    } else {
      s = SendFrame(fd, "unknown", kReplyMs);
    }
    if (!s.ok()) break;
  }
  server->reset();  // the remote holds end (their shares spent) before we exit
  return 0;
}

int RunServe(const std::shared_ptr<spdlog::logger>& log) {
  std::string path;
  ServeOptions o;
  o.logger = log;
  bool read = ReadOptions([&](std::string_view key, const std::string& v) {
    if (key == "path") path = v;
    if (key == "listen") o.listen = v;
    if (key == "token") o.token = v;
    if (key == "hello_timeout") o.hello_timeout_seconds = std::strtod(v.c_str(), nullptr);
    if (key == "transport") o.transport = v == "get" ? PeerTransport::kGet : PeerTransport::kAm;
    if (key == "log_level") log->set_level(LogLevel(v));
  });
  if (!read) return 1;
  auto server = PeerServer::Start(path, o);
  if (!server.ok()) return Refuse(server.status());
  const ServeInfo& info = (*server)->info();
  // The identity last: it may hold spaces.
  Status ready = SendFrame(fd,
                           "ready " + info.address + " " + std::to_string(info.port) + " " +
                               std::to_string(info.identity_hash) + " " +
                               std::to_string(info.data_bytes) + " " +
                               std::to_string(info.file_bytes) + " " +
                               PeerTransportName(info.transport) + " " + info.identity,
                           kReplyMs);
  if (!ready.ok()) return 1;
  bool stop = false;
  Status run = (*server)->Run([&] {
    while (!stop) {
      std::string request = NextRequest(0);
      if (request == "idle") return false;
      if (request.empty() || request == "stop") {
        stop = true;
        break;
      }
      if (request == "counters") {
        const DoorCounters c = (*server)->counters();
        Status s = SendFrame(fd,
                             "counters " + std::to_string((*server)->peers_offered()) + " " +
                                 std::to_string((*server)->ranges_refused()) + " " + Counts(c) +
                                 " " + std::to_string((*server)->bytes_sent()),
                             kReplyMs);
        if (!s.ok()) stop = true;
      } else {
        stop = !SendFrame(fd, "unknown", kReplyMs).ok();
      }
    }
    return stop;
  });
  if (!run.ok()) {
    log->error("expert-arena-net serve: {}", run.message());
    return 1;
  }
  return 0;
}

int Main(int argc, char** argv) {
  if (argc < 4 || std::strcmp(argv[2], "--parent-pid") != 0) {
    std::fprintf(stderr,
                 "expert-arena-net: the network process of a listening stream producer and of "
                 "expert-arena serve; started by them, not by hand\n");
    return 2;
  }
  const pid_t parent = static_cast<pid_t>(std::atol(argv[3]));
  if (!platform::DieWithParent(parent).ok()) return 1;
  signal(SIGINT, SIG_IGN);
  signal(SIGPIPE, SIG_IGN);
  // UCX's tcp segment sizes stay UCX's: a sender's segment above a receiver's aborts the
  // receiver inside UCX, and consumers' engines run UCX (docs/cross-host.md, UCX settings).
  if (!platform::SetNonBlocking(fd).ok()) return 1;
  auto log = ResolveLogger(nullptr);
  const std::string mode = argv[1];
  if (mode == "stream") return RunStream(log);
  if (mode == "serve") return RunServe(log);
  return Refuse(InvalidArgument("expert-arena-net: unknown mode " + mode));
}

}  // namespace
}  // namespace expert_arena::remote

int main(int argc, char** argv) { return expert_arena::remote::Main(argc, argv); }
