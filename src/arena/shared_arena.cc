// The shared-arena protocol: load once, attach everywhere.
//
// Two one-byte OFD locks on the arena file (platform/ofd_lock.h):
//   FILL (byte 0) exclusive while an engine decides what to do with the file and, when it
//        loads, until the load passed its checks and is published;
//   USER (byte 1) shared by every engine that maps the published file; exclusive by the
//        loader until it publishes (then converted to shared without a gap), and by an
//        engine that replaces a stale file (then the file is unlinked, never truncated).
// Every decision is taken while holding FILL, after checking that the path still names the
// file we locked (another engine may have replaced it while we waited). A process that dies
// loses its locks with its descriptors, so a half-loaded file is found unpublished with FILL
// and USER free, and is replaced by the next engine.
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <thread>
#include <vector>

#include "arena/arena_impl.h"
#include "arena/shared_protocol.h"
#include "arena/arena_locks.h"
#include "arena/memory_charge.h"
#include "arena/numa_placement.h"
#include "common/fault_points.h"
#include "common/logging.h"
#include "common/units.h"
#include "format/arena_format.h"
#include "load/loader.h"
#include "pages/page_backing.h"
#include "platform/file.h"
#include "platform/mapping.h"
#include "platform/ofd_lock.h"
#include "platform/pid_namespace.h"
#include "platform/system_info.h"
#include "source/model_fingerprint.h"

