#include "engine/core/gloo_communicator.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gloo/transport/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <optional>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "engine/core/collective_text.h"
#include "engine/core/log.h"
#include "engine/core/rank_order_reduction.h"
#include "engine/core/thread.h"

namespace strata {

using Clock = std::chrono::steady_clock;

namespace gloo_communicator_internal {

// What a communicator shares with the tasks it leaves on streams (which may outlive it).
struct State {
  State(int rank_index, int world, const GlooCommunicatorOptions& communicator_options)
      : rank(rank_index),
        world_size(world),
        options(communicator_options),
        who("gloo rank " + std::to_string(rank_index) + " of " + std::to_string(world)),
        lost(static_cast<size_t>(world)) {}
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() {
    // The watchers first (their probes' waits end), then the pairs, then the device whose
    // event loop serves them.
    for (auto& probe : probes)
      if (probe) probe->abortWaitRecv();
    for (std::thread& watcher : watchers)
      if (watcher.joinable()) watcher.join();
    probes.clear();
    context.reset();
    device.reset();
  }

  const int rank;
  const int world_size;
  const GlooCommunicatorOptions options;
  const std::string who;  // "gloo rank 3 of 8"
  std::string address;    // where this rank's pairs listen

  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<gloo::transport::Context> context;
  // Per peer, a receive that is never matched (see watch_peer) and the thread waiting on it.
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> probes;
  std::vector<std::thread> watchers;
  std::vector<char> probe_bytes;

  std::mutex mutex;
  Status failure;                 // guarded by mutex; the first failure
  bool closed = false;            // guarded by mutex; the pairs were closed
  std::vector<std::string> lost;  // guarded by mutex; per peer: how its connection ended (empty: alive)
  std::multimap<int, gloo::transport::UnboundBuffer*> waiting;  // guarded by mutex; by peer, buffers of operations running

  Status current_failure() {
    std::lock_guard<std::mutex> lock(mutex);
    return failure;
  }

  // Records `reason` (the first one wins), wakes the operations that wait and closes the
  // connections, which peers see as this rank closing its end.
  void abort(Status reason) {
    std::lock_guard<std::mutex> lock(mutex);
    if (failure.ok()) {
      STRATA_LOG(kDebug) << who << ": aborted: " << reason.message();
      failure = std::move(reason);
    }
    for (const auto& [peer, buffer] : waiting) {
      buffer->abortWaitRecv();
      buffer->abortWaitSend();
    }
    close_locked();
  }

  // `peer`'s connection ended (`detail`): the waits of operations on it end now.
  void mark_lost(int peer, std::string detail) {
    std::lock_guard<std::mutex> lock(mutex);
    if (lost[static_cast<size_t>(peer)].empty()) lost[static_cast<size_t>(peer)] = std::move(detail);
    const auto [begin, end] = waiting.equal_range(peer);
    for (auto it = begin; it != end; ++it) {
      it->second->abortWaitRecv();
      it->second->abortWaitSend();
    }
  }

  std::string lost_detail(int peer) {
    std::lock_guard<std::mutex> lock(mutex);
    return lost[static_cast<size_t>(peer)];
  }

