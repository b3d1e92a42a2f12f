// strata-bench: the offload benchmark tool. Each subcommand lives in its own file and
// prints a readable table, or with --json exactly one JSON object as the last line of
// stdout (logs go to stderr).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "engine/core/status.h"

namespace strata::bench {

// A tiny flag parser: `--name value`, `--name=value` and boolean `--name`.
class Args {
 public:
  // `boolean_flags` take no value. Unknown flags are an error naming the flag and the
  // subcommand's usage.
  static StatusOr<Args> parse(int argc, char** argv, const std::vector<std::string>& value_flags,
                              const std::vector<std::string>& boolean_flags);
  bool has(const std::string& name) const { return values_.count(name) != 0; }
  std::string get(const std::string& name, const std::string& fallback) const;
  StatusOr<int64_t> get_int(const std::string& name, int64_t fallback) const;
  StatusOr<double> get_double(const std::string& name, double fallback) const;
  bool flag(const std::string& name) const { return has(name); }

 private:
  std::map<std::string, std::string> values_;
};

// Subcommands: each returns the process exit code.
int run_nvme(int argc, char** argv);
int run_copy(int argc, char** argv);
int run_adam(int argc, char** argv);
int run_step(int argc, char** argv);

// Prints "strata-bench <subcommand>: <status>" to stderr and returns 1 (or 2 for usage errors).
int report_failure(const char* subcommand, const Status& status);

}  // namespace strata::bench
