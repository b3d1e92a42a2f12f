#include "engine/core/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>

#include "engine/core/check.h"
#include "engine/core/log.h"

namespace strata {

// ---------------------------------------------------------------------------
// Options from the environment
// ---------------------------------------------------------------------------

std::optional<std::string> process_env_lookup(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

namespace {

using Clock = std::chrono::steady_clock;

// Parses a whole decimal integer in [min, max]; the error names the variable.
StatusOr<long long> parse_env_integer(const char* name, const std::string& text, long long min, long long max,
                                      std::string_view expected) {
  long long value = 0;
  const char* begin = text.data();
  const char* end = text.data() + text.size();
  const auto [ptr, error] = std::from_chars(begin, end, value);
  if (text.empty() || error != std::errc() || ptr != end || value < min || value > max)
    return InvalidArgumentError("environment variable " + std::string(name) + "='" + text + "': expected " +
                                std::string(expected));
  return value;
}

std::string seconds_text(std::chrono::milliseconds duration) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f s", static_cast<double>(duration.count()) / 1000.0);
  return text;
}

// Rank 0's text without its own "rendezvous: " prefix, to follow ours.
std::string without_prefix(std::string text) {
  constexpr std::string_view kPrefix = "rendezvous: ";
  if (text.starts_with(kPrefix)) text.erase(0, kPrefix.size());
  return text;
}

std::string rank_list_text(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(ranks[i]);
  }
  return text;
}

}  // namespace

std::string_view launch_environment_name(LaunchEnvironment environment) {
  switch (environment) {
    case LaunchEnvironment::kNone: return "none";
    case LaunchEnvironment::kTorchrun: return "torchrun";
    case LaunchEnvironment::kOpenMpi: return "openmpi";
    case LaunchEnvironment::kSlurm: return "slurm";
  }
  return "unknown";
}

namespace {

// A host list bigger than any cluster: garbage such as "n[0-99999999]" is refused, not expanded.
constexpr size_t kMaxSlurmHosts = size_t{1} << 20;

Status nodelist_error(std::string_view nodelist, std::string_view why) {
  return InvalidArgumentError("Slurm node list '" + std::string(nodelist) + "': " + std::string(why));
}

// Parses a whole decimal number in [0, 10^9] from `text`.
std::optional<long long> parse_list_number(std::string_view text) {
  long long value = 0;
  const auto [ptr, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || ptr != text.data() + text.size() || value < 0 || value > 1000000000)
    return std::nullopt;
  return value;
}

// Expands one name that may hold brackets ("rack[1-2]-n[01,03]") onto `hosts`.
Status expand_slurm_host(std::string_view whole, std::string_view name, std::vector<std::string>& hosts) {
  const size_t open = name.find('[');
  if (open == std::string_view::npos) {
    if (name.find(']') != std::string_view::npos) return nodelist_error(whole, "']' without '['");
    if (hosts.size() >= kMaxSlurmHosts) return nodelist_error(whole, "more than 2^20 hosts");
    hosts.emplace_back(name);
    return Status::Ok();
  }
  const size_t close = name.find(']', open);
  if (close == std::string_view::npos) return nodelist_error(whole, "'[' without ']'");
  const std::string_view prefix = name.substr(0, open);
  const std::string_view ranges = name.substr(open + 1, close - open - 1);
  const std::string_view rest = name.substr(close + 1);
  size_t start = 0;
  while (start <= ranges.size()) {
    const size_t comma = std::min(ranges.find(',', start), ranges.size());
    const std::string_view range = ranges.substr(start, comma - start);
    const size_t dash = range.find('-');
    const std::string_view low_text = range.substr(0, dash);
    const std::string_view high_text = dash == std::string_view::npos ? low_text : range.substr(dash + 1);
    const std::optional<long long> low = parse_list_number(low_text);
    const std::optional<long long> high = parse_list_number(high_text);
    if (!low || !high || *high < *low)
      return nodelist_error(whole, "'" + std::string(range) + "' is not a number or a range low-high");
    if (static_cast<size_t>(*high - *low) >= kMaxSlurmHosts) return nodelist_error(whole, "more than 2^20 hosts");
    for (long long value = *low; value <= *high; ++value) {
      std::string digits = std::to_string(value);
      // Slurm keeps the low bound's width: node[08-10] -> node08 node09 node10.
      if (digits.size() < low_text.size()) digits.insert(0, low_text.size() - digits.size(), '0');
      STRATA_RETURN_IF_ERROR(expand_slurm_host(whole, std::string(prefix) + digits + std::string(rest), hosts));
    }
    start = comma + 1;
  }
  return Status::Ok();
}

}  // namespace

