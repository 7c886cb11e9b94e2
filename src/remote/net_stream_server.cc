// The stream server of a listening producer, run in a network process of its own
// (stream_remote.h, docs/cross-host.md "What runs where").
//
// Design note. UCX asserts on malformed input, and an admitted peer can reach UCX's code behind
// the front door: so the engine's process runs no UCX for its listener. One supervisor thread
// starts expert-arena-net (posix_spawn, a socketpair as fd 3), sends it the options as frames
// (net_control.h; the token never shows in argv), and waits for "ready ADDRESS INSTANCE". The
// child maps the producer's segments through its own StreamConsumer, as any local consumer,
// so a remote consumer's share is held by the child's reader entry: when the child dies, its
// OFD locks go with it and the producer spends those shares as a dead local reader's
// (ClearDeadReaders), and local consumers, who never talk to it, never notice.
//
// The supervisor thread is the child's parent thread (PR_SET_PDEATHSIG fires when it ends, so
// the child cannot outlive the producer), polls the child every 50 ms, reads its counters
// every second, and, when it ended, logs how once, refuses nothing itself (a remote open then
// finds the port closed: a clean connection error at the consumer) and starts it again with a
// backoff (0.5 s doubling to 30 s, back to 0.5 s after a minute up) on the address it had, with
// the same instance id, so descriptors handed out before open again. Counters add the dead
// children's last counts; restarts() counts the restarts.
//
// Other threads call Aborted and Holds: each is one request and its answer, bounded by
// kRequestMs; a child that does not answer in time is killed (and restarted), and the caller
// gets "nothing held": the engine never waits on it longer. counters() makes no request of its
// own: it asks the supervisor for fresh counts and waits at most kCountersWaitMs for them, then
// takes them as last read, so a stopped child costs a Stats() that long, not a request's bound.
//
// Locks: `io_mu_` serializes the requests on the control socket (and guards the socket's
// lifetime: it is closed or replaced only under io_mu_); `mu_` guards the state and is never
// held across a round trip. Order: io_mu_, then mu_.
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <future>
#include <mutex>
#include <sstream>
#include <thread>

#include "common/logging.h"
#include "platform/process.h"
#include "remote/front_door.h"
#include "remote/net_control.h"
#include "stream/stream_remote.h"

namespace expert_arena::remote {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kRequestMs = 5000;
constexpr int kCountersWaitMs = 1000;
constexpr int kReadyMs = 60000;
constexpr double kStableSeconds = 60;

DoorCounters Add(DoorCounters a, const DoorCounters& b) {
  a.admitted += b.admitted;
  a.refused += b.refused;
  a.timed_out += b.timed_out;
  a.dropped += b.dropped;
  a.auth_failed += b.auth_failed;
  return a;
}

class NetStreamServer final : public StreamServer {
 public:
  explicit NetStreamServer(const StreamServerOptions& options)
      : options_(options), log_(ResolveLogger(options.logger)), instance_(options.instance_id) {}

  ~NetStreamServer() override {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (supervisor_.joinable()) supervisor_.join();
  }

  Status Start(const std::string& program) {
    program_ = program;
    std::promise<Status> first;
    auto started = first.get_future();
    supervisor_ = std::thread([this, p = std::move(first)]() mutable { Supervise(p); });
    Status s = started.get();
    if (!s.ok() && supervisor_.joinable()) supervisor_.join();
    return s;
  }

  const std::string& address() const override { return address_; }
  uint64_t instance_id() const override { return instance_; }

  void Aborted(std::string_view key) override {
    {
      std::lock_guard lock(mu_);
      // Told again to a restarted child, so that its opens of the key still say why.
      aborted_keys_.emplace_back(key);
      if (aborted_keys_.size() > 4096) aborted_keys_.pop_front();
    }
    (void)Request("aborted " + std::string(key), /*answer=*/false);
  }

  std::vector<RemoteHold> Holds() override {
    std::vector<RemoteHold> out;
    auto answer = Request("holds", true);
    if (!answer.ok()) return out;
    std::istringstream in(*answer);
    std::string word;
    in >> word;  // "holds"
    RemoteHold h;
    while (in >> h.segment >> h.slot) out.push_back(h);
    return out;
  }

  DoorCounters counters() override {
    std::unique_lock lock(mu_);
    if (up_) {
      const uint64_t want = ++refresh_wanted_;
      wake_.notify_all();
      (void)wake_.wait_for(lock, std::chrono::milliseconds(kCountersWaitMs),
                           [&] { return refreshed_ >= want || stopping_ || !up_; });
    }
    return Add(base_, last_);
  }

