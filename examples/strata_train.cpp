// strata-train (also built as train_gpt, its first name): train or fine-tune a causal
// language model — GPT-2, or the Llama family (Llama, Mistral, Qwen2) — whose training
// state may be far larger than the device's memory.
//
//   strata-train [--config FILE] [--model DIR | --preset NAME] [--flag VALUE | --flag=VALUE]...
//
// The config file speaks DeepSpeed's vocabulary (docs/config.md), with Strata's own
// settings (model, data, device budget, files) under "strata". Flags override it. Output:
// the placement plan and one progress line per step on stdout, logs on stderr, and as the
// last line of stdout one JSON object summarizing the run.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/core/config.h"
#include "engine/core/log.h"
#include "engine/local_cluster.h"
#include "examples/data/token_data.h"
#include "examples/flags/flags.h"
#include "examples/gpt/gpt_architecture.h"
#include "examples/gpt/gpt_model.h"
#include "examples/gpt/gpt_weights.h"
#include "examples/hf/hf_export.h"
#include "examples/hf/safetensors.h"
#include "examples/llama/llama_architecture.h"
#include "examples/run_config/run_config.h"
#include "examples/train/auto_placement.h"
#include "examples/train/plan_preview.h"
#include "examples/train/preemption.h"
#include "examples/train/train_args.h"
#include "examples/train/trainer.h"
#include "kernels/transformer_ops_cpu.h"

namespace {

using namespace strata;
using namespace strata::gpt;
using namespace strata::train;
using strata::data::kGpt2VocabSize;

constexpr const char* kUsage = R"(usage: %s [--config FILE] [options]

Model and data
  --model DIR                a Hugging Face model directory to fine-tune (config.json's model_type:
                             gpt2, llama, mistral or qwen2; model.safetensors or sharded with its index)
  --preset NAME              GPT-2: tiny, small-demo, gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt-2.7b, gpt-6.7b, gpt-13b
                             Llama: llama-tiny, llama-1b (Llama-3.2-1B), llama-3b (Llama-3.2-3B), llama-8b (Llama-3.1-8B)
  --n-layer N --n-head N --n-embd N --n-ctx N --vocab-size N     override a GPT-2 preset's shape
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
  --eval-only                no training: eval_loss over the --data file's first --eval-sequences windows
                             of --seq-len T, window i = tokens [i*T, i*T+T] (a perplexity evaluation)
Placement
  --device cpu|cuda --world-size N --device-budget-mib N --pinned-budget-mib N
  --offload-param device|cpu|nvme --offload-optimizer device|cpu|nvme --nvme-path DIR
Plan and prediction (docs/profile.md)
  --plan-only                print the plan (and its predicted step) and exit: no data, engine or device is
                             opened and --nvme-path is neither created nor touched; exit 1 when the plan
                             fails its budget checks
  --profile FILE             the machine profile the plan predicts the step with (strata-bench profile);
                             default: the one kept for this host, else no prediction. Key strata.profile
  --placement auto|config    auto: choose parameter and optimizer tiers, prefetch depth, micro-batch size
                             (the batch per rank kept), activation checkpointing and optimizer overlap for
                             the most predicted tokens/s within the budgets (needs a profile); prints the
                             choice and the runner-up. config (default): the config's placement.
                             Key strata.placement
Files
  --metrics FILE --trace FILE
  --save-dir DIR --save-every N --keep-checkpoints N --resume DIR
  --init-from FILE|DIR --export DIR
  --export-dtype auto|fp32|bf16|fp16   (auto: the dtype --init-from/--model is stored in, else fp32)
  --export-shard-mib N       largest export file (families that shard their exports)
Any config key
  --set KEY=VALUE            e.g. --set zero_optimization.offload_param.pin_memory=false
)";

std::string trainer_string(const TrainArgs& args, const std::string& flag) {
  auto it = args.trainer.find(flag);
  return it == args.trainer.end() ? std::string() : it->second;
}

