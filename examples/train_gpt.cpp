// train_gpt: train or fine-tune a GPT-2-architecture model whose training state may be
// far larger than the device's memory.
//
//   train_gpt [--config FILE] [--flag VALUE | --flag=VALUE]...
//
// The config file speaks DeepSpeed's vocabulary (docs/config.md), with Strata's own
// settings (model, data, device budget, files) under "strata". Flags override it. Output:
// the placement plan and one progress line per step on stdout, logs on stderr, and as the
// last line of stdout one JSON object summarizing the run.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/config.h"
#include "engine/core/log.h"
#include "examples/gpt/gpt_model.h"
#include "examples/gpt/gpt_trainer.h"
#include "examples/gpt/gpt_weights.h"
#include "examples/gpt/preemption.h"
#include "examples/gpt/safetensors.h"
#include "examples/gpt/token_data.h"

namespace {

using namespace strata;
using namespace strata::gpt;

constexpr const char* kUsage = R"(usage: train_gpt [--config FILE] [options]

Model and data
  --preset NAME              tiny, small-demo, gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt-2.7b, gpt-6.7b, gpt-13b
  --n-layer N --n-head N --n-embd N --n-ctx N --vocab-size N     override the preset's shape
  --data SPEC                synthetic | text:PATH | tokens:PATH | PATH (.bin: llm.c tokens, else text bytes)
  --eval-fraction F          share of a file held out for evaluation
  --seq-len N                tokens per sequence (default: n_ctx)
  --synthetic-order N        1 or 2 (synthetic language; default 1)
  --synthetic-successors K   successors per context; the loss floor is ln K (default 4)
  --data-seed N              which samples (default: --seed)
Training
  --steps N                  total optimizer steps (a resumed run stops where a straight one would)
  --micro-batch N --grad-accum N --batch-size N --lr X --clip X --seed N
  --activation-checkpointing off|device|pinned   (default device)
  --eval-every N             evaluate every N steps (default: steps / 10); always after the last step
  --eval-sequences N         sequences in the (fixed) evaluation batch, over all ranks
Placement
  --device cpu|cuda --world-size N --device-budget-mib N --pinned-budget-mib N
  --offload-param device|cpu|nvme --offload-optimizer device|cpu|nvme --nvme-path DIR
Files
  --metrics FILE --trace FILE
  --save-dir DIR --save-every N --keep-checkpoints N --resume DIR
  --init-from FILE.safetensors --export DIR
Any config key
  --set KEY=VALUE            e.g. --set zero_optimization.offload_param.pin_memory=false
)";

struct Args {
  std::string config_path;
  std::vector<std::pair<std::string, std::string>> overrides;  // config key, value (in order)
  std::string data_spec;
  std::optional<std::string> checkpointing;
  std::map<std::string, std::string> trainer;  // trainer-only flags
};

// Flags that set no config key.
const std::vector<std::string> kTrainerFlags = {"init-from", "export", "save-dir", "save-every", "keep-checkpoints", "resume",
                                                "eval-every", "eval-sequences", "data-seed", "synthetic-order",
                                                "synthetic-successors", "head-chunk-rows"};

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

StatusOr<Args> parse_args(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return CancelledError("help");
    if (arg.rfind("--", 0) != 0) return InvalidArgumentError("unexpected argument \"" + arg + "\" (flags start with --; see --help)");
    std::string flag = arg.substr(2), value;
    if (const size_t eq = flag.find('='); eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    } else {
      if (i + 1 >= argc) return InvalidArgumentError("--" + flag + " needs a value");
      value = argv[++i];
    }
    if (flag == "config") {
      args.config_path = value;
    } else if (flag == "set") {
      const size_t eq = value.find('=');
      if (eq == std::string::npos) return InvalidArgumentError("--set needs KEY=VALUE, got \"" + value + "\"");
      args.overrides.emplace_back(value.substr(0, eq), value.substr(eq + 1));
    } else if (flag == "data") {
      args.data_spec = value;
    } else if (flag == "activation-checkpointing") {
      args.checkpointing = value;
    } else if (std::find(kTrainerFlags.begin(), kTrainerFlags.end(), flag) != kTrainerFlags.end()) {
      args.trainer[flag] = value;
    } else if (auto key = model_or_data_key(flag)) {
      args.overrides.emplace_back(*key, value);
    } else if (auto key = config_key_for_flag(flag)) {
      args.overrides.emplace_back(*key, value);
    } else {
      return InvalidArgumentError("unknown flag --" + flag + " (see --help; --set KEY=VALUE sets any config key)");
    }
  }
  return args;
}

