#include "examples/train/train_args.h"

#include <limits>
#include <string_view>

namespace strata::train {
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
constexpr std::string_view kSwitchFlags[] = {"eval-only", "plan-only"};

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
StatusOr<bool> take_trainer_flag(TrainArgs& args, const std::string& flag, const std::string& value) {
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

StatusOr<TrainArgs> parse_train_args(std::span<const std::string> args) {
  TrainArgs parsed;
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

Status apply_train_overrides(RunConfig& config, const TrainArgs& args) {
  for (const TrainArgs::Override& o : args.overrides) {
    const Status status = apply_run_override(config, o.key, o.value);
    if (!status.ok()) {
      const std::string written = o.flag == "--set" ? "--set " + o.key + "=" + o.value : o.flag + " " + o.value;
      return Status(status.code(), written + ": " + status.message());
    }
  }
  return {};
}

}  // namespace strata::train
