// Peer fill (`expert-arena serve`, `load --from-peer`) over real UCX between "hosts": network
// namespaces joined by veth pairs on a bridge, each with its own mount namespace (its own
// /dev/shm tmpfs and a sysfs of its own network namespace, where UCX finds its interfaces), so
// no host sees another's arenas. UCX_TLS=tcp: every namespace has the same boot id, and UCX
// would otherwise take shared memory. Loopback in the test's own namespace is the other case.
// Every test runs with both transports of `serve` (--transport am, the default, and get); the
// loads follow what the server offers.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "expert_arena/expert_arena.h"
#include "remote/peer_client.h"
#include "test_util.h"

namespace expert_arena {
namespace {

bool InCi() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}

// Skips outside CI, fails in CI.
#define SKIP_OR_FAIL(why)        \
  do {                           \
    if (InCi()) FAIL() << (why); \
    GTEST_SKIP() << (why);       \
  } while (0)

// Runs a shell command line, stderr folded into the output.
int Sh(const std::string& command, std::string* out = nullptr, double timeout = 120) {
  auto child = testing::SpawnProgram("/bin/sh", {"-c", command + " 2>&1"});
  int code = child.Wait(timeout);
  if (out != nullptr) *out = child.Output();
  return code;
}

// The JSON object a command printed (the line that starts with '{'), or null.
nlohmann::json JsonLine(const std::string& out) {
  size_t at = 0;
  while (at < out.size()) {
    size_t end = out.find('\n', at);
    if (end == std::string::npos) end = out.size();
    if (out[at] == '{') {
      auto j = nlohmann::json::parse(out.substr(at, end - at), nullptr, false);
      if (!j.is_discarded()) return j;
    }
    at = end + 1;
  }
  return nullptr;
}

std::string Quote(const std::string& s) { return "'" + s + "'"; }

// Three hosts (0, 1, 2) on one bridge, made once for the suite and removed after it.
class Hosts {
 public:
  static constexpr int kCount = 3;

  // "" when made, else why not.
  std::string Make() {
    if (!remote::RemoteBuilt()) return "built without UCX (libucx-dev)";
    if (geteuid() != 0) return "needs root to make network and mount namespaces";
    if (Sh("command -v ip && command -v nsenter && command -v unshare") != 0)
      return "needs ip (iproute2), nsenter and unshare (util-linux)";
    const std::string pid = std::to_string(getpid());
    run_ = "/run/ea-peer-" + pid;
    switch_ = "ea" + pid + "sw";
    subnet_ = "10.213." + std::to_string(20 + getpid() % 200) + ".";
    std::string script = "set -e; mkdir -p " + run_ + "; mount --bind " + run_ + " " + run_ +
                         "; mount --make-private " + run_ + "; ip netns add " + switch_ +
                         "; ip -n " + switch_ + " link add br0 type bridge; ip -n " + switch_ +
                         " link set br0 up;";
    made_ = true;
    for (int i = 0; i < kCount; ++i) {
      std::string ns = Namespace(i);
      std::string vh = "e" + pid + "h" + std::to_string(i);
      std::string vs = "e" + pid + "s" + std::to_string(i);
      script += " ip netns add " + ns + "; ip link add " + vh + " type veth peer name " + vs +
                "; ip link set " + vh + " netns " + ns + "; ip link set " + vs + " netns " +
                switch_ + "; ip -n " + switch_ + " link set " + vs + " master br0 up; ip -n " + ns +
                " addr add " + Address(i) + "/24 dev " + vh + "; ip -n " + ns + " link set " + vh +
                " up; ip -n " + ns + " link set lo up; touch " + MountFile(i) +
                "; nsenter --net=/run/netns/" + ns + " unshare --mount=" + MountFile(i) +
                " --propagation private sh -c 'mount -t tmpfs -o size=512m tmpfs /dev/shm && "
                "umount -l /sys && mount -t sysfs sysfs /sys';";
    }
    std::string out;
    if (Sh(script, &out) != 0) return "cannot make the test network: " + out;
    return "";
  }

  ~Hosts() {
    if (!made_) return;
    std::string script;
    for (int i = 0; i < kCount; ++i) {
      script += "umount " + MountFile(i) + "; ip netns del " + Namespace(i) + "; ";
    }
    script += "ip netns del " + switch_ + "; umount " + run_ + "; rm -rf " + run_;
    (void)Sh(script);
  }

