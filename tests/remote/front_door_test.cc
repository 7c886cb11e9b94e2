// The front door of `expert-arena serve` under a hostile network (docs/cross-host.md, "Attacks
// and what they get"): real `serve` processes on loopback, real UCX behind the door, peers
// that are raw TCP sockets of this test. Each case names the attack; on the protocol before the
// front door (UCX's sockaddr listener on the port) the first ones killed the server.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "remote/front_door.h"
#include "remote/peer_client.h"
#include "test_util.h"

namespace expert_arena {
namespace {

using Clock = std::chrono::steady_clock;

int Sh(const std::string& command, std::string* out = nullptr, double timeout = 120) {
  auto child = testing::SpawnProgram("/bin/sh", {"-c", command + " 2>&1"});
  int code = child.Wait(timeout);
  if (out != nullptr) *out = child.Output();
  return code;
}

nlohmann::json JsonLine(const std::string& out, const std::string& key) {
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] != '{') continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.contains(key)) return j;
  }
  return nullptr;
}

std::string Tool() { return testing::BinDir() + "/expert-arena"; }

bool Alive(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  std::getline(stat, text);
  size_t close = text.rfind(')');
  return close != std::string::npos && close + 2 < text.size() && text[close + 2] != 'Z';
}

size_t OpenFds(pid_t pid) {
  size_t n = 0;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return n;
}

// Sockets in CLOSE-WAIT (state 08) whose local port is `port` (/proc/net/tcp, IPv4 loopback).
size_t CloseWait(uint16_t port) {
  std::ifstream tcp("/proc/net/tcp");
  std::string line;
  std::getline(tcp, line);
  size_t n = 0;
  while (std::getline(tcp, line)) {
    std::istringstream f(line);
    std::string slot, local, remote, state;
    f >> slot >> local >> remote >> state;
    unsigned local_port = std::stoul(local.substr(local.find(':') + 1), nullptr, 16);
    if (local_port == port && state == "08") ++n;
  }
  return n;
}

uint64_t RssKiB(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6));
  }
  return 0;
}

// A raw TCP connection to 127.0.0.1:`port`, from `source` (another loopback address: another
// "peer"). -1 when it cannot connect.
int RawConnect(uint16_t port, const char* source = "127.0.0.1") {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in from{};
  from.sin_family = AF_INET;
  inet_pton(AF_INET, source, &from.sin_addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof from) != 0) {
    close(fd);
    return -1;
  }
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

void SendAndClose(uint16_t port, const std::string& bytes) {
  int fd = RawConnect(port);
  ASSERT_GE(fd, 0);
  (void)send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  close(fd);
}

// Reads exactly `n` bytes (or fewer when the peer closes or 5 s pass).
std::string ReadN(int fd, size_t n) {
  std::string out(n, '\0');
  size_t have = 0;
  while (have < n) {
    ssize_t r = recv(fd, out.data() + have, n - have, 0);
    if (r <= 0) break;
    have += static_cast<size_t>(r);
  }
  out.resize(have);
  return out;
}

// The 109-byte packet that killed `serve` and a listening producer inside UCX's connection
// manager (tcp_sockcm_ep.c:825), and its variants of the issue.
std::vector<std::string> KillerPackets() {
  std::string sockcm(9, '\0');
  const uint64_t six = 6;
  std::memcpy(sockcm.data(), &six, 8);
  sockcm += std::string(100, 'A');
  std::string huge(8, '\xff');  // a length of 2^64-1
  huge += std::string(64, 'B');
  return {sockcm, huge, std::string(200, '\0'), std::string(4096, '\xff')};
}

class FrontDoorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!remote::RemoteBuilt()) {
      skip_ = "built without UCX (libucx-dev)";
      return;
    }
    dir_ = std::filesystem::temp_directory_path() / ("ea-front-door-" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
    model_ = (dir_ / "m.gguf").string();
    served_ = new testing::ScopedPath("served");
    std::string out;
    if (Sh(Tool() + " gen-model --format gguf --out " + model_ +
               " --layers 1 --experts 4 --hidden 256 --ffn 512 --dtype f16",
           &out) != 0) {
      skip_ = "gen-model failed: " + out;
    } else if (Sh(Tool() + " load --model " + model_ + " --arena " + served_->path(), &out) != 0) {
      skip_ = "the served arena did not load: " + out;
    }
  }
  static void TearDownTestSuite() {
    delete served_;
    std::filesystem::remove_all(dir_);
  }
  void SetUp() override {
    if (!skip_.empty()) {
      if (std::getenv("CI") != nullptr) FAIL() << skip_;
      GTEST_SKIP() << skip_;
    }
  }

  struct Server {
    testing::Child child;
    std::string address;
    uint16_t port = 0;
    pid_t pid = -1;
    pid_t net_pid = -1;  // its network process, where the front door and UCX run
  };

  static Server Serve(const std::string& extra = "", const std::string& env = "") {
    Server s;
    s.child = testing::SpawnProgram(
        "/bin/sh", {"-c", "exec env UCX_TLS=tcp " + env + " " + Tool() + " serve " +
                              served_->path() + " --listen 127.0.0.1:0 --json " + extra});
    if (!s.child.WaitForOutput("\"port\"", 60)) return s;
    auto j = JsonLine(s.child.Output(), "port");
    if (!j.is_object()) return s;
    s.address = j["address"].get<std::string>();
    s.port = j["port"].get<uint16_t>();
    s.pid = j["pid"].get<pid_t>();
    s.net_pid = j["net_pid"].get<pid_t>();
    return s;
  }

  // A legitimate fill from `server`: exit status 0 and a verified arena.
  static void ExpectServed(const Server& server, const std::string& token = "") {
    testing::ScopedPath filled("filled");
    std::string out;
    ASSERT_EQ(Sh("env UCX_TLS=tcp " + Tool() + " load --arena " + filled.path() +
                     " --from-peer " + server.address +
                     (token.empty() ? " --insecure-no-token" : " --token " + token),
                 &out),
              0)
        << out;
    ASSERT_EQ(Sh(Tool() + " verify " + filled.path(), &out), 0) << out;
  }

  // Stops `server` and returns its final summary (serve --json).
  static nlohmann::json Stop(Server& server) {
    server.child.Kill(SIGTERM);
    EXPECT_EQ(server.child.Wait(30), 0);
    return JsonLine(server.child.Output(), "stopped");
  }

  static std::string skip_;
  static std::filesystem::path dir_;
  static std::string model_;
  static testing::ScopedPath* served_;
};

std::string FrontDoorTest::skip_;
std::filesystem::path FrontDoorTest::dir_;
std::string FrontDoorTest::model_;
testing::ScopedPath* FrontDoorTest::served_ = nullptr;

TEST_F(FrontDoorTest, KillerPacketsLeaveServeAliveAndServing) {
  Server server = Serve();
  ASSERT_GT(server.port, 0) << server.child.Output();
  for (const std::string& packet : KillerPackets()) {
    SendAndClose(server.port, packet);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    ASSERT_TRUE(Alive(server.pid) && Alive(server.net_pid))
        << "serve died of a " << packet.size() << "-byte packet\n"
        << server.child.Output();
  }
  ExpectServed(server);
  auto summary = Stop(server);
  ASSERT_TRUE(summary.is_object()) << server.child.Output();
  EXPECT_GE(summary["dropped"].get<uint64_t>(), KillerPackets().size()) << summary.dump();
  EXPECT_EQ(summary["peers_offered"], 1);
}

// A sample's value in a Prometheus text file ("name{...} value" lines), or -1 when absent.
double Sample(const std::string& path, const std::string& name) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name + "{", 0) == 0 || line.rfind(name + " ", 0) == 0) {
      return std::strtod(line.substr(line.rfind(' ') + 1).c_str(), nullptr);
    }
  }
  return -1;
}

