// strata-bench <subcommand> [flags]: the offload benchmark tool.
#include <cstdio>
#include <cstring>

#include "engine/version.h"
#include "examples/strata_bench/bench.h"
#include "kernels/transformer_ops_cpu.h"

namespace {

struct Subcommand {
  const char* name;
  int (*run)(int argc, char** argv);
  const char* summary;
  const char* const* usage;  // printed for `strata-bench <name> --help` (the address: defined in another file)
};

constexpr Subcommand kSubcommands[] = {
    {"nvme", strata::bench::run_nvme, "NVMe store write/read bandwidth through io_uring (or the psync pool)",
     &strata::bench::kNvmeUsage},
    {"copy", strata::bench::run_copy, "host<->device copy bandwidth from pinned and pageable memory",
     &strata::bench::kCopyUsage},
    {"adam", strata::bench::run_adam, "fused CPU Adam step throughput against the memory ceiling",
     &strata::bench::kAdamUsage},
    {"step", strata::bench::run_step, "a synthetic layer stack through the full offload engine",
     &strata::bench::kStepUsage},
    {"kernels", strata::bench::run_kernels, "each transformer op at GPT-2 XL and Llama-1B shapes against the H200's peak",
     &strata::bench::kKernelsUsage},
    {"profile", strata::bench::run_profile, "this machine's rates (NVMe, copies, CPU Adam, kernels, memory) as one JSON profile",
     &strata::bench::kProfileUsage},
    {"token-scan", strata::bench::run_token_scan, "the vocabulary check of a token file at open, per ISA and thread count",
     &strata::bench::kTokenScanUsage},
};

void print_usage(std::FILE* out) {
  std::fprintf(out, "usage: strata-bench <subcommand> [flags] [--json]\n"
                    "       strata-bench <subcommand> --help\n\nsubcommands:\n");
  for (const auto& sub : kSubcommands) std::fprintf(out, "  %-10s %s\n", sub.name, sub.summary);
  std::fprintf(out, "\n%s\n", strata::build_description().c_str());
}

bool is_help(const char* arg) { return std::strcmp(arg, "--help") == 0 || std::strcmp(arg, "-h") == 0; }

}  // namespace

int main(int argc, char** argv) {
  // Before anything is measured: OpenBLAS's idle pool would otherwise spin on a core
  // through every subcommand, including those that never multiply (nvme, adam), or hang
  // the tool under an address-space limit; this may re-execute the tool, so it comes first.
  if (strata::Status blas = strata::kernels::cpu::reexec_with_single_threaded_blas(argv); !blas.ok()) {
    std::fprintf(stderr, "strata-bench: warning: %s\n", blas.to_string().c_str());
  }
  if (argc < 2 || is_help(argv[1])) {
    print_usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (const auto& sub : kSubcommands) {
    if (std::strcmp(argv[1], sub.name) != 0) continue;
    // --help anywhere among a subcommand's flags: its usage, for every subcommand alike.
    for (int i = 2; i < argc; ++i) {
      if (is_help(argv[i])) {
        std::printf("%s\n", *sub.usage);
        return 0;
      }
    }
    return sub.run(argc - 2, argv + 2);
  }
  std::fprintf(stderr, "strata-bench: unknown subcommand '%s'\n\n", argv[1]);
  print_usage(stderr);
  return 2;
}
