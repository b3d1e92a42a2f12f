#include "engine/core/rendezvous_wire.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>

#include "engine/core/check.h"

namespace strata::rendezvous_wire {

std::string_view message_kind_name(MessageKind kind) {
  switch (kind) {
    case MessageKind::kHello: return "hello";
    case MessageKind::kWelcome: return "welcome";
    case MessageKind::kReject: return "reject";
    case MessageKind::kBroadcast: return "broadcast";
    case MessageKind::kAllGather: return "all_gather";
    case MessageKind::kBarrier: return "barrier";
    case MessageKind::kWaiting: return "waiting";
  }
  return "unknown";
}

std::vector<std::byte> encode(const MessageHeader& header, std::span<const std::byte> payload) {
  std::vector<std::byte> bytes(kHeaderBytes + payload.size());
  size_t offset = 0;
  put(bytes.data(), offset, header.magic);
  put(bytes.data(), offset, header.version);
  put(bytes.data(), offset, static_cast<uint16_t>(header.kind));
  put(bytes.data(), offset, header.rank);
  put(bytes.data(), offset, header.aux);
  put(bytes.data(), offset, header.sequence);
  put(bytes.data(), offset, static_cast<uint64_t>(payload.size()));
  if (!payload.empty()) std::memcpy(bytes.data() + kHeaderBytes, payload.data(), payload.size());
  return bytes;
}

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, INT_MAX));
}

Status poll_fds(std::vector<pollfd>& fds, int timeout_ms, int* ready) {
  int result = 0;
  STRATA_SYSCALL(result, ::poll(fds.data(), fds.size(), timeout_ms));
  *ready = result;
  return Status::Ok();
}

std::string host_and_pid() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "?");
  return std::string(host) + " pid " + std::to_string(::getpid());
}

Status set_socket_options(int fd) {
  int result = 0;
  const int one = 1;
  STRATA_SYSCALL(result, ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)));
  return Status::Ok();
}

StatusOr<AddrInfoPtr> resolve(const std::string& host, uint16_t port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* result = nullptr;
  const std::string service = std::to_string(port);
  const int error = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &result);
  if (error != 0) {
    const std::string detail = error == EAI_SYSTEM ? std::strerror(errno) : ::gai_strerror(error);
    return InvalidArgumentError("rendezvous: cannot resolve '" + host + "' (MASTER_ADDR or listen address): " + detail);
  }
  return AddrInfoPtr(result);
}

uint16_t bound_port(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return 0;
  if (address.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&address)->sin_port);
  if (address.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&address)->sin6_port);
  return 0;
}

StatusOr<File> try_connect(const addrinfo& address, Clock::time_point deadline) {
  int fd = -1;
  STRATA_SYSCALL(fd, ::socket(address.ai_family, address.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, address.ai_protocol));
  File socket(fd, "socket");
  if (::connect(fd, address.ai_addr, address.ai_addrlen) != 0) {
    if (errno != EINPROGRESS && errno != EINTR) return Status::FromErrno(errno, "connect");
    std::vector<pollfd> fds{{fd, POLLOUT, 0}};
    int ready = 0;
    STRATA_RETURN_IF_ERROR(poll_fds(fds, remaining_ms(deadline), &ready));
    if (ready == 0) return Status::FromErrno(ETIMEDOUT, "connect");
    int error = 0;
    socklen_t length = sizeof(error);
    int result = 0;
    STRATA_SYSCALL(result, ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length));
    if (error != 0) return Status::FromErrno(error, "connect");
  }
  STRATA_RETURN_IF_ERROR(set_socket_options(fd));
  return socket;
}

Status send_all(int fd, std::span<const std::byte> bytes, Clock::time_point deadline, const std::string& to_whom) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t written = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (written > 0) {
      sent += static_cast<size_t>(written);
      continue;
    }
    if (written < 0 && errno == EINTR) continue;
    if (written < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      std::vector<pollfd> fds{{fd, POLLOUT, 0}};
      int ready = 0;
      STRATA_RETURN_IF_ERROR(poll_fds(fds, remaining_ms(deadline), &ready));
      if (ready == 0)
        return DeadlineExceededError("rendezvous: sending " + std::to_string(bytes.size()) + " bytes to " + to_whom +
                                     " did not finish in time (is it still reading?)");
      continue;
    }
    return Status::FromErrno(errno, "send to " + to_whom);
  }
  return Status::Ok();
}

}  // namespace strata::rendezvous_wire
