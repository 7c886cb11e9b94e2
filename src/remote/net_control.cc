// The control channel's frames (net_control.h).
#include "remote/net_control.h"

#include <cstdlib>
#include <cstring>

#include "platform/net.h"

namespace expert_arena::remote {

Status SendFrame(int fd, std::string_view frame, int timeout_ms) {
  if (frame.size() > kControlMaxFrame) return InvalidArgument("control frame too large");
  unsigned char length[4];
  const uint32_t n = static_cast<uint32_t>(frame.size());
  for (int i = 0; i < 4; ++i) length[i] = static_cast<unsigned char>(n >> (8 * i));
  EA_RETURN_IF_ERROR(platform::SendAll(fd, length, sizeof length, timeout_ms, "control channel"));
  if (n == 0) return Status::Ok();
  return platform::SendAll(fd, frame.data(), frame.size(), timeout_ms, "control channel");
}

Result<std::string> RecvFrame(int fd, int timeout_ms) {
  unsigned char length[4];
  EA_RETURN_IF_ERROR(platform::RecvAll(fd, length, sizeof length, timeout_ms, "control channel"));
  uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n |= uint32_t{length[i]} << (8 * i);
  if (n > kControlMaxFrame) {
    return Corrupt("control channel: a frame of " + std::to_string(n) + " bytes (at most " +
                   std::to_string(kControlMaxFrame) + ")");
  }
  std::string frame(n, '\0');
  if (n > 0) {
    EA_RETURN_IF_ERROR(platform::RecvAll(fd, frame.data(), n, timeout_ms, "control channel"));
  }
  return frame;
}

double NetRestartFirstSeconds() {
  const char* given = std::getenv("EXPERT_ARENA_NET_RESTART_SECONDS");
  if (given == nullptr || given[0] == '\0') return 0.5;
  double v = std::strtod(given, nullptr);
  return v > 0 && v <= kNetRestartMaxSeconds ? v : 0.5;
}

std::pair<std::string_view, std::string_view> SplitWord(std::string_view message) {
  size_t space = message.find(' ');
  if (space == std::string_view::npos) return {message, {}};
  return {message.substr(0, space), message.substr(space + 1)};
}

}  // namespace expert_arena::remote
