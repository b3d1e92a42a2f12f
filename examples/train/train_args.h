// The trainer's command line (strata-train, train_gpt): parsed into TrainArgs, then
// applied to a RunConfig. Flags are split and range-checked by examples/flags/flags.h;
// everything takes the arguments as strings, so a unit test or a fuzz target can call it
// without a process.
#pragma once

#include <concepts>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "examples/run_config/run_config.h"
#include "engine/core/status.h"
#include "examples/flags/flags.h"

namespace strata::train {

// train_gpt's command line, parsed but not yet applied to a config.
struct TrainArgs {
  // A config key set from the command line: `flag` is how it was written (--grad-accum,
  // or --set for --set KEY=VALUE), so errors can name it.
  struct Override {
    std::string key;
    std::string value;
    std::string flag;
  };
  bool help = false;  // --help / -h: print the usage and exit 0
  std::string config_path;
  std::vector<Override> overrides;  // in command-line order
  std::string data_spec;
  std::optional<std::string> checkpointing;
  std::map<std::string, std::string> trainer;  // trainer-only flags, validated (numbers are in range)
};

// Parses train_gpt's arguments (`args` excludes the program name). Numeric trainer flags
// are range-checked here in the type they are stored in; config keys are checked when
// applied (apply_train_overrides).
StatusOr<TrainArgs> parse_train_args(std::span<const std::string> args);

// Applies the overrides to `config` in order; an error names the flag as written and its
// value before the key's own message (which gives the expected type and range).
Status apply_train_overrides(RunConfig& config, const TrainArgs& args);

// A trainer integer flag's value (already range-checked by parse_train_args), or
// `fallback` when the flag was not given.
template <std::integral T>
StatusOr<T> trainer_integer(const TrainArgs& args, const std::string& flag, T fallback) {
  auto it = args.trainer.find(flag);
  if (it == args.trainer.end()) return fallback;
  return flags::parse_flag_integer<T>(flag, it->second);
}

}  // namespace strata::train