namespace expert_arena::arena {

using pages::AllocateAndMap;
using pages::BackgroundPages;
using pages::HugeDecision;
using pages::PageSourceFor;
namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(20);
// How long an engine that may only read an empty arena file waits for its creator to take FILL.
constexpr double kCreatorGraceSeconds = 2.0;

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

uint64_t UnixNanos() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

// `start` + `seconds` (>= 0, checked with the options). Infinity, and any timeout too large
// for the clock (a double cast to an integer out of its range is undefined, and gave a deadline
// in the past), mean no limit.
Clock::time_point WaitDeadline(Clock::time_point start, double seconds) {
  const double left =
      std::chrono::duration<double>(Clock::time_point::max() - start).count();
  if (!(seconds < left / 2)) return Clock::time_point::max();
  return start + std::chrono::duration_cast<Clock::duration>(
                     std::chrono::duration<double>(seconds));
}

// The first bytes of the file, for a summary that trusts nothing.
format::HeaderSummary PeekHeader(const platform::UniqueFd& fd) {
  std::vector<std::byte> buf(sizeof(format::HeaderFixed));
  auto got = platform::ReadSome(fd, 0, buf);
  if (!got.ok()) return {};
  buf.resize(*got);
  return format::SummarizeHeader(buf);
}

Status NoSpaceMessage(const Status& s, const platform::FilesystemInfo& fs, uint64_t file_bytes,
                      const std::string& path) {
  if (s.code() == StatusCode::kNoSpace && fs.kind == platform::FsKind::kTmpfs) {
    // On a host the fix is the tmpfs mount's size=; Docker and Kubernetes give a container a
    // 64 MiB /dev/shm unless told otherwise.
    const uint64_t needed = fs.total_bytes - std::min(fs.total_bytes, fs.available_bytes) +
                            file_bytes;
    const std::string mount = fs.mount_point.empty() ? DirectoryOf(path) : fs.mount_point;
    return NoSpace(s.message() + ". On a host: `mount -o remount,size=" +
                   std::to_string((needed + kGiB - 1) / kGiB + 1) + "G " + mount + "` (" + mount +
                   " is a tmpfs of " + FormatBytes(fs.total_bytes) +
                   "; the size= of its /etc/fstab line keeps the change over a reboot), or "
                   "the arena on a hugetlbfs. In a container /dev/shm is 64 MiB unless sized: "
                   "`docker run "
                   "--shm-size=" +
                   std::to_string((file_bytes + kGiB - 1) / kGiB + 1) +
                   "g`, a Kubernetes emptyDir with medium: Memory mounted at /dev/shm (its "
                   "sizeLimit and the pod's memory limit must hold the arena), or a host tmpfs "
                   "or hugetlbfs directory bind-mounted in (a hostPath) with the arena there; "
                   "see docs/deployment.md");
  }
  if (s.code() != StatusCode::kNoSpace || fs.kind != platform::FsKind::kHugetlbfs) return s;
  const uint64_t page = std::max(fs.block_bytes, kHugePageBytes);
  auto pool = platform::ReadHugetlbPool(page);
  uint64_t pages = (file_bytes + page - 1) / page;
  std::string have = pool.ok() ? std::to_string(pool->free - std::min(pool->free, pool->reserved))
                               : std::string("unknown");
  // vm.nr_hugepages is the pool of the default size only; another size has its own file.
  const std::string pool_file = platform::HugetlbPoolDir(page) + "nr_hugepages";
  const std::string knob = page == kHugePageBytes ? "set vm.nr_hugepages (e.g. echo " +
                                                        std::to_string(pages + (pool.ok() ? pool->total : 0)) +
                                                        " > /proc/sys/vm/nr_hugepages)"
                                                  : "reserve them (e.g. echo " +
                                                        std::to_string(pages + (pool.ok() ? pool->total : 0)) +
                                                        " > " + pool_file + ")";
  return NoSpace("allocate " + path + ": hugetlbfs needs " + std::to_string(pages) +
                 " huge pages of " + FormatPageSize(page) + " (" + FormatBytes(file_bytes) +
                 ") but its pool " + platform::HugetlbPoolName(page) + " has " + have +
                 " free; " + knob + " or mount with a larger size=");
}

// The huge page size an arena on `fs` lives on (ArenaReport::page_bytes).
uint64_t HugePageBytesOf(const platform::FilesystemInfo& fs) {
  if (fs.kind == platform::FsKind::kHugetlbfs) return std::max(fs.block_bytes, kHugePageBytes);
  return fs.kind == platform::FsKind::kTmpfs ? kHugePageBytes : 0;
}

// Engines map arenas at 2 MiB-aligned addresses (hugetlbfs: its page size).
uint64_t MappingAlignment(const platform::FilesystemInfo& fs) {
  return std::max<uint64_t>(
      kHugePageBytes, fs.kind == platform::FsKind::kHugetlbfs ? fs.block_bytes : kHugePageBytes);
}

// GPU mode maps the file writable (the registration pins the data with write intent), but the
// header and table are written only by the loader, only while it holds FILL: every engine maps
// them read-only, so a stray write through a pointer into the mapping faults in the process
// that made it instead of damaging the table every engine reads. The data range stays as it
// is. On a hugetlbfs of 1 GiB pages the header shares its page with the first data and cannot
// be protected apart from it.
Status ProtectHeader(Arena::Impl& impl, const platform::FilesystemInfo& fs) {
  if (!impl.mapping.writable() || impl.data_offset == 0) return Status::Ok();
  const uint64_t page =
      fs.kind == platform::FsKind::kHugetlbfs ? std::max<uint64_t>(fs.block_bytes, 4096) : 4096;
  if (impl.data_offset % page != 0) return Status::Ok();
  return impl.mapping.ProtectReadOnly(0, impl.data_offset);
}

// Maps a published file, populates it, and decodes its table. We hold FILL or USER.
Result<std::unique_ptr<Arena::Impl>> MapPublished(platform::UniqueFd fd,
                                                  const platform::FileStat& st,
                                                  const platform::FilesystemInfo& fs,
                                                  const std::string& path, bool writable) {
  auto impl = std::make_unique<Arena::Impl>();
  EA_ASSIGN_OR_RETURN(impl->mapping,
                      platform::Mapping::MapFile(fd, st.size, writable, MappingAlignment(fs)));
  // The header region comes first; DecodeHeader checks every offset against the real size.
  auto summary = format::SummarizeHeader(
      impl->mapping.bytes().first(std::min<uint64_t>(st.size, sizeof(format::HeaderFixed))));
  uint64_t header_bytes = summary.layout.header_bytes;
  if (header_bytes == 0 || header_bytes > st.size)
    header_bytes = std::min<uint64_t>(st.size, format::kHeaderPageBytes);
  EA_RETURN_IF_ERROR(format::DecodeHeader(impl->mapping.bytes().first(header_bytes), st.size, path,
                                          &impl->table, nullptr));
  impl->data_offset = header_bytes;
  // A writable mapping (for GPU registration) is populated writable too, so the driver's
  // page walk does not take a write fault per page.
  EA_RETURN_IF_ERROR(platform::AdviseRange(
      impl->mapping.data(), impl->mapping.size(),
      writable ? platform::Advice::kPopulateWrite : platform::Advice::kPopulateRead, path));
  impl->fd = std::move(fd);
  return impl;
}

// Reads sampled pages of the data region back through the file descriptor and compares them
// with the mapping the loader wrote. A kernel that lost writes to a shared mapping (seen on
// 6.18 after MADV_COLLAPSE of huge folios) is caught here, before anything is published.
Status CheckWritesReachedTheFile(const platform::UniqueFd& fd, const platform::Mapping& mapping,
                                 uint64_t data_offset, uint64_t data_bytes) {
  constexpr uint64_t kSample = 4096;
  constexpr uint64_t kSamples = 64;
  std::vector<std::byte> buf(kSample);
  uint64_t pages = data_bytes / kSample;
  for (uint64_t i = 0; i < kSamples && pages > 0; ++i) {
    uint64_t page = i == kSamples - 1 ? pages - 1 : (i * pages) / kSamples;
    uint64_t offset = data_offset + page * kSample;
    EA_RETURN_IF_ERROR(platform::ReadFull(fd, offset, buf));
    if (std::memcmp(buf.data(), mapping.data() + offset, kSample) != 0) {
      return Internal(fd.path() + ": bytes written through the mapping at offset " +
                      std::to_string(offset) +
                      " did not reach the file (kernel page-cache inconsistency); not "
                      "published. Retry with --huge off and report the kernel version");
    }
  }
  return Status::Ok();
}

// MADV_POPULATE_WRITE of a whole mapping on two threads, split at a page boundary: making a
// page is zeroing it, which one core does at memory speed for one core; hugetlbfs and tmpfs
// huge=always make every page here, before the load (bench/load_ceiling.sh).
Status PopulateWriteInParallel(const platform::Mapping& mapping, uint64_t page_bytes,
                               const std::string& path) {
  const uint64_t size = mapping.size();
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  uint64_t half = size / 2 / page_bytes * page_bytes;
  if (cores < 2 || half == 0) {
    return platform::AdviseRange(mapping.data(), size, platform::Advice::kPopulateWrite, path);
  }
  Status second_status = Status::Ok();
  std::thread second([&] {
    second_status = platform::AdviseRange(mapping.data() + half, size - half,
                                          platform::Advice::kPopulateWrite, path);
  });
  Status first = platform::AdviseRange(mapping.data(), half, platform::Advice::kPopulateWrite, path);
  second.join();
  return first.ok() ? second_status : first;
}

// Whether the published arena in `found` records the fingerprint of the model's planning
// inputs and they hash the same on disk now (a model not planned yet attaches without
// planning). Records the bytes read to know it.
bool MatchesFingerprint(ModelWant& want, const FileFindings& found) {
  if (found.size == 0 || !found.view || found.view->fixed().fingerprint == 0) return false;
  if (found.summary.engine_made) return false;  // its identity was not checked against its table
  if (!WhyNotReusable(found.summary, found.decoded, nullptr, found.size).empty()) return false;
  std::vector<format::SourceRecord> sources;
  sources.reserve(found.view->source_count());
  for (size_t i = 0; i < found.view->source_count(); ++i) sources.push_back(found.view->source(i));
  auto check = source::FingerprintFromSources(*want.spec, sources);
  if (check.ok()) want.fingerprint_bytes_read = check->bytes_read;
  return check.ok() && check->fingerprint == found.view->fixed().fingerprint;
}

// An engine-made arena whose planning failed on the empty file this engine created: nothing
// was published, so the file goes (nobody else may map it yet).
void AbandonEmptyFile(const ArenaFile& file, const std::string& path) {
  auto user = platform::TryLockByte(file.fd, kUserByte, platform::LockMode::kExclusive);
  if (user.ok() && *user && PathNamesFile(path, file.st)) (void)platform::UnlinkPath(path);
}

}  // namespace

