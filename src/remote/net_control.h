// The control channel between the engine (or `serve`) and its network process
// (docs/cross-host.md, "What runs where"): frames of a little-endian u32 length and that many
// bytes over a local socketpair (platform/process.h). Every call has a deadline, so the side
// that waits never hangs on the other. No UCX here.
//
// Messages are text: a word, then a space and arguments. Options travel as frames too (not
// argv, which `ps` shows: the token).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "expert_arena/status.h"

namespace expert_arena::remote {

// The largest frame either side accepts (a reply listing every remote hold fits).
inline constexpr uint32_t kControlMaxFrame = 64u << 20;

// The network process' executable (net_process_main.cc).
inline constexpr char kNetProcessFile[] = "expert-arena-net";

// Sends one frame within `timeout_ms`; kTimedOut or kIoError (the other side closed).
Status SendFrame(int fd, std::string_view frame, int timeout_ms);
// Receives one frame within `timeout_ms`; kIoError "closed" at EOF, kCorrupt past the bound.
Result<std::string> RecvFrame(int fd, int timeout_ms);

// Restarts of an ended network process: the first after this many seconds
// ($EXPERT_ARENA_NET_RESTART_SECONDS, else 0.5; tests widen the outage with it), each next one
// after twice the last, at most kNetRestartMaxSeconds; back to the first after a minute up.
inline constexpr double kNetRestartMaxSeconds = 30;
double NetRestartFirstSeconds();

// "word rest..." split at the first space.
std::pair<std::string_view, std::string_view> SplitWord(std::string_view message);

// The executable of the network process: $EXPERT_ARENA_NET_PROCESS when set (only it), else
// kNetProcessFile beside the UCX plugin named by $EXPERT_ARENA_UCX_PLUGIN, beside the object
// that holds the core (libexpert_arena.so, the tool, the Python module: where the plugin is
// looked for first), then in the installed libdir. kUnsupported naming every path tried.
Result<std::string> FindNetProcess();

}  // namespace expert_arena::remote