StatusOr<std::vector<std::string>> expand_slurm_nodelist(std::string_view nodelist) {
  std::vector<std::string> hosts;
  size_t start = 0;
  int depth = 0;
  for (size_t i = 0; i <= nodelist.size(); ++i) {
    const char c = i < nodelist.size() ? nodelist[i] : ',';
    if (c == '[' && ++depth > 1) return nodelist_error(nodelist, "'[' inside brackets");
    if (c == ']' && --depth < 0) return nodelist_error(nodelist, "']' without '['");
    if (i == nodelist.size() && depth > 0) return nodelist_error(nodelist, "'[' without ']'");
    if (c != ',' || depth > 0) continue;  // a comma inside brackets separates ranges, not hosts
    const std::string_view name = nodelist.substr(start, i - start);
    if (name.empty()) return nodelist_error(nodelist, "an empty host name");
    STRATA_RETURN_IF_ERROR(expand_slurm_host(nodelist, name, hosts));
    start = i + 1;
  }
  return hosts;
}

StatusOr<std::vector<int>> expand_slurm_tasks_per_node(std::string_view tasks_per_node) {
  std::vector<int> counts;
  const auto error = [&] {
    return InvalidArgumentError("Slurm tasks-per-node list '" + std::string(tasks_per_node) +
                                "': expected comma-separated counts, each maybe repeated as N(xK), e.g. 2(x3),1");
  };
  size_t start = 0;
  while (start <= tasks_per_node.size()) {
    const size_t comma = std::min(tasks_per_node.find(',', start), tasks_per_node.size());
    std::string_view item = tasks_per_node.substr(start, comma - start);
    long long repeat = 1;
    const size_t paren = item.find("(x");
    if (paren != std::string_view::npos) {
      if (!item.ends_with(')')) return error();
      const std::optional<long long> times = parse_list_number(item.substr(paren + 2, item.size() - paren - 3));
      if (!times || *times < 1 || static_cast<size_t>(*times) > kMaxSlurmHosts) return error();
      repeat = *times;
      item = item.substr(0, paren);
    }
    const std::optional<long long> count = parse_list_number(item);
    if (!count || *count < 1 || *count > (1 << 20) || counts.size() + repeat > kMaxSlurmHosts) return error();
    counts.insert(counts.end(), static_cast<size_t>(repeat), static_cast<int>(*count));
    start = comma + 1;
  }
  return counts;
}

namespace {

// A positive number of seconds (fractions allowed); the error names the variable.
StatusOr<std::chrono::milliseconds> parse_env_seconds(const char* name, const std::string& text) {
  double seconds = 0.0;
  const char* begin = text.data();
  const char* end = begin + text.size();
  const auto [ptr, error] = std::from_chars(begin, end, seconds);
  if (text.empty() || error != std::errc() || ptr != end || !(seconds > 0.0) || seconds > 1e7)
    return InvalidArgumentError("environment variable " + std::string(name) + "='" + text +
                                "': expected a positive number of seconds");
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000.0 + 0.5));
}

// The names one launcher gives its variables (nullptr: the launcher has none).
struct LauncherVariables {
  LaunchEnvironment environment;
  const char* rank;
  const char* world_size;
  const char* local_rank;
  const char* local_world_size;
  const char* node_rank;
};

