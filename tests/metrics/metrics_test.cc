// `expert-arena metrics` against Prometheus' own tools (Debian's prometheus and
// prometheus-node-exporter): promtool's linter accepts the exposition, its numbers are those of
// `ls --json`, and a real node_exporter (textfile collector only) scraped by a real Prometheus
// server, both on 127.0.0.1 ports of their own (never the Debian services), serves them back
// through the HTTP query API. Real processes throughout: arenas loaded and held by the CLI, a
// stream segment of a producer in this process.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "expert_arena/stream.h"
#include "source_test_util.h"
#include "test_util.h"

namespace expert_arena {
namespace {

using testing::Child;
using testing::ScopedArenaDir;
using testing::ScopedDir;

bool InCi() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}

// The path of `program` on PATH, or "" when it is not installed.
std::string Which(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path != nullptr ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const std::string candidate = dir + "/" + program;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

#define NEED_PROGRAM(var, program, package)                                               \
  const std::string var = Which(program);                                                 \
  if (var.empty()) {                                                                      \
    if (InCi()) FAIL() << program " is missing (Debian package " package                  \
                       << ", scripts/install-deps.sh)";                                   \
    GTEST_SKIP() << program " is missing (Debian package " package ")";                   \
  }

int ExpertArena(const std::vector<std::string>& args, std::string* out = nullptr) {
  auto child = testing::SpawnProgram(testing::BinDir() + "/expert-arena", args);
  int code = child.Wait(120);
  if (out != nullptr) *out = child.Output();
  return code;
}

// Runs a shell command line, stderr folded into the captured output.
int Shell(const std::string& command, std::string* out) {
  auto child = testing::SpawnProgram("/bin/sh", {"-c", command + " 2>&1"});
  int code = child.Wait(120);
  *out = child.Output();
  return code;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// "name{labels}" -> value, from an exposition (HELP/TYPE lines skipped).
std::map<std::string, double> Samples(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    out[line.substr(0, space)] = std::stod(line.substr(space + 1));
  }
  return out;
}

std::string ArenaKey(const std::string& name, const nlohmann::json& a, const std::string& backing) {
  return name + "{path=\"" + a["path"].get<std::string>() + "\",backing=\"" + backing +
         "\",state=\"" + a["state"].get<std::string>() + "\"}";
}

// A small model, an arena loaded and left (nobody maps it), one held by `load --hold`, and a
// stream segment of a live producer, all in one fresh directory of /dev/shm.
class MetricsFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(testing::BinDir() + "/expert-arena")) {
      GTEST_SKIP() << "expert-arena not built";
    }
    model_ = tmp_.File("m.gguf");
    ASSERT_EQ(ExpertArena({"gen-model", "--format", "gguf", "--out", model_, "--layers", "2",
                           "--experts", "2", "--hidden", "64", "--ffn", "64"}),
              0);
    idle_ = dir_.File("idle.arena");
    held_ = dir_.File("held.arena");
    ASSERT_EQ(ExpertArena({"load", "--model", model_, "--arena", idle_}), 0);
    holder_ = testing::SpawnProgram(
        "/bin/sh", {"-c", "exec " + testing::BinDir() + "/expert-arena load --model " + model_ +
                              " --arena " + held_ + " --hold --json </dev/null"});
    ASSERT_TRUE(holder_.WaitForOutput("\"role\"", 60)) << holder_.Output();
    StreamOptions options;
    options.directory = dir_.path();
    options.logical_name = "metrics";
    options.segment_bytes = 4 * 1024 * 1024;
    auto producer = StreamProducer::Create(options);
    ASSERT_TRUE(producer.ok()) << producer.status().ToString();
    producer_.emplace(std::move(*producer));
    std::vector<std::byte> data(100000);
    ASSERT_TRUE(producer_->Put("k", data, {}).ok());
  }

  void TearDown() override {
    producer_.reset();
    if (holder_.pid() > 0) {
      holder_.Kill(SIGTERM);
      EXPECT_EQ(holder_.Wait(30), 0);
    }
  }

  nlohmann::json Ls() {
    std::string out;
    EXPECT_EQ(ExpertArena({"ls", dir_.path(), "--json"}, &out), 0);
    return nlohmann::json::parse(out);
  }

  ScopedDir tmp_{"metrics"};
  ScopedArenaDir dir_{"metrics"};
  std::string model_, idle_, held_;
  Child holder_;
  std::optional<StreamProducer> producer_;
};

