// A peer that asks `expert-arena serve` for ranges of its choice, as a hostile peer would, to
// test that the server refuses what is outside the arena file (PeerFillTest.*OutOfRange*).
// Passes the front door with the library's client (src/remote/front_door.h), then speaks the
// wire protocol of src/remote/wire.h with plain UCX calls (the tool links UCX; the library's
// client would never ask for such a range).
//
//   peer_range_probe HOST:PORT TOKEN (OFFSET:BYTES | rawget:ADDRESS:BYTES)...
//
// Says hello, prints "offer <transport> <file bytes>", then asks for each range in turn and
// prints "range OFFSET:BYTES: <N> bytes" when it is answered, or "closed: <UCX status>" when the
// server closed the endpoint instead (then exits 3). rawget: a ucp_get_nbx of ADDRESS in the
// server's process with a key of the probe's own (on tcp a get request carries none): prints
// "rawget ...: <N> bytes" when the server answers it, "no answer" (exit 4) when it does not
// within 3 s. Exit 0: every request answered; 2: usage or no offer; 4: no answer and no
// close within 20 s (3 s for rawget).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "platform/net.h"
#include "remote/front_door.h"
#include "remote/wire.h"

namespace {

using expert_arena::remote::Hello;
using expert_arena::remote::Offer;
using expert_arena::remote::Range;
namespace wire = expert_arena::remote;

struct State {
  bool failed = false;
  ucs_status_t failure = UCS_OK;
  std::vector<char> offer;
  bool answered = false;
  size_t answer_bytes = 0;
  void* desc = nullptr;  // a rendezvous answer, received in the main loop
  std::vector<char> buffer;
};

bool Done(ucp_worker_h worker, ucs_status_ptr_t request, State& st) {
  if (request == nullptr) return true;
  if (UCS_PTR_IS_ERR(request)) return false;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (ucp_request_check_status(request) == UCS_INPROGRESS && !st.failed &&
         std::chrono::steady_clock::now() < deadline) {
    ucp_worker_progress(worker);
  }
  ucs_status_t s = ucp_request_check_status(request);
  ucp_request_free(request);
  return s == UCS_OK;
}

}  // namespace

