#include "platform/system_info.h"

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "common/units.h"
#include "platform/kernel_features.h"
#include "platform/page_scan.h"
#include "platform/process_memory.h"

#ifndef TMPFS_MAGIC
#define TMPFS_MAGIC 0x01021994
#endif
#ifndef HUGETLBFS_MAGIC
#define HUGETLBFS_MAGIC 0x958458f6
#endif

namespace expert_arena::platform {

const char* FsKindName(FsKind kind) {
  switch (kind) {
    case FsKind::kTmpfs:
      return "tmpfs";
    case FsKind::kHugetlbfs:
      return "hugetlbfs";
    case FsKind::kOther:
      return "other";
  }
  return "other";
}

namespace {

// The mount point and the huge= option of the mount whose device is `device`, from
// /proc/self/mountinfo: "36 25 0:32 / /mnt/x rw,relatime - tmpfs tmpfs rw,size=65536k,huge=always".
// A bind mount of a part of the filesystem (root other than "/") names the filesystem only when
// no mount of its root is listed.
void ReadMountInfo(dev_t device, FilesystemInfo* info) {
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  const std::string wanted = std::to_string(major(device)) + ":" + std::to_string(minor(device));
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string id, parent, dev, root, mount_point;
    words >> id >> parent >> dev >> root >> mount_point;
    if (dev != wanted) continue;
    if (info->mount_point.empty() || root == "/") info->mount_point = mount_point;
    if (info->kind == FsKind::kTmpfs) {
      size_t at = line.find("huge=");
      size_t end = at == std::string::npos ? at : line.find_first_of(", \n", at);
      info->tmpfs_huge = at == std::string::npos
                             ? "never"
                             : line.substr(at + 5, end == std::string::npos ? end : end - at - 5);
    }
    if (root == "/") return;
  }
}

}  // namespace

Result<FilesystemInfo> StatFilesystem(const std::string& path) {
  struct statfs fs {};
  if (::statfs(path.c_str(), &fs) != 0) return ErrnoStatus(errno, "statfs", path);
  struct statvfs vfs {};
  if (::statvfs(path.c_str(), &vfs) != 0) return ErrnoStatus(errno, "statvfs", path);
  FilesystemInfo info;
  if (static_cast<uint64_t>(fs.f_type) == TMPFS_MAGIC) info.kind = FsKind::kTmpfs;
  if (static_cast<uint64_t>(fs.f_type) == HUGETLBFS_MAGIC) info.kind = FsKind::kHugetlbfs;
  info.block_bytes = static_cast<uint64_t>(fs.f_bsize);
  info.total_bytes = static_cast<uint64_t>(vfs.f_blocks) * vfs.f_frsize;
  info.available_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  if (info.kind == FsKind::kHugetlbfs && vfs.f_blocks == 0 && info.block_bytes != 0) {
    auto pool = ReadHugetlbPool(info.block_bytes);
    if (pool.ok()) {
      info.pool_sized = true;
      info.total_bytes = pool->total * info.block_bytes;
      const uint64_t unreserved = pool->free > pool->reserved ? pool->free - pool->reserved : 0;
      info.available_bytes = unreserved * info.block_bytes;
    }
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) ReadMountInfo(st.st_dev, &info);
  return info;
}

Result<uint64_t> FreeHugeBlocks() {
  std::ifstream in("/proc/buddyinfo");
  if (!in) return ErrnoStatus(errno, "open", "/proc/buddyinfo");
  // "Node 0, zone   Normal   1  2  3 ... (11 orders)"
  uint64_t blocks = 0;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string word;
    int field = 0;
    int order = 0;
    while (words >> word) {
      ++field;
      if (field <= 4) continue;  // "Node", "0,", "zone", "<name>"
      uint64_t count = std::strtoull(word.c_str(), nullptr, 10);
      if (order >= 9) blocks += count << (order - 9);
      ++order;
    }
  }
  return blocks;
}

namespace {

// "Key:   123 kB" -> bytes.
bool ParseKb(const std::string& line, const char* key, uint64_t* bytes) {
  size_t key_len = std::strlen(key);
  if (line.compare(0, key_len, key) != 0 || line.size() <= key_len || line[key_len] != ':') {
    return false;
  }
  *bytes = std::strtoull(line.c_str() + key_len + 1, nullptr, 10) * 1024;
  return true;
}

Result<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return ErrnoStatus(errno, "open", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Result<uint64_t> StatusField(const char* key) {
  std::ifstream in("/proc/self/status");
  if (!in) return ErrnoStatus(errno, "open", "/proc/self/status");
  std::string line;
  uint64_t bytes = 0;
  while (std::getline(in, line)) {
    if (ParseKb(line, key, &bytes)) return bytes;
  }
  return NotFound(std::string("no ") + key + " in /proc/self/status");
}

Result<uint64_t> ReadNumber(const std::string& path) {
  EA_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path));
  return std::strtoull(text.c_str(), nullptr, 10);
}

}  // namespace