TEST_F(MetricsFixture, PromtoolAcceptsTheExpositionAndItsNumbersAreThoseOfLs) {
  NEED_PROGRAM(promtool, "promtool", "prometheus");
  std::string text;
  ASSERT_EQ(ExpertArena({"metrics", dir_.path()}, &text), 0);
  const std::string file = tmp_.File("out.prom");
  std::ofstream(file) << text;
  std::string lint;
  EXPECT_EQ(Shell(promtool + " check metrics < " + file, &lint), 0) << lint << "\n" << text;

  const auto samples = Samples(text);
  const nlohmann::json ls = Ls();
  ASSERT_EQ(ls["arenas"].size(), 2u) << ls.dump(1);
  uint64_t idle_bytes = 0;
  for (const auto& a : ls["arenas"]) {
    const bool held = a["path"] == held_;
    EXPECT_EQ(samples.at(ArenaKey("expert_arena_arena_bytes", a, "tmpfs")),
              a["file_bytes"].get<double>())
        << text;
    EXPECT_EQ(samples.at(ArenaKey("expert_arena_arena_in_use", a, "tmpfs")), held ? 1 : 0);
    EXPECT_EQ(samples.at(ArenaKey("expert_arena_arena_users", a, "tmpfs")), held ? 1 : 0);
    if (!held) idle_bytes = a["file_bytes"];
  }
  ASSERT_EQ(ls["segments"].size(), 1u) << ls.dump(1);
  const auto& g = ls["segments"][0];
  const std::string segment = "{path=\"" + g["path"].get<std::string>() +
                              "\",stream=\"metrics\",kind=\"regular\"}";
  EXPECT_EQ(samples.at("expert_arena_segment_bytes" + segment), g["file_bytes"].get<double>());
  EXPECT_EQ(samples.at("expert_arena_segment_owner_alive" + segment), 1);
  EXPECT_EQ(samples.at("expert_arena_segment_live_blocks" + segment), 1);
  const double data = samples.at("expert_arena_segment_data_bytes" + segment);
  EXPECT_EQ(samples.at("expert_arena_segment_free_bytes" + segment), data - 100000);
  EXPECT_LE(samples.at("expert_arena_segment_largest_free_block_bytes" + segment), data - 100000);
  EXPECT_GE(samples.at("expert_arena_segment_largest_free_block_bytes" + segment),
            (data - 100000) / 2);
  const std::string dir = "{directory=\"" + dir_.path() + "\",command=";
  EXPECT_EQ(samples.at("expert_arena_reclaimable_bytes" + dir + "\"rm\"}"), idle_bytes);
  EXPECT_EQ(samples.at("expert_arena_reclaimable_bytes" + dir + "\"sweep\"}"), 0);
  EXPECT_EQ(samples.at("expert_arena_directory_up{directory=\"" + dir_.path() + "\"}"), 1);
}

