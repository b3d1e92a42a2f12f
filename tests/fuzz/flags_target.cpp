// train_gpt's command line under fuzzing: the input is one argument per line. It runs the
// trainer's flag parser (examples/flags/flags.h), then applies the config overrides it
// collected onto a default config and finalizes it, as train_gpt does before any file is
// read or written (a --config path is not opened: the harness touches no files).
#include <string>
#include <string_view>
#include <vector>

#include "examples/flags/flags.h"
#include "examples/train/train_args.h"
#include "tests/fuzz/fuzz_targets.h"

namespace strata::fuzz {

namespace {

std::vector<std::string> split_lines(std::string_view text) {
  std::vector<std::string> lines;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string_view::npos) end = text.size();
    lines.emplace_back(text.substr(begin, end - begin));
    begin = end + 1;
  }
  return lines;
}

void run_command_line(const std::vector<std::string>& arguments) {
  StatusOr<train::TrainArgs> args = train::parse_train_args(arguments);
  if (!args.ok()) {
    STRATA_FUZZ_CHECK(!args.status().message().empty(), "flags: an error without a message");
    return;
  }
  RunConfig config;
  Status applied = train::apply_train_overrides(config, *args);
  if (applied.ok()) applied = finalize_run_config(config, kConfiguredWorldSize);
  if (!applied.ok()) STRATA_FUZZ_CHECK(!applied.message().empty(), "flags: an error without a message");
}

}  // namespace

int fuzz_flags(const uint8_t* data, size_t size) {
  const std::vector<std::string> arguments = split_lines(std::string_view(reinterpret_cast<const char*>(data), size));
  if (arguments.size() > 64) return 0;  // a command line, not a file
  run_command_line(arguments);
  return 0;
}

}  // namespace strata::fuzz
