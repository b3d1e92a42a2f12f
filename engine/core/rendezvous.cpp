#include "engine/core/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>

#include "engine/core/check.h"
#include "engine/core/collective_text.h"
#include "engine/core/log.h"
#include "engine/core/rendezvous_wire.h"

namespace strata {

using namespace rendezvous_wire;  // the wire format and the socket helpers of this file's protocol

namespace {

// Rank 0's text without its own "rendezvous: " prefix, to follow ours.
std::string without_prefix(std::string text) {
  constexpr std::string_view kPrefix = "rendezvous: ";
  if (text.starts_with(kPrefix)) text.erase(0, kPrefix.size());
  return text;
}

// Rank 0's join timed out with `missing` ranks absent.
Status never_arrived_error(const RendezvousOptions& options, uint16_t port, const std::vector<int>& missing) {
  return DeadlineExceededError("rendezvous: rank 0 waited " + seconds_text(options.timeout) + " on port " + std::to_string(port) +
                               " but rank" + (missing.size() == 1 ? " " : "s ") + rank_list_text(missing) + " of WORLD_SIZE=" +
                               std::to_string(options.world_size) + " never arrived (" +
                               (missing.size() == 1 ? "is it" : "are they") + " running, with MASTER_ADDR=" +
                               options.master_addr + " MASTER_PORT=" + std::to_string(port) + "?)");
}

// Why a connection's first message cannot join a group of `world` ranks (Ok when it can):
// not a hello, another WORLD_SIZE, a rank out of range, or a rank that `claimed_by`
// (non-null) already holds.
Status hello_problem(const Message& hello, const std::string& who, int world, const std::string* claimed_by) {
  if (hello.header.kind != MessageKind::kHello) {
    return DataLossError("rendezvous: a connection (" + who + ") sent " + std::string(message_kind_name(hello.header.kind)) +
                         " before hello");
  }
  if (hello.header.aux != world) {
    return InvalidArgumentError("rendezvous: rank " + std::to_string(hello.header.rank) + " (" + who + ") has WORLD_SIZE=" +
                                std::to_string(hello.header.aux) + " but rank 0 has WORLD_SIZE=" + std::to_string(world) +
                                ": every process must be started with the same WORLD_SIZE");
  }
  if (hello.header.rank <= 0 || hello.header.rank >= world) {
    return InvalidArgumentError("rendezvous: a process (" + who + ") has RANK=" + std::to_string(hello.header.rank) +
                                ", outside [1, " + std::to_string(world - 1) + "] for the non-root ranks of WORLD_SIZE=" +
                                std::to_string(world));
  }
  if (claimed_by != nullptr) {
    return InvalidArgumentError("rendezvous: two processes have RANK=" + std::to_string(hello.header.rank) + ": " +
                                *claimed_by + " and " + who + "; every process needs its own RANK");
  }
  return Status::Ok();
}

}  // namespace

// A connection with the bytes received so far that do not yet make a whole message.
struct Rendezvous::Peer {
  File socket;
  int rank = -1;            // -1 while a hello is awaited
  std::string description;  // "rank 2 (host pid 123)"
  std::vector<std::byte> inbox;
  bool closed = false;      // the other end has closed; `inbox` may still hold whole messages

  // Takes one whole message off the inbox if there is one.
  StatusOr<std::optional<Message>> take_message() {
    if (inbox.size() < kHeaderBytes) return std::optional<Message>();
    size_t offset = 0;
    Message message;
    message.header.magic = get<uint32_t>(inbox.data(), offset);
    message.header.version = get<uint16_t>(inbox.data(), offset);
    message.header.kind = static_cast<MessageKind>(get<uint16_t>(inbox.data(), offset));
    message.header.rank = get<int32_t>(inbox.data(), offset);
    message.header.aux = get<int32_t>(inbox.data(), offset);
    message.header.sequence = get<uint64_t>(inbox.data(), offset);
    message.header.length = get<uint64_t>(inbox.data(), offset);
    if (message.header.magic != kMagic || message.header.version != kProtocolVersion)
      return DataLossError("rendezvous: " + description +
                           " sent bytes that are not a Strata rendezvous message of protocol version " +
                           std::to_string(kProtocolVersion) + " (another program on MASTER_PORT?)");
    if (message.header.length > kMaxPayloadBytes)
      return DataLossError("rendezvous: " + description + " announced a payload of " +
                           std::to_string(message.header.length) + " bytes, more than the limit of " +
                           std::to_string(kMaxPayloadBytes));
    if (inbox.size() < kHeaderBytes + message.header.length) return std::optional<Message>();
    const auto payload_begin = inbox.begin() + kHeaderBytes;
    const auto payload_end = payload_begin + static_cast<std::ptrdiff_t>(message.header.length);
    message.payload.assign(payload_begin, payload_end);
    inbox.erase(inbox.begin(), payload_end);
    return std::optional<Message>(std::move(message));
  }