// serve --metrics-textfile: the counters node_exporter's textfile collector reads, as they
// change, carried over a restart of the network process, and up 0 once stopped; promtool
// (Debian's prometheus) accepts the file.
TEST_F(FrontDoorTest, ServeKeepsItsCountersInATextfileForNodeExporter) {
  const std::string prom = (dir_ / "serve.prom").string();
  Server server = Serve("--metrics-textfile " + prom, "EXPERT_ARENA_NET_RESTART_SECONDS=1");
  ASSERT_GT(server.port, 0) << server.child.Output();
  EXPECT_EQ(Sample(prom, "expert_arena_serve_up"), 1);
  EXPECT_EQ(Sample(prom, "expert_arena_serve_peers_served_total"), 0);
  ExpectServed(server);
  const auto deadline = Clock::now() + std::chrono::seconds(15);
  while (Sample(prom, "expert_arena_serve_peers_served_total") < 1 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(Sample(prom, "expert_arena_serve_peers_served_total"), 1);
  const double file_bytes = static_cast<double>(std::filesystem::file_size(served_->path()));
  EXPECT_GE(Sample(prom, "expert_arena_serve_sent_bytes_total"), file_bytes - (2 << 20))
      << "the data region at least";
  EXPECT_LE(Sample(prom, "expert_arena_serve_sent_bytes_total"), file_bytes);
  // An outage: the network process is down in the file, then up again, the totals kept.
  ASSERT_EQ(kill(server.net_pid, SIGKILL), 0);
  ASSERT_TRUE(server.child.WaitForOutput("\"restarted\"", 30)) << server.child.Output();
  auto summary = Stop(server);
  ASSERT_TRUE(summary.is_object()) << server.child.Output();
  EXPECT_EQ(Sample(prom, "expert_arena_serve_up"), 0);
  EXPECT_EQ(Sample(prom, "expert_arena_serve_network_process_restarts_total"), 1);
  EXPECT_EQ(Sample(prom, "expert_arena_serve_peers_served_total"), 1);
  EXPECT_EQ(Sample(prom, "expert_arena_serve_sent_bytes_total"),
            summary["bytes_sent"].get<double>());
  EXPECT_EQ(Sample(prom, "expert_arena_serve_peers_admitted_total"),
            summary["admitted"].get<double>());
  std::string out;
  const int promtool = Sh("command -v promtool >/dev/null", &out);
  if (promtool != 0) {
    if (std::getenv("CI") != nullptr) ADD_FAILURE() << "promtool is missing (Debian prometheus)";
  } else {
    EXPECT_EQ(Sh("promtool check metrics < " + prom, &out), 0) << out;
  }
  std::filesystem::remove(prom);
}

// The network process of serve SIGKILLed (as a UCX abort would end it): serve lives, a fill
// during the outage fails cleanly, and once the process is restarted (on the same address)
// a fill succeeds; serve --json says so, and its summary counts the restart.
TEST_F(FrontDoorTest, KilledNetworkProcessIsRestartedAndServesAgain) {
  Server server = Serve("", "EXPERT_ARENA_NET_RESTART_SECONDS=3");
  ASSERT_GT(server.port, 0) << server.child.Output();
  ASSERT_EQ(kill(server.net_pid, SIGKILL), 0);
  testing::ScopedPath filled("outage");
  std::string out;
  const auto killed = Clock::now();
  EXPECT_EQ(Sh("env UCX_TLS=tcp " + Tool() + " load --arena " + filled.path() +
                   " --from-peer " + server.address + " --insecure-no-token --peer-stall-timeout 2",
               &out),
            1)
      << out;
  EXPECT_LT(Clock::now() - killed, std::chrono::seconds(3)) << "the fill did not fail at once";
  ASSERT_TRUE(server.child.WaitForOutput("\"restarted\"", 30)) << server.child.Output();
  ASSERT_TRUE(Alive(server.pid));
  auto restarted = JsonLine(server.child.Output(), "restarted");
  ASSERT_TRUE(restarted.is_object()) << server.child.Output();
  EXPECT_EQ(restarted["restarted"], server.address);
  EXPECT_NE(restarted["net_pid"].get<pid_t>(), server.net_pid);
  server.net_pid = restarted["net_pid"].get<pid_t>();
  ExpectServed(server);
  auto summary = Stop(server);
  ASSERT_TRUE(summary.is_object()) << server.child.Output();
  EXPECT_EQ(summary["restarts"], 1);
  EXPECT_GE(summary["peers_offered"].get<uint64_t>(), 1u);
  EXPECT_FALSE(Alive(server.net_pid)) << "the network process outlived serve";
}

TEST_F(FrontDoorTest, SilentPeerIsAnErrorAndTheFilesAreReadInstead) {
  // A peer that accepts TCP and never answers (a stopped server, the wrong service): the
  // kernel accepts into the backlog; nobody reads.
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &at.sin_addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&at), sizeof at), 0);
  ASSERT_EQ(listen(fd, 16), 0);
  socklen_t length = sizeof at;
  getsockname(fd, reinterpret_cast<sockaddr*>(&at), &length);
  const std::string address = "127.0.0.1:" + std::to_string(ntohs(at.sin_port));
  testing::ScopedPath filled("silent");
  std::string out;
  const std::string load = "env UCX_TLS=tcp " + Tool() + " load --arena " + filled.path() +
                           " --from-peer " + address +
                           " --insecure-no-token --peer-stall-timeout 2";
  EXPECT_EQ(Sh(load, &out, 60), 1) << out;
  EXPECT_NE(out.find("did not answer"), std::string::npos) << out;
  EXPECT_FALSE(std::filesystem::exists(filled.path()));
  // With the model files: the fallback, and the reason in the report.
  ASSERT_EQ(Sh(load + " --model " + model_ + " --json", &out, 60), 0) << out;
  auto j = JsonLine(out, "peer_note");
  ASSERT_TRUE(j.is_object()) << out;
  EXPECT_EQ(j["from_peer"], "");
  EXPECT_NE(j["peer_note"].get<std::string>().find("did not answer"), std::string::npos) << out;
  ASSERT_EQ(Sh(Tool() + " verify " + filled.path(), &out), 0) << out;
  close(fd);
}

