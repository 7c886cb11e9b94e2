// The C interface of tensor streaming (include/expert_arena/expert_arena_stream.h) over the
// C++ StreamProducer / StreamConsumer API.
//
// Each handle owns the C++ object: the C++ move-only types keep their producer's or
// consumer's state alive on their own, so the handles may be destroyed in any order. Every
// entry point runs inside Guarded (no exception crosses) and fails with a negative errno and
// the library's message (capi_internal.h).
#include <spdlog/sinks/null_sink.h>
#include <spdlog/spdlog.h>

#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "capi/capi_internal.h"
#include "common/escape.h"
#include "expert_arena/expert_arena.h"
#include "expert_arena/stream.h"

struct ea_stream_producer {
  expert_arena::StreamProducer producer;
  std::vector<expert_arena::PendingBlock> pending;  // the strings of ea_stream_pending
  std::string remote_address;                       // of ea_stream_producer_remote_address
};

struct ea_stream_reservation {
  expert_arena::Reservation reservation;
  std::string key;
  bool published = false;
  size_t remote_bytes = 0;  // what the producer's remote fields add to a descriptor
};

struct ea_stream_consumer {
  expert_arena::StreamConsumer consumer;
};

struct ea_stream_tensor {
  expert_arena::StreamTensor tensor;
};

namespace expert_arena::capi {
namespace {

// The fields of the first version of each struct: a caller's size below these is refused.
constexpr size_t kMinParamsSize = offsetof(ea_stream_params, quiet) + sizeof(int);
constexpr size_t kMinStatsSize = offsetof(ea_stream_stats, segments_grown_ahead) + sizeof(uint64_t);
constexpr size_t kMinReservationInfoSize =
    offsetof(ea_stream_reservation_info, key) + sizeof(const char*);
constexpr size_t kMinPutItemSize = offsetof(ea_stream_put_item, ndim) + sizeof(uint32_t);
constexpr size_t kMinTensorInfoSize = offsetof(ea_stream_tensor_info, spilled) + sizeof(int);
constexpr size_t kMinPendingSize = offsetof(ea_stream_pending_block, spilled) + sizeof(int);

// The longest segment name a descriptor may carry (stream::IsValidSegmentName, which Decode
// applies).
constexpr size_t kLongestSegmentName = 200;

std::shared_ptr<spdlog::logger> QuietLogger() {
  return std::make_shared<spdlog::logger>("expert_arena_c_stream",
                                          std::make_shared<spdlog::sinks::null_sink_mt>());
}

// The caller's params with the defaults for what its (older) struct lacks; -EINVAL when it
// is smaller than any version.
int ReadParams(const char* what, const ea_stream_params* in, ea_stream_params* p) {
  if (in == nullptr) return Fail(-EINVAL, std::string(what) + ": params is NULL");
  if (in->size < kMinParamsSize) {
    return Fail(-EINVAL, std::string(what) + ": params->size " + std::to_string(in->size) +
                             " is smaller than any version of ea_stream_params (call "
                             "ea_stream_params_init)");
  }
  ea_stream_params_init_sized(p, sizeof *p);
  std::memcpy(static_cast<void*>(p), in, std::min(in->size, sizeof *p));
  return 0;
}

std::string Text(const char* s, const char* fallback) {
  return s != nullptr && *s != '\0' ? s : fallback;
}

// The tensor's info, or -EINVAL naming the argument that cannot make one.
int ReadInfo(const char* what, const char* dtype, const uint64_t* shape, uint32_t ndim,
             TensorInfo* info) {
  if (ndim > 0 && shape == nullptr) {
    return Fail(-EINVAL, std::string(what) + ": shape is NULL with ndim " + std::to_string(ndim));
  }
  info->dtype = dtype != nullptr ? dtype : "u8";
  info->shape.assign(shape, shape + ndim);
  return 0;
}

// A descriptor of this tensor can take at most this many bytes: what Encode writes for an
// empty key, dtype and shape with the longest segment name (measured once), plus the key's and
// dtype's bytes and 8 per dimension (the wire form carries each as is, after a length).
// Checked before anything is reserved or published.
// `remote_bytes`: RemoteBytes() of the producer.
size_t DescriptorBound(std::string_view key, const TensorInfo& info, size_t remote_bytes) {
  static const size_t base = [] {
    TensorDescriptor probe;
    probe.segment.assign(kLongestSegmentName, 'x');
    probe.dtype.clear();
    return probe.Encode().size();
  }();
  return base + key.size() + info.dtype.size() + sizeof(uint64_t) * info.shape.size() +
         remote_bytes;
}

// What a listening producer's descriptors carry more (its address, instance id and boot id).
size_t RemoteBytes(const std::string& remote_address) {
  if (remote_address.empty()) return 0;
  return sizeof(uint16_t) + remote_address.size() + sizeof(uint64_t) + sizeof(uint16_t) + 36;
}

int CheckCapacity(const char* what, std::string_view key, const TensorInfo& info,
                  size_t remote_bytes, void* out_descriptor, size_t capacity,
                  size_t* descriptor_len) {
  if (descriptor_len == nullptr) {
    return Fail(-EINVAL, std::string(what) + ": descriptor_len is NULL");
  }
  // EA_STREAM_DESCRIPTOR_MAX holds any descriptor the producer can make: a larger bound means
  // a key, dtype or shape that the put refuses with its own message.
  size_t need =
      std::min<size_t>(DescriptorBound(key, info, remote_bytes), EA_STREAM_DESCRIPTOR_MAX);
  if (out_descriptor == nullptr || capacity < need) {
    *descriptor_len = need;
    return Fail(-ERANGE, std::string(what) + ": descriptor buffer of " +
                             std::to_string(out_descriptor == nullptr ? 0 : capacity) +
                             " bytes; the descriptor of key " + QuoteForMessage(key) +
                             " may take " + std::to_string(need) +
                             " (EA_STREAM_DESCRIPTOR_MAX always suffices); nothing was " +
                             "reserved or published");
  }
  return 0;
}

int WriteDescriptor(const char* what, const std::string& d, void* out, size_t capacity,
                    size_t* len) {
  if (d.size() > capacity) {  // not reached: CheckCapacity bounded it
    *len = d.size();
    return Fail(-EIO, std::string(what) + ": descriptor of " + std::to_string(d.size()) +
                          " bytes is longer than its bound " + std::to_string(capacity));
  }
  std::memcpy(out, d.data(), d.size());
  *len = d.size();
  return 0;
}

int HugeFor(const char* what, int value, HugePages* out) {
  switch (value) {
    case EA_HUGE_AUTO:
      *out = HugePages::kAuto;
      return 0;
    case EA_HUGE_ON:
      *out = HugePages::kOn;
      return 0;
    case EA_HUGE_OFF:
      *out = HugePages::kOff;
      return 0;
    default:
      return Fail(-EINVAL, std::string(what) + ": huge_pages " + std::to_string(value) +
                               " is not EA_HUGE_AUTO, EA_HUGE_ON or EA_HUGE_OFF");
  }
}

}  // namespace
}  // namespace expert_arena::capi

