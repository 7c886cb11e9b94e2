#include "source/model_format.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <string_view>

#include "common/escape.h"
#include "common/option_words.h"
#include "common/units.h"
#include "platform/file.h"
#include "source/gguf_reader.h"
#include "source/safetensors_reader.h"

namespace expert_arena::source {
namespace {

// Enough for every test below: an LFS pointer is about 130 bytes, and an HTML page names
// itself in its first line (its <title> usually within the first few hundred bytes).
constexpr size_t kHeadBytes = 4096;

std::string RawHint(OptionWords words) {
  return "to load its bytes as one tensor, ask for the raw format (" +
         std::string(Word(words, OptionWord::kRawFormat)) + ")";
}

bool EndsWith(std::string_view text, std::string_view suffix) {
  if (text.size() < suffix.size()) return false;
  std::string_view tail = text.substr(text.size() - suffix.size());
  return std::equal(tail.begin(), tail.end(), suffix.begin(), [](char a, char b) {
    return std::tolower(static_cast<unsigned char>(a)) == b;
  });
}

bool StartsWithNoCase(std::string_view text, std::string_view prefix) {
  return text.size() >= prefix.size() && EndsWith(text.substr(0, prefix.size()), prefix);
}

// Bytes of the file between single quotes, escaped (common/escape.h) so that a binary or
// hostile file cannot drive the terminal: 'GGUX', '\x00\x00\x01\x02'.
std::string Quoted(std::string_view bytes) {
  std::string out = "'";
  for (char c : EscapeForMessage(bytes)) {
    if (c == '\'') out += '\\';
    out += c;
  }
  return out + "'";
}

std::string Preview(std::string_view head) {
  constexpr size_t kShown = 24;
  return Quoted(head.substr(0, kShown)) + (head.size() > kShown ? "..." : "");
}

std::string_view SkipSpace(std::string_view text) {
  if (text.substr(0, 3) == "\xef\xbb\xbf") text.remove_prefix(3);  // UTF-8 byte order mark
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) {
    text.remove_prefix(1);
  }
  return text;
}

std::string_view FirstLine(std::string_view text) {
  return text.substr(0, std::min(text.find('\n'), text.size()));
}

// "version https://git-lfs.github.com/spec/v1" then "oid sha256:..." and "size N" lines.
bool IsLfsPointer(std::string_view head) {
  return head.substr(0, 8) == "version " &&
         FirstLine(head).find("git-lfs") != std::string_view::npos;
}

std::string LfsPointerMessage(const std::string& path, std::string_view head) {
  std::string what = "version " + EscapeForMessage(FirstLine(head).substr(8, 120));
  size_t at = head.find("\nsize ");
  if (at != std::string_view::npos) {
    std::string_view digits = FirstLine(head.substr(at + 6));
    bool numeric =
        !digits.empty() && digits.size() <= 19 &&
        std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (numeric) what += ", for a " + FormatBytes(std::stoull(std::string(digits))) + " file";
  }
  return path + ": a Git LFS pointer (" + what + "), not the model: fetch it with git lfs pull";
}

bool IsHtml(std::string_view head) {
  std::string_view text = SkipSpace(head);
  return StartsWithNoCase(text, "<!doctype html") || StartsWithNoCase(text, "<html") ||
         StartsWithNoCase(text, "<head") || StartsWithNoCase(text, "<body");
}

std::string HtmlMessage(const std::string& path, std::string_view head) {
  std::string message = path + ": an HTML page, not a model";
  // Its title says which page it is ("404 Not Found", a sign-in page).
  std::string lower(head);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  size_t open = lower.find("<title>");
  size_t close = open == std::string::npos ? open : lower.find("</title>", open);
  if (close != std::string::npos) {
    std::string_view title = SkipSpace(head.substr(open + 7, close - open - 7));
    while (!title.empty() && std::isspace(static_cast<unsigned char>(title.back()))) {
      title.remove_suffix(1);
    }
    if (!title.empty()) message += " (titled " + QuoteForMessage(title, 80) + ")";
  }
  return message + ": the download saved an error or sign-in page under the model's name";
}

Status GgufMagicMismatch(const std::string& path, std::string_view head) {
  return Corrupt(
      path + ": GGUF magic expected, found " + Quoted(head.substr(0, 4)) +
      (head.size() < 4 ? " (the file has " + std::to_string(head.size()) + " bytes)" : ""));
}

// A .safetensors name or format whose header is not one: the two faults a reader can name
// before parsing. Ok when the length fits (the safetensors reader then says what is wrong).
Status SafetensorsLengthProblem(const std::string& path, std::string_view head,
                                uint64_t file_size) {
  if (file_size < 8 || head.size() < 8) {
    return Corrupt(path + ": " + std::to_string(file_size) +
                   " bytes, too short for a safetensors file (its header length alone takes 8)");
  }
  uint64_t n;
  std::memcpy(&n, head.data(), 8);
  if (n > file_size - 8) {
    return Corrupt(path + ": safetensors header length " + std::to_string(n) +
                   " is larger than the file (" + std::to_string(file_size) + " bytes)");
  }
  return Status::Ok();
}

bool IsJsonObject(std::string_view head) {
  std::string_view text = SkipSpace(head);
  return !text.empty() && text.front() == '{';
}

}  // namespace