 private:
  void close_locked() {
    if (closed || context == nullptr) return;
    closed = true;
    for (int peer = 0; peer < world_size; ++peer) {
      if (peer == rank) continue;
      try {
        context->getPair(peer)->close();
      } catch (const std::exception& error) {
        STRATA_LOG(kDebug) << who << ": closing the pair with rank " << peer << ": " << error.what();
      }
    }
  }
};

}  // namespace gloo_communicator_internal

using gloo_communicator_internal::State;

namespace {

// The local address the kernel would send from to reach `host`: connecting a UDP socket
// sends nothing but picks the route, so this is the interface the peers can reach.
StatusOr<std::string> local_address_towards(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port == 0 ? 9 : port);  // the route does not depend on the port
  if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0)
    return UnavailableError("gloo: cannot resolve the master address '" + host + "': " + ::gai_strerror(rc));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> owner(found, &::freeaddrinfo);
  const int fd = ::socket(found->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return IoError(std::string("gloo: socket: ") + std::strerror(errno));
  sockaddr_storage local{};
  socklen_t length = sizeof(local);
  const bool routed = ::connect(fd, found->ai_addr, found->ai_addrlen) == 0 &&
                      ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0;
  const int saved = errno;
  ::close(fd);
  if (!routed)
    return UnavailableError("gloo: no route to the master address '" + host + "': " + std::strerror(saved) +
                            " (set the listen address explicitly)");
  char text[INET6_ADDRSTRLEN] = {};
  const void* raw = local.ss_family == AF_INET6 ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
                                                : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
  if (::inet_ntop(local.ss_family, raw, text, sizeof(text)) == nullptr)
    return IoError(std::string("gloo: inet_ntop: ") + std::strerror(errno));
  return std::string(text);
}

// A peer that dies would otherwise kill this process with SIGPIPE when Gloo writes to
// its socket (Gloo uses writev, without MSG_NOSIGNAL). Ignored only when nobody chose
// another disposition.
void ignore_sigpipe_by_default() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    (void)::sigaction(SIGPIPE, &ignore, nullptr);
  }
}

// This rank's pair addresses, one per peer in rank order, as a blob of
// [u32 length][bytes] entries.
std::vector<std::byte> pack_addresses(State& state) {
  std::vector<std::byte> blob;
  for (int peer = 0; peer < state.world_size; ++peer) {
    if (peer == state.rank) continue;
    const std::vector<char> bytes = state.context->createPair(peer)->address().bytes();
    const auto length = static_cast<uint32_t>(bytes.size());
    const auto* length_bytes = reinterpret_cast<const std::byte*>(&length);
    blob.insert(blob.end(), length_bytes, length_bytes + sizeof(length));
    const auto* data = reinterpret_cast<const std::byte*>(bytes.data());
    blob.insert(blob.end(), data, data + bytes.size());
  }
  return blob;
}

// The address `peer` made for its pair with `rank`, from `peer`'s blob.
StatusOr<std::vector<char>> address_for(const std::vector<std::byte>& blob, int peer, int rank, int world_size) {
  const int index = rank < peer ? rank : rank - 1;
  size_t offset = 0;
  for (int entry = 0; entry < world_size - 1; ++entry) {
    uint32_t length = 0;
    if (offset + sizeof(length) > blob.size()) break;
    std::memcpy(&length, blob.data() + offset, sizeof(length));
    offset += sizeof(length);
    if (offset + length > blob.size()) break;
    if (entry == index) {
      const auto* data = reinterpret_cast<const char*>(blob.data() + offset);
      return std::vector<char>(data, data + length);
    }
    offset += length;
  }
  return DataLossError("gloo: rank " + std::to_string(peer) + "'s pair addresses (" + std::to_string(blob.size()) +
                       " bytes) hold no entry for rank " + std::to_string(rank) +
                       " (do all ranks run the same Strata build?)");
}

Status connect_pairs(State& state, Rendezvous& rendezvous) {
  std::vector<std::byte> mine;
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = state.address;
    state.device = gloo::transport::tcp::CreateDevice(attr);
    state.context = state.device->createContext(state.rank, state.world_size);
    state.context->setTimeout(state.options.timeout);
    mine = pack_addresses(state);
  } catch (const std::exception& error) {
    return UnavailableError("gloo: " + state.who + ": cannot listen on " + state.address + ": " + error.what());
  }
  StatusOr<std::vector<std::vector<std::byte>>> blobs = rendezvous.all_gather(mine);
  if (!blobs.ok()) return std::move(blobs).status().with_context("gloo: " + state.who + ": exchanging pair addresses");
  for (int peer = 0; peer < state.world_size; ++peer) {
    if (peer == state.rank) continue;
    STRATA_ASSIGN_OR_RETURN(const std::vector<char> address,
                            address_for((*blobs)[static_cast<size_t>(peer)], peer, state.rank, state.world_size));
    try {
      state.context->getPair(peer)->connect(address);
    } catch (const std::exception& error) {
      return UnavailableError("gloo: " + state.who + " could not connect to rank " + std::to_string(peer) + " within " +
                              seconds_text(state.options.timeout) + ": " + error.what() +
                              " (is rank " + std::to_string(peer) + " running, and can this host reach it?)");
    }
  }
  return Status::Ok();
}