  // Reads what the socket has now. Returns false at end of stream.
  StatusOr<bool> read_available() {
    std::byte chunk[65536];
    while (true) {
      const ssize_t got = ::recv(socket.fd(), chunk, sizeof(chunk), 0);
      if (got > 0) {
        inbox.insert(inbox.end(), chunk, chunk + got);
        continue;
      }
      if (got == 0) return false;
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      if (errno == ECONNRESET) return false;
      return Status::FromErrno(errno, "recv from " + description);
    }
  }

  Status send(const MessageHeader& header, std::span<const std::byte> payload, Clock::time_point deadline) {
    const std::vector<std::byte> bytes = encode(header, payload);
    return send_all(socket.fd(), bytes, deadline, description);
  }

  // Waits for one whole message by `deadline`; `waiting_for` completes the timeout message.
  StatusOr<Message> receive(Clock::time_point deadline, const std::string& waiting_for) {
    while (true) {
      STRATA_ASSIGN_OR_RETURN(std::optional<Message> message, take_message());
      if (message) return std::move(*message);
      if (closed)
        return UnavailableError("rendezvous: " + description + " closed the connection " + waiting_for +
                                " (did that process exit or fail?)");
      std::vector<pollfd> fds{{socket.fd(), POLLIN, 0}};
      int ready = 0;
      STRATA_RETURN_IF_ERROR(poll_fds(fds, remaining_ms(deadline), &ready));
      if (ready == 0) return DeadlineExceededError("rendezvous: timed out " + waiting_for);
      STRATA_ASSIGN_OR_RETURN(const bool open, read_available());
      if (!open) closed = true;
    }
  }
};

Rendezvous::Rendezvous(const RendezvousOptions& options) : options_(options) {}
Rendezvous::Rendezvous(Rendezvous&&) noexcept = default;
Rendezvous& Rendezvous::operator=(Rendezvous&&) noexcept = default;
Rendezvous::~Rendezvous() = default;

Status Rendezvous::fail(Status status) {
  if (!failure_.ok()) return status;
  failure_ = status;
  // Rank 0 is the hub: tell the others why the group is over, so that none of them
  // waits out its own deadline.
  if (options_.rank == 0 && joined_) {
    const std::string text = "rank 0 failed: " + without_prefix(status.message());
    const Clock::time_point soon = Clock::now() + std::chrono::seconds(1);
    for (Peer& peer : peers_)
      if (peer.socket.is_open() && !peer.closed)
        (void)peer.send(MessageHeader{.kind = MessageKind::kReject, .rank = 0}, as_bytes(text), soon);
  }
  return status;
}

StatusOr<Rendezvous> Rendezvous::start(const RendezvousOptions& options) {
  if (options.world_size < 1)
    return InvalidArgumentError("rendezvous: world size " + std::to_string(options.world_size) +
                                " (WORLD_SIZE): expected at least 1");
  if (options.rank < 0 || options.rank >= options.world_size)
    return InvalidArgumentError("rendezvous: rank " + std::to_string(options.rank) + " (RANK) is outside [0, " +
                                std::to_string(options.world_size - 1) + "] for world size " +
                                std::to_string(options.world_size) + " (WORLD_SIZE)");
  if (options.timeout.count() <= 0) return InvalidArgumentError("rendezvous: the timeout must be positive");
  if (options.collective_timeout.count() <= 0)
    return InvalidArgumentError("rendezvous: the collective timeout (STRATA_COLLECTIVE_TIMEOUT_S) must be positive");
  Rendezvous rendezvous(options);
  rendezvous.port_ = options.master_port;
  if (options.world_size == 1) return rendezvous;
  if (options.rank != 0) {
    if (options.master_port == 0)
      return InvalidArgumentError("rendezvous: rank " + std::to_string(options.rank) +
                                  " has MASTER_PORT=0; only rank 0 may ask for a free port, the other ranks need "
                                  "the port rank 0 reports");
    return rendezvous;
  }

  const std::string& host = options.listen_address.empty() ? options.master_addr : options.listen_address;
  STRATA_ASSIGN_OR_RETURN(AddrInfoPtr addresses, resolve(host, options.master_port, /*passive=*/true));
  Status last_error = InternalError("rendezvous: no address to listen on for '" + host + "'");
  for (const addrinfo* address = addresses.get(); address != nullptr; address = address->ai_next) {
    const auto listen_on = [&]() -> Status {
      int fd = -1;
      STRATA_SYSCALL(fd, ::socket(address->ai_family, address->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                                  address->ai_protocol));
      File socket(fd, "socket");
      int result = 0;
      const int one = 1;
      STRATA_SYSCALL(result, ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)));
      STRATA_SYSCALL(result, ::bind(fd, address->ai_addr, address->ai_addrlen));
      STRATA_SYSCALL(result, ::listen(fd, std::min(options.world_size, 4096)));
      rendezvous.listener_ = std::move(socket);
      return Status::Ok();
    };
    last_error = listen_on();
    if (last_error.ok()) break;
  }
  if (!last_error.ok())
    return std::move(last_error).with_context("rendezvous: rank 0 cannot listen on " + host + ":" +
                                              std::to_string(options.master_port) + " (MASTER_ADDR:MASTER_PORT)");
  rendezvous.port_ = bound_port(rendezvous.listener_.fd());
  STRATA_LOG(kDebug) << "rendezvous: rank 0 listening on " << host << ":" << rendezvous.port_ << " for "
                     << options.world_size << " ranks";
  return rendezvous;
}

