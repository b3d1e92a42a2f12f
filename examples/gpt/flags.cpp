#include "examples/gpt/flags.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <system_error>

namespace strata::flags {

StatusOr<FlagToken> split_flag(std::string_view argument) {
  if (argument.substr(0, 2) != "--" || argument.size() == 2)
    return InvalidArgumentError("unexpected argument \"" + std::string(argument) + "\" (flags start with --; see --help)");
  FlagToken token;
  std::string_view name = argument.substr(2);
  if (const size_t eq = name.find('='); eq != std::string_view::npos) {
    token.inline_value = std::string(name.substr(eq + 1));
    name = name.substr(0, eq);
  }
  token.name = std::string(name);
  return token;
}

StatusOr<std::string> take_flag_value(std::span<const std::string> args, size_t& index, const FlagToken& flag) {
  if (flag.inline_value) return *flag.inline_value;
  if (index + 1 >= args.size()) return InvalidArgumentError("--" + flag.name + " needs a value");
  const std::string& next = args[index + 1];
  if (next.rfind("--", 0) == 0)
    return InvalidArgumentError("--" + flag.name + " needs a value, but the next argument is the flag \"" + next +
                                "\" (write --" + flag.name + "=" + next + " if that is the value)");
  ++index;
  return next;
}

Status integer_range_error(std::string_view flag, std::string_view text, std::string_view min, std::string_view max,
                           std::string_view why) {
  return InvalidArgumentError("--" + std::string(flag) + " " + std::string(why) + ": got \"" + std::string(text) +
                              "\", expected an integer in [" + std::string(min) + ", " + std::string(max) + "]");
}

StatusOr<double> parse_flag_number(std::string_view flag, std::string_view text) {
  const std::string copy(text);  // strtod needs a terminated string
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(copy.c_str(), &end);
  if (errno != 0 || copy.empty() || end != copy.c_str() + copy.size() || !std::isfinite(value))
    return InvalidArgumentError("--" + std::string(flag) + " expects a finite number, got \"" + copy + "\"");
  return value;
}

namespace {

Status output_path_error(std::string_view what, const std::string& path, const std::string& problem) {
  return FailedPreconditionError(std::string(what) + " " + path + ": " + problem + " (checked before training starts)");
}

bool writable(const std::filesystem::path& path) { return ::access(path.c_str(), W_OK) == 0; }

}  // namespace

Status prepare_output_path(std::string_view what, const std::string& path, OutputKind kind) {
  namespace fs = std::filesystem;
  if (path.empty()) return output_path_error(what, path, "the path is empty");
  std::error_code error;
  const fs::path target = fs::absolute(path, error);
  if (error) return output_path_error(what, path, error.message());
  const fs::file_status status = fs::status(target, error);
  if (fs::exists(status)) {
    if (kind == OutputKind::kFile && fs::is_directory(status)) return output_path_error(what, path, "is a directory, not a file");
    if (kind == OutputKind::kDirectory && !fs::is_directory(status)) return output_path_error(what, path, "exists and is not a directory");
    if (!writable(target)) return output_path_error(what, path, std::string("is not writable: ") + std::strerror(errno));
    return {};
  }
  if (kind == OutputKind::kFile) {
    const fs::path parent = target.parent_path();
    fs::create_directories(parent, error);
    if (error) return output_path_error(what, path, "cannot create its directory " + parent.string() + ": " + error.message());
    if (!writable(parent))
      return output_path_error(what, path, "its directory " + parent.string() + " is not writable: " + std::strerror(errno));
    return {};
  }
  // A directory its writer will create: the nearest existing ancestor must be a
  // writable directory.
  fs::path ancestor = target.parent_path();
  while (!fs::exists(ancestor, error) && ancestor != ancestor.parent_path()) ancestor = ancestor.parent_path();
  if (!fs::is_directory(ancestor, error))
    return output_path_error(what, path, "cannot be created: " + ancestor.string() + " is not a directory");
  if (!writable(ancestor))
    return output_path_error(what, path, "cannot be created: the directory " + ancestor.string() + " is not writable (" +
                                             std::strerror(errno) + ")");
  return {};
}

}  // namespace strata::flags