constexpr LauncherVariables kTorchrunVariables = {LaunchEnvironment::kTorchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                  "LOCAL_WORLD_SIZE", "GROUP_RANK"};
constexpr LauncherVariables kOpenMpiVariables = {LaunchEnvironment::kOpenMpi, "OMPI_COMM_WORLD_RANK",
                                                 "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                                                 "OMPI_COMM_WORLD_LOCAL_SIZE", nullptr};
// SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE are read by slurm_local_world_size.
constexpr LauncherVariables kSlurmVariables = {LaunchEnvironment::kSlurm, "SLURM_PROCID", "SLURM_NTASKS",
                                               "SLURM_LOCALID", nullptr, "SLURM_NODEID"};

// The first launcher, in order of preference, whose variables are set.
const LauncherVariables* detect_launcher(const EnvLookup& lookup) {
  if (lookup("RANK") || lookup("WORLD_SIZE")) return &kTorchrunVariables;
  if (lookup("OMPI_COMM_WORLD_RANK")) return &kOpenMpiVariables;
  if (lookup("SLURM_PROCID")) return &kSlurmVariables;
  return nullptr;
}

// Reads an optional integer variable in [min, max] into `value` (left alone when unset).
Status read_env_integer(const EnvLookup& lookup, const char* name, long long min, long long max,
                        std::string_view expected, int& value) {
  if (name == nullptr) return Status::Ok();
  const std::optional<std::string> text = lookup(name);
  if (!text) return Status::Ok();
  STRATA_ASSIGN_OR_RETURN(const long long parsed, parse_env_integer(name, *text, min, max, expected));
  value = static_cast<int>(parsed);
  return Status::Ok();
}

std::string index_range_text(const char* bound_name, int bound) {
  return "an integer in [0, " + std::string(bound_name) + "-1] = [0, " + std::to_string(bound - 1) + "]";
}

// This node's process count under Slurm: SLURM_NTASKS_PER_NODE (one number, set by
// --ntasks-per-node), else this node's entry (SLURM_NODEID) of SLURM_TASKS_PER_NODE.
Status read_slurm_local_world_size(const EnvLookup& lookup, RendezvousOptions& options) {
  if (lookup("SLURM_NTASKS_PER_NODE")) {
    return read_env_integer(lookup, "SLURM_NTASKS_PER_NODE", 1, options.world_size,
                            "an integer in [1, SLURM_NTASKS] = [1, " + std::to_string(options.world_size) + "]",
                            options.local_world_size);
  }
  const std::optional<std::string> list = lookup("SLURM_TASKS_PER_NODE");
  if (!list) return Status::Ok();
  StatusOr<std::vector<int>> counts = expand_slurm_tasks_per_node(*list);
  if (!counts.ok()) return InvalidArgumentError("environment variable SLURM_TASKS_PER_NODE: " + counts.status().message());
  if (static_cast<size_t>(options.node_rank) >= counts->size())
    return InvalidArgumentError("environment variable SLURM_TASKS_PER_NODE='" + *list + "' lists " +
                                std::to_string(counts->size()) + " node(s) but SLURM_NODEID=" +
                                std::to_string(options.node_rank));
  options.local_world_size = (*counts)[static_cast<size_t>(options.node_rank)];
  if (options.local_world_size > options.world_size)
    return InvalidArgumentError("environment variable SLURM_TASKS_PER_NODE='" + *list + "' gives node " +
                                std::to_string(options.node_rank) + " " + std::to_string(options.local_world_size) +
                                " tasks, more than SLURM_NTASKS=" + std::to_string(options.world_size));
  return Status::Ok();
}

// Rank, world size, local rank and size, node rank from `names`, with their defaults.
Status read_launcher_ranks(const EnvLookup& lookup, const LauncherVariables& names, RendezvousOptions& options) {
  const std::optional<std::string> rank_text = lookup(names.rank);
  const std::optional<std::string> world_text = lookup(names.world_size);
  if (!world_text && rank_text)
    return InvalidArgumentError("environment variable " + std::string(names.rank) + "='" + *rank_text + "' is set but " +
                                names.world_size + " is not: set both (or neither, for a single process)");
  STRATA_RETURN_IF_ERROR(read_env_integer(lookup, names.world_size, 1, 1 << 20,
                                          "a positive integer (the number of processes)", options.world_size));
  if (!rank_text && options.world_size > 1)
    return InvalidArgumentError("environment variable " + std::string(names.world_size) + "=" +
                                std::to_string(options.world_size) + " but " + names.rank +
                                " is not set: each process needs its rank in [0, " + names.world_size + "-1]");
  STRATA_RETURN_IF_ERROR(read_env_integer(lookup, names.rank, 0, options.world_size - 1,
                                          index_range_text(names.world_size, options.world_size), options.rank));
  STRATA_RETURN_IF_ERROR(read_env_integer(lookup, names.node_rank, 0, options.world_size - 1,
                                          index_range_text(names.world_size, options.world_size), options.node_rank));
  options.local_world_size = options.world_size;
  if (names.environment == LaunchEnvironment::kSlurm) {
    STRATA_RETURN_IF_ERROR(read_slurm_local_world_size(lookup, options));
  } else {
    STRATA_RETURN_IF_ERROR(read_env_integer(
        lookup, names.local_world_size, 1, options.world_size,
        "an integer in [1, " + std::string(names.world_size) + "] = [1, " + std::to_string(options.world_size) + "]",
        options.local_world_size));
  }
  if (names.node_rank == nullptr || !lookup(names.node_rank)) options.node_rank = options.rank / options.local_world_size;
  // Without a local rank the ranks are taken to fill the nodes in order (one node, by default).
  options.local_rank = options.rank % options.local_world_size;
  const char* bound = names.local_world_size != nullptr ? names.local_world_size : "the node's task count";
  STRATA_RETURN_IF_ERROR(read_env_integer(lookup, names.local_rank, 0, options.local_world_size - 1,
                                          index_range_text(bound, options.local_world_size), options.local_rank));
  return Status::Ok();
}

// MASTER_ADDR, or where the launcher has no such variable, its fallback.
Status read_master_address(const EnvLookup& lookup, const LauncherVariables& names, RendezvousOptions& options) {
  if (const std::optional<std::string> addr = lookup("MASTER_ADDR")) {
    if (addr->empty()) return InvalidArgumentError("environment variable MASTER_ADDR is empty: expected rank 0's host");
    options.master_addr = *addr;
    return Status::Ok();
  }
  if (options.world_size == 1) return Status::Ok();
  const std::string world = std::string(names.world_size) + "=" + std::to_string(options.world_size);
  switch (names.environment) {
    case LaunchEnvironment::kOpenMpi:
      if (options.local_world_size == options.world_size) return Status::Ok();  // one node: the loopback default
      return InvalidArgumentError("environment variable MASTER_ADDR is not set and the ranks span several nodes (" +
                                  world + ", OMPI_COMM_WORLD_LOCAL_SIZE=" + std::to_string(options.local_world_size) +
                                  "): export MASTER_ADDR=<rank 0's host> and pass it with mpirun -x MASTER_ADDR");
    case LaunchEnvironment::kSlurm:
      for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"}) {
        const std::optional<std::string> nodelist = lookup(name);
        if (!nodelist) continue;
        StatusOr<std::vector<std::string>> hosts = expand_slurm_nodelist(*nodelist);
        if (!hosts.ok())
          return InvalidArgumentError("environment variable " + std::string(name) + ": " + hosts.status().message());
        options.master_addr = hosts->front();
        return Status::Ok();
      }
      return InvalidArgumentError("environment variable MASTER_ADDR is not set, nor SLURM_STEP_NODELIST or "
                                  "SLURM_JOB_NODELIST, but " + world + ": set MASTER_ADDR to rank 0's host");
    default:
      return InvalidArgumentError("environment variable MASTER_ADDR is not set but " + world +
                                  ": set it to rank 0's host name or address");
  }
}