StatusOr<int64_t> parse_int(const Args& args, const std::string& flag, int64_t fallback) {
  auto it = args.trainer.find(flag);
  if (it == args.trainer.end()) return fallback;
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(it->second.c_str(), &end, 10);
  if (errno != 0 || end == it->second.c_str() || *end != '\0' || value < 0)
    return InvalidArgumentError("--" + flag + " needs a non-negative integer, got \"" + it->second + "\"");
  return static_cast<int64_t>(value);
}

std::string trainer_string(const Args& args, const std::string& flag) {
  auto it = args.trainer.find(flag);
  return it == args.trainer.end() ? std::string() : it->second;
}

Status apply_data_spec(StrataConfig& config, const std::string& spec) {
  if (spec.empty()) return {};
  if (spec == "synthetic") return apply_override(config, "strata.data.kind", "synthetic");
  std::string kind, path = spec;
  if (spec.rfind("text:", 0) == 0) {
    kind = "text";
    path = spec.substr(5);
  } else if (spec.rfind("tokens:", 0) == 0) {
    kind = "tokens";
    path = spec.substr(7);
  } else {
    kind = spec.size() > 4 && spec.substr(spec.size() - 4) == ".bin" ? "tokens" : "text";
  }
  STRATA_RETURN_IF_ERROR(apply_override(config, "strata.data.kind", kind));
  return apply_override(config, "strata.data.path", path);
}

