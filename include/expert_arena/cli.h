// --shared-expert-arena for any engine that parses its command line with CLI11: one call
// adds the flag and its companions as an option group, one call turns them into
// ArenaOptions.
//
//   expert_arena::cli::SharedArenaFlags arena_flags;
//   expert_arena::cli::AddSharedArenaOptions(app, arena_flags);
//   CLI11_PARSE(app, argc, argv);
//   expert_arena::ArenaOptions options;
//   arena_flags.ApplyTo(options);      // no --shared-expert-arena: a private arena
//   auto arena = expert_arena::Arena::Open({.files = model_files}, options);
//
// Options added (group "Shared expert arena"):
//   --shared-expert-arena PATH   the arena file on tmpfs or hugetlbfs (absent: private)
//   --arena-wait-timeout SEC     how long to wait for another engine that is loading it
//   --arena-huge auto|on|off     2 MiB pages on tmpfs / anonymous memory
//   --arena-numa PLACEMENT       auto|local|interleave|node:N|replicate (docs/numa.md)
//   --arena-mode MODE            octal mode of a file this engine creates (default 0600)
//   --arena-allow-foreign-owner  attach to a file another user created
//   --gpu none|cuda[:N]|hip[:N]  register the arena with that device
//   --gpu-required               fail when the registration does not happen
//
// Header-only on purpose: CLI11 is a header-only library whose types change between
// releases, so compiling this in the engine (against the engine's own CLI11) keeps
// libexpert_arena.so free of any CLI11 dependency or ABI. Engines that do not use CLI11
// never include this file. Requires CLI11 2.x.
//
// Thread-safety: a SharedArenaFlags is plain data; it must outlive the parse.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <string>

#include "expert_arena/arena.h"

namespace expert_arena::cli {

struct SharedArenaFlags {
  std::string path;
  double wait_timeout_seconds = 600.0;
  std::string huge = "auto";
  std::string numa = "auto";
  std::string mode = "0600";
  bool allow_foreign_owner = false;
  bool allow_world_writable = false;
  std::string gpu = "none";
  bool gpu_required = false;

  bool shared() const { return !path.empty(); }

  // Copies the parsed values into `options` (shared_path empty without the flag). The
  // values were validated by the parser, so this cannot fail.
  void ApplyTo(ArenaOptions& options) const {
    options.shared_path = path;
    options.wait_timeout_seconds = wait_timeout_seconds;
    options.huge = huge == "on"    ? HugePages::kOn
                   : huge == "off" ? HugePages::kOff
                                   : HugePages::kAuto;
    // Validated by the parser; a value set by hand that is not octal keeps the default.
    char* end = nullptr;
    unsigned long parsed = std::strtoul(mode.c_str(), &end, 8);
    options.file_mode = end != nullptr && *end == '\0' && !mode.empty()
                            ? static_cast<mode_t>(parsed)
                            : mode_t{0600};
    // Validated by the parser; a value set by hand that does not parse keeps auto.
    if (!ParseNumaPlacement(numa, &options.numa, &options.numa_node).ok()) {
      options.numa = NumaPlacement::kAuto;
      options.numa_node = -1;
    }
    options.allow_foreign_owner = allow_foreign_owner;
    options.allow_world_writable = allow_world_writable;
    // Validated by the parser; a value set by hand that does not parse keeps none.
    auto device = ParseGpuDevice(gpu);
    options.gpu = device.ok() ? *device : GpuDevice{};
    options.gpu_required = gpu_required;
  }
};

// A CLI11 validator for --gpu: "none", "cuda", "cuda:N", "hip", "hip:N".
inline CLI::Validator GpuDeviceValidator() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        auto device = ParseGpuDevice(value);
        return device.ok() ? std::string() : device.status().message();
      },
      "none|cuda[:N]|hip[:N]", "GpuDevice");
}

// A CLI11 validator for --numa / --arena-numa: auto, local, interleave, node:N, replicate.
inline CLI::Validator NumaPlacementValidator() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        NumaPlacement placement;
        int node = -1;
        Status s = ParseNumaPlacement(value, &placement, &node);
        return s.ok() ? std::string() : s.message();
      },
      "auto|local|interleave|node:N|replicate", "NumaPlacement");
}

// An octal file mode that the owner can read and write, with read and write bits only (0666):
// no setuid, setgid, sticky or execute bit. Write for every user is refused later, unless
// asked for by name (--allow-world-writable, --arena-allow-world-writable).
inline CLI::Validator FileModeValidator() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        if (value.empty() || value.size() > 4 ||
            value.find_first_not_of("01234567") != std::string::npos) {
          return "expected an octal mode such as 0600 or 0660, got '" + value + "'";
        }
        unsigned long mode = std::stoul(value, nullptr, 8);
        if ((mode & 0600) != 0600 || (mode & ~0666ul) != 0) {
          return "mode " + value +
                 " must give the owner read and write, and no setuid, setgid, sticky or "
                 "execute bit (an arena file holds data, never a program)";
        }
        return {};
      },
      "MODE", "FileMode");
}

// Adds the options above to `app` as one option group and returns it (engines may hide it
// or add more). `flags` receives the values during app.parse().
inline CLI::Option_group* AddSharedArenaOptions(
    CLI::App& app, SharedArenaFlags& flags, const std::string& group_name = "Shared expert arena") {
  CLI::Option_group* group = app.add_option_group(
      group_name, "One RAM copy of the expert weights shared by every engine on this host");
  CLI::Option* path =
      group
          ->add_option("--shared-expert-arena", flags.path,
                       "Arena file on tmpfs or hugetlbfs (e.g. /dev/shm/model.arena): load "
                       "the experts into it once, or attach when another engine did; "
                       "without it the engine loads a private copy")
          ->type_name("PATH");
  group
      ->add_option("--arena-wait-timeout", flags.wait_timeout_seconds,
                   "Seconds to wait for another engine that is loading the same arena")
      ->type_name("SECONDS")
      ->check(CLI::NonNegativeNumber)
      ->needs(path);
  group
      ->add_option("--arena-huge", flags.huge,
                   "2 MiB pages on tmpfs: auto (when free blocks allow), on, off")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  group
      ->add_option("--arena-numa", flags.numa,
                   "Where a loader puts the arena's pages on a host with several NUMA nodes: "
                   "auto (interleave where it can), local, interleave, node:N, replicate")
      ->check(NumaPlacementValidator());
  group
      ->add_option("--arena-mode", flags.mode,
                   "Octal mode of an arena file this engine creates (0660: group access)")
      ->check(FileModeValidator())
      ->needs(path);
  group
      ->add_flag("--arena-allow-foreign-owner", flags.allow_foreign_owner,
                 "Attach to an arena file owned by another user")
      ->needs(path);
  group
      ->add_flag("--arena-allow-world-writable", flags.allow_world_writable,
                 "Create (--arena-mode 0666) or attach to an arena file every user may write")
      ->needs(path);
  group->add_option("--gpu", flags.gpu, "Register the arena with this device")
      ->check(GpuDeviceValidator());
  group->add_flag("--gpu-required", flags.gpu_required,
                  "Fail instead of continuing on the CPU when GPU registration fails");
  return group;
}

}  // namespace expert_arena::cli