// True when torchrun says its agent already serves a store on MASTER_PORT (its static
// rendezvous, and the c10d one in newer versions): rank 0 cannot listen there.
bool torchrun_agent_holds_master_port(const EnvLookup& lookup) {
  const std::optional<std::string> flag = lookup("TORCHELASTIC_USE_AGENT_STORE");
  return flag && (*flag == "True" || *flag == "true" || *flag == "1");
}

// The launcher's port: MASTER_PORT (plus one when torchrun's agent holds it), or for Open
// MPI and Slurm the documented default.
Status read_launcher_port(const EnvLookup& lookup, const LauncherVariables& names, RendezvousOptions& options) {
  if (const std::optional<std::string> port_text = lookup("MASTER_PORT")) {
    STRATA_ASSIGN_OR_RETURN(const long long port,
                            parse_env_integer("MASTER_PORT", *port_text, 0, 65535, "a port number in [0, 65535]"));
    options.master_port = static_cast<uint16_t>(port);
    if (names.environment == LaunchEnvironment::kTorchrun && torchrun_agent_holds_master_port(lookup)) {
      if (port == 0 || port == 65535)
        return InvalidArgumentError("environment variable MASTER_PORT=" + *port_text +
                                    " is torchrun's own store (TORCHELASTIC_USE_AGENT_STORE) and the next port, "
                                    "where Strata's rendezvous would listen, does not exist: set STRATA_MASTER_PORT");
      options.master_port = static_cast<uint16_t>(port + 1);
    }
    return Status::Ok();
  }
  if (options.world_size == 1) return Status::Ok();
  if (names.environment == LaunchEnvironment::kTorchrun)
    return InvalidArgumentError("environment variable MASTER_PORT is not set but WORLD_SIZE=" +
                                std::to_string(options.world_size) + ": set it to the port rank 0 listens on");
  options.master_port = kDefaultMasterPort;
  if (names.environment == LaunchEnvironment::kSlurm) {
    if (const std::optional<std::string> job = lookup("SLURM_JOB_ID")) {
      STRATA_ASSIGN_OR_RETURN(const long long job_id, parse_env_integer("SLURM_JOB_ID", *job, 0, LLONG_MAX,
                                                                        "a non-negative integer (the job id)"));
      options.master_port = static_cast<uint16_t>(kDefaultMasterPort + job_id % 1000);
    }
  }
  return Status::Ok();
}

