// expert-arena serve: serve a published arena to peers over UCX (docs/cross-host.md).
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <iostream>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "remote/peer_server.h"

namespace expert_arena::cli {
namespace {

struct ServeArgs {
  std::string path;
  std::string listen = "127.0.0.1:0";
  std::string token;
  double hello_timeout = 10;
  std::string transport = "am";
  bool json = false;
};

int RunServe(const ServeArgs& args) {
  remote::ServeOptions options;
  options.listen = args.listen;
  options.token = args.token;
  if (options.token.empty()) {
    const char* token = std::getenv("EXPERT_ARENA_TOKEN");
    if (token != nullptr) options.token = token;
  }
  options.hello_timeout_seconds = args.hello_timeout;
  options.transport =
      args.transport == "get" ? remote::PeerTransport::kGet : remote::PeerTransport::kAm;
  // SIGINT/SIGTERM are taken synchronously between progress rounds.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigprocmask(SIG_BLOCK, &set, nullptr);
  auto server = remote::PeerServer::Start(args.path, options);
  if (!server.ok()) {
    std::fprintf(stderr, "expert-arena serve: %s\n", server.status().message().c_str());
    return 1;
  }
  const remote::ServeInfo& info = (*server)->info();
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
    j["token"] = !options.token.empty();
    j["transport"] = remote::PeerTransportName(info.transport);
    j["pid"] = getpid();
    std::cout << j.dump() << std::endl;
  } else {
    std::cout << "expert-arena serve: serving " << info.path << " on " << info.address << " ("
              << info.identity << ") by " << remote::PeerTransportName(info.transport)
              << (options.token.empty() ? "" : ", token required") << std::endl;
  }
  Status run = (*server)->Run([&] {
    timespec zero{0, 0};
    siginfo_t si;
    return sigtimedwait(&set, &si, &zero) > 0;
  });
  if (!run.ok()) {
    std::fprintf(stderr, "expert-arena serve: %s\n", run.message().c_str());
    return 1;
  }
  const remote::DoorCounters c = (*server)->counters();
  auto n = [](uint64_t v) { return static_cast<unsigned long long>(v); };
  std::fprintf(stderr,
               "expert-arena serve: stopped after offering %s to %llu peers (%llu range requests "
               "refused; front door: %llu admitted, %llu refused, %llu timed out, %llu dropped, "
               "%llu failed the token)\n",
               info.path.c_str(), n((*server)->peers_offered()), n((*server)->ranges_refused()),
               n(c.admitted), n(c.refused), n(c.timed_out), n(c.dropped), n(c.auth_failed));
  if (args.json) {
    // The final summary, on a line of its own.
    nlohmann::json j;
    j["stopped"] = info.path;
    j["peers_offered"] = (*server)->peers_offered();
    j["ranges_refused"] = (*server)->ranges_refused();
    j["admitted"] = c.admitted;
    j["refused"] = c.refused;
    j["timed_out"] = c.timed_out;
    j["dropped"] = c.dropped;
    j["auth_failed"] = c.auth_failed;
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
  cmd->add_option("--hello-timeout", args->hello_timeout,
                  "Seconds a connected peer has to prove the token at the front door (and then to "
                  "send its first message)");
  cmd->add_option("--transport", args->transport,
                  "am (default): send only the ranges of the arena file a peer asks for, each "
                  "checked; get: peers read the registered mapping with ucp_get (on UCX's tcp "
                  "transport a get carries no key: needs a token, trusted networks only)")
      ->check(CLI::IsMember({"am", "get"}));
  cmd->add_flag("--json", args->json,
                "Print one JSON line once listening, and one with the counts when stopped");
  cmd->callback([args, &exit_code] { exit_code = RunServe(*args); });
}

}  // namespace expert_arena::cli