std::string WhyNotReusable(const format::HeaderSummary& summary, const Status& decoded,
                           const source::ModelPlan* plan, uint64_t file_size) {
  if (file_size == 0) return "";
  if (!summary.our_magic) return "a file that is not an expert-arena file";
  if (summary.version != format::kFormatVersion) {
    return "an arena of format version " + std::to_string(summary.version);
  }
  if (summary.state == format::FileState::kBuilt || summary.state == format::FileState::kFailed) {
    return "a build that never ran (" + BuildFailure(summary) + ")";
  }
  if (summary.state != format::FileState::kPublished) return "an unfinished load";
  if (!decoded.ok()) return "a damaged arena (" + decoded.message() + ")";
  if (plan != nullptr) {
    // A model's table was checked against its identity hash when it was decoded; an engine's
    // cannot be, so an engine-made file is never taken for a model whatever hash it shows.
    if (summary.engine_made && plan->format != "engine") {
      return "an engine-made arena (" + summary.identity_text + ")";
    }
    if (summary.identity_hash != plan->table.identity_hash) {
      return "another model (" + summary.identity_text + ")";
    }
    if (summary.layout.data_bytes != plan->table.data_bytes) {
      return "an arena of another size (" + FormatBytes(summary.layout.data_bytes) + ")";
    }
  }
  return "";
}

std::string BuildFailure(const format::HeaderSummary& summary) {
  if (summary.state == format::FileState::kFailed && !summary.build_failure.empty()) {
    return summary.build_failure;
  }
  std::string why = "built by " +
                    platform::DescribePid(summary.loader_pid, summary.loader_pid_namespace) +
                    ", never confirmed: its engine exited or was killed before its first "
                    "forwards ran on the arena";
  // A rebuild carries the failure of the build before it.
  if (!summary.build_failure.empty()) {
    why += " (the build before it: " + summary.build_failure + ")";
  }
  return why;
}

const char* StepName(Step step) {
  switch (step) {
    case Step::kAttach:
      return "attach";
    case Step::kPlanUnlocked:
      return "plan unlocked";
    case Step::kPlanHere:
      return "plan here";
    case Step::kWaitForCreator:
      return "wait for creator";
    case Step::kRefuse:
      return "refuse";
    case Step::kReplace:
      return "replace";
    case Step::kLoad:
      return "load";
  }
  return "unknown";
}

double FillWait::Seconds() const {
  return said_waiting ? std::chrono::duration<double>(Clock::now() - wait_start).count() : 0;
}

Status CheckArenaFileMode(const std::string& path, uint32_t mode, bool allow_world_writable) {
  char octal[16];
  std::snprintf(octal, sizeof octal, "%04o", mode & 07777);
  if ((mode & 07111) != 0) {
    // Bytes that any engine writes through a mapping must never be run, least of all with
    // the owner's rights (a setuid file in /dev/shm runs as its owner where it is not nosuid).
    return PermissionDenied(path + " has mode " + octal +
                            " (setuid, setgid, sticky or execute bits): refusing to use it as "
                            "an arena. `chmod 0600 " + path +
                            "` (or 0660 to share it with a group), or remove it");
  }
  if ((mode & 0002) != 0 && !allow_world_writable) {
    return PermissionDenied(path + " has mode " + octal +
                            ": any user may write it, and so change the bytes every engine "
                            "reads; refusing to use it. `chmod o-w " + path +
                            "` (a group shares it with 0660), or remove it and let the engine "
                            "create it; or ask for it by name (allow_world_writable, "
                            "--allow-world-writable)");
  }
  return Status::Ok();
}

Result<ArenaFile> OpenArenaFile(const ArenaOptions& options, bool create, bool absent_ok) {
  const std::string& path = options.shared_path;
  platform::OpenOptions open_options;
  open_options.write = true;
  open_options.create = create;
  open_options.mode = options.file_mode;
  open_options.exact_mode = true;
  auto opened = platform::OpenFile(path, open_options);
  ArenaFile file;
  file.path = path;
  if (!opened.ok() && opened.status().code() == StatusCode::kNotFound && absent_ok) {
    file.absent = true;
    return file;
  }
  // Another user's arena shared with a group mode (0640, or 0660 with a umask that took the
  // group's write bit before this version): attaching needs only read access.
  if (!opened.ok() && opened.status().code() == StatusCode::kPermission) {
    auto lst = platform::StatPath(path);
    if (!lst.ok() && lst.status().code() == StatusCode::kPermission) {
      return PermissionDenied(path + ": this user may not reach the arena file: " +
                              platform::DescribeFileAccess(path) +
                              ". Every engine must be able to search its directory (a shared "
                              "directory is mode 1777 like /dev/shm, or 2770 with a group)");
    }
    if (!lst.ok() || !lst->regular) return opened.status();  // a symlink, or no file at all
    auto reading = platform::OpenFile(path, platform::OpenOptions{});
    if (!reading.ok()) {
      if (reading.status().code() != StatusCode::kPermission) return reading.status();
      return PermissionDenied(
          path +
          ": this user may not read the arena file: " + platform::DescribeFileAccess(path) +
          ". To share an arena between users, the engine that creates it sets a group mode "
          "(moe-engine --arena-mode 0660, expert-arena load --mode 0660, Python "
          "open(file_mode=0o660)) and every engine runs with that group (a supplementary "
          "group; in a container --group-add or the pod's fsGroup) and "
          "--arena-allow-foreign-owner; or run this engine as the owner, or give it another "
          "arena path");
    }
    opened = std::move(reading);
    file.read_only = true;
  }
  if (!opened.ok()) return opened.status();
  file.fd = std::move(*opened);
  EA_ASSIGN_OR_RETURN(file.st, platform::StatFd(file.fd));
  if (!file.st.regular) return InvalidArgument(path + ": not a regular file");
  if (file.st.owner_uid != platform::EffectiveUid() && !options.allow_foreign_owner) {
    return PermissionDenied(path + " is owned by uid " + std::to_string(file.st.owner_uid) +
                            ", not by this user (uid " +
                            std::to_string(platform::EffectiveUid()) +
                            "); refusing to share it (allow_foreign_owner opts in)");
  }
  EA_RETURN_IF_ERROR(CheckArenaFileMode(path, file.st.mode, options.allow_world_writable));
  return file;
}

