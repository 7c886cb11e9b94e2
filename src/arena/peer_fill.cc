#include "arena/peer_fill.h"

#include <spdlog/spdlog.h>

#include "arena/arena_filler.h"
#include "arena/peer_transport.h"
#include "load/loader.h"
#include "source/model_source.h"

namespace expert_arena::arena {

std::string LayoutDifference(const format::ArenaTable& local, const format::ArenaTable& peer) {
  if (local.tensors.size() != peer.tensors.size()) {
    return std::to_string(local.tensors.size()) + " tensors here, " +
           std::to_string(peer.tensors.size()) + " at the peer";
  }
  if (local.sources.size() != peer.sources.size()) {
    return std::to_string(local.sources.size()) + " model files here, " +
           std::to_string(peer.sources.size()) + " at the peer";
  }
  for (size_t i = 0; i < local.sources.size(); ++i) {
    if (local.sources[i].size != peer.sources[i].size) {
      return "model file " + local.sources[i].path + " has " +
             std::to_string(local.sources[i].size) + " bytes, the peer's " +
             std::to_string(peer.sources[i].size);
    }
  }
  if (local.alignment != peer.alignment) return "another tensor alignment";
  if (local.data_bytes != peer.data_bytes) return "another data size";
  for (size_t i = 0; i < local.tensors.size(); ++i) {
    const auto& a = local.tensors[i];
    const auto& b = peer.tensors[i];
    if (a.name != b.name) return "tensor " + std::to_string(i) + " is named differently";
    if (a.dtype != b.dtype || a.shape != b.shape || a.bytes != b.bytes ||
        a.arena_offset != b.arena_offset || a.source_index != b.source_index ||
        a.source_offset != b.source_offset) {
      return "tensor " + a.name + " differs (dtype, shape, size or place)";
    }
  }
  return "";
}

namespace {

// The bytes of a connected peer, verified as they land (PeerConnection::Fill). Its plan: the
// peer's table, or the local model's when it gives the peer's layout.
class PeerFiller final : public ArenaFiller {
 public:
  PeerFiller(PeerConnection& peer, const ModelSpec& model, const std::string& address)
      : peer_(peer), model_(model), address_(address) {}

  Result<source::ModelPlan> Plan() override {
    source::ModelPlan plan;
    if (model_.files.empty()) {
      // A new host without the checkpoint: the peer's table is the plan (its identity too).
      plan.table = peer_.table();
      plan.format = "peer";
      return plan;
    }
    EA_ASSIGN_OR_RETURN(plan, source::PlanModel(model_));
    std::string difference = LayoutDifference(plan.table, peer_.table());
    if (!difference.empty()) {
      return Corrupt("peer " + address_ + " serves another model than the local files (" +
                     difference + "); its arena holds " + peer_.table().identity_text);
    }
    // The local identity (paths, times of this host's files), so that local engines opening
    // the same files attach; the peer's checksums, verified as the bytes land.
    for (size_t i = 0; i < plan.table.tensors.size(); ++i) {
      plan.table.tensors[i].checksum = peer_.table().tensors[i].checksum;
    }
    return plan;
  }

  Result<load::LoadResult> Fill(const load::LoadRequest& request,
                                format::ArenaTable& table) override {
    EA_RETURN_IF_ERROR(peer_.Fill(request.data, table, request.ready_front, request.ready_base));
    load::LoadResult result;
    result.reader = "ucx";
    result.seconds = peer_.fill_seconds();
    return result;
  }

 private:
  PeerConnection& peer_;
  const ModelSpec& model_;
  const std::string& address_;
};

}  // namespace

Result<std::unique_ptr<Arena::Impl>> FillFromPeer(const ModelSpec& model,
                                                  const ArenaOptions& options,
                                                  spdlog::logger& log) {
  if (options.shared_path.empty()) {
    return InvalidArgument("from_peer " + options.from_peer + " needs a shared arena path");
  }
  PeerConnectOptions peer_options;
  peer_options.address = options.from_peer;
  peer_options.token = options.peer_token;
  peer_options.allow_no_token = options.peer_allow_no_token;
  peer_options.stall_seconds = options.peer_stall_seconds;
  peer_options.transport = PeerTransportName(options.peer_transport);
  peer_options.logger = &log;
  EA_ASSIGN_OR_RETURN(std::unique_ptr<PeerConnection> peer, ConnectToPeer(peer_options));

  // Planned before the protocol (no published arena is matched without the plan), not
  // counted as a plan of the model files.
  PeerFiller filler(*peer, model, options.from_peer);
  ModelWant want{.spec = &model, .filler = &filler};
  EA_ASSIGN_OR_RETURN(source::ModelPlan plan, filler.Plan());
  const uint64_t metadata_bytes = plan.metadata_bytes_read;
  want.plan = std::move(plan);
  EA_ASSIGN_OR_RETURN(auto impl, OpenShared(&want, options, log));
  impl->report.from_peer = options.from_peer;
  impl->report.peer_bytes = peer->bytes_received();
  impl->report.peer_transport = peer->transport();
  // Model bytes read here: the local headers, when files were given (0 without).
  impl->report.bytes_read = metadata_bytes;
  return impl;
}

}  // namespace expert_arena::arena
