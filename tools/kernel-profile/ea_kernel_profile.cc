// ea-kernel-profile: runs a command under a seccomp filter that answers the calls an older
// kernel or a container runtime lacks the way that kernel or runtime does, so the fallbacks of
// expert-arena (src/platform/kernel_features.h) run on a new kernel. The idiom is runc's and
// systemd's: SCMP_ACT_ERRNO with the errno the real thing returns.
//
//   ea-kernel-profile --profile linux-4.18 -- build/bin/moe-engine --model m.gguf ...
//   ea-kernel-profile --list
//
// What a real kernel answers (read in its source, docs/kernels.md):
//   - an madvise advice it does not know: EINVAL (do_madvise checks madvise_behavior_valid()
//     before anything else, 4.18 as today);
//   - ioctl(PAGEMAP_SCAN) on /proc/self/pagemap before 6.7: ENOTTY (the file has no ioctl
//     handler, vfs_ioctl returns -ENOTTY);
//   - a syscall it does not have: ENOSYS (sys_ni_syscall); io_uring_setup before 5.1 or built
//     without CONFIG_IO_URING: ENOSYS; kernel.io_uring_disabled=2: EPERM;
//   - a memfd_create flag it does not know (MFD_NOEXEC_SEAL, MFD_EXEC before 6.3): EINVAL.
// Docker 25+ and containerd 2 leave io_uring out of their default profile (EPERM, their
// default errno); Podman's profile answers ENOSYS.
//
// The child inherits EXPERT_ARENA_KERNEL_PROFILE=NAME so tests know what to expect.
#include <seccomp.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

// _IOWR('f', 16, struct pm_scan_arg) with its 96-byte argument (include/uapi/linux/fs.h, 6.7).
constexpr unsigned long kPagemapScan = 0xC0606610ul;

// Syscalls numbered 424 and above share one number on every architecture, so they can be
// named by number where this libseccomp predates them.
struct Syscall {
  const char* name;
  int number;  // -1: resolve by name
};

struct Rule {
  enum Kind { kSyscall, kMadvise, kIoctl, kMemfdFlags } kind;
  Syscall call{nullptr, -1};
  uint64_t value = 0;  // the madvise advice, the ioctl request, the memfd flag bits
  int error = 0;
  const char* what = "";
};

struct Profile {
  const char* name;
  const char* stands_for;
  std::vector<Rule> rules;
};

Rule Missing(const char* name, int number, int error, const char* what) {
  return Rule{Rule::kSyscall, {name, number}, 0, error, what};
}
Rule Advice(int advice, const char* what) {
  return Rule{Rule::kMadvise, {"madvise", -1}, static_cast<uint64_t>(advice), EINVAL, what};
}