  uint64_t restarts() override {
    std::lock_guard lock(mu_);
    return restarts_;
  }

 private:
  // One request (and its answer when `answer`) to the child when it is up (kIoError
  // otherwise), under io_mu_ only. A failure kills the child: the supervisor restarts it.
  Result<std::string> Request(const std::string& message, bool answer) {
    std::lock_guard io(io_mu_);
    int fd = -1;
    pid_t pid = -1;
    {
      std::lock_guard lock(mu_);
      if (!up_) return Status(StatusCode::kIoError, "the network process is not running");
      fd = control_.get();
      pid = pid_;
    }
    Status s = SendFrame(fd, message, kRequestMs);
    Result<std::string> reply = s.ok() && answer ? RecvFrame(fd, kRequestMs)
                                : s.ok()         ? Result<std::string>(std::string())
                                                 : Result<std::string>(s);
    if (!reply.ok()) {
      // A closed channel is the child ending: the supervisor says how. A silent one is killed.
      if (reply.status().code() == StatusCode::kTimedOut) {
        log_->warn("stream server: network process pid {} did not answer \"{}\" ({}); killing it",
                   pid, SplitWord(message).first, reply.status().message());
      }
      std::lock_guard lock(mu_);
      if (pid_ == pid) {
        (void)platform::SignalProcess(pid, SIGKILL);
        up_ = false;
      }
    }
    return reply;
  }

  void RefreshCounters() {
    auto answer = Request("counters", true);
    if (!answer.ok()) return;
    std::istringstream in(*answer);
    std::string word;
    DoorCounters c;
    in >> word >> c.admitted >> c.refused >> c.timed_out >> c.dropped >> c.auth_failed;
    std::lock_guard lock(mu_);
    if (word == "counters" && in && up_) last_ = c;
  }

  // Starts a child and waits for its "ready"; on success the child is up_ (under mu_).
  Status SpawnOnce(const std::string& listen) {
    std::vector<std::string> argv = {program_, "stream", "--parent-pid",
                                     std::to_string(getpid())};
    EA_ASSIGN_OR_RETURN(platform::SpawnedChild child, platform::SpawnWithControl(program_, argv));
    const int fd = child.control.get();
    std::vector<std::string> frames = {
        "listen " + listen,
        "token " + options_.token,
        "lease " + std::to_string(options_.lease_seconds),
        "directory " + options_.directory,
        "spill " + options_.spill_directory,
        "prefix " + options_.segment_prefix,
        "instance " + std::to_string(instance_),
        "log_level " + std::to_string(static_cast<int>(log_->level())),
    };
    {
      std::lock_guard lock(mu_);
      for (const std::string& k : aborted_keys_) frames.push_back("aborted " + k);
    }
    frames.push_back("go");
    Status sent = Status::Ok();
    for (const std::string& f : frames) {
      sent = SendFrame(fd, f, kRequestMs);
      if (!sent.ok()) break;
    }
    Result<std::string> ready = sent.ok() ? RecvFrame(fd, kReadyMs) : Result<std::string>(sent);
    if (!ready.ok()) {
      std::string how = platform::StopChild(child.pid, 2);
      return Status(ready.status().code(), "network process " + program_ + " (pid " +
                                               std::to_string(child.pid) + ") did not start (" +
                                               how + "; " + ready.status().message() + ")");
    }
    auto [word, rest] = SplitWord(*ready);
    if (word != "ready") {
      (void)platform::StopChild(child.pid, 2);
      if (word == "error") {
        auto [code, message] = SplitWord(rest);
        int c = std::atoi(std::string(code).c_str());
        if (c <= 0 || c > static_cast<int>(StatusCode::kInternal)) {
          c = static_cast<int>(StatusCode::kInternal);
        }
        return Status(static_cast<StatusCode>(c), std::string(message));
      }
      return Internal("network process " + program_ + " said \"" + std::string(word) +
                      "\" instead of ready");
    }
    auto [address, instance] = SplitWord(rest);
    std::lock_guard io(io_mu_);
    std::lock_guard lock(mu_);
    if (address_.empty()) {
      address_ = std::string(address);
      instance_ = std::strtoull(std::string(instance).c_str(), nullptr, 10);
    }
    pid_ = child.pid;
    control_ = std::move(child.control);
    up_ = true;
    last_ = DoorCounters{};
    return Status::Ok();
  }

