// A stand-in for a training program in the multi-node harness (tests/scripts/multinode_test.sh):
// joins through rendezvous_options_from_env like the programs do, all-gathers each rank's
// "rank node_rank local_rank host", checks the job's shape, leaves a file in its node's
// --nvme-path, and has rank 0 print one line listing every rank. Exits 1 with the error.
//
//   rendezvous_probe --nvme-path DIR [--nodes M] [--exit-rank R --exit-code C]
//
// With --exit-rank, rank R exits with code C right after joining, as a process that dies
// mid-run: the others must fail (not hang), naming it.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "engine/core/rendezvous.h"

namespace {

struct RankInfo {
  int rank = -1, node_rank = -1, local_rank = -1;
  std::string host;
};

strata::StatusOr<RankInfo> parse_info(const std::string& text) {
  RankInfo info;
  std::istringstream in(text);
  if (!(in >> info.rank >> info.node_rank >> info.local_rank >> info.host))
    return strata::DataLossError("rendezvous_probe: malformed rank record '" + text + "'");
  return info;
}

// Every rank present once, on the node its rank implies, the nodes numbered 0..nodes-1.
strata::Status check_shape(const std::vector<RankInfo>& ranks, const strata::RendezvousOptions& options, int nodes) {
  for (size_t i = 0; i < ranks.size(); ++i) {
    const RankInfo& info = ranks[i];
    const int expected_node = static_cast<int>(i) / options.local_world_size;
    if (info.rank != static_cast<int>(i) || info.node_rank != expected_node ||
        info.local_rank != static_cast<int>(i) % options.local_world_size || info.node_rank >= nodes)
      return strata::InternalError("rendezvous_probe: rank " + std::to_string(i) + " reports rank " +
                                   std::to_string(info.rank) + " on node " + std::to_string(info.node_rank) +
                                   " local " + std::to_string(info.local_rank) + ", expected node " +
                                   std::to_string(expected_node) + " of " + std::to_string(nodes));
  }
  return strata::Status::Ok();
}

struct ProbeArgs {
  std::string nvme_path;
  int nodes = 1;
  int exit_rank = -1;  // the rank that exits early, -1 for none
  int exit_code = 0;
};

strata::Status run(const ProbeArgs& args) {
  STRATA_ASSIGN_OR_RETURN(const strata::RendezvousOptions options, strata::rendezvous_options_from_env());
  STRATA_ASSIGN_OR_RETURN(strata::Rendezvous rendezvous, strata::Rendezvous::create(options));
  if (options.rank == args.exit_rank) {
    std::fprintf(stderr, "rendezvous_probe: rank %d exits with code %d as asked\n", options.rank, args.exit_code);
    std::exit(args.exit_code);
  }
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::string record = std::to_string(options.rank) + " " + std::to_string(options.node_rank) + " " +
                             std::to_string(options.local_rank) + " " + host;
  STRATA_ASSIGN_OR_RETURN(const std::vector<std::string> records, rendezvous.all_gather_strings(record));
  std::vector<RankInfo> ranks;
  for (const std::string& text : records) {
    STRATA_ASSIGN_OR_RETURN(RankInfo info, parse_info(text));
    ranks.push_back(info);
  }
  STRATA_RETURN_IF_ERROR(check_shape(ranks, options, args.nodes));
  std::filesystem::create_directories(args.nvme_path);
  std::ofstream(std::filesystem::path(args.nvme_path) / ("rank-" + std::to_string(options.rank))) << record << "\n";
  STRATA_RETURN_IF_ERROR(rendezvous.barrier());
  if (options.rank == 0) {
    std::string line = "rendezvous_probe: " + std::to_string(options.world_size) + " ranks joined via " +
                       std::string(strata::launch_environment_name(options.launched_by)) + " variables:";
    for (const RankInfo& info : ranks)
      line += " " + std::to_string(info.rank) + "@node" + std::to_string(info.node_rank);
    std::printf("%s\n", line.c_str());
  }
  return strata::Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  ProbeArgs args;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--nvme-path") args.nvme_path = argv[i + 1];
    else if (flag == "--nodes") args.nodes = std::atoi(argv[i + 1]);
    else if (flag == "--exit-rank") args.exit_rank = std::atoi(argv[i + 1]);
    else if (flag == "--exit-code") args.exit_code = std::atoi(argv[i + 1]);
  }
  if (args.nvme_path.empty() || args.nodes < 1) {
    std::fprintf(stderr, "usage: rendezvous_probe --nvme-path DIR [--nodes M] [--exit-rank R --exit-code C]\n");
    return 2;
  }
  const strata::Status status = run(args);
  if (!status.ok()) {
    std::fprintf(stderr, "rendezvous_probe: %s\n", status.to_string().c_str());
    return 1;
  }
  return 0;
}
