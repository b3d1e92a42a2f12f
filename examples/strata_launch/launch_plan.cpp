#include "examples/strata_launch/launch_plan.h"

#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <set>

#include "engine/core/check.h"
#include "engine/core/file.h"
#include "engine/core/rendezvous.h"
#include "examples/flags/flags.h"

namespace strata::launch {
namespace {

constexpr std::array<std::string_view, 7> kLaunchVariables = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"};

// Applies one flag's value to `plan`.
Status apply_launch_flag(const std::string& name, const std::string& value, LaunchPlan& plan) {
  const std::string flag = "--" + name;
  if (name == "nproc-per-node") {
    STRATA_ASSIGN_OR_RETURN(plan.nproc_per_node, flags::parse_flag_integer<int>(flag, value, 1, 4096));
  } else if (name == "nnodes") {
    STRATA_ASSIGN_OR_RETURN(plan.nnodes, flags::parse_flag_integer<int>(flag, value, 1, 65536));
  } else if (name == "node-rank") {
    STRATA_ASSIGN_OR_RETURN(plan.node_rank, flags::parse_flag_integer<int>(flag, value, 0, 65535));
  } else if (name == "master-addr") {
    if (value.empty()) return InvalidArgumentError("--master-addr is empty: expected rank 0's host name or address");
    plan.master_addr = value;
  } else if (name == "master-port") {
    STRATA_ASSIGN_OR_RETURN(plan.master_port, flags::parse_flag_integer<uint16_t>(flag, value, 1, 65535));
  } else if (name == "grace-period") {
    STRATA_ASSIGN_OR_RETURN(const double seconds, flags::parse_flag_number(flag, value));
    if (seconds < 0.0 || seconds > 86400.0)
      return InvalidArgumentError("--grace-period '" + value + "': expected seconds in [0, 86400]");
    plan.grace_period = std::chrono::milliseconds(std::llround(seconds * 1000.0));
  } else {
    return InvalidArgumentError("unknown flag " + flag + " (strata-launch --help lists the flags)");
  }
  return Status::Ok();
}

// The checks that involve several flags.
// `given` holds the names of the flags the command line set.
Status check_launch_plan(const LaunchPlan& plan, const std::set<std::string>& given) {
  if (plan.command.empty())
    return InvalidArgumentError("no program to launch: strata-launch [FLAGS] -- PROGRAM [ARGS...]");
  if (plan.node_rank >= plan.nnodes)
    return InvalidArgumentError("--node-rank " + std::to_string(plan.node_rank) + " is not below --nnodes " +
                                std::to_string(plan.nnodes));
  if (plan.nnodes > 1 && !given.contains("node-rank"))
    return InvalidArgumentError("--nnodes " + std::to_string(plan.nnodes) +
                                " needs --node-rank (this node's index, different on every node)");
  if (plan.nnodes > 1 && !given.contains("master-addr"))
    return InvalidArgumentError("--nnodes " + std::to_string(plan.nnodes) +
                                " needs --master-addr (node 0's address, reachable from every node)");
  if (static_cast<long long>(plan.nnodes) * plan.nproc_per_node > (1 << 20))
    return InvalidArgumentError("--nnodes x --nproc-per-node is over 2^20 processes");
  return Status::Ok();
}

}  // namespace

std::string_view launch_usage() {
  return "usage: strata-launch --nproc-per-node N [--nnodes M --node-rank R --master-addr A]\n"
         "                     [--master-port P] [--grace-period S] -- PROGRAM [ARGS...]\n"
         "\n"
         "Starts N processes of PROGRAM on this node with torchrun's variables: RANK = R*N + i,\n"
         "WORLD_SIZE = M*N, LOCAL_RANK = i, LOCAL_WORLD_SIZE = N, GROUP_RANK = R, MASTER_ADDR,\n"
         "MASTER_PORT. Prefixes their output lines with \"[rank RANK] \", forwards SIGINT, SIGTERM\n"
         "and SIGHUP to them, and when one exits non-zero or is killed, stops the others (SIGTERM,\n"
         "then SIGKILL after the grace period) and exits with its code (128+signal when killed).\n"
         "\n"
         "  --nproc-per-node N  processes on this node (default 1)\n"
         "  --nnodes M          nodes in the job, one strata-launch each (default 1)\n"
         "  --node-rank R       this node's index in [0, M) (required when M > 1)\n"
         "  --master-addr A     node 0's address (default 127.0.0.1; required when M > 1)\n"
         "  --master-port P     rank 0's rendezvous port (default: a free port on one node,\n"
         "                      29500 on several)\n"
         "  --grace-period S    seconds between SIGTERM and SIGKILL when stopping (default 10)\n"
         "\n"
         "See docs/distributed.md.\n";
}

StatusOr<LaunchPlan> parse_launch_args(std::span<const std::string> args) {
  LaunchPlan plan;
  std::set<std::string> given;
  size_t index = 0;
  for (; index < args.size(); ++index) {
    const std::string& argument = args[index];
    if (argument == "--") {
      ++index;
      break;
    }
    if (!argument.starts_with("-")) break;  // the program
    if (argument == "--help" || argument == "-h") {
      plan.help = true;
      return plan;
    }
    STRATA_ASSIGN_OR_RETURN(const flags::FlagToken token, flags::split_flag(argument));
    STRATA_ASSIGN_OR_RETURN(const std::string value, flags::take_flag_value(args, index, token));
    STRATA_RETURN_IF_ERROR(apply_launch_flag(token.name, value, plan));
    given.insert(token.name);
  }
  plan.command.assign(args.begin() + static_cast<std::ptrdiff_t>(index), args.end());
  if (plan.master_port == 0 && plan.nnodes > 1) plan.master_port = kDefaultMasterPort;
  STRATA_RETURN_IF_ERROR(check_launch_plan(plan, given));
  return plan;
}

StatusOr<uint16_t> pick_free_port() {
  int fd = -1;
  STRATA_SYSCALL(fd, ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const File socket(fd, "free-port probe socket");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = 0;
  int result = 0;
  STRATA_SYSCALL(result, ::bind(socket.fd(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)));
  socklen_t length = sizeof(address);
  STRATA_SYSCALL(result, ::getsockname(socket.fd(), reinterpret_cast<sockaddr*>(&address), &length));
  return ntohs(address.sin_port);
}

std::vector<std::string> child_environment(const LaunchPlan& plan, int local_rank,
                                           std::span<const std::string> inherited) {
  std::vector<std::string> environment;
  environment.reserve(inherited.size() + kLaunchVariables.size());
  for (const std::string& entry : inherited) {
    const std::string_view name = std::string_view(entry).substr(0, entry.find('='));
    if (std::find(kLaunchVariables.begin(), kLaunchVariables.end(), name) == kLaunchVariables.end())
      environment.push_back(entry);
  }
  environment.push_back("RANK=" + std::to_string(plan.global_rank(local_rank)));
  environment.push_back("WORLD_SIZE=" + std::to_string(plan.world_size()));
  environment.push_back("LOCAL_RANK=" + std::to_string(local_rank));
  environment.push_back("LOCAL_WORLD_SIZE=" + std::to_string(plan.nproc_per_node));
  environment.push_back("GROUP_RANK=" + std::to_string(plan.node_rank));
  environment.push_back("MASTER_ADDR=" + plan.master_addr);
  environment.push_back("MASTER_PORT=" + std::to_string(plan.master_port));
  return environment;
}

}  // namespace strata::launch
