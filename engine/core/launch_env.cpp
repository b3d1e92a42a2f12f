#include "engine/core/launch_env.h"

#include <charconv>
#include <climits>
#include <cstdlib>
#include <string>

#include "engine/core/slurm_nodelist.h"

namespace strata {

std::optional<std::string> process_env_lookup(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

namespace {

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
}  // namespace strata