  std::string Address(int host) const { return subnet_ + std::to_string(host + 1); }
  // Takes `host`'s link down or up (a cable pulled: no reset reaches the peer).
  int SetLink(int host, bool up) const {
    return Sh("ip -n " + Namespace(host) + " link set e" + std::to_string(getpid()) + "h" +
              std::to_string(host) + (up ? " up" : " down"));
  }
  // The prefix that runs a command on `host`.
  std::string On(int host) const {
    return "nsenter --net=/run/netns/" + Namespace(host) + " --mount=" + MountFile(host) +
           " -- env UCX_TLS=tcp ";
  }

 private:
  std::string Namespace(int host) const {
    return "ea" + std::to_string(getpid()) + "h" + std::to_string(host);
  }
  std::string MountFile(int host) const { return run_ + "/h" + std::to_string(host) + ".mnt"; }
  bool made_ = false;
  std::string run_;
  std::string switch_;
  std::string subnet_;
};

std::string Tool() { return testing::BinDir() + "/expert-arena"; }

struct Server {
  testing::Child child;
  std::string address;  // HOST:PORT
};

class PeerFillTest : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    hosts_ = new Hosts();
    skip_ = hosts_->Make();
    dir_ = std::filesystem::temp_directory_path() / ("ea-peer-fill-" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
    model_ = (dir_ / "m.gguf").string();
    other_ = (dir_ / "other.gguf").string();
    // 48 MiB of experts (the killed-server case reads it in 1 MiB chunks, two in flight, and
    // pauses half-way: mid-transfer).
    std::string out;
    if (Sh(Tool() + " gen-model --format gguf --out " + model_ +
               " --layers 2 --experts 8 --hidden 512 --ffn 1024 --dtype f16",
           &out) != 0 ||
        Sh(Tool() + " gen-model --format gguf --out " + other_ +
               " --layers 2 --experts 4 --hidden 256 --ffn 512 --dtype f16",
           &out) != 0) {
      skip_ = "gen-model failed: " + out;
    }
    if (skip_.empty() &&
        Sh(hosts_->On(0) + Tool() + " load --model " + model_ + " --arena " + kServed, &out) != 0) {
      skip_ = "the served arena did not load: " + out;
    }
  }
  static void TearDownTestSuite() {
    delete hosts_;  // the hosts' /dev/shm go with their mount namespaces
    std::filesystem::remove_all(dir_);
  }
  void SetUp() override {
    if (!skip_.empty()) SKIP_OR_FAIL(skip_);
    // Each case starts from hosts that hold only the served arena (the cases of the other
    // transport used the same names).
    for (int host = 0; host < Hosts::kCount; ++host) {
      Sh(hosts_->On(host) +
         "find /dev/shm -maxdepth 1 -name '*.arena' ! -name served.arena -delete");
    }
  }

  static constexpr const char* kServed = "/dev/shm/served.arena";

  // `expert-arena serve PATH --transport <param>` on `host`, once it says where it listens.
  Server Serve(int host, const std::string& path, const std::string& extra = "") {
    Server server;
    const std::string listen = host < 0 ? "127.0.0.1:0" : hosts_->Address(host) + ":0";
    const std::string prefix =
        (host < 0 ? "exec env UCX_TLS=tcp " : "exec " + hosts_->On(host)) + TokenEnv();
    server.child = testing::SpawnProgram(
        "/bin/sh", {"-c", prefix + Tool() + " serve " + path + " --listen " + listen +
                              " --transport " + GetParam() + " --json " + extra});
    if (!server.child.WaitForOutput("\"port\"", 60)) return server;
    auto j = JsonLine(server.child.Output());
    if (j.is_object()) server.address = j["address"].get<std::string>();
    return server;
  }

  // `expert-arena ARGS` on `host` (-1: here), stderr folded into `out`.
  static int Run(int host, const std::string& args, std::string* out) {
    return Sh((host < 0 ? std::string("env UCX_TLS=tcp ") : hosts_->On(host)) + TokenEnv() +
                  Tool() + " " + args,
              out);
  }