Status apply_data_spec(RunConfig& run, const std::string& spec) {
  if (spec.empty()) return {};
  if (spec == "synthetic") return apply_run_override(run, "strata.data.kind", "synthetic");
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
  STRATA_RETURN_IF_ERROR(apply_run_override(run, "strata.data.kind", kind));
  return apply_run_override(run, "strata.data.path", path);
}

// The files a run writes as it goes or at its end are checked (their directories made)
// before step 1, so a typo in --trace does not cost the run. (--save-dir is checked where
// checkpoints are locked.)
Status check_output_paths(const StrataConfig& config, const TrainerOptions& options) {
  using flags::OutputKind;
  if (!config.strata.metrics.empty())
    STRATA_RETURN_IF_ERROR(flags::prepare_output_path("--metrics (strata.metrics)", config.strata.metrics, OutputKind::kFile));
  if (!config.strata.trace.empty())
    STRATA_RETURN_IF_ERROR(flags::prepare_output_path("--trace (strata.trace)", config.strata.trace, OutputKind::kFile));
  if (!options.export_dir.empty()) {
    STRATA_RETURN_IF_ERROR(flags::prepare_output_path("--export", options.export_dir, OutputKind::kDirectory));
    STRATA_RETURN_IF_ERROR(hf::check_export_directory(options.export_dir).with_context("--export (checked before training starts)"));
  }
  return {};
}

// The "model_type" of a Hugging Face model directory's config.json.
StatusOr<std::string> hf_model_type(const std::string& dir) {
  const std::filesystem::path path = std::filesystem::path(dir) / "config.json";
  std::ifstream in(path);
  if (!in) return NotFoundError("--model " + dir + ": no config.json in it (a Hugging Face model directory has one)");
  const nlohmann::json json = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) return InvalidArgumentError(path.string() + " is not a JSON object");
  if (!json.contains("model_type") || !json["model_type"].is_string())
    return InvalidArgumentError(path.string() + " has no string \"model_type\"");
  return json["model_type"].get<std::string>();
}

