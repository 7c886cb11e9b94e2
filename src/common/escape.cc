#include "common/escape.h"

#include <cstdio>

namespace expert_arena {

std::string EscapeForMessage(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (byte >= 0x20 && byte < 0x7f) {
      out += c;
    } else {
      char hex[5];
      std::snprintf(hex, sizeof hex, "\\x%02x", byte);
      out += hex;
    }
  }
  return out;
}

std::string QuoteForMessage(std::string_view text, size_t max_bytes) {
  // Appended piece by piece: `"\"" + std::string` (operator+ inserting at the front of a
  // temporary) makes g++ 12 at -O2/-O3 report a bogus -Wrestrict overlap of 2^63 bytes inside
  // std::string (GCC PR 105651, the same bug as PR 105329; fixed in GCC 12.4 and 13).
  std::string out = "\"";
  out += EscapeForMessage(text.substr(0, max_bytes));
  out += '"';
  if (text.size() > max_bytes) out += "...";
  return out;
}

std::string ControlByteProblem(std::string_view text) {
  for (size_t i = 0; i < text.size(); ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    if (byte < 0x20 || byte == 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02x", byte);
      return "the control byte " + std::string(hex) + " at byte " + std::to_string(i) + " of " +
             std::to_string(text.size());
    }
  }
  return "";
}

}  // namespace expert_arena