  // Every server and load shares this token (an explicit --token wins over it): `serve
  // --transport get` needs one, a server on a namespace's address (not loopback) refuses to
  // start without one, and a fill refuses a peer that proves none.
  static std::string Token() { return GetParam() == "get" ? "get-token" : "fill-token"; }
  static std::string TokenEnv() { return "EXPERT_ARENA_TOKEN=" + Token() + " "; }

  // SHA-256 of the data region of an arena on `host` (headers differ: loader, times).
  static std::string DataDigest(int host, const std::string& path) {
    std::string out;
    if (Run(host, "info " + path + " --json", &out) != 0) return "info failed: " + out;
    auto info = nlohmann::json::parse(out.substr(out.find('{')), nullptr, false);
    if (info.is_discarded()) return "bad info";
    uint64_t header = info["header_bytes"].get<uint64_t>();
    uint64_t data = info["data_bytes"].get<uint64_t>();
    std::string prefix = host < 0 ? "" : hosts_->On(host);
    Sh(prefix + "sh -c " +
           Quote("tail -c +" + std::to_string(header + 1) + " " + path + " | head -c " +
                 std::to_string(data) + " | sha256sum"),
       &out);
    return out;
  }

  static bool Exists(int host, const std::string& path) {
    return Sh(hosts_->On(host) + "test -e " + path) == 0;
  }

  static Hosts* hosts_;
  static std::string skip_;
  static std::filesystem::path dir_;
  static std::string model_;
  static std::string other_;
};

Hosts* PeerFillTest::hosts_ = nullptr;
std::string PeerFillTest::skip_;
std::filesystem::path PeerFillTest::dir_;
std::string PeerFillTest::model_;
std::string PeerFillTest::other_;

TEST_P(PeerFillTest, TwoHostsFillIsByteExactAndLocalEnginesAttach) {
  Server server = Serve(0, kServed);
  ASSERT_FALSE(server.address.empty()) << server.child.Output();
  std::string out;
  // Without the model: identity and table come from the peer.
  ASSERT_EQ(
      Run(1, "load --arena /dev/shm/fill.arena --from-peer " + server.address + " --json", &out), 0)
      << out;
  auto j = JsonLine(out);
  ASSERT_TRUE(j.is_object()) << out;
  EXPECT_EQ(j["role"], "loaded");
  EXPECT_EQ(j["from_peer"], server.address);
  EXPECT_EQ(j["reader"], "ucx");
  EXPECT_EQ(j["peer_transport"], GetParam());
  EXPECT_EQ(j["bytes_read"], 0);
  EXPECT_GE(j["peer_bytes"].get<uint64_t>(), j["tensor_bytes"].get<uint64_t>());
  EXPECT_NE(out.find("from peer " + server.address), std::string::npos) << out;
  ASSERT_EQ(Run(1, "verify /dev/shm/fill.arena", &out), 0) << out;
  EXPECT_EQ(DataDigest(1, "/dev/shm/fill.arena"), DataDigest(0, kServed));
  // A load that takes the other transport only is refused before any byte, nothing published.
  const std::string other = GetParam() == "am" ? "get" : "am";
  EXPECT_EQ(Run(1,
                "load --arena /dev/shm/other-transport.arena --from-peer " + server.address +
                    " --peer-transport " + other,
                &out),
            1);
  EXPECT_NE(out.find("serves by " + GetParam() + ", and this fill takes " + other + " only"),
            std::string::npos)
      << out;
  EXPECT_FALSE(Exists(1, "/dev/shm/other-transport.arena"));

  // With the model: the local identity, so a local engine with the same files attaches.
  ASSERT_EQ(Run(1,
                "load --arena /dev/shm/with-model.arena --model " + model_ + " --from-peer " +
                    server.address + " --json",
                &out),
            0)
      << out;
  j = JsonLine(out);
  EXPECT_EQ(j["role"], "loaded");
  EXPECT_EQ(j["from_peer"], server.address);
  EXPECT_GT(j["bytes_read"].get<uint64_t>(), 0u);  // the local headers
  EXPECT_LT(j["bytes_read"].get<uint64_t>(), j["tensor_bytes"].get<uint64_t>());
  ASSERT_EQ(Run(1, "load --arena /dev/shm/with-model.arena --model " + model_ + " --json", &out), 0)
      << out;
  EXPECT_EQ(JsonLine(out)["role"], "attached") << out;
  server.child.Kill(SIGTERM);
  EXPECT_EQ(server.child.Wait(30), 0);
}

