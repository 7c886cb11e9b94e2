// What a front door (remote/front_door.h) counts. A listening producer's stats() report it
// (stream/stream_remote.h), so it lies below both.
#pragma once

#include <cstdint>

namespace expert_arena::remote {

// What the front door has done to peers so far (serve --json, a producer's stats()).
struct DoorCounters {
  uint64_t admitted = 0;
  uint64_t refused = 0;      // at accept: limits, throttling; or refused by the admit callback
  uint64_t timed_out = 0;    // the handshake's deadline passed
  uint64_t dropped = 0;      // a malformed message, a hang-up or a reset mid-handshake
  uint64_t auth_failed = 0;  // a client proof that did not hold
};

}  // namespace expert_arena::remote