StatusOr<Rendezvous> Rendezvous::create(const RendezvousOptions& options) {
  STRATA_ASSIGN_OR_RETURN(Rendezvous rendezvous, start(options));
  STRATA_RETURN_IF_ERROR(rendezvous.join());
  return rendezvous;
}

Status Rendezvous::join() {
  if (!failure_.ok()) return failure_;
  if (joined_) return FailedPreconditionError("rendezvous: join() called twice");
  if (options_.world_size == 1) {
    joined_ = true;
    return Status::Ok();
  }
  Status status = options_.rank == 0 ? join_as_root() : join_as_peer();
  if (!status.ok()) {
    peers_.clear();
    listener_.reset();
    return fail(std::move(status));
  }
  joined_ = true;
  return Status::Ok();
}

Status Rendezvous::join_as_root() {
  const Clock::time_point deadline = Clock::now() + options_.timeout;
  const int world = options_.world_size;
  peers_.clear();
  peers_.resize(static_cast<size_t>(world));
  std::vector<Peer> pending;  // accepted, hello not yet read
  int present = 1;

  while (present < world) {
    std::vector<pollfd> fds;
    fds.push_back({listener_.fd(), POLLIN, 0});
    for (const Peer& peer : pending) fds.push_back({peer.socket.fd(), POLLIN, 0});
    int ready = 0;
    STRATA_RETURN_IF_ERROR(poll_fds(fds, remaining_ms(deadline), &ready));
    if (ready == 0) {
      std::vector<int> missing;
      for (int rank = 1; rank < world; ++rank)
        if (!peers_[static_cast<size_t>(rank)].socket.is_open()) missing.push_back(rank);
      Status timeout = never_arrived_error(options_, port_, missing);
      reject_all(pending, timeout);
      return timeout;
    }
    // Hellos first (fds[1..] refer to `pending` as it was when polled).
    std::vector<Peer> still_pending;
    for (size_t i = 0; i < pending.size(); ++i) {
      bool keep = true;
      if (fds[i + 1].revents != 0) {
        StatusOr<bool> kept = read_hello(pending[i], pending, present);
        if (!kept.ok()) return kept.status();
        keep = *kept;
      }
      if (keep) still_pending.push_back(std::move(pending[i]));
    }
    pending = std::move(still_pending);
    // Then new connections.
    if (fds[0].revents != 0) STRATA_RETURN_IF_ERROR(accept_connections(pending));
  }

  // Everyone is here: welcome them all. The listener is no longer needed.
  listener_.reset();
  for (int rank = 1; rank < world; ++rank) {
    Peer& peer = peers_[static_cast<size_t>(rank)];
    STRATA_RETURN_IF_ERROR(peer.send(MessageHeader{.kind = MessageKind::kWelcome, .rank = 0}, {}, deadline));
  }
  STRATA_LOG(kDebug) << "rendezvous: all " << world << " ranks present on port " << port_;
  return Status::Ok();
}