TEST_P(PeerFillTest, ServerKilledMidTransferPublishesNothingAndFallsBack) {
  const std::string pause = (dir_ / "pause").string();
  for (bool with_model : {true, false}) {
    SCOPED_TRACE(with_model ? "with --model" : "without --model");
    Server server = Serve(0, kServed);
    ASSERT_FALSE(server.address.empty()) << server.child.Output();
    const std::string arena = with_model ? "/dev/shm/killed-model.arena" : "/dev/shm/killed.arena";
    std::string command = hosts_->On(1) + "EXPERT_ARENA_TEST_PEER_PAUSE_FILE=" + pause +
                          " EXPERT_ARENA_PEER_CHUNK_MIB=1 EXPERT_ARENA_PEER_WINDOW=2 " +
                          TokenEnv() + Tool() + " load --arena " + arena + " --from-peer " + server.address + " --json" +
                          (with_model ? " --model " + model_ : "");
    auto load = testing::SpawnProgram("/bin/sh", {"-c", command + " 2>&1"});
    // The fill stops half-way and says so through the pause file.
    bool paused = false;
    for (int i = 0; i < 1200 && !paused; ++i) {
      paused = std::filesystem::exists(pause);
      if (!paused) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ASSERT_TRUE(paused) << load.Output();
    server.child.Kill(SIGKILL);
    EXPECT_EQ(server.child.Wait(30), 128 + SIGKILL);
    std::filesystem::remove(pause);
    int code = load.Wait(120);
    std::string out = load.Output();
    if (with_model) {
      ASSERT_EQ(code, 0) << out;
      auto j = JsonLine(out);
      EXPECT_EQ(j["from_peer"], "");
      EXPECT_NE(j["peer_note"].get<std::string>().find("went away"), std::string::npos) << out;
      EXPECT_GE(j["bytes_read"].get<uint64_t>(), j["tensor_bytes"].get<uint64_t>());
      EXPECT_NE(out.find("read the model files instead"), std::string::npos) << out;
      ASSERT_EQ(Run(1, "verify " + arena, &out), 0) << out;
    } else {
      EXPECT_EQ(code, 1) << out;
      EXPECT_NE(out.find("nothing published"), std::string::npos) << out;
      EXPECT_NE(out.find("went away"), std::string::npos) << out;
      EXPECT_FALSE(Exists(1, arena));
    }
  }
}

TEST_P(PeerFillTest, ServerUnreachableMidTransferIsAnErrorNotAHang) {
  const std::string pause = (dir_ / "pause-link").string();
  Server server = Serve(0, kServed);
  ASSERT_FALSE(server.address.empty()) << server.child.Output();
  auto load = testing::SpawnProgram(
      "/bin/sh", {"-c", hosts_->On(1) + "EXPERT_ARENA_TEST_PEER_PAUSE_FILE=" + pause +
                            " EXPERT_ARENA_PEER_CHUNK_MIB=1 EXPERT_ARENA_PEER_WINDOW=2 " +
                            TokenEnv() + Tool() +
                            " load --arena /dev/shm/unreachable.arena --from-peer " +
                            server.address + " --peer-stall-timeout 3 2>&1"});
  bool paused = false;
  for (int i = 0; i < 1200 && !paused; ++i) {
    paused = std::filesystem::exists(pause);
    if (!paused) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(paused) << load.Output();
  // The server's host drops off the network: no reset, no answer; the server lives on.
  ASSERT_EQ(hosts_->SetLink(0, false), 0);
  std::filesystem::remove(pause);
  int code = load.Wait(120);
  ASSERT_EQ(hosts_->SetLink(0, true), 0);
  EXPECT_EQ(code, 1) << load.Output();
  EXPECT_NE(load.Output().find("nothing published"), std::string::npos) << load.Output();
  EXPECT_FALSE(Exists(1, "/dev/shm/unreachable.arena"));
  server.child.Kill(SIGTERM);
  EXPECT_EQ(server.child.Wait(30), 0);
}

TEST_P(PeerFillTest, CorruptedByteOnTheServerIsRefused) {
  const std::string bad = "/dev/shm/corrupt.arena";
  std::string out;
  ASSERT_EQ(Run(0, "load --model " + model_ + " --arena " + bad, &out), 0) << out;
  ASSERT_EQ(Run(0, "info " + bad + " --json", &out), 0) << out;
  auto info = nlohmann::json::parse(out.substr(out.find('{')));
  uint64_t offset = info["tensors"][2]["file_offset"].get<uint64_t>() + 12345;
  // Flip one byte of a published tensor in place (what a bad DIMM or a stray write does).
  ASSERT_EQ(Sh(hosts_->On(0) + "/usr/bin/python3 -c " +
                   Quote("f=open(\"" + bad + "\",\"r+b\");f.seek(" + std::to_string(offset) +
                         ");b=f.read(1);f.seek(" + std::to_string(offset) +
                         ");f.write(bytes([b[0]^0x5a]))"),
               &out),
            0)
      << out;
  ASSERT_EQ(Run(0, "verify " + bad, &out), 1) << out;
  Server server = Serve(0, bad);
  ASSERT_FALSE(server.address.empty()) << server.child.Output();
  EXPECT_EQ(Run(1, "load --arena /dev/shm/from-corrupt.arena --from-peer " + server.address, &out),
            1);
  EXPECT_NE(out.find("checksum"), std::string::npos) << out;
  EXPECT_NE(out.find("nothing published"), std::string::npos) << out;
  EXPECT_FALSE(Exists(1, "/dev/shm/from-corrupt.arena"));
  // With the model files, the refusal falls back to them.
  ASSERT_EQ(Run(1,
                "load --arena /dev/shm/from-corrupt.arena --model " + model_ + " --from-peer " +
                    server.address + " --json",
                &out),
            0)
      << out;
  auto j = JsonLine(out);
  EXPECT_NE(j["peer_note"].get<std::string>().find("checksum"), std::string::npos) << out;
  ASSERT_EQ(Run(1, "verify /dev/shm/from-corrupt.arena", &out), 0) << out;
  server.child.Kill(SIGTERM);
  EXPECT_EQ(server.child.Wait(30), 0);
}

TEST_P(PeerFillTest, ThreeHostChain) {
  Server first = Serve(0, kServed);
  ASSERT_FALSE(first.address.empty()) << first.child.Output();
  std::string out;
  ASSERT_EQ(Run(1, "load --arena /dev/shm/chain.arena --from-peer " + first.address, &out), 0)
      << out;
  // The host that finished serves the next one.
  Server second = Serve(1, "/dev/shm/chain.arena");
  ASSERT_FALSE(second.address.empty()) << second.child.Output();
  ASSERT_EQ(
      Run(2, "load --arena /dev/shm/chain.arena --from-peer " + second.address + " --json", &out),
      0)
      << out;
  EXPECT_EQ(JsonLine(out)["from_peer"], second.address);
  ASSERT_EQ(Run(2, "verify /dev/shm/chain.arena", &out), 0) << out;
  EXPECT_EQ(DataDigest(2, "/dev/shm/chain.arena"), DataDigest(0, kServed));
  first.child.Kill(SIGTERM);
  second.child.Kill(SIGTERM);
  EXPECT_EQ(first.child.Wait(30), 0);
  EXPECT_EQ(second.child.Wait(30), 0);
}

TEST_P(PeerFillTest, TwoPeersFillAtOnceFromOneServer) {
  Server server = Serve(0, kServed);
  ASSERT_FALSE(server.address.empty()) << server.child.Output();
  std::vector<testing::Child> loads;
  for (int host : {1, 2}) {
    loads.push_back(testing::SpawnProgram(
        "/bin/sh", {"-c", hosts_->On(host) + TokenEnv() + Tool() +
                              " load --arena /dev/shm/both.arena " +
                              "--from-peer " + server.address + " --json 2>&1"}));
  }
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(loads[i].Wait(120), 0) << loads[i].Output();
    EXPECT_EQ(JsonLine(loads[i].Output())["from_peer"], server.address);
  }
  std::string out;
  for (int host : {1, 2}) {
    ASSERT_EQ(Run(host, "verify /dev/shm/both.arena", &out), 0) << out;
  }
  server.child.Kill(SIGTERM);
  EXPECT_EQ(server.child.Wait(30), 0);
  EXPECT_NE(server.child.Output().find("\"port\""), std::string::npos);
}

TEST_P(PeerFillTest, AnotherModelIsRefusedAndTheLocalFilesAreRead) {
  Server server = Serve(0, kServed);
  ASSERT_FALSE(server.address.empty()) << server.child.Output();
  std::string out;
  ASSERT_EQ(Run(2,
                "load --arena /dev/shm/other.arena --model " + other_ + " --from-peer " +
                    server.address + " --json",
                &out),
            0)
      << out;
  auto j = JsonLine(out);
  EXPECT_EQ(j["from_peer"], "");
  EXPECT_NE(j["peer_note"].get<std::string>().find("another model"), std::string::npos) << out;
  EXPECT_EQ(j["tensors"], 6);
  ASSERT_EQ(Run(2, "verify /dev/shm/other.arena", &out), 0) << out;
  server.child.Kill(SIGTERM);
  EXPECT_EQ(server.child.Wait(30), 0);
}

TEST_P(PeerFillTest, LoopbackWithTokenAndRefusals) {
  testing::ScopedPath served("served");
  testing::ScopedPath filled("filled");
  std::string out;
  ASSERT_EQ(Run(-1, "load --model " + model_ + " --arena " + served.path(), &out), 0) << out;
  Server server = Serve(-1, served.path(), "--token s3cret");
  ASSERT_FALSE(server.address.empty()) << server.child.Output();
  EXPECT_NE(server.address.find("127.0.0.1:"), std::string::npos);
  // No token, a wrong one: refused before any byte, nothing published.
  for (std::string token : {"", "--token wrong"}) {
    EXPECT_EQ(
        Run(-1, "load --arena " + filled.path() + " --from-peer " + server.address + " " + token,
            &out),
        1);
    EXPECT_NE(out.find("refused"), std::string::npos) << out;
    EXPECT_FALSE(std::filesystem::exists(filled.path()));
  }
  ASSERT_EQ(Run(-1,
                "load --arena " + filled.path() + " --from-peer " + server.address +
                    " --token s3cret --json",
                &out),
            0)
      << out;
  ASSERT_EQ(Run(-1, "verify " + filled.path(), &out), 0) << out;
  EXPECT_EQ(DataDigest(-1, filled.path()), DataDigest(-1, served.path()));
  server.child.Kill(SIGTERM);
  EXPECT_EQ(server.child.Wait(30), 0);
  // Nobody listening: a clear error at once, not a hang.
  EXPECT_EQ(Run(-1, "load --arena " + filled.path() + ".2 --from-peer " + server.address, &out), 1);
  EXPECT_NE(out.find("nothing published"), std::string::npos) << out;
  // No address: usage.
  EXPECT_EQ(Run(-1, "serve " + served.path() + " --listen :4000", &out), 1);
  EXPECT_NE(out.find("no default on all interfaces"), std::string::npos) << out;
}

TEST_P(PeerFillTest, CInterfaceFillsFromPeer) {
  testing::ScopedPath served("c-served");
  testing::ScopedPath filled("c-filled");
  std::string out;
  ASSERT_EQ(Run(-1, "load --model " + model_ + " --arena " + served.path(), &out), 0) << out;
  Server server = Serve(-1, served.path(), "--token c");
  ASSERT_FALSE(server.address.empty()) << server.child.Output();
  setenv("UCX_TLS", "tcp", 1);
  ea_open_params p;
  ea_open_params_init(&p);
  p.shared_path = filled.path().c_str();
  p.from_peer = server.address.c_str();
  p.peer_token = "c";
  p.quiet = 1;
  ea_arena* arena = nullptr;
  ASSERT_EQ(ea_arena_open(&p, &arena), 0) << ea_last_error();
  ea_arena_info info;
  info.size = sizeof info;
  ASSERT_EQ(ea_arena_get_info(arena, &info), 0);
  EXPECT_EQ(info.role, EA_ROLE_LOADED);
  EXPECT_EQ(info.bytes_read, 0u);
  EXPECT_NE(std::string(info.start_line).find("from peer " + server.address), std::string::npos)
      << info.start_line;
  ea_arena_close(arena);
  // A wrong token without model files: an error, and nothing published.
  testing::ScopedPath refused("c-refused");
  p.shared_path = refused.path().c_str();
  p.peer_token = "wrong";
  EXPECT_LT(ea_arena_open(&p, &arena), 0);
  EXPECT_EQ(arena, nullptr);
  EXPECT_NE(std::string(ea_last_error()).find("refused"), std::string::npos) << ea_last_error();
  EXPECT_FALSE(std::filesystem::exists(refused.path()));
  unsetenv("UCX_TLS");
  server.child.Kill(SIGTERM);
  EXPECT_EQ(server.child.Wait(30), 0);
}

// A peer that asks for bytes outside the arena file (peer_range_probe speaks the wire protocol
// with plain UCX) is refused, logged and disconnected; the server serves on.
TEST_P(PeerFillTest, RangeOutsideTheArenaIsRefusedAndLogged) {
  std::string out;
  ASSERT_EQ(Run(0, "info " + std::string(kServed) + " --json", &out), 0) << out;
  auto info = nlohmann::json::parse(out.substr(out.find('{')));
  const uint64_t file = info["header_bytes"].get<uint64_t>() + info["data_bytes"].get<uint64_t>();
  Server server = Serve(0, kServed, "2>&1");
  ASSERT_FALSE(server.address.empty()) << server.child.Output();
  const std::string probe =
      // UCX's keepalive at 1 s (the library's clients use that too): the probe sees the
      // server's close of its endpoint within a second or two.
      hosts_->On(1) + "UCX_KEEPALIVE_INTERVAL=1s " + testing::BinDir() + "/peer_range_probe " +
      server.address + " '" + Token() +
      "' ";
  // Past the end (straddling it), then one whose end wraps around 2^64.
  const std::string past = std::to_string(file - 100) + ":4096";
  const std::string wraps = "18446744073709547520:8192";
  for (const std::string& range : {past, wraps}) {
    SCOPED_TRACE(range);
    EXPECT_EQ(Sh(probe + "0:4096 " + range, &out), 3) << out;
    EXPECT_NE(out.find("offer " + GetParam() + " " + std::to_string(file)), std::string::npos)
        << out;
    if (GetParam() == "am") {
      // The range inside is sent: the probe can read, and is stopped only at the bad one.
      EXPECT_NE(out.find("range 0:4096: 4096 bytes"), std::string::npos) << out;
    }
    EXPECT_NE(out.find("closed: "), std::string::npos) << out;
  }
  if (GetParam() == "am") {
    // A raw get of an address in the server's process, with a key of the probe's own (all a
    // tcp get request needs): an am server has no RMA handler and does not answer. A server
    // that did would read address 4096 and die, which the checks below would see.
    EXPECT_EQ(Sh(probe + "rawget:4096:64", &out), 4) << out;
    EXPECT_NE(out.find("no answer"), std::string::npos) << out;
  }
  // An ordinary fill from the same server still works.
  ASSERT_EQ(Run(1, "load --arena /dev/shm/after-probe.arena --from-peer " + server.address, &out),
            0)
      << out;
  ASSERT_EQ(Run(1, "verify /dev/shm/after-probe.arena", &out), 0) << out;
  server.child.Kill(SIGTERM);
  EXPECT_EQ(server.child.Wait(30), 0);
  const std::string log = server.child.Output();
  if (GetParam() == "am") {
    EXPECT_NE(log.find("refused bytes [" + std::to_string(file - 100) +
                       ", +4096) asked, outside the arena file (" + std::to_string(file) +
                       " bytes); disconnected"),
              std::string::npos)
        << log;
    EXPECT_NE(log.find("refused bytes [18446744073709547520, +8192)"), std::string::npos) << log;
  } else {
    EXPECT_NE(log.find("refused a range request to a server that serves by get"), std::string::npos)
        << log;
  }
  EXPECT_NE(log.find(" sent; 2 range requests refused;"), std::string::npos) << log;
}

INSTANTIATE_TEST_SUITE_P(Transports, PeerFillTest, ::testing::Values("am", "get"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace expert_arena