// What each kernel since the one named lacks and the code might call (newest last).
std::vector<Rule> After618() {
  return {
      Advice(20, "MADV_COLD (5.4)"),
      Advice(21, "MADV_PAGEOUT (5.4)"),
      Advice(22, "MADV_POPULATE_READ (5.14)"),
      Advice(23, "MADV_POPULATE_WRITE (5.14)"),
      Missing("io_uring_setup", 425, ENOSYS, "io_uring (5.1)"),
      Missing("io_uring_enter", 426, ENOSYS, "io_uring (5.1)"),
      Missing("io_uring_register", 427, ENOSYS, "io_uring (5.1)"),
      Missing("pidfd_send_signal", 424, ENOSYS, "pidfd_send_signal (5.1)"),
      Missing("open_tree", 428, ENOSYS, "open_tree (5.2)"),
      Missing("pidfd_open", 434, ENOSYS, "pidfd_open (5.3)"),
      Missing("clone3", 435, ENOSYS, "clone3 (5.3; glibc falls back to clone)"),
      Missing("close_range", 436, ENOSYS, "close_range (5.9)"),
      Missing("openat2", 437, ENOSYS, "openat2 (5.6)"),
      Missing("pidfd_getfd", 438, ENOSYS, "pidfd_getfd (5.6)"),
      Missing("faccessat2", 439, ENOSYS, "faccessat2 (5.8; glibc falls back)"),
      Missing("process_madvise", 440, ENOSYS, "process_madvise (5.10)"),
      Missing("epoll_pwait2", 441, ENOSYS, "epoll_pwait2 (5.11)"),
      Missing("mount_setattr", 442, ENOSYS, "mount_setattr (5.12)"),
      Missing("landlock_create_ruleset", 444, ENOSYS, "landlock (5.13)"),
      Missing("memfd_secret", 447, ENOSYS, "memfd_secret (5.14)"),
      Missing("process_mrelease", 448, ENOSYS, "process_mrelease (5.15)"),
  };
}
// 5.10 (Amazon Linux 2's 5.10, Debian 11) has io_uring but not what came from 5.11 to 5.15.
std::vector<Rule> After510() {
  return {
      Advice(22, "MADV_POPULATE_READ (5.14)"),
      Advice(23, "MADV_POPULATE_WRITE (5.14)"),
      Missing("epoll_pwait2", 441, ENOSYS, "epoll_pwait2 (5.11)"),
      Missing("mount_setattr", 442, ENOSYS, "mount_setattr (5.12)"),
      Missing("landlock_create_ruleset", 444, ENOSYS, "landlock (5.13)"),
      Missing("memfd_secret", 447, ENOSYS, "memfd_secret (5.14)"),
      Missing("process_mrelease", 448, ENOSYS, "process_mrelease (5.15)"),
  };
}
std::vector<Rule> After515() {
  return {
      Missing("futex_waitv", 449, ENOSYS, "futex_waitv (5.16)"),
      Missing("set_mempolicy_home_node", 450, ENOSYS, "set_mempolicy_home_node (5.17)"),
      Advice(24, "MADV_DONTNEED_LOCKED (5.18)"),
      Advice(25, "MADV_COLLAPSE (6.1)"),
  };
}
std::vector<Rule> After61() {
  return {
      Rule{Rule::kMemfdFlags,
           {"memfd_create", -1},
           0x0008u | 0x0010u,
           EINVAL,
           "MFD_NOEXEC_SEAL, MFD_EXEC (6.3)"},
      Missing("cachestat", 451, ENOSYS, "cachestat (6.5)"),
      Missing("fchmodat2", 452, ENOSYS, "fchmodat2 (6.6)"),
      Missing("map_shadow_stack", 453, ENOSYS, "map_shadow_stack (6.6)"),
      Missing("futex_wake", 454, ENOSYS, "futex_wake (6.7)"),
      Missing("futex_wait", 455, ENOSYS, "futex_wait (6.7)"),
      Missing("futex_requeue", 456, ENOSYS, "futex_requeue (6.7)"),
      Rule{Rule::kIoctl, {"ioctl", -1}, kPagemapScan, ENOTTY, "PAGEMAP_SCAN (6.7)"},
      Missing("statmount", 457, ENOSYS, "statmount (6.8)"),
      Missing("listmount", 458, ENOSYS, "listmount (6.8)"),
      Missing("mseal", 462, ENOSYS, "mseal (6.10)"),
      Advice(26, "MADV_GUARD_INSTALL (6.13)"),
      Advice(27, "MADV_GUARD_REMOVE (6.13)"),
  };
}