Result<bool> WaitForFill(ArenaFile& file, FillWait& wait, spdlog::logger& log) {
  const std::string& path = file.path;
  // A read-only descriptor cannot take a write lock (EBADF): such an engine only attaches,
  // and FILL shared is enough for that (it conflicts with a loader's, not with other
  // attachers').
  const platform::LockMode fill_mode =
      file.read_only ? platform::LockMode::kShared : platform::LockMode::kExclusive;
  for (;;) {
    EA_ASSIGN_OR_RETURN(bool got_fill, platform::TryLockByte(file.fd, kFillByte, fill_mode));
    if (got_fill) break;
    if (!wait.said_waiting && PeekHeader(file.fd).state == format::FileState::kPublished) {
      // FILL is held by an engine of another user checking a published arena before it
      // attaches (shared): a moment, nobody is loading.
    } else if (!wait.said_waiting) {
      wait.wait_start = Clock::now();
      format::HeaderSummary loading = PeekHeader(file.fd);
      // The loader writes its pid first thing; give it up to 2 s to appear.
      for (int i = 0; i < 100 && loading.loader_pid == 0; ++i) {
        std::this_thread::sleep_for(kPollInterval);
        loading = PeekHeader(file.fd);
      }
      // A loader in another container (PID namespace) is named as such, and not reported
      // as a pid of ours.
      wait.waiting_for =
          loading.loader_pid == 0
              ? std::string("pid unknown")
              : platform::DescribePid(loading.loader_pid, loading.loader_pid_namespace);
      wait.waited_for =
          platform::PidIsLocal(loading.loader_pid_namespace) ? loading.loader_pid : 0;
      log.info("expert-arena: another engine ({}) is loading {}, waiting", wait.waiting_for, path);
      wait.said_waiting = true;
    }
    if (Clock::now() > wait.deadline) {
      return TimedOut("waited " + std::to_string(static_cast<int>(SecondsSince(wait.start))) +
                      " s for another engine (" + wait.waiting_for + ") loading " + path +
                      "; raise the wait timeout or check that process");
    }
    std::this_thread::sleep_for(kPollInterval);
    if (!PathNamesFile(path, file.st)) return false;
  }
  if (!PathNamesFile(path, file.st)) return false;  // replaced between open and lock
  EA_ASSIGN_OR_RETURN(file.st, platform::StatFd(file.fd));
  return true;
}

FileFindings ReadFindings(const ArenaFile& file, const platform::FilesystemInfo& fs,
                          bool writable, const std::string& path) {
  FileFindings found;
  found.size = file.st.size;
  found.read_only = file.read_only;
  found.summary = PeekHeader(file.fd);
  const format::HeaderSummary& summary = found.summary;
  found.header_bytes = summary.layout.header_bytes;
  const uint64_t header_bytes = found.header_bytes;
  if (found.size > 0 && summary.our_magic && summary.version == format::kFormatVersion &&
      summary.state == format::FileState::kPublished) {
    if (header_bytes == 0 || header_bytes > found.size || header_bytes > 1024 * kMiB) {
      found.decoded = format::DecodeHeader({}, found.size, path, nullptr, nullptr);
    } else if (auto mapped = platform::Mapping::MapFile(file.fd, found.size, writable,
                                                        MappingAlignment(fs));
               mapped.ok()) {
      auto opened =
          format::TableView::Open(mapped->bytes().first(header_bytes), found.size, path);
      if (opened.ok()) {
        found.view = std::move(*opened);
        found.whole = std::move(*mapped);
      } else {
        found.decoded = opened.status();
      }
    } else {
      std::vector<std::byte> region(header_bytes);
      found.decoded = platform::ReadFull(file.fd, 0, region);
      if (found.decoded.ok()) {
        found.decoded = format::DecodeHeader(region, found.size, path, nullptr, nullptr);
      }
    }
  }
  return found;
}