// STRATA_MASTER_PORT, which overrides every launcher's port, else the launcher's.
Status read_master_port(const EnvLookup& lookup, const LauncherVariables& names, RendezvousOptions& options) {
  if (const std::optional<std::string> port_text = lookup("STRATA_MASTER_PORT")) {
    STRATA_ASSIGN_OR_RETURN(const long long port, parse_env_integer("STRATA_MASTER_PORT", *port_text, 0, 65535,
                                                                    "a port number in [0, 65535]"));
    options.master_port = static_cast<uint16_t>(port);
    return Status::Ok();
  }
  return read_launcher_port(lookup, names, options);
}

}  // namespace

StatusOr<RendezvousOptions> rendezvous_options_from_env(const EnvLookup& lookup) {
  RendezvousOptions options;
  if (const LauncherVariables* names = detect_launcher(lookup)) {
    options.launched_by = names->environment;
    STRATA_RETURN_IF_ERROR(read_launcher_ranks(lookup, *names, options));
    STRATA_RETURN_IF_ERROR(read_master_address(lookup, *names, options));
    STRATA_RETURN_IF_ERROR(read_master_port(lookup, *names, options));
  } else if (const std::optional<std::string> local_rank = lookup("LOCAL_RANK")) {
    // LOCAL_RANK alone (a GPU pick for a single process) must still be a valid index.
    STRATA_RETURN_IF_ERROR(read_env_integer(lookup, "LOCAL_RANK", 0, 0, "0 (WORLD_SIZE is not set: one process)",
                                            options.local_rank));
  }
  if (const std::optional<std::string> text = lookup("STRATA_RENDEZVOUS_TIMEOUT_S")) {
    STRATA_ASSIGN_OR_RETURN(options.timeout, parse_env_seconds("STRATA_RENDEZVOUS_TIMEOUT_S", *text));
  }
  if (const std::optional<std::string> text = lookup("STRATA_COLLECTIVE_TIMEOUT_S")) {
    STRATA_ASSIGN_OR_RETURN(options.collective_timeout, parse_env_seconds("STRATA_COLLECTIVE_TIMEOUT_S", *text));
  }
  return options;
}