std::vector<Rule> Join(std::initializer_list<std::vector<Rule>> parts) {
  std::vector<Rule> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

std::vector<Profile> Profiles() {
  return {
      {"linux-4.18", "RHEL 8", Join({After618(), After515(), After61()})},
      {"linux-5.10", "Amazon Linux 2, Debian 11", Join({After510(), After515(), After61()})},
      {"linux-5.15", "Ubuntu 22.04", Join({After515(), After61()})},
      {"linux-6.1", "Debian 12", After61()},
      {"docker",
       "Docker 25+ / containerd 2 default seccomp profile",
       {Missing("io_uring_setup", 425, EPERM, "io_uring (not in the profile)"),
        Missing("io_uring_enter", 426, EPERM, "io_uring (not in the profile)"),
        Missing("io_uring_register", 427, EPERM, "io_uring (not in the profile)"),
        // Allowed only with CAP_SYS_NICE, which a container does not get by default.
        Missing("mbind", 237, EPERM, "mbind (CAP_SYS_NICE only)"),
        Missing("set_mempolicy", 238, EPERM, "set_mempolicy (CAP_SYS_NICE only)"),
        Missing("get_mempolicy", 239, EPERM, "get_mempolicy (CAP_SYS_NICE only)")}},
      {"podman",
       "Podman's default seccomp profile",
       {Missing("io_uring_setup", 425, ENOSYS, "io_uring (not in the profile)"),
        Missing("io_uring_enter", 426, ENOSYS, "io_uring (not in the profile)"),
        Missing("io_uring_register", 427, ENOSYS, "io_uring (not in the profile)"),
        // Allowed only with CAP_SYS_NICE; the profile's default answer otherwise.
        Missing("mbind", 237, ENOSYS, "mbind (CAP_SYS_NICE only)"),
        Missing("set_mempolicy", 238, ENOSYS, "set_mempolicy (CAP_SYS_NICE only)"),
        Missing("get_mempolicy", 239, ENOSYS, "get_mempolicy (CAP_SYS_NICE only)")}},
  };
}

int Resolve(const Syscall& call) {
  int nr = seccomp_syscall_resolve_name(call.name);
  if (nr == __NR_SCMP_ERROR && call.number >= 0) nr = call.number;
  return nr;
}

int Install(const Profile& p) {
  scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ALLOW);
  if (ctx == nullptr) {
    std::fprintf(stderr, "ea-kernel-profile: seccomp_init failed\n");
    return -1;
  }
  for (const Rule& r : p.rules) {
    const int nr = Resolve(r.call);
    if (nr == __NR_SCMP_ERROR) {
      std::fprintf(stderr, "ea-kernel-profile: no syscall number for %s\n", r.call.name);
      seccomp_release(ctx);
      return -1;
    }
    int rc = 0;
    const uint32_t action = SCMP_ACT_ERRNO(static_cast<uint32_t>(r.error));
    switch (r.kind) {
      case Rule::kSyscall:
        rc = seccomp_rule_add(ctx, action, nr, 0);
        break;
      case Rule::kMadvise:  // int advice: compare the low 32 bits only
        rc =
            seccomp_rule_add(ctx, action, nr, 1, SCMP_A2(SCMP_CMP_MASKED_EQ, 0xffffffffu, r.value));
        break;
      case Rule::kIoctl:  // unsigned int request
        rc =
            seccomp_rule_add(ctx, action, nr, 1, SCMP_A1(SCMP_CMP_MASKED_EQ, 0xffffffffu, r.value));
        break;
      case Rule::kMemfdFlags:  // any of the flag bits set
        for (uint64_t bit = 1; bit <= r.value && rc == 0; bit <<= 1) {
          if ((r.value & bit) == 0) continue;
          rc = seccomp_rule_add(ctx, action, nr, 1, SCMP_A1(SCMP_CMP_MASKED_EQ, bit, bit));
        }
        break;
    }
    if (rc != 0) {
      std::fprintf(stderr, "ea-kernel-profile: rule for %s: %s\n", r.what, std::strerror(-rc));
      seccomp_release(ctx);
      return -1;
    }
  }
  const int rc = seccomp_load(ctx);
  seccomp_release(ctx);
  if (rc != 0) {
    std::fprintf(stderr, "ea-kernel-profile: seccomp_load: %s\n", std::strerror(-rc));
    return -1;
  }
  return 0;
}

void Usage(FILE* out) {
  std::fprintf(out,
               "usage: ea-kernel-profile --profile NAME -- COMMAND [ARGS...]\n"
               "       ea-kernel-profile --list | --describe NAME\n");
}

const Profile* Find(const std::vector<Profile>& all, const std::string& name) {
  for (const Profile& p : all) {
    if (name == p.name) return &p;
  }
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<Profile> all = Profiles();
  std::string name;
  int command = -1;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--list") {
      for (const Profile& p : all) std::printf("%-11s %s\n", p.name, p.stands_for);
      return 0;
    }
    if ((arg == "--describe" || arg == "--profile") && i + 1 < argc) {
      name = argv[++i];
      if (arg == "--describe") {
        const Profile* p = Find(all, name);
        if (p == nullptr) break;
        std::printf("%s (%s):\n", p->name, p->stands_for);
        for (const Rule& r : p->rules) {
          std::printf("  %-40s -> %s\n", r.what, strerrorname_np(r.error));
        }
        return 0;
      }
      continue;
    }
    if (arg == "--") {
      command = i + 1;
      break;
    }
    if (arg == "-h" || arg == "--help") {
      Usage(stdout);
      return 0;
    }
    Usage(stderr);
    return 2;
  }
  const Profile* p = Find(all, name);
  if (p == nullptr) {
    std::fprintf(stderr, "ea-kernel-profile: unknown profile '%s'; --list names them\n",
                 name.c_str());
    return 2;
  }
  if (command < 0 || command >= argc) {
    Usage(stderr);
    return 2;
  }
  ::setenv("EXPERT_ARENA_KERNEL_PROFILE", p->name, 1);
  if (Install(*p) != 0) return 1;
  ::execvp(argv[command], argv + command);
  std::fprintf(stderr, "ea-kernel-profile: exec %s: %s\n", argv[command], std::strerror(errno));
  return 127;
}
