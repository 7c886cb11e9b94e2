// Printing strings that another process, a peer or a downloaded file controls.
//
// A tensor name, a stream key, a dtype or a segment's logical name can come from a hostile or
// buggy peer. Every message and `info` line that shows one must not let it drive the
// operator's terminal (escape sequences, carriage returns) nor forge extra log lines.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace expert_arena {

// `text` with printable ASCII (0x20..0x7e) as is, except `\` and `"` written `\\` and `\"`,
// and every other byte (control bytes, 0x7f, bytes of 0x80 and up, UTF-8 included) written
// `\xNN`: the result is printable ASCII, safe between double quotes in a message, in a log
// line and in JSON. Strings that were already clean come out unchanged.
std::string EscapeForMessage(std::string_view text);

// EscapeForMessage of at most the first `max_bytes` bytes of `text`, between double quotes,
// with "..." after the closing quote when `text` was longer: for messages that name a string
// a peer chose, whatever its length.
std::string QuoteForMessage(std::string_view text, size_t max_bytes = 128);

// `text` for a terminal, a log line or a JSON string, where it is shown without quotes:
// valid UTF-8 as it is, except control characters (below 0x20, 0x7f, and the C1 controls
// U+0080..U+009F, which some terminals obey as escape sequences) and every byte that is not
// part of valid UTF-8 (a Linux path or a name read from a file may hold any byte), each
// byte of them written `\xNN` (lowercase hex). The result is valid UTF-8 without a control
// character, so text and JSON outputs show the same string (and nlohmann's dump, which
// throws on invalid UTF-8, never sees one). It is a view for people, not an encoding: a text
// that holds the four characters `\xff` itself shows the same as one holding the byte 0xff.
std::string EscapeForDisplay(std::string_view text);

// "" when `text` holds no control byte (below 0x20, or 0x7f), else where the first one is:
// "the control byte 0x1b at byte 3 of 8". Never quotes `text`.
std::string ControlByteProblem(std::string_view text);

}  // namespace expert_arena
