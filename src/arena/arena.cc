#include "expert_arena/arena.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "arena/arena_impl.h"
#include "arena/numa_placement.h"
#include "arena/peer_fill.h"
#include "common/escape.h"
#include "common/fault_points.h"
#include "common/logging.h"
#include "common/units.h"
#include "expert_arena/gpu.h"
#include "gpu/runtime.h"
#include "platform/kernel_features.h"
#include "platform/numa.h"
#include "platform/page_scan.h"
#include "platform/process_memory.h"
#include "platform/system_info.h"
#include "source/model_fingerprint.h"

namespace expert_arena {

const char* ArenaRoleName(ArenaRole role) {
  switch (role) {
    case ArenaRole::kLoaded:
      return "loaded";
    case ArenaRole::kAttached:
      return "attached";
    case ArenaRole::kPrivate:
      return "private";
  }
  return "unknown";
}

const char* ModelFormatName(ModelFormat format) {
  switch (format) {
    case ModelFormat::kAuto:
      return "auto";
    case ModelFormat::kGguf:
      return "gguf";
    case ModelFormat::kSafetensors:
      return "safetensors";
    case ModelFormat::kRaw:
      return "raw";
  }
  return "unknown";
}

const char* ModelReaderName(ModelReader reader) {
  switch (reader) {
    case ModelReader::kAuto:
      return "auto";
    case ModelReader::kIoUring:
      return "io_uring";
    case ModelReader::kPread:
      return "pread";
  }
  return "unknown";
}

Result<ModelReader> ParseModelReader(std::string_view text) {
  for (ModelReader r : {ModelReader::kAuto, ModelReader::kIoUring, ModelReader::kPread}) {
    if (text == ModelReaderName(r)) return r;
  }
  return InvalidArgument("reader must be auto, io_uring or pread, not " + QuoteForMessage(text));
}

const char* PeerTransportName(PeerTransport transport) {
  switch (transport) {
    case PeerTransport::kAuto:
      return "auto";
    case PeerTransport::kAm:
      return "am";
    case PeerTransport::kGet:
      return "get";
  }
  return "unknown";
}

Result<PeerTransport> ParsePeerTransport(std::string_view text) {
  for (PeerTransport t : {PeerTransport::kAuto, PeerTransport::kAm, PeerTransport::kGet}) {
    if (text == PeerTransportName(t)) return t;
  }
  return InvalidArgument("peer_transport must be auto, am or get, not " + QuoteForMessage(text));
}

std::string ArenaReport::StartLine() const {
  // Sizes and times in the unit that shows them (MiB and ms for a small arena, never "0.00
  // GiB in 0.00 s").
  const std::string size = FormatBytes(tensor_bytes);
  // The arena's path may hold any byte (Linux paths are not text): escaped for the log.
  const std::string path = EscapeForDisplay(this->path);
  const std::string from_peer = EscapeForDisplay(this->from_peer);
  char buf[512];
  std::string line = "expert-arena: ";
  switch (role) {
    case ArenaRole::kLoaded:
      if (!from_peer.empty()) {
        std::snprintf(buf, sizeof buf,
                      "filled %s (%s) from peer %s: %llu tensors, %s in %s (%s, ucx), checksums "
                      "verified, %llu model bytes read",
                      path.c_str(), backing.c_str(), from_peer.c_str(),
                      static_cast<unsigned long long>(tensors), size.c_str(),
                      FormatDuration(seconds).c_str(),
                      FormatRate(tensor_bytes, load_seconds).c_str(),
                      static_cast<unsigned long long>(bytes_read));
        line += buf;
        break;
      }
      [[fallthrough]];
    case ArenaRole::kPrivate: {
      std::snprintf(
          buf, sizeof buf, "%s %s (%s): %llu of %llu tensors, %s in %s (%s, %s)",
          role == ArenaRole::kLoaded ? "loaded" : "private arena,",
          role == ArenaRole::kLoaded ? path.c_str() : "loaded", backing.c_str(),
          static_cast<unsigned long long>(tensors), static_cast<unsigned long long>(model_tensors),
          size.c_str(), FormatDuration(seconds).c_str(),
          FormatRate(tensor_bytes, load_seconds).c_str(),
          (reader_note.empty() ? reader : reader + " (" + reader_note + ")").c_str());
      line += buf;
      break;
    }
    case ArenaRole::kAttached:
      std::snprintf(buf, sizeof buf,
                    "attached %s (%s) loaded by another engine: %llu tensors, %s in %s%s, %llu "
                    "model bytes read",
                    path.c_str(), backing.c_str(), static_cast<unsigned long long>(tensors),
                    size.c_str(), FormatDuration(seconds).c_str(),
                    wait_seconds > 0 ? (" (waited " + FormatDuration(wait_seconds) + ")").c_str()
                                     : "",
                    static_cast<unsigned long long>(bytes_read));
      line += buf;
      break;
  }
  const uint64_t page = page_bytes != 0 ? page_bytes : kHugePageBytes;
  line += "; " + FormatBytes(huge_bytes) + " of " + FormatBytes(mapped_bytes) + " on " +
          FormatPageSize(page) + " pages";
  if (!huge_note.empty()) line += " (" + huge_note + ")";
  // hugetlbfs sizes a file in whole pages: a small arena on 1 GiB pages pays for a whole one.
  if (page > kHugePageBytes && mapped_bytes >= page && 2 * data_bytes < mapped_bytes) {
    line += "; a " + FormatBytes(data_bytes) + " arena takes " + FormatBytes(mapped_bytes) +
            ": hugetlbfs sizes files in whole " + FormatPageSize(page) + " pages";
  }
  line += "; gpu: " + (gpu_note.empty() ? std::string("none") : gpu_note);
  if (!peer_note.empty()) line += "; " + peer_note;
  if (!kernel_note.empty()) line += "; " + kernel_note;
  line += arena::NumaStartLinePart(*this);
  if (!charge_note.empty()) line += "; memory: " + charge_note;
  return line;
}

void Arena::Impl::IndexNames() {
  by_name.clear();
  if (view) return;  // the view finds names through the arena's own index
  by_name.reserve(table.tensors.size());
  for (size_t i = 0; i < table.tensors.size(); ++i) by_name.emplace(table.tensors[i].name, i);
}

namespace arena {

Status ModelWant::MakePlan() {
  if (filler == nullptr) return Internal("an arena wanted without a filler cannot be planned");
  fault_points::PlanMade();
  EA_ASSIGN_OR_RETURN(source::ModelPlan made, filler->Plan());
  plan = std::move(made);
  return Status::Ok();
}

void MeasureBacking(Arena::Impl& impl) {
  auto huge = platform::HugeBytesInRange(impl.mapping.data(), impl.mapping.size());
  impl.report.mapped_bytes = impl.mapping.size();
  if (huge.ok()) impl.report.huge_bytes = std::min(*huge, impl.mapping.size());
  arena::MeasureNuma(impl.mapping.data(), impl.report);
  // VmPin matters only once something was registered with a GPU.
  if (impl.report.gpu_registered_bytes > 0) {
    auto pinned = platform::PinnedBytes();
    if (pinned.ok()) impl.report.pinned_bytes = *pinned;
  }
}

bool MapWritableForGpu(const ArenaOptions& options) {
  return options.gpu.backend != GpuBackend::kNone;
}

Status RegisterWithGpu(Arena::Impl& impl, const ArenaOptions& options, spdlog::logger& log) {
  gpu::RegisterOptions gpu_options;
  gpu_options.device = options.gpu;
  gpu_options.pin_budget_bytes = options.pin_budget_bytes;
  gpu_options.read_only = !impl.mapping.writable();
  gpu_options.logger = options.logger;
  // The data only: a device reads tensors, and the header of a shared arena is mapped
  // read-only (ProtectHeader), which a registration with write intent could not pin.
  auto registration =
      gpu::RegisterHostRange(impl.mapping.bytes().subspan(impl.data_offset), gpu_options);
  if (!registration.ok()) {
    if (options.gpu_required) return registration.status();
    impl.report.gpu_note = "not registered: " + registration.status().message();
    log.warn("expert-arena: GPU registration skipped: {}", registration.status().message());
    return Status::Ok();
  }
  impl.registration = std::move(*registration);
  const gpu::RegistrationReport& r = impl.registration->report();
  impl.report.gpu_note = r.backend == "none" ? "none" : r.note;
  impl.report.gpu_registered_bytes = r.registered_bytes;
  impl.report.gpu_seconds = r.seconds;
  // No device, no driver, a read-only mapping the device cannot register, or the pin budget
  // used up: skipped and reported, unless the engine said it cannot work without it.
  if (options.gpu_required && r.backend != "none" && r.registered_bytes == 0) {
    return Unsupported("GPU registration required but not done: " + r.note);
  }
  return Status::Ok();
}

}  // namespace arena

namespace {

// Before any load: --numa replicate becomes this engine's replica (its path and node:N), and a
// NUMA placement this host cannot give (a node that is not there or not in the process's
// cpuset) is refused now, whether or not this engine turns out to load. `*how`: which replica.
Result<ArenaOptions> ResolveNumaOptions(const ArenaOptions& options, std::string* how) {
  int gpu_node = -1;
  if (options.numa == NumaPlacement::kReplicate) gpu_node = gpu::NumaNodeOfDevice(options.gpu);
  const int cpu_node =
      options.numa == NumaPlacement::kReplicate ? platform::NodeOfCurrentCpus() : -1;
  EA_ASSIGN_OR_RETURN(ArenaOptions resolved,
                      arena::ResolveReplica(options, gpu_node, cpu_node,
                                            platform::AllowedMemoryNodes(), how));
  EA_RETURN_IF_ERROR(arena::ResolvePlacement(resolved).status());
  return resolved;
}

// The report's placement: "replicate (replica of node 1, ...)" where it was resolved.
void NoteReplica(ArenaReport& r, const ArenaOptions& asked, const std::string& how) {
  if (asked.numa == NumaPlacement::kReplicate && !how.empty()) r.numa = "replicate (" + how + ")";
}

// Before any load, whatever the role turns out to be: an option that cannot be right is a
// usage error now (an attaching engine would otherwise never see it), and a GPU the engine
// requires but this build or machine cannot give fails now rather than after a long load.
Status CheckOptions(const ArenaOptions& options) {
  // Enums an engine may have cast from anything: a value outside the set is refused by name.
  if (std::string_view(ModelReaderName(options.reader)) == "unknown") {
    return InvalidArgument("reader " + std::to_string(static_cast<int>(options.reader)) +
                           " is not a ModelReader");
  }
  if (std::string_view(PeerTransportName(options.peer_transport)) == "unknown") {
    return InvalidArgument("peer_transport " +
                           std::to_string(static_cast<int>(options.peer_transport)) +
                           " is not a PeerTransport");
  }
  if (!(options.wait_timeout_seconds >= 0)) {
    return InvalidArgument("wait_timeout_seconds must be >= 0, not " +
                           std::to_string(options.wait_timeout_seconds));
  }
  if ((options.file_mode & ~static_cast<mode_t>(0666)) != 0) {
    char mode[16];
    std::snprintf(mode, sizeof mode, "0%o", static_cast<unsigned>(options.file_mode));
    return InvalidArgument(std::string("file_mode ") + mode +
                           " has bits outside 0666 (setuid, setgid, sticky or execute): an "
                           "arena file holds data, never a program; give 0600, 0640 or 0660");
  }
  if ((options.file_mode & 0002) != 0 && !options.allow_world_writable) {
    char mode[16];
    std::snprintf(mode, sizeof mode, "0%o", static_cast<unsigned>(options.file_mode));
    return InvalidArgument(std::string("file_mode ") + mode +
                           " lets every user write the arena, and so change the bytes every "
                           "engine reads; share it with a group (0660) instead, or ask for it "
                           "by name (allow_world_writable, --allow-world-writable)");
  }
  if (!(options.peer_stall_seconds > 0)) {
    return InvalidArgument("peer_stall_seconds must be > 0, not " +
                           std::to_string(options.peer_stall_seconds));
  }
  EA_ASSIGN_OR_RETURN(GpuDevice device, ParseGpuDevice(options.gpu.ToString()));
  if (options.gpu_required && device.backend != GpuBackend::kNone) {
    std::string why = gpu::WhyDeviceUnusable(device);
    if (!why.empty()) return Unsupported("GPU registration required but not done: " + why);
  }
  return Status::Ok();
}

// What the kernel lacked while the arena was opened (since `ledger`), for the report.
void ReportKernel(ArenaReport& r, const platform::FallbackLedger& ledger) {
  r.kernel_release = platform::Kernel().release;
  const std::vector<platform::MissingFeature> missing = platform::MissingFeatures(ledger);
  r.kernel_missing.clear();
  for (const platform::MissingFeature& m : missing) {
    r.kernel_missing.push_back(KernelFallbackReport{
        m.name, m.since, m.answer, m.fallback, m.cost.calls > 0, m.cost.seconds, m.cost.bytes});
  }
  r.kernel_note = platform::KernelNote(missing);
}

Result<Arena> Finish(std::unique_ptr<Arena::Impl> impl, const ArenaOptions& options,
                     spdlog::logger& log, std::chrono::steady_clock::time_point start,
                     const platform::FallbackLedger& ledger) {
  EA_RETURN_IF_ERROR(arena::RegisterWithGpu(*impl, options, log));
  impl->IndexNames();
  ArenaReport& r = impl->report;
  r.path = options.shared_path;
  r.identity = impl->table.identity_text;
  r.identity_hash = impl->table.identity_hash;
  r.data_bytes = impl->table.data_bytes;
  r.tensor_bytes = 0;
  if (impl->view) {
    r.tensors = impl->view->tensor_count();
    for (size_t i = 0; i < r.tensors; ++i) r.tensor_bytes += impl->view->entry(i).bytes;
  } else {
    r.tensors = impl->table.tensors.size();
    for (const auto& t : impl->table.tensors) r.tensor_bytes += t.bytes;
  }
  r.model_tensors = std::max<uint64_t>(impl->table.model_tensors_total, r.tensors);
  r.model_tensor_bytes = std::max(impl->table.model_bytes_total, r.tensor_bytes);
  arena::MeasureBacking(*impl);
  ReportKernel(r, ledger);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  log.info("{}", r.StartLine());
  // An arena meant for 2 MiB pages that got 4 KiB ones (fragmented memory at load, or a tmpfs
  // without huge pages) costs every engine TLB misses and a GPU registration of 512 times the
  // entries: a warning, not only a part of the start line (and a metric: `expert-arena
  // metrics`' expert_arena_arena_page_size_bytes).
  // (hugetlbfs pages are huge by construction.)
  if (options.huge != HugePages::kOff && r.backing == "tmpfs" && impl->late_collapse == nullptr &&
      2 * r.huge_bytes < r.mapped_bytes) {
    log.warn("expert-arena: {} fell back to 4 KiB pages: {} of {} on 2 MiB pages{}; see "
             "docs/page-backing.md to get 2 MiB pages (free memory, a hugetlbfs mount)",
             r.path, FormatBytes(r.huge_bytes), FormatBytes(r.mapped_bytes),
             r.huge_note.empty() ? "" : " (" + r.huge_note + ")");
  }
  return Arena::Impl::Make(std::move(impl));
}

}  // namespace

Result<Arena> Arena::Open(const ModelSpec& model, const ArenaOptions& options_in) {
  auto start = std::chrono::steady_clock::now();
  const platform::FallbackLedger ledger = platform::ReadFallbackLedger();
  auto logger = ResolveLogger(options_in.logger);
  EA_RETURN_IF_ERROR(CheckOptions(options_in));
  std::string replica;
  EA_ASSIGN_OR_RETURN(const ArenaOptions placed, ResolveNumaOptions(options_in, &replica));
  const ArenaOptions& options = placed;
  if (options.shared_path.empty()) {
    EA_ASSIGN_OR_RETURN(source::ModelPlan plan, source::PlanModel(model));
    EA_ASSIGN_OR_RETURN(auto impl, arena::OpenPrivate(std::move(plan), options, *logger));
    return Finish(std::move(impl), options, *logger, start, ledger);
  }
  std::string peer_note;
  if (!options.from_peer.empty()) {
    auto filled = arena::FillFromPeer(model, options, *logger);
    if (filled.ok()) return Finish(std::move(*filled), options, *logger, start, ledger);
    if (model.files.empty()) {
      return Status(filled.status().code(),
                    "fill of " + options.shared_path + " from peer " + options.from_peer +
                        " failed, nothing published: " + filled.status().message());
    }
    peer_note = "fill from peer " + options.from_peer + " failed (" + filled.status().message() +
                "); read the model files instead";
    logger->warn("expert-arena: {}", peer_note);
  }
  // A model with a fingerprint is planned only when no published arena holds it.
  arena::ModelFilesFiller files(model);
  arena::ModelWant want{.spec = &model, .filler = &files};
  EA_ASSIGN_OR_RETURN(bool fingerprinted, source::HasFingerprint(model));
  if (!fingerprinted) EA_RETURN_IF_ERROR(want.MakePlan());
  EA_ASSIGN_OR_RETURN(auto impl, arena::OpenShared(&want, options, *logger));
  if (impl->report.role == ArenaRole::kAttached) {
    impl->report.bytes_read =
        want.plan ? want.plan->metadata_bytes_read : want.fingerprint_bytes_read;
  }
  impl->report.peer_note = std::move(peer_note);
  NoteReplica(impl->report, options_in, replica);
  return Finish(std::move(impl), options, *logger, start, ledger);
}

Result<Arena> Arena::AttachExisting(const std::string& path, const ArenaOptions& options) {
  auto start = std::chrono::steady_clock::now();
  const platform::FallbackLedger ledger = platform::ReadFallbackLedger();
  auto logger = ResolveLogger(options.logger);
  EA_RETURN_IF_ERROR(CheckOptions(options));
  ArenaOptions attach = options;
  attach.shared_path = path;
  EA_ASSIGN_OR_RETURN(auto impl, arena::OpenShared(nullptr, attach, *logger));
  return Finish(std::move(impl), attach, *logger, start, ledger);
}

Result<Arena> Arena::OpenEngine(const EngineArenaSpec& spec, const ArenaOptions& options_in) {
  auto start = std::chrono::steady_clock::now();
  const platform::FallbackLedger ledger = platform::ReadFallbackLedger();
  auto logger = ResolveLogger(options_in.logger);
  EA_RETURN_IF_ERROR(CheckOptions(options_in));
  std::string replica;
  EA_ASSIGN_OR_RETURN(const ArenaOptions placed, ResolveNumaOptions(options_in, &replica));
  const ArenaOptions& options = placed;
  if (options.shared_path.empty()) {
    return InvalidArgument(
        "an engine-made arena needs a shared path (a file on tmpfs or hugetlbfs): a private "
        "one would be a copy of the engine's own tensors");
  }
  if (!spec.declare || !spec.fill) {
    return InvalidArgument("an engine-made arena needs both declare and fill");
  }
  if (!options.from_peer.empty()) {
    return InvalidArgument("an engine-made arena is filled by its engine, not from a peer (" +
                           options.from_peer + ")");
  }
  EA_ASSIGN_OR_RETURN(arena::EngineIdentity id, arena::IdentifyEngineArena(spec));
  arena::EngineFiller engine(spec, id);
  arena::ModelWant want{.engine_identity = id.hash, .filler = &engine};
  if (spec.confirm_after_run) want.deferred.emplace();
  // The engine writes where it pleases: every page first (no pages made alongside).
  ArenaOptions engine_options = options;
  engine_options.pages_alongside_load = false;
  EA_ASSIGN_OR_RETURN(auto impl, arena::OpenShared(&want, engine_options, *logger));
  impl->report.bytes_read = id.bytes_read;
  impl->report.reader = impl->report.role == ArenaRole::kLoaded ? "engine" : "";
  NoteReplica(impl->report, options_in, replica);
  return Finish(std::move(impl), options, *logger, start, ledger);
}

Arena Arena::Impl::Make(std::unique_ptr<Impl> impl) { return Arena(std::move(impl)); }

Arena::Arena(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Arena::Arena(Arena&& other) noexcept = default;
Arena& Arena::operator=(Arena&& other) noexcept = default;
Arena::~Arena() = default;

ArenaRole Arena::role() const { return impl_->report.role; }

bool Arena::awaiting_confirm() const { return impl_->awaiting_confirm; }

Status Arena::Confirm() {
  return arena::ConfirmBuild(*impl_).WithContext("publishing " + impl_->report.path);
}

Status Arena::Abandon(std::string_view reason) {
  return arena::AbandonBuild(*impl_, reason).WithContext("recording the failed build of " +
                                                         impl_->report.path);
}
const ArenaReport& Arena::report() const { return impl_->report; }
size_t Arena::tensor_count() const {
  return impl_->view ? impl_->view->tensor_count() : impl_->table.tensors.size();
}

TensorView Arena::tensor(size_t index) const {
  if (impl_->view) {
    const format::TableView& table = *impl_->view;
    if (index >= table.tensor_count()) return TensorView();
    format::TensorEntry entry = table.entry(index);
    std::span<const std::byte> data = impl_->data();
    TensorView view;
    view.name = table.name(index);
    view.dtype = table.dtype(index);
    view.shape = table.shape(index);
    // Checked on open; checked again, so a header changed under the mapping cannot reach
    // outside it.
    if (entry.arena_offset <= data.size() && entry.bytes <= data.size() - entry.arena_offset) {
      view.bytes = data.subspan(entry.arena_offset, entry.bytes);
    }
    view.file_offset = impl_->data_offset + entry.arena_offset;
    view.checksum = entry.checksum;
    return view;
  }
  if (index >= impl_->table.tensors.size()) return TensorView();
  const format::TensorRecord& t = impl_->table.tensors[index];
  TensorView view;
  view.name = t.name;
  view.dtype = t.dtype;
  view.shape = t.shape;
  view.bytes = impl_->data().subspan(t.arena_offset, t.bytes);
  view.file_offset = impl_->fd.valid() ? impl_->data_offset + t.arena_offset : 0;
  view.checksum = t.checksum;
  return view;
}

std::optional<TensorView> Arena::Find(std::string_view name) const {
  if (impl_->view) {
    auto index = impl_->view->Find(name);
    if (!index) return std::nullopt;
    return tensor(*index);
  }
  auto it = impl_->by_name.find(name);
  if (it == impl_->by_name.end()) return std::nullopt;
  return tensor(it->second);
}

std::span<const std::byte> Arena::data() const { return impl_->data(); }

Result<std::span<std::byte>> Arena::CopyOnWriteData() const {
  Impl& impl = *impl_;
  std::lock_guard<std::mutex> lock(impl.copy_on_write_mutex);
  if (impl.fd.get() < 0) {
    // A private arena: anonymous memory of this process only.
    EA_RETURN_IF_ERROR(impl.mapping.MakeWritable());
    return std::span<std::byte>(impl.mapping.data() + impl.data_offset, impl.table.data_bytes);
  }
  if (impl.copy_on_write.data() == nullptr) {
    const bool hugetlbfs = impl.report.backing == "hugetlbfs";
    uint64_t alignment = std::max<uint64_t>(impl.mapping.alignment(), kHugePageBytes);
    EA_ASSIGN_OR_RETURN(
        impl.copy_on_write,
        platform::Mapping::MapFileCopyOnWrite(impl.fd, impl.mapping.size(), alignment, hugetlbfs));
    // While the late collapse makes the 2 MiB pages the views are not populated: that would
    // map every page there on 4 KiB entries (a million for 4 GiB, most of a second on the
    // building engine's start), which the collapse replaces piece by piece (AlsoMapIn) and
    // whose arena-side page tables it drops itself. The first forward maps what it reads.
    const bool pages_being_made = impl.late_collapse && !impl.late_collapse->done();
    if (!pages_being_made &&
        (!impl.registration || impl.registration->report().registered_bytes == 0)) {
      // The views read the arena through the new mapping, populated here as the arena's own
      // was when it opened (the file's pages, uncopied: no fault at the first forward); the
      // arena's own mapping leaves the page tables, or RSS would count every page twice. Its
      // pages stay in the file; a kernel that cannot drop hugetlb ranges (before 5.18) keeps
      // them mapped, which costs nothing but the count.
      Status populated = platform::AdviseRange(impl.copy_on_write.data() + impl.data_offset,
                                               impl.table.data_bytes,
                                               platform::Advice::kPopulateRead, impl.report.path);
      if (populated.ok()) {
        (void)platform::AdviseRange(impl.mapping.data() + impl.data_offset,
                                    impl.table.data_bytes, platform::Advice::kDontNeed,
                                    impl.report.path);
      }
    }
    if (impl.late_collapse) {
      // The 2 MiB pages still being made go under the views as 2 MiB entries too.
      impl.late_collapse->AlsoMapIn(impl.copy_on_write.data() +
                                    (impl.late_collapse->data() - impl.mapping.data()));
    }
    if (impl.registration && impl.registration->report().registered_bytes > 0) {
      // Registered read-only: pinning with write intent would copy every page of a private
      // mapping. Pages a write copied later are not the pinned ones: a device copy then reads
      // the arena's bytes, not the stray write.
      gpu::RegisterOptions options;
      auto device = ParseGpuDevice(impl.registration->report().device);
      if (device.ok()) options.device = *device;
      options.read_only = true;
      auto registration = gpu::RegisterHostRange(impl.copy_on_write.bytes(), options);
      if (registration.ok() && (*registration)->report().registered_bytes > 0) {
        impl.copy_on_write_registration = std::move(*registration);
      } else {
        ResolveLogger(nullptr)->warn(
            "expert-arena: {}: the copy-on-write mapping of the views is not registered "
            "with {} ({}): device copies from them are staged",
            impl.report.path, options.device.ToString(),
            registration.ok() ? (*registration)->report().note : registration.status().message());
      }
    }
  }
  return std::span<std::byte>(impl.copy_on_write.data() + impl.data_offset, impl.table.data_bytes);
}

Result<std::vector<ArenaRange>> Arena::PrivateCopies(bool changed_only, uint64_t offset,
                                                     uint64_t length) const {
  Impl& impl = *impl_;
  std::vector<ArenaRange> out;
  std::span<std::byte> views;
  {
    std::lock_guard<std::mutex> lock(impl.copy_on_write_mutex);
    if (impl.fd.get() < 0 || impl.copy_on_write.data() == nullptr) return out;
    views = {impl.copy_on_write.data() + impl.data_offset, impl.table.data_bytes};
  }
  if (offset >= views.size()) return out;
  length = std::min(length, views.size() - offset);
  EA_ASSIGN_OR_RETURN(std::vector<platform::AddressRange> pages,
                      platform::PrivatePagesIn(views.data() + offset, length));
  const auto base = reinterpret_cast<uintptr_t>(views.data());
  const std::span<const std::byte> shared = impl.data();
  const uint64_t piece = platform::BasePageSize();
  for (const platform::AddressRange& r : pages) {
    const uint64_t from = r.start - base;
    const uint64_t to = r.end - base;
    if (!changed_only) {
      out.push_back({from, to - from});
      continue;
    }
    // Page by page (offsets in the data region are page-aligned: it starts on a 2 MiB
    // boundary), so that a write of one value names its page, not the whole huge page.
    for (uint64_t at = from; at < to;) {
      const uint64_t next = std::min(to, (at / piece + 1) * piece);
      if (std::memcmp(views.data() + at, shared.data() + at, next - at) != 0) {
        if (!out.empty() && out.back().offset + out.back().bytes == at) {
          out.back().bytes += next - at;
        } else {
          out.push_back({at, next - at});
        }
      }
      at = next;
    }
  }
  return out;
}

Result<ArenaMemory> Arena::Memory() const {
  const Impl& impl = *impl_;
  ArenaMemory m;
  auto add = [&m](const platform::Mapping& mapping) -> Status {
    if (mapping.data() == nullptr) return Status::Ok();
    EA_ASSIGN_OR_RETURN(platform::MemoryFigures f,
                        platform::MemoryOfMappingsOverlapping(mapping.data(), mapping.size()));
    m.rss_bytes += f.rss;
    m.pss_bytes += f.pss;
    m.private_bytes += f.anonymous;
    ++m.mappings;
    return Status::Ok();
  };
  EA_RETURN_IF_ERROR(add(impl.mapping));
  {
    std::lock_guard<std::mutex> lock(impl_->copy_on_write_mutex);
    EA_RETURN_IF_ERROR(add(impl.copy_on_write));
  }
  m.shared_bytes = m.pss_bytes - std::min(m.pss_bytes, m.private_bytes);
  return m;
}

}  // namespace expert_arena
