#include "platform/file_locks.h"

#include <dirent.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include "common/escape.h"

namespace expert_arena::platform {
namespace {

template <typename T>
bool ParseNumber(std::string_view text, T* out, int base = 10) {
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out, base);
  return ec == std::errc() && end == text.data() + text.size();
}

// "00:1a:1234": major and minor in hex (the kernel prints them with %02x), inode in decimal.
bool ParseFileId(std::string_view text, FileLockRecord* r) {
  const size_t a = text.find(':');
  const size_t b = a == std::string_view::npos ? a : text.find(':', a + 1);
  if (b == std::string_view::npos) return false;
  return ParseNumber(text.substr(0, a), &r->device_major, 16) &&
         ParseNumber(text.substr(a + 1, b - a - 1), &r->device_minor, 16) &&
         ParseNumber(text.substr(b + 1), &r->inode);
}

bool ParseLine(std::string_view line, FileLockRecord* r) {
  std::vector<std::string_view> fields;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
    size_t j = i;
    while (j < line.size() && line[j] != ' ' && line[j] != '\t') ++j;
    if (j > i) fields.push_back(line.substr(i, j - i));
    i = j;
  }
  size_t f = 0;
  if (f < fields.size() && fields[f] == "lock:") ++f;  // an fdinfo line
  // "12:" the lock's number; then "->" on a request blocked behind it.
  if (f >= fields.size() || fields[f].empty() || fields[f].back() != ':') return false;
  ++f;
  if (f < fields.size() && fields[f] == "->") {
    r->waiting = true;
    ++f;
  }
  // kind, ADVISORY|MANDATORY|*NOINODE*, READ|WRITE|UNLCK, pid, MAJ:MIN:INODE, start, end.
  if (fields.size() < f + 7) return false;
  r->kind = std::string(fields[f]);
  const std::string_view type = fields[f + 2];
  if (type != "READ" && type != "WRITE") return false;
  r->write = type == "WRITE";
  if (!ParseNumber(fields[f + 3], &r->pid)) return false;
  if (!ParseFileId(fields[f + 4], r)) return false;
  if (!ParseNumber(fields[f + 5], &r->start)) return false;
  if (fields[f + 6] == "EOF") {
    r->end = UINT64_MAX;
  } else if (!ParseNumber(fields[f + 6], &r->end)) {
    return false;
  }
  return true;
}

bool SameFile(const FileLockRecord& r, uint64_t device, uint64_t inode) {
  return r.inode == inode && r.device_major == major(static_cast<dev_t>(device)) &&
         r.device_minor == minor(static_cast<dev_t>(device));
}

bool Covers(const FileLockRecord& r, uint64_t offset) {
  return !r.waiting && r.start <= offset && offset <= r.end;
}

Result<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return ErrnoStatus(errno != 0 ? errno : ENOENT, "open", path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string CommandOf(int64_t pid) {
  const std::string dir = "/proc/" + std::to_string(pid);
  auto cmdline = ReadText(dir + "/cmdline");
  std::string command = cmdline.ok() ? *cmdline : "";
  while (!command.empty() && command.back() == '\0') command.pop_back();
  std::replace(command.begin(), command.end(), '\0', ' ');
  if (command.empty()) {  // a kernel thread, or a process that cleared its arguments
    auto comm = ReadText(dir + "/comm");
    if (comm.ok()) {
      command = "[" + *comm + "]";
      command.erase(std::remove(command.begin(), command.end(), '\n'), command.end());
    }
  }
  return command;
}

bool IsPid(const char* name) {
  if (*name == '\0') return false;
  for (const char* c = name; *c != '\0'; ++c) {
    if (*c < '0' || *c > '9') return false;
  }
  return true;
}

// The names in a /proc directory; false when it cannot be read (permission, a process gone).
bool ListNames(const std::string& dir, std::vector<std::string>* names) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return false;
  while (struct dirent* entry = ::readdir(d)) {
    if (entry->d_name[0] != '.') names->emplace_back(entry->d_name);
  }
  ::closedir(d);
  return true;
}

}  // namespace

std::vector<FileLockRecord> ParseFileLocks(std::string_view text) {
  std::vector<FileLockRecord> out;
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string_view::npos) end = text.size();
    FileLockRecord r;
    if (ParseLine(text.substr(begin, end - begin), &r)) out.push_back(std::move(r));
    begin = end + 1;
  }
  return out;
}

Result<std::vector<FileLockRecord>> ReadFileLocks() {
  auto text = ReadText("/proc/locks");
  if (!text.ok()) return NotFound("/proc/locks cannot be read: " + text.status().message());
  return ParseFileLocks(*text);
}

uint64_t CountLocksOnByte(const std::vector<FileLockRecord>& locks, uint64_t device,
                          uint64_t inode, uint64_t offset, bool only_read) {
  uint64_t n = 0;
  for (const auto& r : locks) {
    if (SameFile(r, device, inode) && Covers(r, offset) && !(only_read && r.write)) ++n;
  }
  return n;
}

Result<LockHolderScan> FindLockHolders(uint64_t device, uint64_t inode, uint64_t offset) {
  std::vector<std::string> pids;
  if (!ListNames("/proc", &pids)) return NotFound("/proc cannot be read");
  std::map<int64_t, LockHolder> found;
  LockHolderScan scan;
  for (const auto& name : pids) {
    if (!IsPid(name.c_str())) continue;
    const std::string dir = "/proc/" + name;
    std::vector<std::string> fds;
    if (!ListNames(dir + "/fd", &fds)) {
      // EACCES: another user's process; ENOENT: it exited while we looked.
      if (errno == EACCES || errno == EPERM) ++scan.unreadable_processes;
      continue;
    }
    for (const auto& fd : fds) {
      struct stat st {};
      if (::stat((dir + "/fd/" + fd).c_str(), &st) != 0) continue;
      if (st.st_ino != inode || st.st_dev != static_cast<dev_t>(device)) continue;
      auto info = ReadText(dir + "/fdinfo/" + fd);
      if (!info.ok()) continue;
      for (const auto& r : ParseFileLocks(*info)) {
        if (!SameFile(r, device, inode) || !Covers(r, offset)) continue;
        int64_t pid = 0;
        if (!ParseNumber(std::string_view(name), &pid)) continue;
        LockHolder& h = found[pid];
        h.pid = pid;
        h.write = h.write || r.write;
      }
    }
  }
  for (auto& [pid, holder] : found) {
    holder.command = CommandOf(pid);
    scan.holders.push_back(std::move(holder));
  }
  return scan;
}

std::string DescribeLockHolder(const LockHolder& holder, size_t max_bytes) {
  std::string out = "pid " + std::to_string(holder.pid);
  if (holder.command.empty()) return out;
  // The program's base name, not its path: a path under a deep directory (a build tree, a
  // virtual environment) would fill the bytes shown and cut off what names the program.
  std::string_view full = holder.command;
  const size_t program_end = std::min(full.find(' '), full.size());
  const size_t slash = full.substr(0, program_end).rfind('/');
  if (slash != std::string_view::npos && slash + 1 < program_end) full.remove_prefix(slash + 1);
  std::string command = EscapeForMessage(full.substr(0, max_bytes));
  if (full.size() > max_bytes) command += "...";
  return out + " (" + command + ")";
}

}  // namespace expert_arena::platform