// ---------------------------------------------------------------------------
// Wire format: a fixed 32-byte header, then `length` payload bytes.
// ---------------------------------------------------------------------------
namespace {

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

std::span<const std::byte> as_bytes(std::string_view text) {
  return {reinterpret_cast<const std::byte*>(text.data()), text.size()};
}
std::string as_string(std::span<const std::byte> bytes) {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
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

// getaddrinfo owner.
struct AddrInfoDeleter {
  void operator()(addrinfo* info) const { ::freeaddrinfo(info); }
};
using AddrInfoPtr = std::unique_ptr<addrinfo, AddrInfoDeleter>;

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

// One non-blocking connect attempt, bounded by `deadline`.
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

// Sends all of `bytes` on a non-blocking socket by `deadline`.
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

  // Tells every connected rank why the group cannot form, so no one waits out its own deadline.
  const auto reject_all = [&](const Status& why) {
    const std::string text = why.message();
    MessageHeader header{.kind = MessageKind::kReject, .rank = 0};
    const Clock::time_point soon = Clock::now() + std::chrono::seconds(1);
    for (Peer& peer : peers_)
      if (peer.socket.is_open()) (void)peer.send(header, as_bytes(text), soon);
    for (Peer& peer : pending)
      if (peer.socket.is_open()) (void)peer.send(header, as_bytes(text), soon);
  };

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
      Status timeout = DeadlineExceededError(
          "rendezvous: rank 0 waited " + seconds_text(options_.timeout) + " on port " + std::to_string(port_) +
          " but rank" + (missing.size() == 1 ? " " : "s ") + rank_list_text(missing) + " of WORLD_SIZE=" +
          std::to_string(world) + " never arrived (" + (missing.size() == 1 ? "is it" : "are they") + " running, with MASTER_ADDR=" +
          options_.master_addr + " MASTER_PORT=" + std::to_string(port_) + "?)");
      reject_all(timeout);
      return timeout;
    }
    // Hellos first (fds[1..] refer to `pending` as it was when polled).
    std::vector<Peer> still_pending;
    for (size_t i = 0; i < pending.size(); ++i) {
      Peer& peer = pending[i];
      if (fds[i + 1].revents != 0) {
        STRATA_ASSIGN_OR_RETURN(const bool open, peer.read_available());
        StatusOr<std::optional<Message>> taken = peer.take_message();
        if (!taken.ok()) {
          // Not one of ours (a port scanner, another program): drop it, keep waiting.
          STRATA_LOG(kWarn) << taken.status().message() << "; dropping that connection";
          continue;
        }
        if (!taken->has_value()) {
          if (open) still_pending.push_back(std::move(peer));
          continue;
        }
        const Message hello = std::move(**taken);
        const std::string who = as_string(hello.payload);
        Status problem;
        if (hello.header.kind != MessageKind::kHello) {
          problem = DataLossError("rendezvous: a connection (" + who + ") sent " +
                                  std::string(message_kind_name(hello.header.kind)) + " before hello");
        } else if (hello.header.aux != world) {
          problem = InvalidArgumentError("rendezvous: rank " + std::to_string(hello.header.rank) + " (" + who +
                                         ") has WORLD_SIZE=" + std::to_string(hello.header.aux) +
                                         " but rank 0 has WORLD_SIZE=" + std::to_string(world) +
                                         ": every process must be started with the same WORLD_SIZE");
        } else if (hello.header.rank <= 0 || hello.header.rank >= world) {
          problem = InvalidArgumentError("rendezvous: a process (" + who + ") has RANK=" +
                                         std::to_string(hello.header.rank) + ", outside [1, " +
                                         std::to_string(world - 1) + "] for the non-root ranks of WORLD_SIZE=" +
                                         std::to_string(world));
        } else if (peers_[static_cast<size_t>(hello.header.rank)].socket.is_open()) {
          problem = InvalidArgumentError("rendezvous: two processes have RANK=" + std::to_string(hello.header.rank) +
                                         ": " + peers_[static_cast<size_t>(hello.header.rank)].description + " and " +
                                         who + "; every process needs its own RANK");
        }
        if (!problem.ok()) {
          const std::string text = problem.message();
          (void)peer.send(MessageHeader{.kind = MessageKind::kReject, .rank = 0}, as_bytes(text),
                          Clock::now() + std::chrono::seconds(1));
          reject_all(problem);
          return problem;
        }
        peer.rank = hello.header.rank;
        peer.description = "rank " + std::to_string(peer.rank) + " (" + who + ")";
        peers_[static_cast<size_t>(peer.rank)] = std::move(peer);
        ++present;
      } else {
        still_pending.push_back(std::move(peer));
      }
    }
    pending = std::move(still_pending);
    // Then new connections.
    if (fds[0].revents != 0) {
      while (true) {
        const int fd = ::accept4(listener_.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
          if (errno == EINTR || errno == ECONNABORTED) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) break;
          return Status::FromErrno(errno, "rendezvous: accept on port " + std::to_string(port_));
        }
        Peer peer;
        peer.socket = File(fd, "socket");
        peer.description = "a connecting process";
        STRATA_RETURN_IF_ERROR(set_socket_options(fd));
        pending.push_back(std::move(peer));
      }
    }
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

}  // namespace