  // Waits `seconds`, until stopping or until counts are asked for; true when stopping.
  bool WaitOrStop(double seconds, bool or_counts = false) {
    std::unique_lock lock(mu_);
    (void)wake_.wait_for(lock, std::chrono::duration<double>(seconds), [&] {
      return stopping_ || (or_counts && refresh_wanted_ > refreshed_);
    });
    return stopping_;
  }

  void Supervise(std::promise<Status>& first) {
    Status s = SpawnOnce(options_.listen);
    first.set_value(s);
    if (!s.ok()) return;
    log_->info("stream server: network process pid {} listens on {}", pid_, address_);
    const double first_backoff = NetRestartFirstSeconds();
    double backoff = first_backoff;
    auto up_since = Clock::now();
    auto last_counts = Clock::now();
    while (true) {
      if (WaitOrStop(0.05, /*or_counts=*/true)) break;
      std::unique_lock io(io_mu_);
      std::unique_lock lock(mu_);
      std::optional<std::string> how;
      if (pid_ > 0) how = platform::ReapIfExited(pid_);
      if (!how) {
        const uint64_t wanted = refresh_wanted_;
        if (up_ && (wanted > refreshed_ || Clock::now() - last_counts > std::chrono::seconds(1))) {
          lock.unlock();
          io.unlock();
          RefreshCounters();  // a round trip: neither lock held meanwhile but its own
          last_counts = Clock::now();
          lock.lock();
        }
        // Answered, or the child did not answer (killed: the counts as last read).
        refreshed_ = std::max(refreshed_, wanted);
        wake_.notify_all();
        continue;
      }
      // The child ended: its counts so far stay, and the next one starts after the backoff.
      const pid_t dead = pid_;
      up_ = false;
      pid_ = -1;
      control_.Reset();
      base_ = Add(base_, last_);
      last_ = DoorCounters{};
      if (Clock::now() - up_since > std::chrono::duration<double>(kStableSeconds))
        backoff = first_backoff;
      log_->warn("stream server: network process pid {} on {} ended ({}); remote opens fail "
                 "until it is restarted (in {} s); local consumers are not affected",
                 dead, address_, *how, backoff);
      wake_.notify_all();  // counters() waiting for this child: the counts are final
      lock.unlock();
      io.unlock();
      while (true) {
        if (WaitOrStop(backoff)) return;
        backoff = std::min(backoff * 2, kNetRestartMaxSeconds);
        Status again = SpawnOnce(address_);
        if (again.ok()) break;
        log_->warn("stream server: restarting the network process on {} failed ({}); next try "
                   "in {} s",
                   address_, again.message(), backoff);
      }
      {
        std::lock_guard relock(mu_);
        ++restarts_;
      }
      up_since = Clock::now();
      log_->info("stream server: network process restarted: pid {} listens on {} again", pid_,
                 address_);
    }
    // Stopping: EOF tells the child to end (its holds end with it), then it is reaped.
    std::unique_lock io(io_mu_);
    std::unique_lock lock(mu_);
    up_ = false;
    control_.Reset();
    const pid_t child = pid_;
    pid_ = -1;
    lock.unlock();
    io.unlock();
    if (child > 0) (void)platform::StopChild(child, 5);
  }

  const StreamServerOptions options_;
  std::shared_ptr<spdlog::logger> log_;
  std::string program_;
  std::string address_;  // fixed by the first child
  uint64_t instance_ = 0;
  std::thread supervisor_;
  std::mutex io_mu_;  // requests on control_; control_ is closed or replaced under it too
  std::mutex mu_;     // everything below
  std::condition_variable wake_;
  uint64_t refresh_wanted_ = 0;  // counters() asked for fresh counts this many times
  uint64_t refreshed_ = 0;       // the supervisor answered the asks up to this one
  bool stopping_ = false;
  bool up_ = false;
  pid_t pid_ = -1;
  platform::UniqueFd control_;
  std::deque<std::string> aborted_keys_;
  DoorCounters base_;  // the ended children's
  DoorCounters last_;  // the running child's, as last read
  uint64_t restarts_ = 0;
};

}  // namespace

Result<std::unique_ptr<StreamServer>> StartStreamServer(const StreamServerOptions& options) {
  EA_RETURN_IF_ERROR(CheckListenToken(options.listen, options.token, options.allow_no_token,
                                      "stream listen", "listen_allow_no_token",
                                      *ResolveLogger(options.logger)));
  EA_ASSIGN_OR_RETURN(std::string program, FindNetProcess());
  auto server = std::make_unique<NetStreamServer>(options);
  EA_RETURN_IF_ERROR(server->Start(program));
  return std::unique_ptr<StreamServer>(std::move(server));
}

}  // namespace expert_arena::remote