// The page size an arena really got is a metric of its own, read from the page tables: an
// arena on small pages (here one loaded with --huge off on a tmpfs that does not force huge
// pages) says 4096, and its small-page bytes are its size.
TEST_F(MetricsFixture, PageSizeIsTheOneTheArenaReallyGot) {
  const std::string small = dir_.File("small.arena");
  ASSERT_EQ(ExpertArena({"load", "--model", model_, "--arena", small, "--huge", "off"}), 0);
  std::string text;
  ASSERT_EQ(ExpertArena({"metrics", dir_.path()}, &text), 0);
  const auto samples = Samples(text);
  const nlohmann::json ls = Ls();
  ASSERT_EQ(ls["arenas"].size(), 3u) << ls.dump(1);
  bool saw_small = false;
  for (const auto& a : ls["arenas"]) {
    const std::string huge_key = ArenaKey("expert_arena_arena_huge_page_bytes", a, "tmpfs");
    const double huge = samples.at(huge_key.substr(0, huge_key.size() - 1) +
                                   ",page_size=\"2MiB\"}");
    const double bytes = a["file_bytes"].get<double>();
    const double page = samples.at(ArenaKey("expert_arena_arena_page_size_bytes", a, "tmpfs"));
    EXPECT_EQ(page, 2 * huge >= bytes ? 2097152 : 4096) << text;
    EXPECT_EQ(samples.at(ArenaKey("expert_arena_arena_small_page_bytes", a, "tmpfs")),
              bytes - huge)
        << text;
    if (a["path"] == small && huge == 0) {
      saw_small = true;
      EXPECT_EQ(page, 4096);
    }
  }
  if (!saw_small) GTEST_SKIP() << dir_.path() << " backs even --huge off arenas on 2 MiB pages";
}

// --textfile replaces the file atomically (no temporary left beside it) with what stdout gets;
// a directory that does not exist is reported as down, not as a failure of the whole run.
TEST_F(MetricsFixture, TextfileIsReplacedWholeAndAMissingDirectoryIsDown) {
  const std::string textfile = tmp_.File("expert_arena.prom");
  std::ofstream(textfile) << "stale\n";
  const std::string missing = tmp_.File("no-such-dir");
  ASSERT_EQ(ExpertArena({"metrics", dir_.path(), missing, "--textfile", textfile}), 0);
  const std::string written = ReadText(textfile);
  EXPECT_EQ(written.find("stale"), std::string::npos);
  EXPECT_EQ(Samples(written).at("expert_arena_directory_up{directory=\"" + missing + "\"}"), 0)
      << written;
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(tmp_.path())) {
    names.push_back(e.path().filename());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"expert_arena.prom", "m.gguf"}));
  EXPECT_EQ(std::filesystem::status(textfile).permissions() & std::filesystem::perms::all,
            std::filesystem::perms(0644));
}

// A free TCP port on 127.0.0.1 (bound, read back, released for the server to take).
int FreeLoopbackPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