const char* FileKindName(FileKind kind) {
  switch (kind) {
    case FileKind::kGguf:
      return "GGUF";
    case FileKind::kSafetensors:
    case FileKind::kSafetensorsIndex:
      return "safetensors";
  }
  return "";
}

Result<FileKind> DetectFileKind(const std::string& path, ModelFormat format,
                                OptionWords words) {
  if (format == ModelFormat::kRaw) {
    return InvalidArgument(path + ": raw files have no format to detect");
  }
  // Followed: model caches link to their blobs.
  EA_ASSIGN_OR_RETURN(platform::UniqueFd fd, platform::OpenFile(path, {.no_follow = false}));
  EA_ASSIGN_OR_RETURN(platform::FileStat st, platform::StatFd(fd));
  if (!st.regular) return InvalidArgument(path + ": not a regular file");
  std::byte buffer[kHeadBytes];
  EA_ASSIGN_OR_RETURN(size_t got, platform::ReadSome(fd, 0, buffer));
  const std::string_view head(reinterpret_cast<const char*>(buffer), got);

  // What the file looks like, whatever its name or the format asked for.
  if (st.size == 0) return InvalidArgument(path + ": empty file (0 bytes), not a model");
  if (IsLfsPointer(head)) return InvalidArgument(LfsPointerMessage(path, head));
  if (IsHtml(head)) return InvalidArgument(HtmlMessage(path, head));

  const bool gguf_magic = got >= 4 && std::memcmp(buffer, kGgufMagic, 4) == 0;
  const bool json_name = EndsWith(path, ".json");
  switch (format) {
    case ModelFormat::kGguf:
      if (!gguf_magic) return GgufMagicMismatch(path, head);
      return FileKind::kGguf;
    case ModelFormat::kSafetensors:
      if (json_name && IsJsonObject(head)) return FileKind::kSafetensorsIndex;
      EA_RETURN_IF_ERROR(SafetensorsLengthProblem(path, head, st.size));
      return FileKind::kSafetensors;
    case ModelFormat::kAuto:
    case ModelFormat::kRaw:
      break;
  }

  if (gguf_magic) return FileKind::kGguf;
  if (LooksLikeSafetensors(buffer, got, st.size)) return FileKind::kSafetensors;
  if (json_name && IsJsonObject(head)) return FileKind::kSafetensorsIndex;
  // The name promises a format whose header is damaged: say which field.
  if (EndsWith(path, ".gguf")) return GgufMagicMismatch(path, head);
  if (EndsWith(path, ".safetensors")) {
    EA_RETURN_IF_ERROR(SafetensorsLengthProblem(path, head, st.size));
    return FileKind::kSafetensors;  // the length fits: the reader names what is wrong
  }
  if (head.substr(0, 4) == std::string_view("PK\x03\x04", 4)) {
    return InvalidArgument(path +
                           ": a ZIP archive (a PyTorch .bin/.pt checkpoint?), not a "
                           "GGUF or safetensors model; convert it to safetensors, or " +
                           RawHint(words));
  }
  return InvalidArgument(path + ": not a GGUF, safetensors or safetensors index file (" +
                         std::to_string(st.size) + " bytes, starting " + Preview(head) + "); " +
                         RawHint(words));
}

}  // namespace expert_arena::source