// Tells every connected rank why the group cannot form, so no one waits out its own deadline.
void Rendezvous::reject_all(std::vector<Peer>& pending, const Status& why) {
  const std::string text = why.message();
  MessageHeader header{.kind = MessageKind::kReject, .rank = 0};
  const Clock::time_point soon = Clock::now() + std::chrono::seconds(1);
  for (Peer& peer : peers_)
    if (peer.socket.is_open()) (void)peer.send(header, as_bytes(text), soon);
  for (Peer& peer : pending)
    if (peer.socket.is_open()) (void)peer.send(header, as_bytes(text), soon);
}

// Reads what a pending connection has sent. A whole, valid hello moves it into peers_ as its
// rank (counted in `present`); a hello that cannot join fails the group, told to every rank.
// Returns whether `peer` stays pending: true while its hello is incomplete and it is open.
StatusOr<bool> Rendezvous::read_hello(Peer& peer, std::vector<Peer>& pending, int& present) {
  const int world = options_.world_size;
  STRATA_ASSIGN_OR_RETURN(const bool open, peer.read_available());
  StatusOr<std::optional<Message>> taken = peer.take_message();
  if (!taken.ok()) {
    // Not one of ours (a port scanner, another program): drop it, keep waiting.
    STRATA_LOG(kWarn) << taken.status().message() << "; dropping that connection";
    return false;
  }
  if (!taken->has_value()) return open;
  const Message hello = std::move(**taken);
  const std::string who = as_string(hello.payload);
  const Peer& claimed = peers_[static_cast<size_t>(std::clamp(hello.header.rank, 0, world - 1))];
  const Status problem = hello_problem(hello, who, world, claimed.socket.is_open() ? &claimed.description : nullptr);
  if (!problem.ok()) {
    const std::string text = problem.message();
    (void)peer.send(MessageHeader{.kind = MessageKind::kReject, .rank = 0}, as_bytes(text),
                    Clock::now() + std::chrono::seconds(1));
    reject_all(pending, problem);
    return problem;
  }
  peer.rank = hello.header.rank;
  peer.description = "rank " + std::to_string(peer.rank) + " (" + who + ")";
  peers_[static_cast<size_t>(peer.rank)] = std::move(peer);
  ++present;
  return false;
}

// Accepts every connection the listener has ready onto `pending` (their hellos follow).
Status Rendezvous::accept_connections(std::vector<Peer>& pending) {
  while (true) {
    const int fd = ::accept4(listener_.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return Status::Ok();
      return Status::FromErrno(errno, "rendezvous: accept on port " + std::to_string(port_));
    }
    Peer peer;
    peer.socket = File(fd, "socket");
    peer.description = "a connecting process";
    STRATA_RETURN_IF_ERROR(set_socket_options(fd));
    pending.push_back(std::move(peer));
  }
}

