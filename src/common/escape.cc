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

namespace {

// The length of the valid UTF-8 sequence at the start of `text` (1 to 4), or 0 when it does
// not start one: a stray continuation byte, an overlong form, a surrogate, a code point above
// U+10FFFF, or a sequence cut short.
size_t Utf8SequenceLength(std::string_view text) {
  const auto at = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char lead = at(0);
  if (lead < 0x80) return 1;
  size_t length = 0;
  unsigned char low = 0x80, high = 0xbf;  // the allowed range of the second byte
  if (lead >= 0xc2 && lead <= 0xdf) {
    length = 2;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    length = 3;
    if (lead == 0xe0) low = 0xa0;   // overlong
    if (lead == 0xed) high = 0x9f;  // surrogates
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    length = 4;
    if (lead == 0xf0) low = 0x90;   // overlong
    if (lead == 0xf4) high = 0x8f;  // above U+10FFFF
  } else {
    return 0;
  }
  if (text.size() < length) return 0;
  if (at(1) < low || at(1) > high) return 0;
  for (size_t i = 2; i < length; ++i) {
    if (at(i) < 0x80 || at(i) > 0xbf) return 0;
  }
  return length;
}

void AppendHexByte(std::string& out, unsigned char byte) {
  char hex[5];
  std::snprintf(hex, sizeof hex, "\\x%02x", byte);
  out += hex;
}

}  // namespace

std::string EscapeForDisplay(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const auto byte = static_cast<unsigned char>(text[i]);
    const size_t length = Utf8SequenceLength(text.substr(i));
    // U+0080..U+009F: 0xc2 followed by 0x80..0x9f.
    const bool c1 = length == 2 && byte == 0xc2 && static_cast<unsigned char>(text[i + 1]) < 0xa0;
    if (length == 0 || (length == 1 && (byte < 0x20 || byte == 0x7f)) || c1) {
      const size_t bytes = c1 ? 2 : 1;
      for (size_t k = 0; k < bytes; ++k) {
        AppendHexByte(out, static_cast<unsigned char>(text[i + k]));
      }
      i += bytes;
      continue;
    }
    out.append(text.substr(i, length));
    i += length;
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
