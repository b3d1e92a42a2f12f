// The rendezvous's wire format and the socket helpers it runs on (engine/core/rendezvous.h
// is the interface): every message is a fixed 32-byte header, then `length` payload bytes.
// Internal to the rendezvous; not part of strata_core's interface for other code.
#pragma once

#include <netdb.h>
#include <poll.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/file.h"
#include "engine/core/status.h"

namespace strata::rendezvous_wire {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x56525453;  // "STRV"
constexpr uint16_t kProtocolVersion = 1;
constexpr size_t kHeaderBytes = 32;
constexpr uint64_t kMaxPayloadBytes = uint64_t{1} << 30;  // a sanity bound against garbage lengths

enum class MessageKind : uint16_t {
  kHello = 1,      // peer -> root: aux = world size, payload = "host pid N"
  kWelcome = 2,    // root -> peer: every rank is present
  kReject = 3,     // root -> peer: payload = why the group cannot form (or failed)
  kBroadcast = 4,  // aux = root
  kAllGather = 5,  // peer -> root: its blob; root -> peer: every blob, length-prefixed
  kBarrier = 6,
  kWaiting = 7,    // root -> peer: rank 0 is in this gather and waits for the others (no payload)
};
std::string_view message_kind_name(MessageKind kind);  // "hello", "welcome", ...

struct MessageHeader {
  uint32_t magic = kMagic;
  uint16_t version = kProtocolVersion;
  MessageKind kind = MessageKind::kHello;
  int32_t rank = 0;      // the sender
  int32_t aux = 0;       // world size (hello), root (broadcast)
  uint64_t sequence = 0; // collective number
  uint64_t length = 0;   // payload bytes
};

struct Message {
  MessageHeader header;
  std::vector<std::byte> payload;
};

// Fixed-size fields, in host byte order.
template <class T>
void put(std::byte* out, size_t& offset, T value) {
  std::memcpy(out + offset, &value, sizeof(T));
  offset += sizeof(T);
}
template <class T>
T get(const std::byte* in, size_t& offset) {
  T value;
  std::memcpy(&value, in + offset, sizeof(T));
  offset += sizeof(T);
  return value;
}

// The header (its length set to the payload's) followed by the payload.
std::vector<std::byte> encode(const MessageHeader& header, std::span<const std::byte> payload);

inline std::span<const std::byte> as_bytes(std::string_view text) {
  return {reinterpret_cast<const std::byte*>(text.data()), text.size()};
}
inline std::string as_string(std::span<const std::byte> bytes) {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

// Milliseconds left until `deadline`, clamped to [0, INT_MAX] (poll's timeout).
int remaining_ms(Clock::time_point deadline);
// poll(2), retrying EINTR; `ready` is how many descriptors have events (0 on timeout).
Status poll_fds(std::vector<pollfd>& fds, int timeout_ms, int* ready);
// "host pid N": how a peer names itself in its hello.
std::string host_and_pid();
Status set_socket_options(int fd);

// getaddrinfo owner.
struct AddrInfoDeleter {
  void operator()(addrinfo* info) const { ::freeaddrinfo(info); }
};
using AddrInfoPtr = std::unique_ptr<addrinfo, AddrInfoDeleter>;

// The addresses of host:port (`passive` for a listener); the error names the host.
StatusOr<AddrInfoPtr> resolve(const std::string& host, uint16_t port, bool passive);
// The port a bound socket listens on; 0 when it cannot be read.
uint16_t bound_port(int fd);
// One non-blocking connect attempt, bounded by `deadline`.
StatusOr<File> try_connect(const addrinfo& address, Clock::time_point deadline);
// Sends all of `bytes` on a non-blocking socket by `deadline`.
Status send_all(int fd, std::span<const std::byte> bytes, Clock::time_point deadline, const std::string& to_whom);

}  // namespace strata::rendezvous_wire