Status Rendezvous::join_as_peer() {
  const Clock::time_point deadline = Clock::now() + options_.timeout;
  const std::string target = options_.master_addr + ":" + std::to_string(options_.master_port);
  const std::string me = "rank " + std::to_string(options_.rank) + " of WORLD_SIZE=" + std::to_string(options_.world_size);
  STRATA_ASSIGN_OR_RETURN(AddrInfoPtr addresses, resolve(options_.master_addr, options_.master_port, /*passive=*/false));

  // Rank 0 may start later than we do: retry refused connections until the deadline.
  Peer root;
  root.rank = 0;
  root.description = "rank 0 at " + target;
  Status last_error;
  auto backoff = std::chrono::milliseconds(10);
  while (!root.socket.is_open()) {
    for (const addrinfo* address = addresses.get(); address != nullptr && !root.socket.is_open();
         address = address->ai_next) {
      StatusOr<File> socket = try_connect(*address, deadline);
      if (socket.ok()) {
        root.socket = std::move(socket).value();
      } else {
        last_error = socket.status();
      }
    }
    if (root.socket.is_open()) break;
    if (Clock::now() >= deadline)
      return DeadlineExceededError("rendezvous: " + me + " could not connect to rank 0 at MASTER_ADDR:MASTER_PORT=" +
                                   target + " within " + seconds_text(options_.timeout) + " (last error: " +
                                   last_error.message() + "); is rank 0 running, and are MASTER_ADDR and "
                                   "MASTER_PORT the ones it uses?");
    std::this_thread::sleep_for(std::min(backoff, std::chrono::milliseconds(std::max(1, remaining_ms(deadline)))));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }

  const std::string who = host_and_pid();
  STRATA_RETURN_IF_ERROR(root.send(
      MessageHeader{.kind = MessageKind::kHello, .rank = options_.rank, .aux = options_.world_size}, as_bytes(who),
      deadline));
  StatusOr<Message> reply = root.receive(
      deadline, "after connecting to rank 0 at " + target + ": " + me +
                    " waited " + seconds_text(options_.timeout) + " for the other ranks to arrive");
  if (!reply.ok()) return reply.status();
  if (reply->header.kind == MessageKind::kReject)
    return Status(StatusCode::kFailedPrecondition, "rendezvous: rank 0 refused " + me + ": " + without_prefix(as_string(reply->payload)));
  if (reply->header.kind != MessageKind::kWelcome)
    return DataLossError("rendezvous: rank 0 answered hello with " +
                         std::string(message_kind_name(reply->header.kind)));
  peers_.clear();
  peers_.push_back(std::move(root));
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Collectives: a star through rank 0.
// ---------------------------------------------------------------------------
namespace {

std::string collective_text(MessageKind kind, uint64_t sequence) {
  return std::string(message_kind_name(kind)) + " #" + std::to_string(sequence);
}

// How much longer than collective_timeout a rank waits for rank 0's reply once rank 0 said
// it is in the collective: the time rank 0 takes to send the names of the missing ranks.
constexpr std::chrono::seconds kRelayMargin{1};

// Checks that a received message is the collective this rank is running.
Status expect_collective(const Message& message, MessageKind kind, uint64_t sequence, int aux, int my_rank,
                         const std::string& from) {
  if (message.header.kind == MessageKind::kReject)
    return Status(StatusCode::kFailedPrecondition, "rendezvous: rank 0 ended the group: " + without_prefix(as_string(message.payload)));
  if (message.header.kind != kind || message.header.sequence != sequence || message.header.aux != aux) {
    std::string theirs = collective_text(message.header.kind, message.header.sequence);
    std::string mine = collective_text(kind, sequence);
    if (kind == MessageKind::kBroadcast) {
      mine += " (root " + std::to_string(aux) + ")";
      if (message.header.kind == MessageKind::kBroadcast) theirs += " (root " + std::to_string(message.header.aux) + ")";
    }
    return FailedPreconditionError("rendezvous: " + from + " is at " + theirs + " but rank " + std::to_string(my_rank) +
                                   " is at " + mine +
                                   ": every rank must call the same collectives in the same order");
  }
  return Status::Ok();
}

// The reply of a gather: for each rank, a uint64 length then the bytes.
std::vector<std::byte> pack_gather_reply(const std::vector<std::vector<std::byte>>& blobs) {
  std::vector<std::byte> reply;
  for (const std::vector<std::byte>& item : blobs) {
    const uint64_t length = item.size();
    const auto* length_bytes = reinterpret_cast<const std::byte*>(&length);
    reply.insert(reply.end(), length_bytes, length_bytes + sizeof(length));
    reply.insert(reply.end(), item.begin(), item.end());
  }
  return reply;
}

// Reads pack_gather_reply's layout back into `blobs` (one per rank).
Status unpack_gather_reply(const std::vector<std::byte>& payload, const std::string& what,
                           std::vector<std::vector<std::byte>>& blobs) {
  size_t offset = 0;
  for (std::vector<std::byte>& blob : blobs) {
    if (payload.size() - offset < sizeof(uint64_t)) return DataLossError("rendezvous: truncated " + what + " reply");
    const uint64_t length = get<uint64_t>(payload.data(), offset);
    if (length > payload.size() - offset) return DataLossError("rendezvous: truncated " + what + " reply");
    blob.assign(payload.begin() + static_cast<std::ptrdiff_t>(offset),
                payload.begin() + static_cast<std::ptrdiff_t>(offset + length));
    offset += length;
  }
  return Status::Ok();
}

}  // namespace

StatusOr<std::vector<std::vector<std::byte>>> Rendezvous::all_gather(std::span<const std::byte> blob) {
  return gather_all(blob, static_cast<uint16_t>(MessageKind::kAllGather));
}

Status Rendezvous::barrier() {
  // A barrier is a gather of nothing: rank 0 replies only once every rank has arrived.
  return gather_all({}, static_cast<uint16_t>(MessageKind::kBarrier)).status();
}

// One all_gather or barrier in progress: what each of its steps needs.
struct Rendezvous::Gather {
  MessageKind kind = MessageKind::kAllGather;
  uint64_t sequence = 0;
  Clock::time_point deadline;
  std::string what;                           // "all_gather #3", for messages
  std::vector<std::vector<std::byte>> blobs;  // indexed by rank
};

StatusOr<std::vector<std::vector<std::byte>>> Rendezvous::gather_all(std::span<const std::byte> blob,
                                                                      uint16_t kind_code) {
  const auto kind = static_cast<MessageKind>(kind_code);
  if (!failure_.ok()) return failure_;
  if (!joined_) return FailedPreconditionError("rendezvous: " + std::string(message_kind_name(kind)) + " before join()");
  const uint64_t sequence = next_sequence_++;
  const int world = options_.world_size;
  std::vector<std::vector<std::byte>> blobs(static_cast<size_t>(world));
  blobs[static_cast<size_t>(options_.rank)].assign(blob.begin(), blob.end());
  if (world == 1) return blobs;
  Gather gather{.kind = kind,
                .sequence = sequence,
                .deadline = Clock::now() + options_.collective_timeout,
                .what = collective_text(kind, sequence),
                .blobs = std::move(blobs)};
  // Every failure of a collective leaves the rendezvous unusable (see fail()).
  StatusOr<std::vector<std::vector<std::byte>>> gathered =
      options_.rank != 0 ? gather_through_root(blob, gather) : gather_at_root(gather);
  if (!gathered.ok()) return fail(gathered.status());
  return gathered;
}

// A rank other than 0: its blob to rank 0, every rank's blob back.
StatusOr<std::vector<std::vector<std::byte>>> Rendezvous::gather_through_root(std::span<const std::byte> blob,
                                                                               Gather& gather) {
  const std::string& what = gather.what;
  Peer& root = peers_[0];
  Status sent = root.send(MessageHeader{.kind = gather.kind, .rank = options_.rank, .sequence = gather.sequence}, blob,
                          gather.deadline);
  if (!sent.ok()) return std::move(sent).with_context("rendezvous " + what);
  Clock::time_point reply_deadline = gather.deadline;
  StatusOr<Message> reply = root.receive(reply_deadline, "in " + what + " on rank " + std::to_string(options_.rank) +
                                                             " waiting " + seconds_text(options_.collective_timeout) +
                                                             " for rank 0 (stuck, or not in this collective?)");
  if (reply.ok() && reply->header.kind == MessageKind::kWaiting && reply->header.sequence == gather.sequence) {
    // Rank 0 is alive and in this gather, waiting at most collective_timeout for the
    // missing ranks; it then sends their names. Waiting for that, rather than timing out
    // first on a clock started earlier, is what lets this rank name the stuck one.
    reply_deadline = Clock::now() + options_.collective_timeout + kRelayMargin;
    reply = root.receive(reply_deadline, "in " + what + " on rank " + std::to_string(options_.rank) +
                                             " waiting for rank 0's reply after it entered the collective");
  }
  if (!reply.ok()) return reply.status();
  if (Status status = expect_collective(*reply, gather.kind, gather.sequence, 0, options_.rank, "rank 0"); !status.ok())
    return status;
  if (Status status = unpack_gather_reply(reply->payload, what, gather.blobs); !status.ok()) return status;
  return std::move(gather.blobs);
}

// Rank 0: tell the others it is here (see kWaiting), collect every rank's blob, then send
// them all to every rank.
StatusOr<std::vector<std::vector<std::byte>>> Rendezvous::gather_at_root(Gather& gather) {
  const int world = options_.world_size;
  for (int rank = 1; rank < world; ++rank) {
    Peer& peer = peers_[static_cast<size_t>(rank)];
    if (!peer.closed)
      (void)peer.send(MessageHeader{.kind = MessageKind::kWaiting, .rank = 0, .sequence = gather.sequence}, {},
                      std::min(gather.deadline, Clock::now() + kRelayMargin));
  }
  if (Status status = collect_at_root(gather); !status.ok()) return status;
  const std::vector<std::byte> reply = pack_gather_reply(gather.blobs);
  for (int rank = 1; rank < world; ++rank) {
    Status sent = peers_[static_cast<size_t>(rank)].send(
        MessageHeader{.kind = gather.kind, .rank = 0, .sequence = gather.sequence}, reply, gather.deadline);
    if (!sent.ok()) return std::move(sent).with_context("rendezvous " + gather.what);
  }
  return std::move(gather.blobs);
}

// Rank 0: every other rank's blob into gather.blobs, waiting on all sockets at once. A peer
// that is gone shows at the reads.
Status Rendezvous::collect_at_root(Gather& gather) {
  std::vector<bool> received(static_cast<size_t>(options_.world_size), false);
  received[0] = true;
  while (true) {
    StatusOr<std::vector<int>> waiting = take_arrived_blobs(gather, received);
    if (!waiting.ok()) return waiting.status();
    if (waiting->empty()) return Status::Ok();
    std::vector<pollfd> fds;
    for (const int rank : *waiting) fds.push_back({peers_[static_cast<size_t>(rank)].socket.fd(), POLLIN, 0});
    int ready = 0;
    if (Status status = poll_fds(fds, remaining_ms(gather.deadline), &ready); !status.ok()) return status;
    if (ready == 0)
      return DeadlineExceededError("rendezvous: " + gather.what + " on rank 0 timed out after " +
                                   seconds_text(options_.collective_timeout) + " waiting for rank" +
                                   (waiting->size() == 1 ? " " : "s ") + rank_list_text(*waiting) +
                                   " (still computing, stuck, or calling a different collective?)");
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      Peer& peer = peers_[static_cast<size_t>((*waiting)[i])];
      StatusOr<bool> open = peer.read_available();
      if (!open.ok()) return open.status();
      if (!*open) peer.closed = true;
    }
  }
}