Decision Classify(const ModelWant* want, const FileFindings& found, const std::string& path) {
  const source::ModelPlan* plan = want != nullptr && want->plan ? &*want->plan : nullptr;
  const std::string why_not = WhyNotReusable(found.summary, found.decoded, plan, found.size);
  const uint64_t size = found.size;
  Decision d;
  if (want != nullptr && plan == nullptr && want->engine_identity != 0) {
    const format::HeaderSummary& summary = found.summary;
    if (size > 0 && !found.read_only && summary.our_magic &&
        summary.version == format::kFormatVersion &&
        summary.identity_hash == want->engine_identity &&
        (summary.state == format::FileState::kBuilt ||
         summary.state == format::FileState::kFailed)) {
      // A build of this arena whose engine failed, or died, before it confirmed (we hold FILL):
      // nobody trusts it. Rebuilt once; after a second failure the first is reported, so that
      // a fleet does not loop building and crashing.
      const std::string failure = BuildFailure(summary);
      if (summary.build_attempt >= 2) {
        d.refusal = InvalidArgument(
            path + ": the engine arena " + summary.identity_text +
            " was built twice and its engine failed on it both times; not building it a third "
            "time. " + (summary.build_failure.empty() ? failure : "The first failure: " +
                                                                   summary.build_failure) +
            ". Fix the cause, then remove the file (`expert-arena rm " + path +
            "`) to build it again");
        return d;
      }
      d.step = Step::kReplace;
      d.held = "a build of this arena that never ran (" + failure + ")";
      d.busy = path + " holds " + d.held + " and is in use by another engine; stop it, or " +
               "give this engine another arena path";
      d.failed_attempt = std::max<uint32_t>(1, summary.build_attempt);
      d.first_failure = failure;
      return d;
    }
    // An engine-made arena: ours when published under our identity hash.
    const bool ours =
        size > 0 && why_not.empty() && found.summary.identity_hash == want->engine_identity;
    if (!ours && found.read_only) {
      d.refusal = PermissionDenied(
          path + " holds " +
          (size == 0         ? std::string("no arena yet")
           : why_not.empty() ? "another engine's arena (" + found.summary.identity_text + ")"
                             : why_not) +
          ", and this user may only read it (" + platform::DescribeFileAccess(path) +
          "), so this engine cannot build or replace it; give this engine another arena path");
      return d;
    }
    if (!ours && size > 0) {
      // Another identity, an unfinished build, or a damaged file: replaced when no engine
      // maps it, before this engine builds anything.
      d.step = Step::kReplace;
      d.held = why_not.empty() ? "another engine's arena (" + found.summary.identity_text + ")"
                               : why_not;
      d.busy = path + " holds " + d.held + " and is in use by another engine; this engine " +
               "builds another. Stop the engines that use it, or give this one another "
               "arena path";
      return d;
    }
    // A fresh, empty file and FILL: this engine builds now, while the others wait.
    if (!ours) {
      d.step = Step::kPlanHere;
      return d;
    }
  } else if (want != nullptr && plan == nullptr) {
    // The model is not planned yet: a published arena that records the fingerprint of its
    // planning inputs is this model when the inputs on disk hash the same. Otherwise it is
    // planned without holding any lock, and the file decided on again.
    if (!found.fingerprint_matches) {
      d.step = Step::kPlanUnlocked;
      return d;
    }
  }
  if (size > 0 && why_not.empty()) {
    d.step = Step::kAttach;  // a published arena of our model
    return d;
  }
  if (found.read_only && size == 0 && found.creator_grace) {
    // The owner's engine may have created the file and not yet taken FILL: give it a moment.
    d.step = Step::kWaitForCreator;
    return d;
  }
  if (plan == nullptr) {
    d.refusal = size == 0 ? NotFound(path + ": empty file, no arena was loaded into it")
                          : Corrupt(path + ": cannot attach: it holds " + why_not);
    return d;
  }
  if (found.read_only) {
    d.refusal = PermissionDenied(
        path + " holds " + (size == 0 ? std::string("no arena yet") : why_not) +
        ", and this user may only read it (" + platform::DescribeFileAccess(path) +
        "), so this engine cannot load or replace it. Start an engine of a user that may "
        "write it (its owner, or a member of its group with mode 0660) to load it, then attach; "
        "or give this engine another arena path");
    return d;
  }
  // Replace or load: both need every other engine gone from the file.
  d.busy = path + " holds " + why_not + " and is in use by another engine; this engine " +
           "wants " + plan->table.identity_text +
           ". Stop the engines that use it, or give this one another arena path";
  d.step = size > 0 ? Step::kReplace : Step::kLoad;
  d.held = why_not;
  return d;
}

Status TakeUserExclusive(const ArenaFile& file, const std::string& busy) {
  EA_ASSIGN_OR_RETURN(bool unused,
                      platform::TryLockByte(file.fd, kUserByte, platform::LockMode::kExclusive));
  if (!unused) return Busy(busy);
  return Status::Ok();
}

Status Replace(const std::string& path, const std::string& held, spdlog::logger& log) {
  log.info("expert-arena: replacing {}: it held {} and no engine maps it", path, held);
  return platform::UnlinkPath(path);
}