// The message slot of the probes: operations use sequence * 2 + round, never this.
constexpr uint64_t kProbeSlot = ~uint64_t{0};

// Gloo (this version) tells a closed connection to the receives posted on it, but not to
// the one whose bytes were arriving when it closed: a peer killed in the middle of sending
// would leave that receive waiting until the deadline. A receive that is never matched
// stays posted for the pair's life, so it always hears: its thread marks the peer lost,
// which ends the waits on that peer at once. (Ends when the State goes: abortWaitRecv.)
void watch_peer(State* state, int peer) {
  try {
    (void)state->probes[static_cast<size_t>(peer)]->waitRecv(std::chrono::hours(24 * 365));
  } catch (const std::exception& error) {
    const std::string detail = error.what();
    // A closure Gloo made itself after a local timeout says nothing about the peer.
    if (detail.find("Application timeout") == std::string::npos) state->mark_lost(peer, detail);
  }
}

Status start_watchers(State& state) {
  state.probe_bytes.assign(static_cast<size_t>(state.world_size), 0);
  state.probes.resize(static_cast<size_t>(state.world_size));
  for (int peer = 0; peer < state.world_size; ++peer) {
    if (peer == state.rank) continue;
    try {
      auto& probe = state.probes[static_cast<size_t>(peer)];
      probe = state.context->createUnboundBuffer(&state.probe_bytes[static_cast<size_t>(peer)], 1);
      probe->recv(peer, kProbeSlot);
    } catch (const std::exception& error) {
      return UnavailableError("gloo: " + state.who + ": rank " + std::to_string(peer) + "'s connection failed at once: " + error.what());
    }
    STRATA_ASSIGN_OR_RETURN(std::thread watcher, spawn_thread("strata:gloo-peer", [raw = &state, peer] { watch_peer(raw, peer); }));
    state.watchers.push_back(std::move(watcher));
  }
  return Status::Ok();
}

}  // namespace

// ---------------------------------------------------------------------------
// Creation
// ---------------------------------------------------------------------------

StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::create(Rendezvous& rendezvous, Device& device,
                                                                     const GlooCommunicatorOptions& options) {
  if (!rendezvous.joined()) return FailedPreconditionError("gloo: the rendezvous has not joined yet (call join())");
  if (device.kind() != DeviceKind::kCpu)
    return InvalidArgumentError("gloo: " + device.description() +
                                " is not a CPU device; GlooCommunicator moves host memory (use NCCL for GPUs)");
  if (options.timeout.count() <= 0)
    return InvalidArgumentError("gloo: timeout " + std::to_string(options.timeout.count()) +
                                " ms: expected a positive duration");
  ignore_sigpipe_by_default();
  auto state = std::make_shared<State>(rendezvous.rank(), rendezvous.world_size(), options);
  if (!options.listen_address.empty()) {
    state->address = options.listen_address;
  } else {
    STRATA_ASSIGN_OR_RETURN(state->address,
                            local_address_towards(rendezvous.options().master_addr, rendezvous.port()));
  }
  if (state->world_size > 1) {
    STRATA_RETURN_IF_ERROR(connect_pairs(*state, rendezvous));
    STRATA_RETURN_IF_ERROR(start_watchers(*state));
  }
  return std::make_unique<GlooCommunicator>(std::move(state), device);
}

