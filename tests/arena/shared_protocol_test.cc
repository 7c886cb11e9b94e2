// The steps of the shared-arena protocol one at a time (arena/shared_protocol.h): Classify's
// decision and message for each kind of file it can find, the wait for FILL, attach, replace,
// and LoadFresh with fillers that succeed and fail. The protocol as a whole, across processes,
// is arena_protocol_test.cc.
#include <spdlog/sinks/null_sink.h>
#include <spdlog/spdlog.h>

#include <cstring>
#include <filesystem>

#include "arena/arena_file.h"
#include "arena/arena_locks.h"
#include "arena/shared_protocol.h"
#include "common/fast_xxh3.h"
#include "common/units.h"
#include "format/arena_format.h"
#include "platform/ofd_lock.h"
#include "source/model_source.h"
#include "test_util.h"

namespace expert_arena::testing {
namespace {

using arena::ArenaFile;
using arena::Classify;
using arena::Decision;
using arena::FileFindings;
using arena::FillWait;
using arena::ModelWant;
using arena::Step;

constexpr uint64_t kModelBytes = 4 * kMiB;

std::shared_ptr<spdlog::logger> QuietLogger() {
  return std::make_shared<spdlog::logger>("protocol-test",
                                          std::make_shared<spdlog::sinks::null_sink_mt>());
}

ModelSpec RawSpec(const std::string& path) {
  ModelSpec spec;
  spec.files = {path};
  spec.format = ModelFormat::kRaw;
  return spec;
}

FillWait WaitOf(double seconds) {
  FillWait wait;
  wait.start = arena::ProtocolClock::now();
  wait.deadline = wait.start + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  return wait;
}

// The findings of a header that says `state` (a file of `size` bytes, nothing decoded).
FileFindings HeaderFindings(format::FileState state, uint64_t size = 8 * kMiB) {
  FileFindings found;
  found.size = size;
  found.summary.our_magic = true;
  found.summary.version = format::kFormatVersion;
  found.summary.state = state;
  return found;
}

// Fills every tensor with one byte value and sets the checksums: a filler that is neither the
// loader nor an engine nor a peer, so LoadFresh is seen to take any.
class PatternFiller final : public arena::ArenaFiller {
 public:
  explicit PatternFiller(const ModelSpec& spec, std::byte value, bool fail = false)
      : spec_(spec), value_(value), fail_(fail) {}
  Result<source::ModelPlan> Plan() override { return source::PlanModel(spec_); }
  Result<load::LoadResult> Fill(const load::LoadRequest& request,
                                format::ArenaTable& table) override {
    ++fills;
    if (fail_) {
      // Half written, then a failure: nothing of it may be published.
      std::memset(request.data.data(), static_cast<int>(value_), request.data.size() / 2);
      return Internal("the pattern filler gave up");
    }
    std::memset(request.data.data(), static_cast<int>(value_), request.data.size());
    for (format::TensorRecord& t : table.tensors) {
      t.checksum = FastXxh3(request.data.data() + t.arena_offset, t.bytes);
    }
    load::LoadResult result;
    result.reader = "pattern";
    return result;
  }
  int fills = 0;

 private:
  const ModelSpec& spec_;
  std::byte value_;
  bool fail_;
};

class SharedProtocolTest : public ::testing::Test {
 protected:
  SharedProtocolTest()
      : model_(kModelBytes, 7), other_(kModelBytes, 8), dir_("protocol"), log_(QuietLogger()) {
    options_.shared_path = dir_.File("arena");
  }

  // Publishes the model in options_.shared_path and closes it (the file stays).
  void Publish() {
    ArenaOptions options = options_;
    options.logger = log_;
    auto arena = Arena::Open(RawSpec(model_.path()), options);
    ASSERT_OK(arena);
    ASSERT_EQ(arena->role(), ArenaRole::kLoaded);
  }

  // Opens the file and takes FILL, as the first steps of a round do.
  ArenaFile OpenHeld(bool create = true) {
    auto file = arena::OpenArenaFile(options_, create, false);
    EXPECT_OK(file);
    if (!file.ok()) return ArenaFile();
    FillWait wait = WaitOf(5);
    auto held = arena::WaitForFill(*file, wait, *log_);
    EXPECT_OK(held);
    EXPECT_TRUE(held.ok() && *held);
    return std::move(*file);
  }

  FileFindings Findings(const ArenaFile& file) {
    return arena::ReadFindings(file, *platform::StatFilesystem(dir_.path()), false,
                               options_.shared_path);
  }

