// strata-bench token-scan: the cost of checking a token file against the vocabulary when
// it is opened (examples/data/token_data.h check_token_file_vocabulary): writes a GPT-2
// token file of --tokens uint16 tokens (all below the vocabulary, so the whole file is
// scanned), reads it once into the page cache, then times the check per ISA and thread
// count, the configurations alternated round by round; prints each one's median.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "examples/data/token_data.h"
#include "examples/strata_bench/bench.h"

namespace strata::bench {

const char* const kTokenScanUsage =
    "usage: strata-bench token-scan [--dir D] [--tokens N] [--repetitions R] [--json]\n"
    "  --dir D          where the token file is written and scanned, then removed (default /tmp)\n"
    "  --tokens N       uint16 tokens in the file, 1 to 2^31 - 1 (default 2^29: 1 GiB)\n"
    "  --repetitions R  rounds over every ISA and thread count; the median is reported (default 7)\n"
    "  --json           print one JSON object as the last line of stdout";

namespace {

Status write_uniform_token_file(const std::string& path, uint64_t tokens) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  std::vector<int32_t> header(data::kLlmcHeaderInts, 0);
  header[0] = data::kLlmcGpt2Magic;
  header[1] = data::kLlmcGpt2Version;
  header[2] = static_cast<int32_t>(std::min<uint64_t>(tokens, INT32_MAX));
  if (tokens > INT32_MAX) return InvalidArgumentError("--tokens must be at most 2^31 - 1 (the header's int32 count)");
  out.write(reinterpret_cast<const char*>(header.data()), data::kLlmcHeaderBytes);
  std::vector<uint16_t> chunk(size_t{1} << 20);
  for (uint64_t written = 0; written < tokens; written += chunk.size()) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk.size(), tokens - written));
    for (size_t i = 0; i < n; ++i) chunk[i] = static_cast<uint16_t>((written + i) * 2654435761u % data::kGpt2VocabSize);
    out.write(reinterpret_cast<const char*>(chunk.data()), static_cast<std::streamsize>(n * 2));
  }
  out.close();
  if (!out) return IoError("cannot write " + path);
  return {};
}

struct ScanConfig {
  CpuIsa isa;
  int threads;
  std::vector<double> seconds;
};

Status measure_token_scan(int argc, char** argv) {
  STRATA_ASSIGN_OR_RETURN(Args args, Args::parse(argc, argv, {"dir", "tokens", "repetitions"}, {"json"}));
  const std::string path = args.get("dir", "/tmp") + "/strata-bench-token-scan.bin";
  STRATA_ASSIGN_OR_RETURN(const uint64_t tokens, args.get_integer<uint64_t>("tokens", uint64_t{1} << 29, 1, INT32_MAX));
  STRATA_ASSIGN_OR_RETURN(const int repetitions, args.get_integer<int>("repetitions", 7, 1, 1000));
  STRATA_RETURN_IF_ERROR(write_uniform_token_file(path, tokens));
  std::vector<ScanConfig> configs;
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512})
    if (cpu_isa_supported(isa))
      for (int threads : {1, 2}) configs.push_back({isa, threads, {}});
  // One untimed pass brings the file into the page cache.
  STRATA_RETURN_IF_ERROR(data::check_token_file_vocabulary(path, data::kGpt2VocabSize));
  for (int round = 0; round < repetitions; ++round) {
    for (ScanConfig& config : configs) {
      const auto start = std::chrono::steady_clock::now();
      STRATA_RETURN_IF_ERROR(data::check_token_file_vocabulary(path, data::kGpt2VocabSize, {.isa = config.isa, .threads = config.threads}));
      config.seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  std::remove(path.c_str());
  const double bytes = static_cast<double>(tokens) * 2;
  std::string json = "{\"subcommand\": \"token-scan\", \"tokens\": " + std::to_string(tokens) + ", \"results\": [";
  std::printf("token-scan: %llu uint16 tokens (%.2f GiB), median of %d, page cache warm\n", static_cast<unsigned long long>(tokens),
              bytes / (1 << 30), repetitions);
  for (size_t i = 0; i < configs.size(); ++i) {
    std::vector<double> s = configs[i].seconds;
    std::sort(s.begin(), s.end());
    const double median = s[s.size() / 2];
    const std::string isa(cpu_isa_name(configs[i].isa));
    std::printf("  %-7s %d thread%s  %8.1f ms  %6.2f GB/s\n", isa.c_str(), configs[i].threads, configs[i].threads == 1 ? " " : "s",
                median * 1e3, bytes / median / 1e9);
    json += std::string(i ? ", " : "") + "{\"isa\": \"" + isa + "\", \"threads\": " + std::to_string(configs[i].threads) +
            ", \"median_s\": " + std::to_string(median) + ", \"gbps\": " + std::to_string(bytes / median / 1e9) + "}";
  }
  if (args.flag("json")) std::printf("%s]}\n", json.c_str());
  return {};
}

}  // namespace

int run_token_scan(int argc, char** argv) {
  const Status status = measure_token_scan(argc, argv);
  return status.ok() ? 0 : report_failure("token-scan", status);
}

}  // namespace strata::bench