// The probe exits where the server hung up on it, with its failed endpoint and worker still
// open (UCX keeps a few bytes for them): under AddressSanitizer, LeakSanitizer would turn the
// exit status the test reads (3: closed) into 1, whatever ASAN_OPTIONS asks. Only the front
// door's client of the library runs in this process.
extern "C" int __lsan_is_turned_off() { return 1; }

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: peer_range_probe HOST:PORT TOKEN OFFSET:BYTES...\n");
    return 2;
  }
  std::string address = argv[1];
  std::string token = argv[2];
  auto sa = expert_arena::platform::ResolveHostPort(address);
  if (!sa.ok()) {
    std::fprintf(stderr, "peer_range_probe: bad address %s\n", argv[1]);
    return 2;
  }

  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA;
  ucp_context_h context;
  if (ucp_init(&params, nullptr, &context) != UCS_OK) return 2;
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker;
  if (ucp_worker_create(context, &wp, &worker) != UCS_OK) return 2;

  State st;
  ucp_am_handler_param_t am{};
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG;
  am.arg = &st;
  am.id = wire::kOfferId;
  am.cb = [](void* arg, const void*, size_t, void* data, size_t length,
             const ucp_am_recv_param_t*) -> ucs_status_t {
    auto* s = static_cast<State*>(arg);
    s->offer.assign(static_cast<char*>(data), static_cast<char*>(data) + length);
    return UCS_OK;
  };
  ucp_worker_set_am_recv_handler(worker, &am);
  am.id = wire::kRangeDataId;
  am.cb = [](void* arg, const void*, size_t, void* data, size_t length,
             const ucp_am_recv_param_t* param) -> ucs_status_t {
    auto* s = static_cast<State*>(arg);
    s->answer_bytes = length;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
      s->desc = data;
      return UCS_INPROGRESS;
    }
    s->answered = true;
    return UCS_OK;
  };
  ucp_worker_set_am_recv_handler(worker, &am);

  ucp_address_t* own = nullptr;
  size_t own_bytes = 0;
  if (ucp_worker_get_address(worker, &own, &own_bytes) != UCS_OK) return 2;
  auto entry = wire::FrontDoorConnect(
      *sa, token, wire::DoorService::kPeerFill,
      {reinterpret_cast<const std::byte*>(own), own_bytes}, 20, "peer " + address);
  ucp_worker_release_address(worker, own);
  if (!entry.ok()) {
    std::printf("front door: %s\n", entry.status().message().c_str());
    return 2;
  }
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                         UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(entry->worker_address.data());
  ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep_params.err_handler.arg = &st;
  ep_params.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t status) {
    static_cast<State*>(arg)->failed = true;
    static_cast<State*>(arg)->failure = status;
  };
  ucp_ep_h ep;
  if (ucp_ep_create(worker, &ep_params, &ep) != UCS_OK) return 2;

  std::vector<char> hello(sizeof(Hello));
  Hello h{wire::kWireMagic, wire::kWireVersion, 0, {}};
  std::memcpy(h.ticket, entry->ticket.data(), sizeof h.ticket);
  std::memcpy(hello.data(), &h, sizeof h);
  ucp_request_param_t reply{};
  reply.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  reply.flags = UCP_AM_SEND_FLAG_REPLY;
  if (!Done(worker,
            ucp_am_send_nbx(ep, wire::kHelloId, nullptr, 0, hello.data(), hello.size(), &reply),
            st)) {
    std::printf("no hello: %s\n", ucs_status_string(st.failure));
    return 2;
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (st.offer.empty() && !st.failed && std::chrono::steady_clock::now() < deadline) {
    ucp_worker_progress(worker);
  }
  Offer offer{};
  if (st.offer.size() < sizeof offer) {
    std::printf("no offer\n");
    return 2;
  }
  std::memcpy(&offer, st.offer.data(), sizeof offer);
  if (offer.status != static_cast<uint32_t>(wire::OfferStatus::kOk)) {
    std::printf("refused\n");
    return 2;
  }
  std::printf("offer %s %llu %llu\n",
              wire::PeerTransportName(static_cast<wire::PeerTransport>(offer.transport)),
              static_cast<unsigned long long>(offer.header_bytes + offer.data_bytes),
              static_cast<unsigned long long>(offer.region_address));
  std::fflush(stdout);

  for (int i = 3; i < argc; ++i) {
    unsigned long address = 0;
    unsigned long bytes = 0;
    if (std::sscanf(argv[i], "rawget:%lu:%lu", &address, &bytes) == 2) {
      // A key packed from a registration of our own: all that a tcp get request needs.
      std::vector<char> local(bytes);
      ucp_mem_map_params_t map{};
      map.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
      map.address = local.data();
      map.length = local.size();
      ucp_mem_h memory;
      void* packed = nullptr;
      size_t packed_bytes = 0;
      ucp_rkey_h rkey = nullptr;
      if (ucp_mem_map(context, &map, &memory) != UCS_OK ||
          ucp_rkey_pack(context, memory, &packed, &packed_bytes) != UCS_OK ||
          ucp_ep_rkey_unpack(ep, packed, &rkey) != UCS_OK) {
        std::printf("cannot make a key\n");
        return 2;
      }
      ucp_request_param_t param{};
      ucs_status_ptr_t get = ucp_get_nbx(ep, local.data(), bytes, address, rkey, &param);
      deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
      while (UCS_PTR_IS_PTR(get) && get != nullptr &&
             ucp_request_check_status(get) == UCS_INPROGRESS && !st.failed &&
             std::chrono::steady_clock::now() < deadline) {
        ucp_worker_progress(worker);
      }
      if (st.failed) {
        std::printf("closed: %s\n", ucs_status_string(st.failure));
        return 3;
      }
      if (UCS_PTR_IS_ERR(get)) {
        std::printf("rawget refused here: %s\n", ucs_status_string(UCS_PTR_STATUS(get)));
        return 2;
      }
      if (get != nullptr && ucp_request_check_status(get) == UCS_INPROGRESS) {
        std::printf("no answer\n");
        std::fflush(stdout);
        _exit(4);  // a get in flight: leave without tearing UCX down under it
      }
      if (get != nullptr) ucp_request_free(get);
      ucp_rkey_destroy(rkey);
      ucp_rkey_buffer_release(packed);
      ucp_mem_unmap(context, memory);
      std::printf("rawget %s: %lu bytes\n", argv[i], bytes);
      std::fflush(stdout);
      continue;
    }
    Range range{};
    if (std::sscanf(argv[i], "%lu:%lu", &range.offset, &range.bytes) != 2) return 2;
    st.answered = false;
    if (!Done(worker,
              ucp_am_send_nbx(ep, wire::kRangeRequestId, nullptr, 0, &range, sizeof range, &reply),
              st) &&
        !st.failed) {
      std::printf("cannot ask\n");
      return 2;
    }
    deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!st.answered && !st.failed && std::chrono::steady_clock::now() < deadline) {
      ucp_worker_progress(worker);
      if (st.desc != nullptr) {
        st.buffer.resize(st.answer_bytes);
        ucp_request_param_t param{};
        void* desc = st.desc;
        st.desc = nullptr;
        st.answered =
            Done(worker,
                 ucp_am_recv_data_nbx(worker, desc, st.buffer.data(), st.answer_bytes, &param), st);
      }
    }
    if (st.failed) {
      std::printf("closed: %s\n", ucs_status_string(st.failure));
      return 3;
    }
    if (!st.answered) {
      std::printf("no answer\n");
      return 4;
    }
    std::printf("range %s: %zu bytes\n", argv[i], st.answer_bytes);
    std::fflush(stdout);
  }
  ucp_request_param_t close{};
  close.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  close.flags = UCP_EP_CLOSE_FLAG_FORCE;
  Done(worker, ucp_ep_close_nbx(ep, &close), st);
  ucp_worker_destroy(worker);
  ucp_cleanup(context);
  return 0;
}