GlooCommunicator::GlooCommunicator(std::shared_ptr<State> state, Device& device)
    : StreamTaskCommunicator(device), state_(std::move(state)) {}

GlooCommunicator::~GlooCommunicator() = default;

int GlooCommunicator::rank() const { return state_->rank; }
int GlooCommunicator::world_size() const { return state_->world_size; }
const std::string& GlooCommunicator::listen_address() const { return state_->address; }

// ---------------------------------------------------------------------------
// Exchanges: every collective is one or two rounds of messages with each peer.
// ---------------------------------------------------------------------------

namespace {

// What this rank sends to and receives from one peer in one round.
struct Transfer {
  const std::byte* send = nullptr;
  size_t send_bytes = 0;
  std::byte* receive = nullptr;
  size_t receive_bytes = 0;
};

// How one peer's part of a round ended.
enum class PeerOutcome : uint8_t { kDone, kLost, kTimedOut, kAborted };

// The buffers of one round, registered with the state so that abort() can wake their
// waits, and unregistered before they go.
class RoundBuffers {
 public:
  RoundBuffers(State& state, int world) : state_(state), send_(static_cast<size_t>(world)), receive_(static_cast<size_t>(world)) {}
  RoundBuffers(const RoundBuffers&) = delete;
  RoundBuffers& operator=(const RoundBuffers&) = delete;
  ~RoundBuffers() {
    std::lock_guard<std::mutex> lock(state_.mutex);
    for (auto it = state_.waiting.begin(); it != state_.waiting.end();) {
      const size_t p = static_cast<size_t>(it->first);
      const bool mine = (send_[p] && it->second == send_[p].get()) || (receive_[p] && it->second == receive_[p].get());
      it = mine ? state_.waiting.erase(it) : std::next(it);
    }
  }
  // Creates the peer's buffers; fails when the communicator has already failed.
  Status add(int peer, const Transfer& transfer) {
    const size_t p = static_cast<size_t>(peer);
    if (transfer.send_bytes > 0)
      send_[p] = state_.context->createUnboundBuffer(const_cast<std::byte*>(transfer.send), transfer.send_bytes);
    if (transfer.receive_bytes > 0)
      receive_[p] = state_.context->createUnboundBuffer(transfer.receive, transfer.receive_bytes);
    std::lock_guard<std::mutex> lock(state_.mutex);
    if (send_[p]) state_.waiting.emplace(peer, send_[p].get());
    if (receive_[p]) state_.waiting.emplace(peer, receive_[p].get());
    return state_.failure;
  }
  gloo::transport::UnboundBuffer* send(int peer) { return send_[static_cast<size_t>(peer)].get(); }
  gloo::transport::UnboundBuffer* receive(int peer) { return receive_[static_cast<size_t>(peer)].get(); }