// GET http://127.0.0.1:port/target (HTTP/1.0: the server closes after the body); the body, or
// "" when nothing answers.
std::string HttpGet(int port, const std::string& target) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  std::string response;
  timeval timeout{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    const std::string request = "GET " + target + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (::write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buf[65536];
      ssize_t n;
      while ((n = ::read(fd, buf, sizeof buf)) > 0) response.append(buf, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

std::string UrlEncode(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (std::isalnum(c) || c == '_' || c == '-' || c == '.') {
      out += static_cast<char>(c);
    } else {
      char hex[4];
      std::snprintf(hex, sizeof hex, "%%%02X", c);
      out += hex;
    }
  }
  return out;
}

// The result vector of an instant query, once it holds `want` series, or what it held when
// `seconds` ran out (the scrape interval is 1 s; the bound only keeps a broken setup from
// hanging the test).
nlohmann::json QueryUntil(int port, const std::string& expr, size_t want, double seconds) {
  nlohmann::json result = nlohmann::json::array();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    const std::string body = HttpGet(port, "/api/v1/query?query=" + UrlEncode(expr));
    auto j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.value("status", "") == "success") {
      result = j["data"]["result"];
      if (result.size() >= want) return result;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  return result;
}

TEST_F(MetricsFixture, NodeExporterAndPrometheusServeTheNumbersOfLs) {
  NEED_PROGRAM(exporter_bin, "prometheus-node-exporter", "prometheus-node-exporter");
  NEED_PROGRAM(prometheus_bin, "prometheus", "prometheus");
  const std::string textfiles = tmp_.File("textfile");
  std::filesystem::create_directories(textfiles);
  ASSERT_EQ(ExpertArena({"metrics", dir_.path(), "--textfile", textfiles + "/expert_arena.prom"}),
            0);

  const int exporter_port = FreeLoopbackPort(), prometheus_port = FreeLoopbackPort();
  ASSERT_GT(exporter_port, 0);
  ASSERT_GT(prometheus_port, 0);
  const std::string exporter_log = tmp_.File("node-exporter.log");
  Child exporter = testing::SpawnProgram(
      "/bin/sh", {"-c", "exec " + exporter_bin + " --web.listen-address=127.0.0.1:" +
                            std::to_string(exporter_port) +
                            " --collector.disable-defaults --collector.textfile"
                            " --collector.textfile.directory=" +
                            textfiles + " 2>" + exporter_log});
  const std::string config = tmp_.File("prometheus.yml");
  std::ofstream(config) << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                        << "scrape_configs:\n  - job_name: expert_arena\n    static_configs:\n"
                        << "      - targets: ['127.0.0.1:" << exporter_port << "']\n";
  const std::string prometheus_log = tmp_.File("prometheus.log");
  Child prometheus = testing::SpawnProgram(
      "/bin/sh",
      {"-c", "exec " + prometheus_bin + " --config.file=" + config + " --storage.tsdb.path=" +
                 tmp_.File("tsdb") + " --web.listen-address=127.0.0.1:" +
                 std::to_string(prometheus_port) + " 2>" + prometheus_log});

  const nlohmann::json bytes = QueryUntil(prometheus_port, "expert_arena_arena_bytes", 2, 90);
  ASSERT_EQ(bytes.size(), 2u) << bytes.dump(1) << "\nnode_exporter:\n"
                              << ReadText(exporter_log) << "\nprometheus:\n"
                              << ReadText(prometheus_log);
  const nlohmann::json ls = Ls();
  std::map<std::string, nlohmann::json> by_path;
  for (const auto& a : ls["arenas"]) by_path[a["path"].get<std::string>()] = a;
  for (const auto& series : bytes) {
    const auto& labels = series["metric"];
    const auto& a = by_path.at(labels["path"].get<std::string>());
    EXPECT_EQ(labels["state"], a["state"]);
    EXPECT_EQ(labels["backing"], "tmpfs");
    EXPECT_EQ(labels["job"], "expert_arena");
    // An instant vector's sample is [time, "value"].
    EXPECT_EQ(std::stoull(series["value"][1].get<std::string>()), a["file_bytes"].get<uint64_t>());
  }
  const nlohmann::json in_use =
      QueryUntil(prometheus_port, "expert_arena_arena_in_use == 1", 1, 30);
  ASSERT_EQ(in_use.size(), 1u) << in_use.dump(1);
  EXPECT_EQ(in_use[0]["metric"]["path"], held_);
  const nlohmann::json info = QueryUntil(prometheus_port, "expert_arena_arena_info", 2, 30);
  ASSERT_EQ(info.size(), 2u) << info.dump(1);
  for (const auto& series : info) {
    EXPECT_EQ(series["metric"]["identity"],
              by_path.at(series["metric"]["path"].get<std::string>())["identity"]);
  }
  const nlohmann::json segments = QueryUntil(prometheus_port, "expert_arena_segment_bytes", 1, 30);
  ASSERT_EQ(segments.size(), 1u) << segments.dump(1);
  EXPECT_EQ(segments[0]["metric"]["path"], ls["segments"][0]["path"]);
  EXPECT_EQ(std::stoull(segments[0]["value"][1].get<std::string>()),
            ls["segments"][0]["file_bytes"].get<uint64_t>());

  prometheus.Kill(SIGTERM);
  EXPECT_GE(prometheus.Wait(30), 0);
  exporter.Kill(SIGTERM);
  EXPECT_GE(exporter.Wait(30), 0);
}

}  // namespace
}  // namespace expert_arena