// Rank 0: takes the blob of every rank whose whole message is already buffered. Returns the
// ranks still awaited, to poll; a rank that closed its connection before sending is an error.
StatusOr<std::vector<int>> Rendezvous::take_arrived_blobs(Gather& gather, std::vector<bool>& received) {
  std::vector<int> waiting;
  for (int rank = 1; rank < options_.world_size; ++rank) {
    if (received[static_cast<size_t>(rank)]) continue;
    Peer& peer = peers_[static_cast<size_t>(rank)];
    StatusOr<std::optional<Message>> taken = peer.take_message();
    if (!taken.ok()) return taken.status();
    if (taken->has_value()) {
      const Message& message = **taken;
      if (Status status = expect_collective(message, gather.kind, gather.sequence, 0, 0, peer.description);
          !status.ok())
        return status;
      gather.blobs[static_cast<size_t>(rank)] = std::move((*taken)->payload);
      received[static_cast<size_t>(rank)] = true;
      continue;
    }
    if (peer.closed)
      return UnavailableError("rendezvous: " + peer.description + " closed its connection during " + gather.what +
                              " (did that process exit or fail?)");
    waiting.push_back(rank);
  }
  return waiting;
}

StatusOr<std::vector<std::byte>> Rendezvous::broadcast(std::span<const std::byte> blob, int root) {
  if (!failure_.ok()) return failure_;
  if (!joined_) return FailedPreconditionError("rendezvous: broadcast before join()");
  const int world = options_.world_size;
  if (root < 0 || root >= world)
    return InvalidArgumentError("rendezvous: broadcast root " + std::to_string(root) + " is outside [0, " +
                                std::to_string(world - 1) + "]");
  const uint64_t sequence = next_sequence_++;
  if (world == 1) return std::vector<std::byte>(blob.begin(), blob.end());
  const Clock::time_point deadline = Clock::now() + options_.collective_timeout;
  const std::string what = collective_text(MessageKind::kBroadcast, sequence) + " from rank " + std::to_string(root);
  const MessageHeader header{.kind = MessageKind::kBroadcast, .rank = options_.rank, .aux = root, .sequence = sequence};

  if (options_.rank != 0) {
    Peer& link = peers_[0];
    if (options_.rank == root) {
      Status sent = link.send(header, blob, deadline);
      if (!sent.ok()) return fail(std::move(sent).with_context("rendezvous " + what));
    }
    // Every non-root rank gets the blob from rank 0; the root gets it back as its completion.
    StatusOr<Message> reply = link.receive(deadline, "in " + what + " on rank " + std::to_string(options_.rank) +
                                                         " waiting " + seconds_text(options_.collective_timeout) + " for rank 0");
    if (!reply.ok()) return fail(reply.status());
    if (Status status = expect_collective(*reply, MessageKind::kBroadcast, sequence, root, options_.rank, "rank 0");
        !status.ok())
      return fail(std::move(status));
    return std::move(reply->payload);
  }

  std::vector<std::byte> value(blob.begin(), blob.end());
  if (root != 0) {
    Peer& source = peers_[static_cast<size_t>(root)];
    StatusOr<Message> message = source.receive(deadline, "in " + what + " on rank 0 waiting " +
                                                             seconds_text(options_.collective_timeout) + " for rank " +
                                                             std::to_string(root) + "'s blob");
    if (!message.ok()) return fail(message.status());
    if (Status status = expect_collective(*message, MessageKind::kBroadcast, sequence, root, 0, source.description);
        !status.ok())
      return fail(std::move(status));
    value = std::move(message->payload);
  }
  for (int rank = 1; rank < world; ++rank) {
    Status sent = peers_[static_cast<size_t>(rank)].send(header, value, deadline);
    if (!sent.ok()) return fail(std::move(sent).with_context("rendezvous " + what));
  }
  return value;
}

StatusOr<std::string> Rendezvous::broadcast_string(std::string_view text, int root) {
  STRATA_ASSIGN_OR_RETURN(std::vector<std::byte> bytes, broadcast(as_bytes(text), root));
  return as_string(bytes);
}

StatusOr<std::vector<std::string>> Rendezvous::all_gather_strings(std::string_view text) {
  STRATA_ASSIGN_OR_RETURN(std::vector<std::vector<std::byte>> blobs, all_gather(as_bytes(text)));
  std::vector<std::string> strings;
  strings.reserve(blobs.size());
  for (const std::vector<std::byte>& blob : blobs) strings.push_back(as_string(blob));
  return strings;
}

}  // namespace strata