using expert_arena::capi::Fail;
using expert_arena::capi::Guarded;

extern "C" {

void ea_stream_params_init_sized(ea_stream_params* params, size_t size) {
  if (params == nullptr || size < sizeof params->size) return;
  // Built whole, copied out only as far as the caller's struct goes.
  const expert_arena::StreamOptions d;
  ea_stream_params defaults;
  std::memset(static_cast<void*>(&defaults), 0, sizeof defaults);
  defaults.size = size;
  defaults.segment_bytes = d.segment_bytes;
  defaults.max_segments = d.max_segments;
  defaults.block_alignment = d.block_alignment;
  defaults.strict = d.strict ? 1 : 0;
  defaults.strict_wait_seconds = d.strict_wait_seconds;
  defaults.huge_pages = EA_HUGE_AUTO;
  defaults.pin_budget_bytes = d.pin_budget_bytes;
  defaults.copy_threads = d.copy_threads;
  defaults.non_temporal_copy_from = d.non_temporal_copy_from;
  defaults.grow_ahead = d.grow_ahead ? 1 : 0;
  defaults.warning_interval_seconds = d.warning_interval_seconds;
  defaults.sweep_at_start = d.sweep_at_start ? 1 : 0;
  defaults.lease_check_seconds = d.lease_check_seconds;
  defaults.remote_lease_seconds = d.remote_lease_seconds;
  defaults.remote_timeout_seconds = expert_arena::ConsumerOptions{}.remote_timeout_seconds;
  std::memcpy(static_cast<void*>(params), &defaults, std::min(size, sizeof defaults));
}

int ea_stream_producer_create(const ea_stream_params* params_in, ea_stream_producer** out) {
  using namespace expert_arena;
  capi::last_error.clear();
  constexpr const char* kWhat = "ea_stream_producer_create";
  if (out == nullptr) return Fail(-EINVAL, std::string(kWhat) + ": out is NULL");
  *out = nullptr;
  return Guarded(kWhat, [&]() -> int {
    ea_stream_params p;
    if (int rc = capi::ReadParams(kWhat, params_in, &p); rc != 0) return rc;
    StreamOptions o;
    o.directory = capi::Text(p.directory, "/dev/shm");
    o.logical_name = capi::Text(p.logical_name, "stream");
    o.segment_bytes = p.segment_bytes;
    o.max_segments = p.max_segments;
    o.block_alignment = p.block_alignment;
    o.spill_directory = capi::Text(p.spill_directory, "/var/tmp");
    o.strict = p.strict != 0;
    if (!(p.strict_wait_seconds >= 0)) {
      return Fail(-EINVAL, std::string(kWhat) + ": strict_wait_seconds " +
                               std::to_string(p.strict_wait_seconds) + " is not 0 or more");
    }
    o.strict_wait_seconds = p.strict_wait_seconds;
    if (int rc = capi::HugeFor(kWhat, p.huge_pages, &o.huge); rc != 0) return rc;
    if (auto gpu = ParseGpuDevice(capi::Text(p.gpu, "none")); gpu.ok()) {
      o.gpu = *gpu;
    } else {
      return Fail(-EINVAL, std::string(kWhat) + ": gpu: " + gpu.status().message());
    }
    o.pin_budget_bytes = p.pin_budget_bytes;
    o.copy_threads = p.copy_threads;
    o.non_temporal_copy_from = p.non_temporal_copy_from;
    o.grow_ahead = p.grow_ahead != 0;
    o.warning_interval_seconds = p.warning_interval_seconds;
    o.sweep_at_start = p.sweep_at_start != 0;
    if (!(p.lease_check_seconds >= 0)) {
      return Fail(-EINVAL, std::string(kWhat) + ": lease_check_seconds " +
                               std::to_string(p.lease_check_seconds) + " is not 0 or more");
    }
    o.lease_check_seconds = p.lease_check_seconds;
    o.listen = capi::Text(p.listen, "");
    o.listen_token = capi::Text(p.listen_token, "");
    if (!o.listen.empty() && !(p.remote_lease_seconds > 0)) {
      return Fail(-EINVAL, std::string(kWhat) + ": remote_lease_seconds " +
                               std::to_string(p.remote_lease_seconds) + " is not more than 0");
    }
    o.remote_lease_seconds = p.remote_lease_seconds;
    if (p.numa != nullptr && *p.numa != '\0') {
      Status numa = ParseNumaPlacement(p.numa, &o.numa, &o.numa_node);
      if (!numa.ok()) return Fail(-EINVAL, std::string(kWhat) + ": " + numa.message());
    }
    if (p.quiet != 0) o.logger = capi::QuietLogger();
    auto producer = StreamProducer::Create(o);
    if (!producer.ok()) return Fail(producer.status());
    std::string address = producer->remote_address();
    *out = new ea_stream_producer{std::move(producer).value(), {}, address};
    return 0;
  });
}

void ea_stream_producer_destroy(ea_stream_producer* producer) {
  (void)Guarded("ea_stream_producer_destroy", [&] {
    delete producer;
    return 0;
  });
}

const char* ea_stream_producer_name(const ea_stream_producer* producer) {
  return producer == nullptr ? nullptr : producer->producer.instance_name().c_str();
}

const char* ea_stream_producer_remote_address(const ea_stream_producer* producer) {
  return producer == nullptr ? nullptr : producer->remote_address.c_str();
}

int ea_stream_put(ea_stream_producer* producer, const char* key, const void* data, uint64_t bytes,
                  const char* dtype, const uint64_t* shape, uint32_t ndim, uint32_t readers,
                  void* out_descriptor, size_t descriptor_capacity, size_t* descriptor_len) {
  using namespace expert_arena;
  constexpr const char* kWhat = "ea_stream_put";
  if (producer == nullptr || key == nullptr) {
    return Fail(-EINVAL, std::string(kWhat) + ": producer or key is NULL");
  }
  if (data == nullptr && bytes > 0) {
    return Fail(-EINVAL,
                std::string(kWhat) + ": data is NULL with " + std::to_string(bytes) + " bytes");
  }
  return Guarded(kWhat, [&]() -> int {
    TensorInfo info;
    if (int rc = capi::ReadInfo(kWhat, dtype, shape, ndim, &info); rc != 0) return rc;
    if (int rc = capi::CheckCapacity(kWhat, key, info,
                                     capi::RemoteBytes(producer->remote_address), out_descriptor,
                                     descriptor_capacity, descriptor_len);
        rc != 0) {
      return rc;
    }
    auto span = std::span<const std::byte>(static_cast<const std::byte*>(data), bytes);
    auto d = producer->producer.Put(key, span, info, readers);
    if (!d.ok()) return Fail(d.status());
    return capi::WriteDescriptor(kWhat, *d, out_descriptor, descriptor_capacity, descriptor_len);
  });
}

int ea_stream_put_many(ea_stream_producer* producer, const ea_stream_put_item* items, size_t count,
                       uint32_t readers, void* out_descriptors, size_t descriptors_capacity,
                       size_t* descriptor_lens, size_t* total_len) {
  using namespace expert_arena;
  constexpr const char* kWhat = "ea_stream_put_many";
  if (producer == nullptr || total_len == nullptr || (count > 0 && items == nullptr) ||
      (count > 0 && descriptor_lens == nullptr)) {
    return Fail(-EINVAL, std::string(kWhat) +
                             ": producer, items, descriptor_lens or total_len "
                             "is NULL");
  }
  *total_len = 0;
  if (count == 0) return 0;
  const size_t stride = items[0].size;
  if (stride < capi::kMinPutItemSize) {
    return Fail(-EINVAL, std::string(kWhat) + ": items[0].size " + std::to_string(stride) +
                             " is smaller than any version of ea_stream_put_item");
  }
  return Guarded(kWhat, [&]() -> int {
    std::vector<PutItem> batch(count);
    size_t need = 0;
    for (size_t i = 0; i < count; ++i) {
      // The caller's array has the caller's stride; fields it lacks stay zero.
      ea_stream_put_item item{};
      const char* at = reinterpret_cast<const char*>(items) + i * stride;
      std::memcpy(static_cast<void*>(&item), at, std::min(stride, sizeof item));
      const std::string where = std::string(kWhat) + ": item " + std::to_string(i);
      if (item.size != stride) {
        return Fail(-EINVAL, where + ": size " + std::to_string(item.size) +
                                 " differs from items[0].size " + std::to_string(stride));
      }
      if (item.key == nullptr) return Fail(-EINVAL, where + ": key is NULL");
      if (item.data == nullptr && item.bytes > 0) {
        return Fail(-EINVAL,
                    where + ": data is NULL with " + std::to_string(item.bytes) + " bytes");
      }
      batch[i].key = item.key;
      batch[i].bytes =
          std::span<const std::byte>(static_cast<const std::byte*>(item.data), item.bytes);
      if (int rc = capi::ReadInfo(where.c_str(), item.dtype, item.shape, item.ndim, &batch[i].info);
          rc != 0) {
        return rc;
      }
      need += std::min<size_t>(capi::DescriptorBound(batch[i].key, batch[i].info,
                                                     capi::RemoteBytes(producer->remote_address)),
                               EA_STREAM_DESCRIPTOR_MAX);
    }
    if (out_descriptors == nullptr || descriptors_capacity < need) {
      *total_len = need;
      return Fail(-ERANGE,
                  std::string(kWhat) + ": descriptor buffer of " +
                      std::to_string(out_descriptors == nullptr ? 0 : descriptors_capacity) +
                      " bytes; the " + std::to_string(count) + " descriptors may take " +
                      std::to_string(need) + "; nothing was reserved or published");
    }
    auto ds = producer->producer.PutMany(batch, readers);
    if (!ds.ok()) return Fail(ds.status());
    size_t written = 0;
    for (size_t i = 0; i < ds->size(); ++i) {
      const std::string& d = (*ds)[i];
      if (d.size() > descriptors_capacity - written) {  // not reached: bounded above
        return Fail(-EIO, std::string(kWhat) + ": descriptors longer than their bound");
      }
      std::memcpy(static_cast<char*>(out_descriptors) + written, d.data(), d.size());
      descriptor_lens[i] = d.size();
      written += d.size();
    }
    *total_len = written;
    return 0;
  });
}

int ea_stream_reserve(ea_stream_producer* producer, const char* key, uint64_t bytes,
                      ea_stream_reservation** out, void** data) {
  using namespace expert_arena;
  constexpr const char* kWhat = "ea_stream_reserve";
  if (out == nullptr) return Fail(-EINVAL, std::string(kWhat) + ": out is NULL");
  *out = nullptr;
  if (data != nullptr) *data = nullptr;
  if (producer == nullptr || key == nullptr) {
    return Fail(-EINVAL, std::string(kWhat) + ": producer or key is NULL");
  }
  return Guarded(kWhat, [&]() -> int {
    auto r = producer->producer.Reserve(key, bytes);
    if (!r.ok()) return Fail(r.status());
    auto* handle = new ea_stream_reservation{std::move(r).value(), key, false,
                                             capi::RemoteBytes(producer->remote_address)};
    if (data != nullptr) *data = handle->reservation.bytes().data();
    *out = handle;
    return 0;
  });
}

int ea_stream_reservation_get_info(const ea_stream_reservation* reservation,
                                   ea_stream_reservation_info* out) {
  using namespace expert_arena;
  constexpr const char* kWhat = "ea_stream_reservation_get_info";
  if (reservation == nullptr || out == nullptr) {
    return Fail(-EINVAL, std::string(kWhat) + ": NULL argument");
  }
  if (out->size < capi::kMinReservationInfoSize) {
    return Fail(-EINVAL, std::string(kWhat) + ": out->size " + std::to_string(out->size) +
                             " is smaller than any version of ea_stream_reservation_info");
  }
  ea_stream_reservation_info info{};
  info.size = sizeof info;
  info.data = reservation->reservation.bytes().data();
  info.bytes = reservation->reservation.bytes().size();
  info.spilled = reservation->reservation.spilled() ? 1 : 0;
  info.key = reservation->key.c_str();
  capi::CopyOut(info, out);
  return 0;
}

int ea_stream_publish(ea_stream_reservation* reservation, const char* dtype, const uint64_t* shape,
                      uint32_t ndim, uint32_t readers, void* out_descriptor,
                      size_t descriptor_capacity, size_t* descriptor_len) {
  using namespace expert_arena;
  constexpr const char* kWhat = "ea_stream_publish";
  if (reservation == nullptr) return Fail(-EINVAL, std::string(kWhat) + ": reservation is NULL");
  if (reservation->published) {
    return Fail(-EINVAL,
                std::string(kWhat) + ": key " + reservation->key + " was published already");
  }
  return Guarded(kWhat, [&]() -> int {
    TensorInfo info;
    if (int rc = capi::ReadInfo(kWhat, dtype, shape, ndim, &info); rc != 0) return rc;
    if (int rc = capi::CheckCapacity(kWhat, reservation->key, info, reservation->remote_bytes,
                                     out_descriptor, descriptor_capacity, descriptor_len);
        rc != 0) {
      return rc;
    }
    auto d = reservation->reservation.Publish(info, readers);
    if (!d.ok()) return Fail(d.status());
    reservation->published = true;
    return capi::WriteDescriptor(kWhat, *d, out_descriptor, descriptor_capacity, descriptor_len);
  });
}

void ea_stream_reservation_destroy(ea_stream_reservation* reservation) {
  (void)Guarded("ea_stream_reservation_destroy", [&] {
    delete reservation;  // an unpublished reservation gives its space back
    return 0;
  });
}

int ea_stream_abort(ea_stream_producer* producer, const char* key, uint64_t* marked) {
  using namespace expert_arena;
  constexpr const char* kWhat = "ea_stream_abort";
  if (marked != nullptr) *marked = 0;
  if (producer == nullptr || key == nullptr) {
    return Fail(-EINVAL, std::string(kWhat) + ": producer or key is NULL");
  }
  return Guarded(kWhat, [&]() -> int {
    auto n = producer->producer.Abort(key);
    if (!n.ok()) return Fail(n.status());
    if (marked != nullptr) *marked = *n;
    return 0;
  });
}

int ea_stream_reclaim(ea_stream_producer* producer) {
  using namespace expert_arena;
  if (producer == nullptr) return Fail(-EINVAL, "ea_stream_reclaim: producer is NULL");
  return Guarded("ea_stream_reclaim", [&]() -> int {
    Status s = producer->producer.Reclaim();
    return s.ok() ? 0 : Fail(s);
  });
}

int ea_stream_pending(ea_stream_producer* producer, ea_stream_pending_block* out,
                      size_t capacity, size_t* count) {
  using namespace expert_arena;
  constexpr const char* kWhat = "ea_stream_pending";
  if (producer == nullptr || count == nullptr || (out == nullptr && capacity > 0)) {
    return Fail(-EINVAL, std::string(kWhat) + ": producer, count or out is NULL");
  }
  const size_t stride = capacity > 0 ? out[0].size : 0;
  if (capacity > 0 && stride < capi::kMinPendingSize) {
    return Fail(-EINVAL, std::string(kWhat) + ": out[0].size " + std::to_string(stride) +
                             " is smaller than any version of ea_stream_pending_block");
  }
  return Guarded(kWhat, [&]() -> int {
    auto pending = producer->producer.Pending();
    if (!pending.ok()) return Fail(pending.status());
    producer->pending = std::move(pending).value();
    *count = producer->pending.size();
    const size_t n = std::min(capacity, producer->pending.size());
    for (size_t i = 0; i < n; ++i) {
      const PendingBlock& p = producer->pending[i];
      ea_stream_pending_block b{};
      b.size = stride;
      b.key = p.key.c_str();
      b.state = p.state.c_str();
      b.segment = p.segment.c_str();
      b.age_seconds = p.age_seconds;
      b.readers_left = p.readers_left;
      b.holders = p.holders;
      b.bytes = p.bytes;
      b.spilled = p.spilled ? 1 : 0;
      b.remote_holders = p.remote_holders;
      // The caller's array has the caller's stride; fields it lacks are not written.
      char* at = reinterpret_cast<char*>(out) + i * stride;
      std::memcpy(at, &b, std::min(stride, sizeof b));
    }
    if (n < producer->pending.size()) {
      return Fail(-ERANGE, std::string(kWhat) + ": " + std::to_string(producer->pending.size()) +
                               " pending blocks, room for " + std::to_string(capacity));
    }
    return 0;
  });
}

int ea_stream_get_stats(ea_stream_producer* producer, ea_stream_stats* out) {
  using namespace expert_arena;
  constexpr const char* kWhat = "ea_stream_get_stats";
  if (producer == nullptr || out == nullptr) {
    return Fail(-EINVAL, std::string(kWhat) + ": NULL argument");
  }
  if (out->size < capi::kMinStatsSize) {
    return Fail(-EINVAL, std::string(kWhat) + ": out->size " + std::to_string(out->size) +
                             " is smaller than any version of ea_stream_stats");
  }
  return Guarded(kWhat, [&]() -> int {
    Result<StreamStats> got = producer->producer.Stats();
    if (!got.ok()) return Fail(got.status());
    const StreamStats& s = *got;
    ea_stream_stats st{};
    st.size = sizeof st;
    st.total_bytes = s.total_bytes;
    st.free_bytes = s.free_bytes;
    st.largest_free_block = s.largest_free_block;
    st.segments = s.segments;
    st.dedicated_segments = s.dedicated_segments;
    st.live_blocks = s.live_blocks;
    st.pinned_bytes = s.pinned_bytes;
    st.spills = s.spills;
    st.spill_files = s.spill_files;
    st.fragmentation_failures = s.fragmentation_failures;
    st.reclaimed_blocks = s.reclaimed_blocks;
    st.dead_readers_cleared = s.dead_readers_cleared;
    st.segments_grown_ahead = s.segments_grown_ahead;
    st.numa_node = s.numa_node;
    capi::CopyOut(st, out);
    return 0;
  });
}

int ea_stream_consumer_create(const ea_stream_params* params_in, ea_stream_consumer** out) {
  using namespace expert_arena;
  capi::last_error.clear();
  constexpr const char* kWhat = "ea_stream_consumer_create";
  if (out == nullptr) return Fail(-EINVAL, std::string(kWhat) + ": out is NULL");
  *out = nullptr;
  return Guarded(kWhat, [&]() -> int {
    ea_stream_params p;
    if (int rc = capi::ReadParams(kWhat, params_in, &p); rc != 0) return rc;
    ConsumerOptions o;
    o.directory = capi::Text(p.directory, "/dev/shm");
    o.spill_directory = capi::Text(p.spill_directory, "/var/tmp");
    if (auto gpu = ParseGpuDevice(capi::Text(p.gpu, "none")); gpu.ok()) {
      o.gpu = *gpu;
    } else {
      return Fail(-EINVAL, std::string(kWhat) + ": gpu: " + gpu.status().message());
    }
    o.pin_budget_bytes = p.pin_budget_bytes;
    o.allow_foreign_owner = p.allow_foreign_owner != 0;
    o.remote_token = capi::Text(p.listen_token, "");
    if (!(p.remote_timeout_seconds > 0)) {
      return Fail(-EINVAL, std::string(kWhat) + ": remote_timeout_seconds " +
                               std::to_string(p.remote_timeout_seconds) + " is not more than 0");
    }
    o.remote_timeout_seconds = p.remote_timeout_seconds;
    if (p.quiet != 0) o.logger = capi::QuietLogger();
    auto consumer = StreamConsumer::Create(o);
    if (!consumer.ok()) return Fail(consumer.status());
    *out = new ea_stream_consumer{std::move(consumer).value()};
    return 0;
  });
}

void ea_stream_consumer_destroy(ea_stream_consumer* consumer) {
  (void)Guarded("ea_stream_consumer_destroy", [&] {
    delete consumer;  // open tensors keep the consumer's state and mappings
    return 0;
  });
}

int ea_stream_open(ea_stream_consumer* consumer, const void* descriptor, size_t descriptor_len,
                   ea_stream_tensor** out) {
  using namespace expert_arena;
  constexpr const char* kWhat = "ea_stream_open";
  if (out == nullptr) return Fail(-EINVAL, std::string(kWhat) + ": out is NULL");
  *out = nullptr;
  if (consumer == nullptr || (descriptor == nullptr && descriptor_len > 0)) {
    return Fail(-EINVAL, std::string(kWhat) + ": consumer or descriptor is NULL");
  }
  return Guarded(kWhat, [&]() -> int {
    std::string_view bytes(static_cast<const char*>(descriptor), descriptor_len);
    auto t = consumer->consumer.Open(bytes);
    if (!t.ok()) return Fail(t.status());
    *out = new ea_stream_tensor{std::move(t).value()};
    return 0;
  });
}

int ea_stream_tensor_get_info(const ea_stream_tensor* tensor, ea_stream_tensor_info* out) {
  using namespace expert_arena;
  constexpr const char* kWhat = "ea_stream_tensor_get_info";
  if (tensor == nullptr || out == nullptr) {
    return Fail(-EINVAL, std::string(kWhat) + ": NULL argument");
  }
  if (out->size < capi::kMinTensorInfoSize) {
    return Fail(-EINVAL, std::string(kWhat) + ": out->size " + std::to_string(out->size) +
                             " is smaller than any version of ea_stream_tensor_info");
  }
  // The descriptor's strings and shape are members of the tensor's state: they stay where
  // they are until the tensor is released. Decode refused a key or dtype with a control byte,
  // so neither holds a NUL.
  const TensorDescriptor& d = tensor->tensor.descriptor();
  ea_stream_tensor_info info{};
  info.size = sizeof info;
  info.data = tensor->tensor.bytes().data();
  info.bytes = tensor->tensor.bytes().size();
  info.key = d.key.c_str();
  info.dtype = d.dtype.c_str();
  info.shape = d.shape.data();
  info.ndim = static_cast<uint32_t>(d.shape.size());
  info.spilled = d.spilled ? 1 : 0;
  capi::CopyOut(info, out);
  return 0;
}

void ea_stream_release(ea_stream_tensor* tensor) {
  (void)Guarded("ea_stream_release", [&] {
    delete tensor;  // ~StreamTensor returns this reader's share
    return 0;
  });
}

int ea_stream_sweep(const char* directory, size_t* removed, size_t* live) {
  using namespace expert_arena;
  constexpr const char* kWhat = "ea_stream_sweep";
  if (removed != nullptr) *removed = 0;
  if (live != nullptr) *live = 0;
  if (directory == nullptr || *directory == '\0') {
    return Fail(-EINVAL, std::string(kWhat) + ": directory is NULL or empty");
  }
  return Guarded(kWhat, [&]() -> int {
    auto report = SweepStreamDirectory(directory);
    if (!report.ok()) return Fail(report.status());
    if (removed != nullptr) *removed = report->removed.size();
    if (live != nullptr) *live = report->live.size();
    return 0;
  });
}

}  // extern "C"