namespace strata::gpt {
namespace {

// Integer trainer flags: each range is that of the field it sets (TrainerOptions).
struct IntegerFlag {
  std::string_view name;
  int64_t min;
  int64_t max;
};
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr IntegerFlag kIntegerFlags[] = {
    {"save-every", 0, kInt64Max},
    {"keep-checkpoints", 0, std::numeric_limits<int>::max()},
    {"eval-every", 0, kInt64Max},
    {"eval-sequences", 0, kInt64Max},
    {"synthetic-order", 1, 2},
    {"synthetic-successors", 1, kInt64Max},
    {"head-chunk-rows", 0, kInt64Max},
    {"export-shard-mib", 1, kInt64Max / (int64_t{1} << 20)},
};
// Flags that set no config key (strings, and the integers above).
constexpr std::string_view kStringFlags[] = {"init-from", "export", "save-dir", "resume", "model", "export-dtype"};
// Switches: `--name` alone means true; `--name=true|false` also reads.
constexpr std::string_view kSwitchFlags[] = {"eval-only"};

// A switch's value: absent (bare `--name`) is true.
StatusOr<std::string> switch_value(const flags::FlagToken& token) {
  if (!token.inline_value || *token.inline_value == "true" || *token.inline_value == "1") return std::string("true");
  if (*token.inline_value == "false" || *token.inline_value == "0") return std::string("false");
  return InvalidArgumentError("--" + token.name + " is a switch: write --" + token.name + " or --" + token.name + "=false, got \"" +
                              *token.inline_value + "\"");
}

std::optional<std::string> model_or_data_key(std::string_view flag) {
  static const std::map<std::string_view, std::string_view> kKeys = {
      {"preset", "strata.model.preset"},       {"n-layer", "strata.model.n_layer"}, {"n-head", "strata.model.n_head"},
      {"n-embd", "strata.model.n_embd"},       {"n-ctx", "strata.model.n_ctx"},     {"vocab-size", "strata.model.vocab_size"},
      {"seq-len", "strata.data.seq_len"},      {"eval-fraction", "strata.data.eval_fraction"},
  };
  auto it = kKeys.find(flag);
  if (it == kKeys.end()) return std::nullopt;
  return std::string(it->second);
}

// A trainer flag's value checked by its kind; false when `flag` is not a trainer flag.
StatusOr<bool> take_trainer_flag(TrainGptArgs& args, const std::string& flag, const std::string& value) {
  for (const IntegerFlag& spec : kIntegerFlags) {
    if (spec.name != flag) continue;
    STRATA_RETURN_IF_ERROR(flags::parse_flag_integer<int64_t>(flag, value, spec.min, spec.max).status());
    args.trainer[flag] = value;
    return true;
  }
  // --data-seed takes any 64-bit seed.
  if (flag == "data-seed") {
    STRATA_RETURN_IF_ERROR(flags::parse_flag_integer<uint64_t>(flag, value).status());
    args.trainer[flag] = value;
    return true;
  }
  if (std::find(std::begin(kStringFlags), std::end(kStringFlags), flag) == std::end(kStringFlags)) return false;
  args.trainer[flag] = value;
  return true;
}

}  // namespace

StatusOr<TrainGptArgs> parse_train_gpt_args(std::span<const std::string> args) {
  TrainGptArgs parsed;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--help" || args[i] == "-h") {
      parsed.help = true;
      return parsed;
    }
    STRATA_ASSIGN_OR_RETURN(const flags::FlagToken token, flags::split_flag(args[i]));
    if (std::find(std::begin(kSwitchFlags), std::end(kSwitchFlags), token.name) != std::end(kSwitchFlags)) {
      STRATA_ASSIGN_OR_RETURN(parsed.trainer[token.name], switch_value(token));
      continue;
    }
    STRATA_ASSIGN_OR_RETURN(const std::string value, flags::take_flag_value(args, i, token));
    const std::string& flag = token.name;
    if (flag == "config") {
      parsed.config_path = value;
    } else if (flag == "set") {
      const size_t eq = value.find('=');
      if (eq == std::string::npos) return InvalidArgumentError("--set needs KEY=VALUE, got \"" + value + "\"");
      parsed.overrides.push_back({value.substr(0, eq), value.substr(eq + 1), "--set"});
    } else if (flag == "data") {
      parsed.data_spec = value;
    } else if (flag == "activation-checkpointing") {
      parsed.checkpointing = value;
    } else if (auto key = model_or_data_key(flag)) {
      parsed.overrides.push_back({*key, value, "--" + flag});
    } else if (auto key = run_config_key_for_flag(flag)) {
      parsed.overrides.push_back({*key, value, "--" + flag});
    } else {
      STRATA_ASSIGN_OR_RETURN(const bool taken, take_trainer_flag(parsed, flag, value));
      if (!taken) return InvalidArgumentError("unknown flag --" + flag + " (see --help; --set KEY=VALUE sets any config key)");
    }
  }
  return parsed;
}

Status apply_train_gpt_overrides(RunConfig& config, const TrainGptArgs& args) {
  for (const TrainGptArgs::Override& o : args.overrides) {
    const Status status = apply_run_override(config, o.key, o.value);
    if (!status.ok()) {
      const std::string written = o.flag == "--set" ? "--set " + o.key + "=" + o.value : o.flag + " " + o.value;
      return Status(status.code(), written + ": " + status.message());
    }
  }
  return {};
}

}  // namespace strata::gpt
