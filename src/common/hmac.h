// HMAC-SHA256 and a constant-time comparison (OpenSSL's libcrypto): the front door's proofs
// (remote/front_door.h) and the stream descriptors' MACs (stream/descriptor.cc) both use them.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace expert_arena {

// HMAC-SHA256 of `data` keyed by `key` (an empty key included).
std::array<uint8_t, 32> HmacSha256(std::string_view key, std::span<const std::byte> data);
// Constant-time comparison of equal-sized secrets.
bool SameSecret(std::span<const uint8_t> a, std::span<const uint8_t> b);

}  // namespace expert_arena