Result<uint64_t> HugeBytesInRange(const void* start, uint64_t length) {
  Result<uint64_t> scanned = ScanHugeBytes(start, length);
  if (scanned.ok() || scanned.status().code() != StatusCode::kUnsupported) return scanned;
  // No PAGEMAP_SCAN (before 6.7): smaps, which walks each page of a shared 2 MiB folio.
  const auto began = std::chrono::steady_clock::now();
  Result<uint64_t> from_smaps = HugeBytesInRangeFromSmaps(start, length);
  CountFallback(KernelFeature::kPagemapScan,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count(),
                length);
  return from_smaps;
}

Result<uint64_t> HugeBytesInRangeFromSmaps(const void* start, uint64_t length) {
  EA_ASSIGN_OR_RETURN(MemoryFigures m, MemoryOfMappingsOverlapping(start, length));
  return m.huge;
}

Result<ProcessIo> ReadProcessIo() {
  std::ifstream in("/proc/self/io");
  if (!in) return ErrnoStatus(errno, "open", "/proc/self/io");
  ProcessIo io;
  std::string key;
  uint64_t value = 0;
  while (in >> key >> value) {
    if (key == "rchar:") io.rchar = value;
    if (key == "wchar:") io.wchar = value;
    if (key == "read_bytes:") io.read_bytes = value;
  }
  return io;
}

Result<uint64_t> ResidentBytes() { return StatusField("VmRSS"); }
Result<uint64_t> PinnedBytes() { return StatusField("VmPin"); }

Result<uint64_t> ProcessStartTime(pid_t pid) {
  std::string path = "/proc/" + std::to_string(pid) + "/stat";
  std::ifstream in(path);
  if (!in) return NotFound("no process " + std::to_string(pid));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // The command name (field 2) is in parentheses and may hold spaces: start after the last ')'.
  size_t close = text.rfind(')');
  if (close == std::string::npos) return Corrupt(path + ": unexpected format");
  std::istringstream rest(text.substr(close + 1));
  std::string field;
  // Fields after ')' start at 3 (state); starttime is field 22.
  for (int i = 3; i <= 22; ++i) {
    if (!(rest >> field)) return Corrupt(path + ": too few fields");
  }
  return std::strtoull(field.c_str(), nullptr, 10);
}

pid_t CurrentPid() { return ::getpid(); }

void LowerThreadPriority(int nice) {
  const auto tid = static_cast<id_t>(::syscall(SYS_gettid));
  (void)::setpriority(PRIO_PROCESS, tid, nice);
}

std::string HugetlbPoolName(uint64_t page_bytes) {
  return "hugepages-" + std::to_string(page_bytes >> 10) + "kB";
}

std::string HugetlbPoolDir(uint64_t page_bytes) {
  return "/sys/kernel/mm/hugepages/" + HugetlbPoolName(page_bytes) + "/";
}

Result<HugetlbPool> ReadHugetlbPool(uint64_t page_bytes) {
  const std::string dir = HugetlbPoolDir(page_bytes);
  HugetlbPool pool;
  EA_ASSIGN_OR_RETURN(pool.total, ReadNumber(dir + "nr_hugepages"));
  EA_ASSIGN_OR_RETURN(pool.free, ReadNumber(dir + "free_hugepages"));
  EA_ASSIGN_OR_RETURN(pool.reserved, ReadNumber(dir + "resv_hugepages"));
  EA_ASSIGN_OR_RETURN(pool.overcommit, ReadNumber(dir + "nr_overcommit_hugepages"));
  return pool;
}

std::string ShmemHugeSetting() {
  auto text = ReadSmallFile("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  if (!text.ok()) return "unknown";
  size_t open = text->find('['), close = text->find(']');
  if (open == std::string::npos || close == std::string::npos || close < open) return "unknown";
  return text->substr(open + 1, close - open - 1);
}

std::string BootId() {
  auto text = ReadSmallFile("/proc/sys/kernel/random/boot_id");
  if (!text.ok()) return "";
  std::string id;
  for (char c : *text) {
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || c == '-') id += c;
    if (c == '\n') break;
  }
  return id.size() == 36 ? id : "";
}

}  // namespace expert_arena::platform