StatusOr<TrainerOptions> build_options(const Args& args) {
  StrataConfig config;
  if (!args.config_path.empty()) {
    STRATA_ASSIGN_OR_RETURN(config, load_config_file(args.config_path));
  }
  for (const auto& [key, value] : args.overrides) STRATA_RETURN_IF_ERROR(apply_override(config, key, value));
  STRATA_RETURN_IF_ERROR(apply_data_spec(config, args.data_spec));
  if (config.strata.steps == 0 && !config.was_given("strata.steps")) config.strata.steps = 50;
  // The engine keeps optimizer state on the host or NVMe (the CPU Adam); unless asked
  // otherwise it goes to pinned host memory.
  if (!config.was_given("zero_optimization.offload_optimizer.device"))
    STRATA_RETURN_IF_ERROR(apply_override(config, "zero_optimization.offload_optimizer.device", "cpu"));
  // Decaying schedules need their length; default it to the run's.
  if ((config.scheduler.type == SchedulerType::kWarmupDecayLR || config.scheduler.type == SchedulerType::kWarmupCosineLR) &&
      !config.scheduler.total_num_steps)
    config.scheduler.total_num_steps = config.strata.steps;
  STRATA_RETURN_IF_ERROR(finalize(config, kConfiguredWorldSize));

  TrainerOptions options;
  // The architecture: the fine-tuning file's, else the preset's with explicit overrides.
  const ModelConfig& m = config.strata.model;
  const std::string preset = m.preset.empty() ? "tiny" : m.preset;
  STRATA_ASSIGN_OR_RETURN(GptConfig model, gpt_preset(preset));
  if (m.n_layer > 0) model.n_layer = m.n_layer;
  if (m.n_head > 0) model.n_head = m.n_head;
  if (m.n_embd > 0) model.n_embd = m.n_embd;
  if (m.n_ctx > 0) model.n_ctx = m.n_ctx;
  if (m.vocab_size > 0) model.vocab_size = m.vocab_size;
  options.init_from = trainer_string(args, "init-from");
  if (!options.init_from.empty()) {
    STRATA_ASSIGN_OR_RETURN(SafetensorsReader reader, SafetensorsReader::open(options.init_from));
    STRATA_ASSIGN_OR_RETURN(GptConfig from_file, gpt_config_from_safetensors(reader, model));
    auto check = [&](const char* key, int64_t given, int64_t actual) -> Status {
      if (given > 0 && given != actual)
        return InvalidArgumentError(std::string("strata.model.") + key + " is " + std::to_string(given) + " but " + options.init_from +
                                    " holds " + std::to_string(actual));
      return {};
    };
    STRATA_RETURN_IF_ERROR(check("n_layer", m.n_layer, from_file.n_layer));
    STRATA_RETURN_IF_ERROR(check("n_embd", m.n_embd, from_file.n_embd));
    STRATA_RETURN_IF_ERROR(check("n_ctx", m.n_ctx, from_file.n_ctx));
    STRATA_RETURN_IF_ERROR(check("vocab_size", m.vocab_size, from_file.vocab_size));
    model = from_file;
  } else if (m.vocab_size == 0) {
    // The data decides the smallest vocabulary: bytes need 256, GPT-2 token files 50257.
    if (config.strata.data.kind == DataKind::kText) model.vocab_size = std::max<int64_t>(model.vocab_size, 256);
    if (config.strata.data.kind == DataKind::kTokens) model.vocab_size = std::max<int64_t>(model.vocab_size, kGpt2VocabSize);
  }
  STRATA_RETURN_IF_ERROR(validate_gpt_config(model));
  if (config.strata.data.seq_len > model.n_ctx)
    return InvalidArgumentError("strata.data.seq_len (" + std::to_string(config.strata.data.seq_len) + ") is longer than n_ctx (" +
                                std::to_string(model.n_ctx) + ")");
  options.model = model;

  if (args.checkpointing) {
    if (*args.checkpointing == "off") options.checkpointing = ActivationCheckpointing::kOff;
    else if (*args.checkpointing == "device") options.checkpointing = ActivationCheckpointing::kDevice;
    else if (*args.checkpointing == "pinned") options.checkpointing = ActivationCheckpointing::kPinnedHost;
    else return InvalidArgumentError("--activation-checkpointing takes off, device or pinned, got \"" + *args.checkpointing + "\"");
  } else if (!m.activation_checkpointing) {
    options.checkpointing = ActivationCheckpointing::kOff;
  } else {
    options.checkpointing = m.checkpoints_in_pinned_memory ? ActivationCheckpointing::kPinnedHost : ActivationCheckpointing::kDevice;
  }

  STRATA_ASSIGN_OR_RETURN(int64_t order, parse_int(args, "synthetic-order", 1));
  STRATA_ASSIGN_OR_RETURN(int64_t successors, parse_int(args, "synthetic-successors", 4));
  options.synthetic.order = static_cast<int>(order);
  options.synthetic.successors = successors;
  options.synthetic.seed = static_cast<uint64_t>(config.strata.seed) + 20240520;
  STRATA_ASSIGN_OR_RETURN(int64_t data_seed, parse_int(args, "data-seed", config.strata.seed));
  options.data_seed = static_cast<uint64_t>(data_seed);
  const int64_t world = config.strata.world_size;
  const int64_t global_batch = config.train_micro_batch_size_per_gpu.value_or(1) * world;
  STRATA_ASSIGN_OR_RETURN(options.eval_sequences, parse_int(args, "eval-sequences", std::max<int64_t>(global_batch, 8)));
  STRATA_ASSIGN_OR_RETURN(options.eval_every, parse_int(args, "eval-every", std::max<int64_t>(1, config.strata.steps / 10)));
  STRATA_ASSIGN_OR_RETURN(options.head_chunk_rows, parse_int(args, "head-chunk-rows", 0));
  options.save_dir = trainer_string(args, "save-dir");
  STRATA_ASSIGN_OR_RETURN(options.save_every, parse_int(args, "save-every", 0));
  STRATA_ASSIGN_OR_RETURN(int64_t keep, parse_int(args, "keep-checkpoints", 0));
  options.keep_checkpoints = static_cast<int>(keep);
  options.resume_dir = trainer_string(args, "resume");
  options.export_dir = trainer_string(args, "export");
  if (options.save_every > 0 && options.save_dir.empty()) return InvalidArgumentError("--save-every needs --save-dir");
  options.config = std::move(config);
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  auto args = parse_args(argc, argv);
  if (!args.ok()) {
    if (args.status().code() == strata::StatusCode::kCancelled) {
      std::cout << kUsage;
      return 0;
    }
    std::cerr << "train_gpt: " << args.status().message() << "\n";
    return 2;
  }
  auto options = build_options(*args);
  if (!options.ok()) {
    std::cerr << "train_gpt: " << options.status().to_string() << "\n";
    return 2;
  }
  options->out = &std::cout;
  options->live_bar = isatty(STDOUT_FILENO) != 0;
  // SIGTERM/SIGINT: finish the step, save, exit 128 + the signal (a second one: at once).
  if (Status installed = install_preemption_handlers("train_gpt"); !installed.ok()) {
    std::cerr << "train_gpt: " << installed.to_string() << "\n";
    return 1;
  }
  options->stop_requested = preemption_requested;
  auto result = run_gpt_training(*options);
  if (!result.ok()) {
    std::cout << std::flush;
    std::cerr << "train_gpt: " << result.status().to_string() << "\n";
    return 1;
  }
  std::cout << summary_json(*result) << std::endl;
  return result->stopped_by_signal != 0 ? 128 + result->stopped_by_signal : 0;
}