StatusOr<std::vector<std::vector<std::byte>>> Rendezvous::all_gather(std::span<const std::byte> blob) {
  return gather_all(blob, static_cast<uint16_t>(MessageKind::kAllGather));
}

Status Rendezvous::barrier() {
  // A barrier is a gather of nothing: rank 0 replies only once every rank has arrived.
  return gather_all({}, static_cast<uint16_t>(MessageKind::kBarrier)).status();
}

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
  const Clock::time_point deadline = Clock::now() + options_.collective_timeout;
  const std::string what = collective_text(kind, sequence);

  if (options_.rank != 0) {
    Peer& root = peers_[0];
    Status sent = root.send(MessageHeader{.kind = kind, .rank = options_.rank, .sequence = sequence}, blob, deadline);
    if (!sent.ok()) return fail(std::move(sent).with_context("rendezvous " + what));
    Clock::time_point reply_deadline = deadline;
    StatusOr<Message> reply = root.receive(reply_deadline, "in " + what + " on rank " + std::to_string(options_.rank) +
                                                               " waiting " + seconds_text(options_.collective_timeout) +
                                                               " for rank 0 (stuck, or not in this collective?)");
    if (reply.ok() && reply->header.kind == MessageKind::kWaiting && reply->header.sequence == sequence) {
      // Rank 0 is alive and in this gather, waiting at most collective_timeout for the
      // missing ranks; it then sends their names. Waiting for that, rather than timing out
      // first on a clock started earlier, is what lets this rank name the stuck one.
      reply_deadline = Clock::now() + options_.collective_timeout + kRelayMargin;
      reply = root.receive(reply_deadline, "in " + what + " on rank " + std::to_string(options_.rank) +
                                               " waiting for rank 0's reply after it entered the collective");
    }
    if (!reply.ok()) return fail(reply.status());
    if (Status status = expect_collective(*reply, kind, sequence, 0, options_.rank, "rank 0"); !status.ok())
      return fail(std::move(status));
    // The reply: for each rank, a uint64 length then the bytes.
    size_t offset = 0;
    const std::vector<std::byte>& payload = reply->payload;
    for (int rank = 0; rank < world; ++rank) {
      if (payload.size() - offset < sizeof(uint64_t)) return fail(DataLossError("rendezvous: truncated " + what + " reply"));
      const uint64_t length = get<uint64_t>(payload.data(), offset);
      if (length > payload.size() - offset) return fail(DataLossError("rendezvous: truncated " + what + " reply"));
      blobs[static_cast<size_t>(rank)].assign(payload.begin() + static_cast<std::ptrdiff_t>(offset),
                                              payload.begin() + static_cast<std::ptrdiff_t>(offset + length));
      offset += length;
    }
    return blobs;
  }

  // Rank 0: tell the others it is here (see kWaiting), then collect every rank's blob,
  // waiting on all sockets at once. A peer that is gone shows at the reads below.
  for (int rank = 1; rank < world; ++rank) {
    Peer& peer = peers_[static_cast<size_t>(rank)];
    if (!peer.closed)
      (void)peer.send(MessageHeader{.kind = MessageKind::kWaiting, .rank = 0, .sequence = sequence}, {},
                      std::min(deadline, Clock::now() + kRelayMargin));
  }
  std::vector<bool> received(static_cast<size_t>(world), false);
  received[0] = true;
  int outstanding = world - 1;
  while (true) {
    std::vector<pollfd> fds;
    std::vector<int> fd_ranks;
    for (int rank = 1; rank < world; ++rank) {  // whole messages may already be buffered
      if (received[static_cast<size_t>(rank)]) continue;
      Peer& peer = peers_[static_cast<size_t>(rank)];
      StatusOr<std::optional<Message>> taken = peer.take_message();
      if (!taken.ok()) return fail(taken.status());
      if (taken->has_value()) {
        const Message& message = **taken;
        if (Status status = expect_collective(message, kind, sequence, 0, 0, peer.description); !status.ok())
          return fail(std::move(status));
        blobs[static_cast<size_t>(rank)] = std::move((*taken)->payload);
        received[static_cast<size_t>(rank)] = true;
        --outstanding;
        continue;
      }
      if (peer.closed)
        return fail(UnavailableError("rendezvous: " + peer.description + " closed its connection during " + what +
                                     " (did that process exit or fail?)"));
      fds.push_back({peer.socket.fd(), POLLIN, 0});
      fd_ranks.push_back(rank);
    }
    if (outstanding == 0) break;
    int ready = 0;
    if (Status status = poll_fds(fds, remaining_ms(deadline), &ready); !status.ok()) return fail(std::move(status));
    if (ready == 0)
      return fail(DeadlineExceededError("rendezvous: " + what + " on rank 0 timed out after " +
                                        seconds_text(options_.collective_timeout) + " waiting for rank" +
                                        (fd_ranks.size() == 1 ? " " : "s ") + rank_list_text(fd_ranks) +
                                        " (still computing, stuck, or calling a different collective?)"));
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      Peer& peer = peers_[static_cast<size_t>(fd_ranks[i])];
      StatusOr<bool> open = peer.read_available();
      if (!open.ok()) return fail(open.status());
      if (!*open) peer.closed = true;
    }
  }
  std::vector<std::byte> reply;
  for (const std::vector<std::byte>& item : blobs) {
    const uint64_t length = item.size();
    const auto* length_bytes = reinterpret_cast<const std::byte*>(&length);
    reply.insert(reply.end(), length_bytes, length_bytes + sizeof(length));
    reply.insert(reply.end(), item.begin(), item.end());
  }
  for (int rank = 1; rank < world; ++rank) {
    Status sent = peers_[static_cast<size_t>(rank)].send(
        MessageHeader{.kind = kind, .rank = 0, .sequence = sequence}, reply, deadline);
    if (!sent.ok()) return fail(std::move(sent).with_context("rendezvous " + what));
  }
  return blobs;
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