 private:
  State& state_;
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> send_;
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> receive_;
};

bool is_timeout(const std::string& message) { return message.find("Timed out waiting") != std::string::npos; }

std::chrono::milliseconds remaining(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

// Waits for one peer's part (its receive, then its send); never throws.
PeerOutcome wait_for_peer(RoundBuffers& buffers, int peer, Clock::time_point deadline, std::string* detail) {
  try {
    if (auto* receive = buffers.receive(peer); receive != nullptr && !receive->waitRecv(remaining(deadline)))
      return PeerOutcome::kAborted;
    if (auto* send = buffers.send(peer); send != nullptr && !send->waitSend(remaining(deadline)))
      return PeerOutcome::kAborted;
    return PeerOutcome::kDone;
  } catch (const std::exception& error) {
    *detail = error.what();
    return is_timeout(*detail) ? PeerOutcome::kTimedOut : PeerOutcome::kLost;
  }
}

// Sends and receives `transfers[p]` with every peer p on message slot `slot`, all at
// once, and waits for all of them until `deadline`. A peer that fails does not stop the
// exchanges with the others: they finish (or fail) too, so every rank sees who was lost.
Status exchange(State& state, const std::vector<Transfer>& transfers, uint64_t slot, const std::string& what,
                Clock::time_point deadline) {
  const int world = state.world_size;
  RoundBuffers buffers(state, world);
  std::vector<PeerOutcome> outcomes(static_cast<size_t>(world), PeerOutcome::kDone);
  std::vector<std::string> details(static_cast<size_t>(world));
  for (int peer = 0; peer < world; ++peer) {
    if (peer == state.rank) continue;
    const Transfer& transfer = transfers[static_cast<size_t>(peer)];
    try {
      if (Status failed = buffers.add(peer, transfer); !failed.ok())
        return Status(failed.code(), state.who + ": " + what + " stopped: " + failed.message());
      // Receives first: a peer's send waits until this side is ready for it.
      if (auto* receive = buffers.receive(peer)) receive->recv(peer, slot);
      if (auto* send = buffers.send(peer)) send->send(peer, slot);
    } catch (const std::exception& error) {
      outcomes[static_cast<size_t>(peer)] = PeerOutcome::kLost;
      details[static_cast<size_t>(peer)] = error.what();
    }
  }
  for (int peer = 0; peer < world; ++peer) {
    if (peer == state.rank || outcomes[static_cast<size_t>(peer)] != PeerOutcome::kDone) continue;
    PeerOutcome outcome = wait_for_peer(buffers, peer, deadline, &details[static_cast<size_t>(peer)]);
    if (outcome == PeerOutcome::kAborted) {
      // Woken by the peer's watcher (its connection ended), or by abort().
      if (std::string detail = state.lost_detail(peer); !detail.empty()) {
        outcome = PeerOutcome::kLost;
        details[static_cast<size_t>(peer)] = std::move(detail);
      }
    }
    outcomes[static_cast<size_t>(peer)] = outcome;
  }

  std::vector<int> lost;
  std::vector<int> silent;
  bool aborted = false;
  for (int peer = 0; peer < world; ++peer) {
    switch (outcomes[static_cast<size_t>(peer)]) {
      case PeerOutcome::kDone: break;
      case PeerOutcome::kLost:
        // A pair closed because another wait of this context timed out says nothing about its peer.
        if (details[static_cast<size_t>(peer)].find("Application timeout") == std::string::npos) lost.push_back(peer);
        break;
      case PeerOutcome::kTimedOut: silent.push_back(peer); break;
      case PeerOutcome::kAborted: aborted = true; break;
    }
  }
  std::string lost_text;
  if (!lost.empty()) {
    lost_text = ranks_text(lost) + (lost.size() == 1 ? " closed its" : " closed their") + " connection during " + what +
                " (did it exit, fail or abort?)";
    for (int peer : lost) lost_text += "; rank " + std::to_string(peer) + ": " + details[static_cast<size_t>(peer)];
  }
  // A silent rank is the likelier cause when both happen: a peer that timed out on it
  // closes its connections too.
  if (!silent.empty())
    return DeadlineExceededError(state.who + ": " + what + ": " + ranks_text(silent) + " sent nothing within " +
                                 seconds_text(state.options.timeout) +
                                 " (a rank failed, is stuck, or issued different collectives)" +
                                 (lost_text.empty() ? "" : "; also " + lost_text));
  if (!lost.empty()) return UnavailableError(state.who + ": " + lost_text);
  if (aborted || !state.current_failure().ok()) {
    const Status failure = state.current_failure();
    return Status(failure.ok() ? StatusCode::kCancelled : failure.code(),
                  state.who + ": " + what + " stopped: " + (failure.ok() ? "aborted" : failure.message()));
  }
  return Status::Ok();
}

// One collective as this rank issued it.
struct Operation : CollectiveCall {
  uint64_t sequence = 0;
  std::string what;  // "reduce_scatter #12"
};

// Slices of a reduction: rank r reduces elements [begin[r], begin[r] + count[r]).
struct Slices {
  std::vector<size_t> begin;
  std::vector<size_t> count;
};

Slices reduction_slices(const Operation& op, int world) {
  Slices slices;
  for (int rank = 0; rank < world; ++rank) {
    if (op.kind == CollectiveKind::kReduceScatter) {
      slices.begin.push_back(static_cast<size_t>(rank) * op.count);
      slices.count.push_back(op.count);
    } else {
      const auto [begin, end] = all_reduce_slice(op.count, world, rank);
      slices.begin.push_back(begin);
      slices.count.push_back(end - begin);
    }
  }
  return slices;
}

// Message slots: two rounds per operation at most.
uint64_t slot_of(const Operation& op, int round) { return op.sequence * 2 + static_cast<uint64_t>(round); }

Status run_reduction(State& state, const Operation& op, Executor* executor, Clock::time_point deadline) {
  const int world = state.world_size;
  const size_t me = static_cast<size_t>(state.rank);
  const Slices slices = reduction_slices(op, world);
  const size_t total = slices.begin.back() + slices.count.back();
  const size_t element = dtype_size(op.dtype);
  const size_t wire_bytes = dtype_size(op.wire);
  const size_t mine = slices.count[me];

  // fp32 data with a 16-bit wire is rounded once, before it travels.
  std::vector<uint16_t> rounded;
  const std::byte* wire_send = op.send;
  if (op.wire != op.dtype) {
    rounded.resize(total);
    cast_to_wire(reinterpret_cast<const float*>(op.send), rounded.data(), total, op.wire, executor);
    wire_send = reinterpret_cast<const std::byte*>(rounded.data());
  }
  // Every peer's copy of this rank's slice; this rank's own copy is read in place.
  std::vector<std::byte> contributions(static_cast<size_t>(world) * mine * wire_bytes);
  std::vector<Transfer> transfers(static_cast<size_t>(world));
  std::vector<const std::byte*> inputs(static_cast<size_t>(world));
  for (size_t p = 0; p < static_cast<size_t>(world); ++p) {
    inputs[p] = p == me ? wire_send + slices.begin[me] * wire_bytes : contributions.data() + p * mine * wire_bytes;
    if (p == me) continue;
    transfers[p] = {.send = wire_send + slices.begin[p] * wire_bytes,
                    .send_bytes = slices.count[p] * wire_bytes,
                    .receive = contributions.data() + p * mine * wire_bytes,
                    .receive_bytes = mine * wire_bytes};
  }
  STRATA_RETURN_IF_ERROR(exchange(state, transfers, slot_of(op, 0), op.what, deadline));
  std::byte* reduced = op.recv + (op.kind == CollectiveKind::kAllReduce ? slices.begin[me] * element : 0);
  reduce_in_rank_order(inputs, mine, op.wire, op.wire, op.op, op.dtype, reduced, executor);
  if (op.kind != CollectiveKind::kAllReduce) return Status::Ok();

  // all_reduce: every rank's reduced slice to every rank.
  for (size_t p = 0; p < static_cast<size_t>(world); ++p) {
    if (p == me) continue;
    transfers[p] = {.send = reduced,
                    .send_bytes = mine * element,
                    .receive = op.recv + slices.begin[p] * element,
                    .receive_bytes = slices.count[p] * element};
  }
  return exchange(state, transfers, slot_of(op, 1), op.what, deadline);
}

// Runs one collective on this rank; never throws.
Status run_operation(State& state, const Operation& op, Executor* executor) {
  if (Status failure = state.current_failure(); !failure.ok())
    return Status(failure.code(), state.who + ": " + op.what + " refused: the communicator failed earlier: " +
                                      failure.message());
  const Clock::time_point deadline = Clock::now() + state.options.timeout;
  const int world = state.world_size;
  const size_t element = dtype_size(op.dtype);
  std::vector<Transfer> transfers(static_cast<size_t>(world));
  Status status;
  switch (op.kind) {
    case CollectiveKind::kBarrier: {
      // One byte each way with every peer.
      std::vector<std::byte> tokens(static_cast<size_t>(world) * 2);
      for (size_t p = 0; p < static_cast<size_t>(world); ++p)
        transfers[p] = {.send = &tokens[2 * p], .send_bytes = 1, .receive = &tokens[2 * p + 1], .receive_bytes = 1};
      status = world > 1 ? exchange(state, transfers, slot_of(op, 0), op.what, deadline) : Status::Ok();
      break;
    }
    case CollectiveKind::kAllGather: {
      const size_t piece = op.count * element;
      std::byte* own = op.recv + static_cast<size_t>(state.rank) * piece;
      if (piece > 0 && own != op.send) std::memmove(own, op.send, piece);
      for (size_t p = 0; p < static_cast<size_t>(world); ++p)
        transfers[p] = {.send = own, .send_bytes = piece, .receive = op.recv + p * piece, .receive_bytes = piece};
      status = exchange(state, transfers, slot_of(op, 0), op.what, deadline);
      break;
    }
    case CollectiveKind::kBroadcast: {
      const size_t bytes = op.count * element;
      if (state.rank == op.root) {
        if (bytes > 0 && op.recv != op.send) std::memmove(op.recv, op.send, bytes);
        for (auto& transfer : transfers) transfer = {.send = op.recv, .send_bytes = bytes};
      } else {
        transfers[static_cast<size_t>(op.root)] = {.receive = op.recv, .receive_bytes = bytes};
      }
      status = exchange(state, transfers, slot_of(op, 0), op.what, deadline);
      break;
    }
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllReduce:
      status = run_reduction(state, op, executor, deadline);
      break;
  }
  // A rank that failed closes its connections: peers still waiting on it fail now, not at
  // their deadline (NCCL's abort does the same).
  if (!status.ok()) state.abort(status);
  return status;
}

}  // namespace

// ---------------------------------------------------------------------------
// GlooCommunicator operations
// ---------------------------------------------------------------------------

Status GlooCommunicator::enqueue(CollectiveCall call, const std::optional<ReduceOptions>& reduce, Stream& stream) {
  State& state = *state_;
  Operation op;
  static_cast<CollectiveCall&>(op) = call;
  op.what = std::string(collective_kind_name(op.kind)) + " #" + std::to_string(next_sequence_.load());
  // Every enqueue-time failure aborts: the peers would otherwise wait for a collective
  // this rank never issues.
  const auto reject = [&](Status problem) {
    Status status = std::move(problem).with_context("gloo: " + state.who + ": " + op.what + " was rejected");
    state.abort(status);
    return status;
  };
  if (Status failure = state.current_failure(); !failure.ok())
    return Status(failure.code(), state.who + ": " + op.what + " refused: the communicator failed earlier: " +
                                      failure.message());
  if (Status problem = check_call(op, reduce, stream); !problem.ok()) return reject(std::move(problem));
  op.sequence = next_sequence_.fetch_add(1);
  auto dropped = [state = state_, what = op.what, stream_name = stream.name()] {
    state->abort(CancelledError(state->who + ": " + what + " never ran: stream '" + stream_name +
                                "' dropped it (an earlier error on that stream, or the stream went away)"));
  };
  Status launched = launch_guarded(stream, std::move(dropped), [state = state_, op = std::move(op)](const LaunchContext& context) {
    return run_operation(*state, op, context.executor);
  });
  if (!launched.ok()) return reject(std::move(launched));
  return Status::Ok();
}

void GlooCommunicator::abort(std::string_view reason) {
  state_->abort(CancelledError(state_->who + " aborted: " + std::string(reason)));
}

Status GlooCommunicator::async_error() { return state_->current_failure(); }

}  // namespace strata