TEST_F(FrontDoorTest, GarbageConnectionsLeaveNoSocketBehind) {
  Server server = Serve("--hello-timeout 2");
  ASSERT_GT(server.port, 0) << server.child.Output();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const size_t baseline = OpenFds(server.net_pid);
  // 50 connections: garbage then closed, half-open, silent (left to the deadline).
  std::vector<int> silent;
  for (int i = 0; i < 50; ++i) {
    if (i % 3 == 2) {
      int fd = RawConnect(server.port);
      ASSERT_GE(fd, 0);
      silent.push_back(fd);
    } else {
      SendAndClose(server.port, std::string(10 + i, static_cast<char>(i)));
    }
  }
  // The silent ones are dropped at the deadline (2 s): the server closes them.
  for (int fd : silent) {
    char byte;
    EXPECT_EQ(recv(fd, &byte, 1, 0), 0) << "the server kept a silent connection open";
    close(fd);
  }
  const auto end = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < end && (OpenFds(server.net_pid) > baseline || CloseWait(server.port) > 0)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_LE(OpenFds(server.net_pid), baseline);
  EXPECT_EQ(CloseWait(server.port), 0u);
  ExpectServed(server);
  auto summary = Stop(server);
  ASSERT_TRUE(summary.is_object()) << server.child.Output();
  // Silent ones past 8 of one address were refused at accept (the per-peer bound); the rest
  // timed out.
  EXPECT_GE(summary["timed_out"].get<uint64_t>() + summary["refused"].get<uint64_t>(),
            silent.size())
      << summary.dump();
  EXPECT_GE(summary["timed_out"].get<uint64_t>(), 1u) << summary.dump();
}

TEST_F(FrontDoorTest, BytesBeforeTheHelloDoNotGrowTheServer) {
  Server server = Serve();
  ASSERT_GT(server.port, 0) << server.child.Output();
  const uint64_t before = RssKiB(server.net_pid);
  // Up to 1 GiB at once, before any hello, on 3 connections: the server reads one hello's
  // worth and hangs up.
  std::string chunk(1 << 20, 'x');
  for (int c = 0; c < 3; ++c) {
    int fd = RawConnect(server.port);
    ASSERT_GE(fd, 0);
    uint64_t sent = 0;
    while (sent < (1ull << 30)) {
      ssize_t n = send(fd, chunk.data(), chunk.size(), MSG_NOSIGNAL);
      if (n <= 0) break;
      sent += static_cast<uint64_t>(n);
    }
    EXPECT_LT(sent, 1ull << 30) << "the server took 1 GiB before a hello";
    EXPECT_LT(RssKiB(server.net_pid), before + 16 * 1024) << "RSS grew by more than 16 MiB";
    close(fd);
  }
  ASSERT_TRUE(Alive(server.pid) && Alive(server.net_pid));
  ExpectServed(server);
  Stop(server);
}

TEST_F(FrontDoorTest, GetWithoutATokenIsRefused) {
  std::string out;
  EXPECT_EQ(Sh("env -u EXPERT_ARENA_TOKEN " + Tool() + " serve " + served_->path() +
                   " --listen 127.0.0.1:0 --transport get",
               &out, 30),
            1);
  EXPECT_NE(out.find("--transport get needs a token"), std::string::npos) << out;
  // With a token, get serves, and only a peer that knows the token.
  Server server = Serve("--transport get --token g3t");
  ASSERT_GT(server.port, 0) << server.child.Output();
  testing::ScopedPath refused("refused");
  EXPECT_EQ(Sh("env UCX_TLS=tcp " + Tool() + " load --arena " + refused.path() + " --from-peer " +
                   server.address + " --insecure-no-token",
               &out),
            1);
  EXPECT_NE(out.find("wrong token"), std::string::npos) << out;
  ExpectServed(server, "g3t");
  Stop(server);
}