  ScopedDataFile model_;
  ScopedDataFile other_;
  ScopedArenaDir dir_;
  std::shared_ptr<spdlog::logger> log_;
  ArenaOptions options_;
};

TEST_F(SharedProtocolTest, ClassifyAttachesAPublishedArenaOfTheModel) {
  Publish();
  ArenaFile file = OpenHeld();
  FileFindings found = Findings(file);
  ASSERT_OK(found.decoded);
  ASSERT_TRUE(found.view.has_value()) << "a published header is read in place";
  ModelSpec spec = RawSpec(model_.path());
  ModelWant want{.spec = &spec};
  ASSERT_OK_AND_ASSIGN(want.plan, source::PlanModel(spec));
  EXPECT_EQ(Classify(&want, found, options_.shared_path).step, Step::kAttach);
  // AttachExisting (no want) attaches whatever is published.
  EXPECT_EQ(Classify(nullptr, found, options_.shared_path).step, Step::kAttach);
  // A model not planned yet attaches only on a fingerprint match; otherwise it plans.
  ModelWant unplanned{.spec = &spec};
  EXPECT_EQ(Classify(&unplanned, found, options_.shared_path).step, Step::kPlanUnlocked);
  found.fingerprint_matches = true;
  EXPECT_EQ(Classify(&unplanned, found, options_.shared_path).step, Step::kAttach);
}

TEST_F(SharedProtocolTest, ClassifyReplacesAnotherModelAndAnotherSize) {
  Publish();
  ArenaFile file = OpenHeld();
  FileFindings found = Findings(file);
  ModelSpec spec = RawSpec(other_.path());
  ModelWant want{.spec = &spec};
  ASSERT_OK_AND_ASSIGN(want.plan, source::PlanModel(spec));
  Decision d = Classify(&want, found, options_.shared_path);
  EXPECT_EQ(d.step, Step::kReplace);
  EXPECT_TRUE(d.held.starts_with("another model (")) << d.held;
  EXPECT_NE(d.busy.find(options_.shared_path + " holds another model ("), std::string::npos)
      << d.busy;
  EXPECT_NE(d.busy.find("is in use by another engine; this engine wants " +
                        want.plan->table.identity_text),
            std::string::npos)
      << d.busy;

  // The same identity laid out at another size.
  ModelSpec same = RawSpec(model_.path());
  ASSERT_OK_AND_ASSIGN(want.plan, source::PlanModel(same));
  want.plan->table.data_bytes += kHugePageBytes;
  d = Classify(&want, found, options_.shared_path);
  EXPECT_EQ(d.step, Step::kReplace);
  EXPECT_EQ(d.held, "an arena of another size (" + FormatBytes(found.summary.layout.data_bytes) +
                        ")");
}

TEST_F(SharedProtocolTest, ClassifyAnUnfinishedLoadAndAFileOfAnotherKind) {
  ModelSpec spec = RawSpec(model_.path());
  ModelWant want{.spec = &spec};
  ASSERT_OK_AND_ASSIGN(want.plan, source::PlanModel(spec));
  const std::string path = options_.shared_path;

  FileFindings partial = HeaderFindings(format::FileState::kLoading);
  Decision d = Classify(&want, partial, path);
  EXPECT_EQ(d.step, Step::kReplace);
  EXPECT_EQ(d.held, "an unfinished load");
  d = Classify(nullptr, partial, path);
  EXPECT_EQ(d.step, Step::kRefuse);
  EXPECT_EQ(d.refusal.code(), StatusCode::kCorrupt);
  EXPECT_EQ(d.refusal.message(), path + ": cannot attach: it holds an unfinished load");

  FileFindings foreign;
  foreign.size = 4096;
  d = Classify(&want, foreign, path);
  EXPECT_EQ(d.step, Step::kReplace);
  EXPECT_EQ(d.held, "a file that is not an expert-arena file");

  FileFindings old = HeaderFindings(format::FileState::kPublished);
  old.summary.version = format::kFormatVersion - 1;
  EXPECT_EQ(Classify(&want, old, path).held,
            "an arena of format version " + std::to_string(format::kFormatVersion - 1));

  FileFindings damaged = HeaderFindings(format::FileState::kPublished);
  damaged.decoded = Corrupt("bad table");
  EXPECT_EQ(Classify(&want, damaged, path).held, "a damaged arena (bad table)");
}

TEST_F(SharedProtocolTest, ClassifyAnEmptyFile) {
  ModelSpec spec = RawSpec(model_.path());
  ModelWant want{.spec = &spec};
  ASSERT_OK_AND_ASSIGN(want.plan, source::PlanModel(spec));
  const std::string path = options_.shared_path;
  FileFindings empty;
  EXPECT_EQ(Classify(&want, empty, path).step, Step::kLoad);
  Decision d = Classify(nullptr, empty, path);
  EXPECT_EQ(d.step, Step::kRefuse);
  EXPECT_EQ(d.refusal.code(), StatusCode::kNotFound);
  EXPECT_EQ(d.refusal.message(), path + ": empty file, no arena was loaded into it");

  // An engine that may only read the file: a moment for its creator, then a refusal.
  empty.read_only = true;
  empty.creator_grace = true;
  EXPECT_EQ(Classify(&want, empty, path).step, Step::kWaitForCreator);
  empty.creator_grace = false;
  d = Classify(&want, empty, path);
  EXPECT_EQ(d.step, Step::kRefuse);
  EXPECT_EQ(d.refusal.code(), StatusCode::kPermission);
  EXPECT_TRUE(d.refusal.message().starts_with(path + " holds no arena yet, and this user may "
                                                     "only read it ("))
      << d.refusal.message();
  EXPECT_NE(d.refusal.message().find("so this engine cannot load or replace it"),
            std::string::npos);
}

TEST_F(SharedProtocolTest, ClassifyForAnEngineMadeArena) {
  const std::string path = options_.shared_path;
  ModelWant want{.engine_identity = 42};
  FileFindings empty;
  EXPECT_EQ(Classify(&want, empty, path).step, Step::kPlanHere)
      << "an engine-made arena is planned by the engine holding FILL on an empty file";

  FileFindings theirs = HeaderFindings(format::FileState::kPublished);
  theirs.summary.identity_hash = 43;
  theirs.summary.identity_text = "engine \"other\"";
  Decision d = Classify(&want, theirs, path);
  EXPECT_EQ(d.step, Step::kReplace);
  EXPECT_EQ(d.held, "another engine's arena (engine \"other\")");
  EXPECT_EQ(d.busy, path + " holds another engine's arena (engine \"other\") and is in use by "
                           "another engine; this engine builds another. Stop the engines that "
                           "use it, or give this one another arena path");

  theirs.summary.identity_hash = 42;
  EXPECT_EQ(Classify(&want, theirs, path).step, Step::kAttach);

  empty.read_only = true;
  d = Classify(&want, empty, path);
  EXPECT_EQ(d.step, Step::kRefuse);
  EXPECT_EQ(d.refusal.code(), StatusCode::kPermission);
  EXPECT_NE(d.refusal.message().find("so this engine cannot build or replace it"),
            std::string::npos)
      << d.refusal.message();
}

TEST_F(SharedProtocolTest, WaitForFillTimesOutNamingNoLoader) {
  // OFD locks belong to the open file description: two opens in one process contend.
  ArenaFile first = OpenHeld();
  auto second = arena::OpenArenaFile(options_, true, false);
  ASSERT_OK(second);
  FillWait wait = WaitOf(0.1);
  auto held = arena::WaitForFill(*second, wait, *log_);
  ASSERT_FALSE(held.ok());
  EXPECT_EQ(held.status().code(), StatusCode::kTimedOut);
  EXPECT_NE(held.status().message().find(" s for another engine (pid unknown) loading " +
                                         options_.shared_path +
                                         "; raise the wait timeout or check that process"),
            std::string::npos)
      << held.status().message();
  EXPECT_TRUE(wait.said_waiting);
}

TEST_F(SharedProtocolTest, OpenArenaFileSaysAbsentOnlyWhenAsked) {
  auto absent = arena::OpenArenaFile(options_, false, true);
  ASSERT_OK(absent);
  EXPECT_TRUE(absent->absent);
  auto refused = arena::OpenArenaFile(options_, false, false);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(dir_.entries().empty());
}

TEST_F(SharedProtocolTest, AttachTakesUserSharedAndLetsFillGo) {
  Publish();
  ArenaFile file = OpenHeld();
  FileFindings found = Findings(file);
  platform::FilesystemInfo fs = *platform::StatFilesystem(dir_.path());
  FillWait wait = WaitOf(5);
  ASSERT_OK_AND_ASSIGN(auto impl, arena::Attach(std::move(file), std::move(found), fs, false,
                                                HugePages::kOff, wait, options_.shared_path));
  EXPECT_EQ(impl->report.role, ArenaRole::kAttached);
  EXPECT_EQ(impl->report.wait_seconds, 0.0);
  ASSERT_OK_AND_ASSIGN(arena::ArenaFileInfo info, arena::InspectArenaFile(options_.shared_path,
                                                                           false));
  EXPECT_TRUE(info.in_use);
  EXPECT_FALSE(info.loading_now);
  // While it is mapped, a replace is refused with the decision's message.
  ArenaFile again = OpenHeld();
  Status busy = arena::TakeUserExclusive(again, "the busy message");
  EXPECT_EQ(busy.code(), StatusCode::kBusy);
  EXPECT_EQ(busy.message(), "the busy message");
  impl.reset();
  ASSERT_OK(arena::TakeUserExclusive(again, "the busy message"));
  ASSERT_OK(arena::Replace(options_.shared_path, "another model", *log_));
  EXPECT_TRUE(dir_.entries().empty()) << "replaced: unlinked, the next round creates it anew";
}

TEST_F(SharedProtocolTest, LoadFreshPublishesWhatAnyFillerWrote) {
  ModelSpec spec = RawSpec(model_.path());
  PatternFiller filler(spec, std::byte{0x5a});
  ASSERT_OK_AND_ASSIGN(source::ModelPlan plan, filler.Plan());
  ArenaFile file = OpenHeld();
  ASSERT_OK(arena::TakeUserExclusive(file, "busy"));
  platform::FilesystemInfo fs = *platform::StatFilesystem(dir_.path());
  FillWait wait = WaitOf(5);
  ArenaOptions options = options_;
  options.pages_alongside_load = false;
  ASSERT_OK_AND_ASSIGN(auto impl,
                       arena::LoadFresh(std::move(file), plan, filler, options, fs, wait, *log_));
  EXPECT_EQ(filler.fills, 1);
  EXPECT_EQ(impl->report.role, ArenaRole::kLoaded);
  EXPECT_EQ(impl->report.reader, "pattern");
  impl.reset();
  ASSERT_OK_AND_ASSIGN(arena::ArenaFileInfo info,
                       arena::InspectArenaFile(options_.shared_path, false));
  EXPECT_EQ(info.state, "published");
  format::ArenaTable table;
  ASSERT_OK_AND_ASSIGN(int64_t bad, arena::VerifyArenaFile(options_.shared_path, &table));
  EXPECT_EQ(bad, -1) << "the checksums the filler left are the bytes' own";
  // An engine of the model attaches to what the pattern filler published (same plan).
  ArenaOptions attach = options_;
  attach.logger = log_;
  ASSERT_OK_AND_ASSIGN(Arena attached, Arena::Open(spec, attach));
  EXPECT_EQ(attached.role(), ArenaRole::kAttached);
  EXPECT_EQ(attached.tensor(0).bytes[0], std::byte{0x5a});
}

TEST_F(SharedProtocolTest, AFillerThatFailsLeavesNothingPublishedAndNoFile) {
  ModelSpec spec = RawSpec(model_.path());
  PatternFiller filler(spec, std::byte{0x11}, /*fail=*/true);
  ASSERT_OK_AND_ASSIGN(source::ModelPlan plan, filler.Plan());
  ArenaFile file = OpenHeld();
  ASSERT_OK(arena::TakeUserExclusive(file, "busy"));
  platform::FilesystemInfo fs = *platform::StatFilesystem(dir_.path());
  FillWait wait = WaitOf(5);
  auto impl = arena::LoadFresh(std::move(file), plan, filler, options_, fs, wait, *log_);
  ASSERT_FALSE(impl.ok());
  EXPECT_EQ(filler.fills, 1);
  EXPECT_EQ(impl.status().code(), StatusCode::kInternal);
  EXPECT_NE(impl.status().message().find("the pattern filler gave up"), std::string::npos)
      << impl.status().message();
  EXPECT_NE(impl.status().message().find("loading " + options_.shared_path), std::string::npos)
      << impl.status().message();
  EXPECT_TRUE(dir_.entries().empty()) << "the unfinished file is removed";

  // The same through OpenShared: the want's filler is the one LoadFresh runs.
  ModelWant want{.spec = &spec, .filler = &filler};
  ArenaOptions options = options_;
  options.logger = log_;
  auto opened = arena::OpenShared(&want, options, *log_);
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(filler.fills, 2);
  EXPECT_TRUE(dir_.entries().empty());
}

}  // namespace
}  // namespace expert_arena::testing