// GPT-2: the starting weights' shape (a file, with n_head from the config.json beside it),
// else the preset's with explicit overrides.
StatusOr<std::shared_ptr<const lm::Architecture>> gpt_model(const RunConfig& run, const std::string& init_from) {
  const ModelConfig& m = run.model;
  const std::string preset = m.preset.empty() ? "tiny" : m.preset;
  STRATA_ASSIGN_OR_RETURN(GptConfig model, gpt_preset(preset));
  if (m.n_layer > 0) model.n_layer = m.n_layer;
  if (m.n_head > 0) model.n_head = m.n_head;
  if (m.n_embd > 0) model.n_embd = m.n_embd;
  if (m.n_ctx > 0) model.n_ctx = m.n_ctx;
  if (m.vocab_size > 0) model.vocab_size = m.vocab_size;
  if (!init_from.empty()) {
    STRATA_ASSIGN_OR_RETURN(SafetensorsReader reader, SafetensorsReader::open(init_from));
    STRATA_ASSIGN_OR_RETURN(GptConfig from_file, gpt_config_from_safetensors(reader, model));
    auto check = [&](const char* key, int64_t given, int64_t actual) -> Status {
      if (given > 0 && given != actual)
        return InvalidArgumentError(std::string("strata.model.") + key + " is " + std::to_string(given) + " but " + init_from +
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
    if (run.data.kind == DataKind::kText) model.vocab_size = std::max<int64_t>(model.vocab_size, 256);
    if (run.data.kind == DataKind::kTokens) model.vocab_size = std::max<int64_t>(model.vocab_size, kGpt2VocabSize);
  }
  if (run.data.seq_len > model.n_ctx)
    return InvalidArgumentError("strata.data.seq_len (" + std::to_string(run.data.seq_len) + ") is longer than n_ctx (" +
                                std::to_string(model.n_ctx) + ")");
  STRATA_ASSIGN_OR_RETURN(auto architecture, GptArchitecture::create(model));
  return std::shared_ptr<const lm::Architecture>(std::move(architecture));
}

// The Llama family: a model directory's config.json, else a preset; the GPT-2 shape keys
// (strata.model.n_layer, ...) do not apply to it.
StatusOr<std::shared_ptr<const lm::Architecture>> llama_model(const RunConfig& run, const std::string& init_from) {
  const ModelConfig& m = run.model;
  if (m.n_layer > 0 || m.n_head > 0 || m.n_embd > 0 || m.n_ctx > 0 || m.vocab_size > 0)
    return InvalidArgumentError("--n-layer, --n-head, --n-embd, --n-ctx and --vocab-size shape GPT-2 models; a Llama-family model's shape "
                                "comes from its config.json or preset");
  llama::LlamaConfig shape;
  if (!init_from.empty()) {
    STRATA_ASSIGN_OR_RETURN(shape, llama::read_llama_config(init_from));
  } else {
    STRATA_ASSIGN_OR_RETURN(shape, llama::llama_preset(m.preset));
  }
  STRATA_ASSIGN_OR_RETURN(auto architecture, llama::LlamaArchitecture::create(shape));
  return std::shared_ptr<const lm::Architecture>(std::move(architecture));
}

bool is_llama_preset(const std::string& name) {
  const auto names = llama::llama_preset_names();
  return std::find(names.begin(), names.end(), name) != names.end();
}

// The model to train: --model DIR (its config.json's model_type picks the family), else
// --init-from, else the preset.
StatusOr<std::shared_ptr<const lm::Architecture>> resolve_model(const TrainArgs& args, const RunConfig& run, std::string& init_from) {
  if (const std::string dir = trainer_string(args, "model"); !dir.empty()) {
    if (!init_from.empty()) return InvalidArgumentError("--model and --init-from both name weights to start from; give one");
    STRATA_ASSIGN_OR_RETURN(const std::string model_type, hf_model_type(dir));
    if (model_type == "gpt2") {
      init_from = (std::filesystem::path(dir) / "model.safetensors").string();
      return gpt_model(run, init_from);
    }
    if (model_type == "llama" || model_type == "mistral" || model_type == "qwen2") {
      init_from = dir;
      return llama_model(run, init_from);
    }
    return InvalidArgumentError("--model " + dir + ": config.json says model_type \"" + model_type +
                                "\"; supported: gpt2, llama, mistral, qwen2");
  }
  if (!init_from.empty() && std::filesystem::is_directory(init_from)) {
    const StatusOr<std::string> model_type = hf_model_type(init_from);
    if (model_type.ok() && *model_type != "gpt2") return llama_model(run, init_from);
  }
  if (is_llama_preset(run.model.preset)) return llama_model(run, init_from);
  return gpt_model(run, init_from);
}

// strata.placement (--placement): auto searches (examples/train/auto_placement.h), prints
// the choice and writes it into `config` and `options`; config (the default) keeps the
// config's placement.
Status place(const RunConfig& run, StrataConfig& config, TrainerOptions& options) {
  if (run.placement == PlacementMode::kConfig) return {};
  // Each process would search alone, against its own node's memory and disk.
  if (options.process_group)
    return UnimplementedError("--placement auto with process ranks (a launcher's WORLD_SIZE > 1) is not supported yet: run it with "
                              "--plan-only on one node and pass the choice as flags");
  options.config = config;  // the search plans with the config as it stands
  options.data = run.data;
  STRATA_ASSIGN_OR_RETURN(const profile::PlacementChoice choice, choose_placement(options));
  std::cout << profile::placement_choice_text(choice) << std::flush;
  apply_placement(choice.best.placement, options);
  config = options.config;
  return {};
}

StatusOr<TrainerOptions> build_options(const TrainArgs& args) {
  RunConfig run;
  if (!args.config_path.empty()) {
    STRATA_ASSIGN_OR_RETURN(run, load_run_config(args.config_path));
  }
  STRATA_RETURN_IF_ERROR(apply_train_overrides(run, args));
  STRATA_RETURN_IF_ERROR(apply_data_spec(run, args.data_spec));
  StrataConfig& config = run.engine;
  if (run.steps == 0 && !config.was_given("strata.steps")) run.steps = 50;
  // The engine keeps optimizer state on the host or NVMe (the CPU Adam); unless asked
  // otherwise it goes to pinned host memory.
  if (!config.was_given("zero_optimization.offload_optimizer.device"))
    STRATA_RETURN_IF_ERROR(apply_override(config, "zero_optimization.offload_optimizer.device", "cpu"));
  // Decaying schedules need their length; default it to the run's.
  if ((config.scheduler.type == SchedulerType::kWarmupDecayLR || config.scheduler.type == SchedulerType::kWarmupCosineLR) &&
      !config.scheduler.total_num_steps)
    config.scheduler.total_num_steps = run.steps;
  // Started by a launcher with WORLD_SIZE > 1: this process is one rank of that world, and
  // a configured world size must agree with it.
  STRATA_ASSIGN_OR_RETURN(std::optional<RendezvousOptions> process_group, LocalCluster::process_group_from_env());
  if (process_group) {
    Status finalized = finalize_run_config(run, process_group->world_size);
    if (!finalized.ok())
      return std::move(finalized).with_context("the launcher's environment gives WORLD_SIZE=" + std::to_string(process_group->world_size) +
                                    " (RANK=" + std::to_string(process_group->rank) + ")");
  } else {
    STRATA_RETURN_IF_ERROR(finalize_run_config(run, kConfiguredWorldSize));
  }

  TrainerOptions options;
  options.process_group = std::move(process_group);
  options.init_from = trainer_string(args, "init-from");
  STRATA_ASSIGN_OR_RETURN(options.model, resolve_model(args, run, options.init_from));

  if (args.checkpointing) {
    if (*args.checkpointing == "off") options.checkpointing = ActivationCheckpointing::kOff;
    else if (*args.checkpointing == "device") options.checkpointing = ActivationCheckpointing::kDevice;
    else if (*args.checkpointing == "pinned") options.checkpointing = ActivationCheckpointing::kPinnedHost;
    else return InvalidArgumentError("--activation-checkpointing takes off, device or pinned, got \"" + *args.checkpointing + "\"");
  } else if (!run.model.activation_checkpointing) {
    options.checkpointing = ActivationCheckpointing::kOff;
  } else {
    options.checkpointing = run.model.checkpoints_in_pinned_memory ? ActivationCheckpointing::kPinnedHost : ActivationCheckpointing::kDevice;
  }

  STRATA_ASSIGN_OR_RETURN(options.synthetic.order, trainer_integer<int>(args, "synthetic-order", 1));
  STRATA_ASSIGN_OR_RETURN(options.synthetic.successors, trainer_integer<int64_t>(args, "synthetic-successors", 4));
  options.synthetic.seed = static_cast<uint64_t>(config.strata.seed) + 20240520;
  STRATA_ASSIGN_OR_RETURN(options.data_seed, trainer_integer<uint64_t>(args, "data-seed", static_cast<uint64_t>(config.strata.seed)));
  const int64_t world = config.strata.world_size;
  const int64_t global_batch = config.train_micro_batch_size_per_gpu.value_or(1) * world;
  STRATA_ASSIGN_OR_RETURN(options.eval_sequences, trainer_integer<int64_t>(args, "eval-sequences", std::max<int64_t>(global_batch, 8)));
  STRATA_ASSIGN_OR_RETURN(options.eval_every, trainer_integer<int64_t>(args, "eval-every", std::max<int64_t>(1, run.steps / 10)));
  STRATA_ASSIGN_OR_RETURN(options.head_chunk_rows, trainer_integer<int64_t>(args, "head-chunk-rows", 0));
  options.save_dir = trainer_string(args, "save-dir");
  STRATA_ASSIGN_OR_RETURN(options.save_every, trainer_integer<int64_t>(args, "save-every", 0));
  STRATA_ASSIGN_OR_RETURN(options.keep_checkpoints, trainer_integer<int>(args, "keep-checkpoints", 0));
  options.resume_dir = trainer_string(args, "resume");
  options.export_dir = trainer_string(args, "export");
  options.eval_only = trainer_string(args, "eval-only") == "true";
  STRATA_ASSIGN_OR_RETURN(const int64_t shard_mib, trainer_integer<int64_t>(args, "export-shard-mib", 0));
  options.export_shard_bytes = static_cast<uint64_t>(shard_mib) << 20;
  if (const std::string dtype = trainer_string(args, "export-dtype"); !dtype.empty() && dtype != "auto") {
    auto parsed = parse_dtype(dtype);
    if (!parsed.ok()) return InvalidArgumentError("--export-dtype takes auto, fp32, bf16 or fp16, got \"" + dtype + "\"");
    options.export_dtype = *parsed;
  }
  if (options.save_every > 0 && options.save_dir.empty()) return InvalidArgumentError("--save-every needs --save-dir");
  // --profile and --placement set strata.profile and strata.placement.
  STRATA_ASSIGN_OR_RETURN(options.profile, profile::resolve_run_profile(run.profile));
  STRATA_RETURN_IF_ERROR(place(run, config, options));
  // --plan-only writes nothing: the output paths are checked (and made) only for a run.
  if (trainer_string(args, "plan-only") != "true") STRATA_RETURN_IF_ERROR(check_output_paths(config, options));
  options.config = std::move(config);
  options.data = run.data;
  options.steps = run.steps;
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  // Messages carry the name the program was started under (strata-train or train_gpt).
  const std::string program = argc > 0 ? std::filesystem::path(argv[0]).filename().string() : std::string("strata-train");
  // First thing: OpenBLAS's pool would otherwise spin on a core through the set-up (the
  // token file's scan, the checkpoint's load), or hang the program under an address-space
  // limit; this may re-execute the program, so nothing may come before it.
  if (strata::Status blas = strata::kernels::cpu::reexec_with_single_threaded_blas(argv); !blas.ok()) {
    std::cerr << program << ": warning: " << blas.to_string() << "\n";
  }
  const std::vector<std::string> arguments(argv + 1, argv + argc);
  auto args = strata::train::parse_train_args(arguments);
  if (!args.ok()) {
    std::cerr << program << ": " << args.status().message() << "\n";
    return 2;
  }
  if (args->help) {
    std::printf(kUsage, program.c_str());
    return 0;
  }
  auto options = build_options(*args);
  if (!options.ok()) {
    std::cerr << program << ": " << options.status().to_string() << "\n";
    return 2;
  }
  if (trainer_string(*args, "plan-only") == "true") {
    if (options->process_group && options->process_group->rank != 0) return 0;  // rank 0 prints the plan
    auto checked = print_plan_only(*options, std::cout);
    if (!checked.ok()) {
      std::cerr << program << ": " << checked.status().to_string() << "\n";
      return 1;
    }
    return *checked ? 0 : 1;
  }
  // Process ranks: rank 0 alone prints the plan, the progress lines and the summary.
  const bool prints = !options->process_group || options->process_group->rank == 0;
  options->out = prints ? &std::cout : nullptr;
  options->live_bar = prints && isatty(STDOUT_FILENO) != 0;
  // SIGTERM/SIGINT: finish the step, save, exit 128 + the signal (a second one: at once).
  if (Status installed = install_preemption_handlers(program); !installed.ok()) {
    std::cerr << program << ": " << installed.to_string() << "\n";
    return 1;
  }
  options->stop_requested = preemption_requested;
  auto result = run_training(*options);
  if (!result.ok()) {
    std::cout << std::flush;
    std::cerr << program << ": " << result.status().to_string() << "\n";
    return 1;
  }
  if (prints) std::cout << summary_json(*result) << std::endl;
  return result->stopped_by_signal != 0 ? 128 + result->stopped_by_signal : 0;
}