// One attempt at the door with a wrong proof from `source`: "challenged" (a challenge came,
// then the refusal), "refused" (closed at once: throttled), or what went wrong.
std::string WrongProof(uint16_t port, const char* source) {
  int fd = RawConnect(port, source);
  if (fd < 0) return "no connection";
  remote::DoorHello hello{remote::kDoorMagic, remote::kDoorVersion,
                          static_cast<uint32_t>(remote::DoorService::kPeerFill), {}};
  (void)send(fd, &hello, sizeof hello, MSG_NOSIGNAL);
  std::string challenge = ReadN(fd, sizeof(remote::DoorChallenge));
  if (challenge.empty()) {
    close(fd);
    return "refused";
  }
  remote::DoorProof proof{remote::kDoorMagic, 8, 0, {}};
  std::string message(reinterpret_cast<const char*>(&proof), sizeof proof);
  message += std::string(8, 'a');
  (void)send(fd, message.data(), message.size(), MSG_NOSIGNAL);
  std::string admit = ReadN(fd, sizeof(remote::DoorAdmit));
  close(fd);
  if (admit.size() != sizeof(remote::DoorAdmit)) return "no admit";
  remote::DoorAdmit a;
  std::memcpy(&a, admit.data(), sizeof a);
  return a.status == static_cast<uint32_t>(remote::DoorStatus::kWrongToken) ? "challenged"
                                                                             : "admitted?!";
}

TEST_F(FrontDoorTest, WrongTokensAreThrottledAndALegitimatePeerIsServed) {
  Server server = Serve("--token right 2>&1");
  ASSERT_GT(server.port, 0) << server.child.Output();
  // 200 guesses from 127.0.0.2 (another address on loopback: another peer).
  int challenged = 0, refused = 0;
  for (int i = 0; i < 200; ++i) {
    std::string r = WrongProof(server.port, "127.0.0.2");
    ASSERT_TRUE(r == "challenged" || r == "refused") << r;
    (r == "challenged" ? challenged : refused)++;
  }
  EXPECT_LE(challenged, 10) << "no throttling: " << challenged << " guesses were answered";
  EXPECT_GE(refused, 190);
  // The legitimate peer (another address) is served meanwhile.
  ExpectServed(server, "right");
  auto summary = Stop(server);
  ASSERT_TRUE(summary.is_object()) << server.child.Output();
  EXPECT_EQ(summary["auth_failed"].get<int>(), challenged);
  EXPECT_GE(summary["refused"].get<int>(), refused);
  // Logged once per peer per interval, not 200 times.
  const std::string log = server.child.Output();
  size_t lines = 0;
  for (size_t at = log.find("refused until the interval passes"); at != std::string::npos;
       at = log.find("refused until the interval passes", at + 1)) {
    ++lines;
  }
  EXPECT_GE(lines, 1u) << log;
  EXPECT_LE(lines, 3u) << log;
}

TEST_F(FrontDoorTest, SeededRandomBytesNeverKillServe) {
  Server server = Serve("--hello-timeout 2");
  ASSERT_GT(server.port, 0) << server.child.Output();
  const uint32_t seed = 27;
  std::mt19937 rng(seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto end = Clock::now() + std::chrono::seconds(20);
  int sent = 0;
  for (int i = 0; i < 300 && Clock::now() < end; ++i, ++sent) {
    std::string bytes(rng() % 512, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    // Half start like a real hello, so the parser's later checks are reached.
    if (rng() % 2 == 0 && bytes.size() >= 12) {
      std::memcpy(bytes.data(), &remote::kDoorMagic, 8);
      if (rng() % 2 == 0) std::memcpy(bytes.data() + 8, &remote::kDoorVersion, 4);
    }
    int fd = RawConnect(server.port);
    ASSERT_GE(fd, 0) << "connection " << i;
    (void)send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (rng() % 4 == 0) (void)ReadN(fd, 1 + rng() % 100);
    close(fd);
    if (i % 50 == 0) {
      ASSERT_TRUE(Alive(server.pid) && Alive(server.net_pid)) << "after " << i << " connections";
    }
  }
  ASSERT_TRUE(Alive(server.pid) && Alive(server.net_pid));
  EXPECT_GT(sent, 50);
  ExpectServed(server);
  Stop(server);
}

}  // namespace
}  // namespace expert_arena