namespace {

// Starts a LateCollapse of the data region of `impl`'s mapping when part of it is not on
// 2 MiB pages (the header stays on small pages: it is rewritten when a build ends). `advise`:
// the mapping has no MADV_HUGEPAGE yet (a tmpfs with huge=never collapses only where it was
// given). Returns whether it started.
bool CollapseDataLater(Arena::Impl& impl, const std::string& path, bool advise) {
  if (!platform::Kernel().has(platform::KernelFeature::kCollapse)) return false;
  const uint64_t begin = (impl.data_offset + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  if (begin >= impl.mapping.size()) return false;
  std::byte* data = impl.mapping.data() + begin;
  const uint64_t length = (impl.mapping.size() - begin) / kHugePageBytes * kHugePageBytes;
  auto huge = platform::HugeBytesInRange(data, length);
  if (length == 0 || (huge.ok() && *huge >= length)) return false;
  if (advise && !platform::AdviseRange(data, length, platform::Advice::kHugePage, path).ok()) {
    return false;
  }
  // (The default logger, as the views' mapping's warnings: the thread outlives Open's.)
  impl.late_collapse = std::make_unique<pages::LateCollapse>(
      data, length, path, [](const std::string& m) { ResolveLogger(nullptr)->warn("{}", m); });
  return true;
}

}  // namespace

Result<std::unique_ptr<Arena::Impl>> Attach(ArenaFile file, FileFindings found,
                                            const platform::FilesystemInfo& fs, bool writable,
                                            HugePages huge, const FillWait& wait,
                                            const std::string& path) {
  EA_ASSIGN_OR_RETURN(bool user,
                      platform::TryLockByte(file.fd, kUserByte, platform::LockMode::kShared));
  if (!user) return Internal(path + ": USER held exclusively while FILL was free");
  std::unique_ptr<Arena::Impl> impl;
  if (found.view && found.view->in_place()) {
    impl = std::make_unique<Arena::Impl>();
    impl->mapping = std::move(*found.whole);
    impl->table = found.view->Summary();
    impl->view = std::move(found.view);
    impl->data_offset = found.header_bytes;
    EA_RETURN_IF_ERROR(platform::AdviseRange(
        impl->mapping.data(), impl->mapping.size(),
        writable ? platform::Advice::kPopulateWrite : platform::Advice::kPopulateRead, path));
    impl->fd = std::move(file.fd);
  } else {
    found.view.reset();
    found.whole.reset();
    EA_ASSIGN_OR_RETURN(impl, MapPublished(std::move(file.fd), file.st, fs, path, writable));
  }
  EA_RETURN_IF_ERROR(ProtectHeader(*impl, fs));
  EA_RETURN_IF_ERROR(platform::UnlockByte(impl->fd, kFillByte));
  impl->report.role = ArenaRole::kAttached;
  impl->report.wait_seconds = wait.Seconds();
  impl->report.waited_for_pid = wait.waited_for;
  impl->report.backing = platform::FsKindName(fs.kind);
  impl->report.huge_note = fs.kind == platform::FsKind::kHugetlbfs ? "hugetlbfs" : "";
  impl->report.page_bytes = HugePageBytesOf(fs);
  // On plain 4 KiB tmpfs, an arena not (yet) whole on 2 MiB pages: its builder is still making
  // them after its build, or stopped before it made them all, or memory was short then. This
  // engine makes the rest, deciding as a loader would (--huge auto holds back where free 2 MiB
  // blocks are short); the kernel skips a page already made or being made by another. (Not on
  // a tmpfs mounted huge=: MADV_COLLAPSE over its 2 MiB folios loses later writes,
  // docs/page-backing.md; not under a GPU registration, which pins the small pages.)
  if (huge != HugePages::kOff && !writable &&
      PageSourceFor(fs.kind, fs.tmpfs_huge) == pages::PageSource::kTmpfs) {
    auto blocks = platform::FreeHugeBlocks();
    if (pages::DecideHugePages(huge, pages::PageSource::kTmpfs, impl->mapping.size(),
                               blocks.ok() ? *blocks : 0)
            .ask &&
        CollapseDataLater(*impl, path, /*advise=*/true)) {
      impl->report.huge_note = "the rest made in the background (MADV_COLLAPSE at nice 19)";
    }
  }
  return impl;
}

Result<std::unique_ptr<Arena::Impl>> LoadFresh(ArenaFile file, source::ModelPlan& plan,
                                               ArenaFiller& filler, const ArenaOptions& options,
                                               const platform::FilesystemInfo& fs,
                                               const FillWait& wait, spdlog::logger& log,
                                               const DeferredPublish* deferred) {
  const std::string& path = file.path;
  platform::UniqueFd& fd = file.fd;
  const bool hugetlbfs = fs.kind == platform::FsKind::kHugetlbfs;
  auto impl = std::make_unique<Arena::Impl>();
  // Every way on from here returns: the plan's table (90,000 records at the largest
  // checkpoints) is moved, not copied; only its scalars are read below.
  impl->table = std::move(plan.table);
  auto fail = [&](const Status& s) {
    // Nobody maps an unpublished file (we hold USER exclusively): remove it, leak nothing.
    (void)platform::UnlinkPath(path);
    return s;
  };
  auto layout = format::ComputeLayout(impl->table, hugetlbfs ? fs.block_bytes : kHugePageBytes);
  if (!layout.ok()) return fail(layout.status());
  // Before the first page is written (the stub header below makes one): would the pages
  // this load makes fit the cgroup they are charged to? The file is new and empty, so every
  // page of it is made here.
  // An engine that frees its own copy of each tensor as it writes, with the pages made as it
  // writes, holds at its peak the arena less what it freed (plus the largest tensor and the
  // pages made ahead), not the arena on top of its memory.
  uint64_t charged = layout->file_bytes;
  uint64_t freed = filler.FreedAsWritten();
  if (freed > 0 && pages::PagesInPieces(options.huge, PageSourceFor(fs.kind, fs.tmpfs_huge),
                                        layout->file_bytes, fs.available_bytes)) {
    uint64_t largest = 0;
    for (const format::TensorRecord& t : impl->table.tensors) largest = std::max(largest, t.bytes);
    freed = std::min(freed, layout->file_bytes);
    charged = std::min(layout->file_bytes,
                       layout->file_bytes - freed + largest + pages::kPacedPagesAheadBytes);
  }
  auto charge = CheckArenaCharge(fs, charged, path, log, layout->file_bytes - charged);
  if (!charge.ok()) return fail(charge.status());
  const uint32_t pid = static_cast<uint32_t>(platform::CurrentPid());
  auto start_time = platform::ProcessStartTime(platform::CurrentPid());
  const uint64_t ticks = start_time.ok() ? *start_time : 0;
  const uint64_t pid_namespace = platform::PidNamespaceId();
  const uint64_t created = UnixNanos();
  auto placement = ResolvePlacement(options);
  if (!placement.ok()) return fail(placement.status());
  // With a NUMA policy on tmpfs no page of the file may exist before the policy is set (the
  // collapse puts a 2 MiB page where its small pages are): the stub below would make the
  // header's first page on the loader's node, so it waits for the header in the mapping.
  const bool placed_tmpfs = placement->policy != platform::MemPolicy::kDefault &&
                            fs.kind == platform::FsKind::kTmpfs;
  if (!placed_tmpfs) {
    // Say who is loading before the (possibly long) allocation, so engines that arrive now
    // can name this process. Best effort: hugetlbfs has no write(2); the header written
    // into the mapping below says it again.
    // Only the fixed part is written: encode the table's scalars, not its 90,000 entries.
    std::vector<format::SourceRecord> sources = std::move(impl->table.sources);
    std::vector<format::TensorRecord> tensors = std::move(impl->table.tensors);
    format::ArenaTable scalars = impl->table;
    impl->table.sources = std::move(sources);
    impl->table.tensors = std::move(tensors);
    format::ArenaLayout stub_layout = *layout;
    stub_layout.header_bytes = format::kHeaderPageBytes;
    std::vector<std::byte> stub(stub_layout.header_bytes);
    if (format::EncodeHeader(scalars, stub_layout, format::FileState::kLoading, pid, ticks,
                             created, 0, stub, pid_namespace)
            .ok()) {
      (void)platform::WriteFull(fd, 0, std::span(stub).first(sizeof(format::HeaderFixed)));
    }
  }
  if (fs.kind == platform::FsKind::kOther) {
    // Works (every engine shares the file's page cache), but the operator most likely meant
    // /dev/shm: say what it costs.
    log.warn(
        "expert-arena: {} is not on tmpfs or hugetlbfs: the arena is the page cache of a "
        "file on a disk filesystem, {} written back to its device, on 4 KiB pages; "
        "/dev/shm or a hugetlbfs mount keeps it in memory only, on 2 MiB pages",
        path, FormatBytes(layout->file_bytes));
  }
  uint64_t alignment = hugetlbfs ? std::max(fs.block_bytes, kHugePageBytes) : kHugePageBytes;
  Status room = CheckRoomOnNode(*placement, hugetlbfs, layout->file_bytes,
                                std::max(fs.block_bytes, kHugePageBytes), path);
  if (!room.ok()) return fail(room);
  auto backed = AllocateAndMap(fd, layout->file_bytes, alignment, options.huge,
                               PageSourceFor(fs.kind, fs.tmpfs_huge), fs.available_bytes, path,
                               options.pages_alongside_load || filler.PagesAsWritten(),
                               &*placement, filler.PagesAsWritten(),
                               /*collapse_after_fill=*/filler.HugeAfterBuild() &&
                                   !MapWritableForGpu(options));
  if (!backed.ok()) {
    return fail(NoSpaceMessage(backed.status(), fs, layout->file_bytes, path));
  }
  // The background pages (if any) write into this mapping: they are stopped and joined
  // (backed->pages) before it is unmapped, on every path out of here.
  impl->mapping = std::move(backed->mapping);
  impl->data_offset = layout->header_bytes;
  BackgroundPages* pages = backed->pages.get();
  auto stop_pages = [&](Status s) {
    backed->pages.reset();
    return fail(s);
  };

  std::span<std::byte> header = impl->mapping.bytes().first(layout->header_bytes);
  if (pages != nullptr) pages->Permit(layout->header_bytes);
  Status s = pages != nullptr ? pages->front().WaitFor(layout->header_bytes) : Status::Ok();
  if (!s.ok()) return stop_pages(s);
  s = format::EncodeHeader(impl->table, *layout, format::FileState::kLoading, pid, ticks, created,
                           0, header, pid_namespace);
  if (!s.ok()) return stop_pages(s);
  std::byte* data = impl->mapping.data() + impl->data_offset;
  if (pages == nullptr) {
    s = PopulateWriteInParallel(impl->mapping, alignment, path);
    if (!s.ok()) return fail(s);
  }

  load::LoadRequest request;
  request.data = {data, impl->table.data_bytes};
  request.reader = ModelReaderName(options.reader);
  request.progress = options.progress;
  request.logger = &log;
  request.logger_is_engines = options.logger != nullptr;
  if (pages != nullptr) {
    request.ready_front = &pages->front();
    request.ready_base = impl->data_offset;
    if (filler.PagesAsWritten()) {
      request.permit_pages = [pages](uint64_t end) { pages->Permit(end); };
    }
  }
  auto loaded = filler.Fill(request, impl->table);
  // A load that failed stops the pages at once (a failure of the pages reaches the load as
  // the front's error); otherwise wait for the last pieces.
  if (!loaded.ok()) return stop_pages(loaded.status().WithContext("loading " + path));
  s = backed->FinishPages();
  if (!s.ok()) return stop_pages(s);
  const HugeDecision& huge = backed->huge;
  const double collapse_seconds = backed->collapse_seconds;

  s = CheckWritesReachedTheFile(fd, impl->mapping, impl->data_offset, impl->table.data_bytes);
  if (!s.ok()) return fail(s);
  fault_points::BeforePublish();
  // An engine-made arena that is published only once its engine ran on it stays "built", and
  // FILL stays held (the waiters keep waiting) until ConfirmBuild.
  s = format::EncodeHeader(
      impl->table, *layout,
      deferred != nullptr ? format::FileState::kBuilt : format::FileState::kPublished, pid, ticks,
      created, deferred != nullptr ? 0 : UnixNanos(), header, pid_namespace);
  if (s.ok() && deferred != nullptr) {
    s = format::SetBuildState(header, format::FileState::kBuilt, 0, deferred->attempt,
                              deferred->first_failure);
  }
  if (!s.ok()) return fail(s);
  // Publish: USER exclusive -> shared in one call, then let the waiters in.
  auto user_shared = platform::TryLockByte(fd, kUserByte, platform::LockMode::kShared);
  if (!user_shared.ok()) return fail(user_shared.status());
  if (deferred == nullptr) EA_RETURN_IF_ERROR(platform::UnlockByte(fd, kFillByte));
  if (deferred != nullptr) {
    impl->awaiting_confirm = true;
    impl->build_attempt = deferred->attempt;
    impl->first_failure = deferred->first_failure;
    impl->mapping_alignment = alignment;
    log.info("expert-arena: {} built (attempt {}); published once this engine's first forwards "
             "ran on it",
             path, deferred->attempt);
  }
  // Nobody writes a published arena: the loader's mapping becomes read-only like the others
  // (unless it is to be registered with a GPU: see MapWritableForGpu).
  EA_RETURN_IF_ERROR(MapWritableForGpu(options) ? ProtectHeader(*impl, fs)
                                                : impl->mapping.MakeReadOnly());
  // From now on the loader reads its table where every other engine does: in the header it
  // published, and the heap copy goes.
  auto published = format::TableView::Open(header, layout->file_bytes, path);
  if (published.ok()) {
    impl->view = std::move(*published);
    impl->table = impl->view->Summary();
  }
  impl->fd = std::move(fd);
  impl->report.role = ArenaRole::kLoaded;
  impl->report.backing = platform::FsKindName(fs.kind);
  impl->report.huge_note = hugetlbfs ? "hugetlbfs: " + FormatPageSize(fs.block_bytes) +
                                           " pages reserved by the filesystem"
                                     : huge.note;
  impl->report.page_bytes = HugePageBytesOf(fs);
  impl->report.numa = placement->asked;
  impl->report.numa_note = backed->numa_note;
  impl->report.charge_note = *charge;
  impl->report.collapse_seconds = collapse_seconds;
  impl->report.load_seconds = loaded->seconds;
  impl->report.reader = loaded->reader;
  impl->report.reader_note = loaded->note;
  impl->report.bytes_read = loaded->bytes_read + plan.metadata_bytes_read;
  impl->report.wait_seconds = wait.Seconds();
  impl->report.waited_for_pid = wait.waited_for;
  if (backed->collapse_after_fill) {
    // Every byte is written and read-only now: its 2 MiB pages come while the engine starts.
    (void)CollapseDataLater(*impl, path, /*advise=*/false);
  }
  return impl;
}

namespace {

// Rewrites the fixed header of the file `impl` holds through a writable mapping of its own
// (the arena's mapping is read-only; hugetlbfs has no write(2)), then lets FILL go.
Status EndBuild(Arena::Impl& impl, format::FileState state, uint64_t published_unix_ns,
                std::string_view failure) {
  if (!impl.awaiting_confirm) return Status::Ok();
  EA_ASSIGN_OR_RETURN(platform::Mapping header,
                      platform::Mapping::MapFile(impl.fd, impl.mapping.size(), /*writable=*/true,
                                                 impl.mapping_alignment));
  EA_RETURN_IF_ERROR(format::SetBuildState(header.bytes().first(sizeof(format::HeaderFixed)),
                                           state, published_unix_ns, impl.build_attempt,
                                           failure));
  impl.awaiting_confirm = false;
  return platform::UnlockByte(impl.fd, kFillByte);
}

}  // namespace

Status ConfirmBuild(Arena::Impl& impl) {
  return EndBuild(impl, format::FileState::kPublished, UnixNanos(), "");
}

Status AbandonBuild(Arena::Impl& impl, std::string_view reason) {
  const std::string text = impl.first_failure.empty()
                               ? std::string(reason)
                               : impl.first_failure + "; the rebuild failed too: " +
                                     std::string(reason);
  return EndBuild(impl, format::FileState::kFailed, 0, text);
}

Result<std::unique_ptr<Arena::Impl>> OpenShared(ModelWant* want, const ArenaOptions& options,
                                                spdlog::logger& log) {
#if !defined(__linux__)
  return Unsupported(options.shared_path + ": shared arena files are implemented on Linux only");
#else
  const std::string& path = options.shared_path;
  FillWait wait;
  wait.start = Clock::now();
  wait.deadline = WaitDeadline(wait.start, options.wait_timeout_seconds);
  auto statfs = platform::StatFilesystem(DirectoryOf(path));
  if (!statfs.ok() && statfs.status().code() == StatusCode::kNotFound) {
    const std::string dir = DirectoryOf(path);
    return NotFound(path + ": the arena's directory " + dir +
                    " does not exist; create it (`mkdir -p " + dir +
                    "`, or mount a tmpfs or hugetlbfs there) or give a path in a directory that "
                    "exists, such as /dev/shm");
  }
  EA_ASSIGN_OR_RETURN(platform::FilesystemInfo fs, std::move(statfs));

  // Each round opens the file anew: a round ends by a decision (attach, load, refuse) or by
  // letting go of the file (planned without a lock, replaced, replaced by another engine).
  for (;;) {
    const bool planned = want != nullptr && want->plan;
    // An engine-made arena is planned only once this engine holds FILL on an empty file.
    const bool create = planned || (want != nullptr && want->engine_identity != 0);
    EA_ASSIGN_OR_RETURN(ArenaFile file,
                        OpenArenaFile(options, create, want != nullptr && !planned));
    if (file.absent) {
      // Nothing to attach to: this engine loads, so it plans.
      EA_RETURN_IF_ERROR(want->MakePlan());
      continue;
    }
    EA_ASSIGN_OR_RETURN(bool held, WaitForFill(file, wait, log));
    if (!held) continue;

    // An engine that may only read the file maps it read-only (and registers it so).
    const bool writable = MapWritableForGpu(options) && !file.read_only;
    // We hold FILL: nobody else decides now. What is in the file?
    FileFindings found = ReadFindings(file, fs, writable, path);
    if (want != nullptr && !want->plan && want->engine_identity == 0) {
      found.fingerprint_matches = MatchesFingerprint(*want, found);
    }
    found.creator_grace =
        Clock::now() < wait.deadline && SecondsSince(wait.start) < kCreatorGraceSeconds;
    Decision decision = Classify(want, found, path);
    if (decision.step == Step::kPlanHere) {
      // A fresh, empty file and FILL: this engine builds now, while the others wait.
      found.view.reset();
      found.whole.reset();
      Status made = want->MakePlan();
      if (!made.ok()) {
        AbandonEmptyFile(file, path);
        return made.WithContext("building the engine arena " + path);
      }
      decision = Classify(want, found, path);
    }
    switch (decision.step) {
      case Step::kAttach:
        return Attach(std::move(file), std::move(found), fs, writable,
                      want != nullptr && want->filler != nullptr &&
                              want->filler->HugeAfterBuild() && !MapWritableForGpu(options)
                          ? options.huge
                          : HugePages::kOff,
                      wait, path);
      case Step::kPlanUnlocked:
        // Plan it without holding any lock (closing the file drops FILL), then decide again.
        found = FileFindings();
        file = ArenaFile();
        EA_RETURN_IF_ERROR(want->MakePlan());
        continue;
      case Step::kWaitForCreator:
        found = FileFindings();
        file = ArenaFile();
        std::this_thread::sleep_for(kPollInterval);
        continue;
      case Step::kRefuse:
        return decision.refusal;
      case Step::kReplace:
        found = FileFindings();
        EA_RETURN_IF_ERROR(TakeUserExclusive(file, decision.busy));
        EA_RETURN_IF_ERROR(Replace(path, decision.held, log));
        if (decision.failed_attempt > 0 && want != nullptr && want->deferred) {
          want->deferred->attempt = decision.failed_attempt + 1;
          want->deferred->first_failure = decision.first_failure;
        }
        continue;  // closing the file drops our locks; the next round creates it anew
      case Step::kLoad:
        found = FileFindings();
        EA_RETURN_IF_ERROR(TakeUserExclusive(file, decision.busy));
        // A fresh, empty file: we load it, holding FILL and USER exclusively.
        if (want->filler == nullptr) {
          (void)platform::UnlinkPath(path);  // nobody maps it: we hold USER exclusively
          return Internal(path + ": an arena wanted without a filler cannot be loaded");
        }
        return LoadFresh(std::move(file), *want->plan, *want->filler, options, fs, wait, log,
                         want->deferred ? &*want->deferred : nullptr);
      case Step::kPlanHere:
        break;  // planned above: Classify does not ask twice
    }
    return Internal(path + ": the protocol asked to plan twice");
  }
#endif
}

}  // namespace expert_arena::arena
