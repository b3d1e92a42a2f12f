// train_gpt's command line under fuzzing: the input is one argument per line. It runs
// the trainer's own flag parser and the option building behind it (config overrides,
// finalize, the model and data checks), stopping before any training.
//
// LEAD: train_gpt's parser is moving into examples/gpt/flags.{h,cpp} (branch wt-input).
// Until it has, this file reaches parse_args() and build_options() by compiling
// examples/train_gpt.cpp into itself with its main() renamed (the three lines marked
// "until flags.h"). After the merge: include "examples/gpt/flags.h" instead; in
// run_command_line() call gpt::parse_train_gpt_args(arguments), then on success
// gpt::apply_train_gpt_overrides() onto a StrataConfig and finalize(); and in
// tests/fuzz/CMakeLists.txt link the flags harness with strata_flags, not strata_gpt.
#include <string>
#include <string_view>
#include <vector>

#include "tests/fuzz/fuzz_targets.h"

#define main train_gpt_main            // until flags.h
#include "examples/train_gpt.cpp"     // until flags.h
#undef main                           // until flags.h

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

void run_command_line(std::vector<std::string> arguments) {
  std::vector<char*> argv;
  std::string program = "train_gpt";
  argv.push_back(program.data());
  for (std::string& argument : arguments) argv.push_back(argument.data());
  argv.push_back(nullptr);
  StatusOr<Args> args = parse_args(static_cast<int>(argv.size() - 1), argv.data());
  if (!args.ok()) {
    STRATA_FUZZ_CHECK(!args.status().message().empty(), "flags: an error without a message");
    return;
  }
  StatusOr<TrainerOptions> options = build_options(*args);
  if (!options.ok()) STRATA_FUZZ_CHECK(!options.status().message().empty(), "flags: an error without a message");
}

}  // namespace

int fuzz_flags(const uint8_t* data, size_t size) {
  std::vector<std::string> arguments = split_lines(std::string_view(reinterpret_cast<const char*>(data), size));
  if (arguments.size() > 64) return 0;  // a command line, not a file
  run_command_line(std::move(arguments));
  return 0;
}

}  // namespace strata::fuzz
