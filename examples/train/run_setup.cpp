#include "examples/train/run_setup.h"

namespace strata::train::internal {

Status check_eval_windows(const TokenDataset& data, int64_t count, int64_t seq_len) {
  if (count <= 0) return InvalidArgumentError("--eval-only needs --eval-sequences N > 0 (the windows to evaluate)");
  const std::optional<uint64_t> tokens = data.total_tokens();
  if (!tokens) return FailedPreconditionError("--eval-only evaluates a token or text file (--data FILE), not " + data.describe());
  const uint64_t needed = static_cast<uint64_t>(count) * static_cast<uint64_t>(seq_len) + 1;
  if (*tokens < needed)
    return InvalidArgumentError("--eval-only: " + std::to_string(count) + " windows of " + std::to_string(seq_len) + " tokens need " +
                                std::to_string(needed) + " tokens, " + data.describe() + " has " + std::to_string(*tokens) +
                                " (lower --eval-sequences or --seq-len)");
  return {};
}

StatusOr<MicroBatchLosses> evaluate_windows(Engine& engine, lm::CausalLm& model, const lm::Architecture& architecture,
                                            const TokenDataset& data, const WindowPlan& plan) {
  const size_t T = static_cast<size_t>(plan.seq_len);
  std::vector<int32_t> inputs(static_cast<size_t>(plan.per_pass) * T), targets(inputs.size()), window(T + 1);
  MicroBatchLosses total;
  for (int64_t round = 0; round < plan.count; round += plan.per_pass * plan.world) {
    for (int64_t j = 0; j < plan.per_pass; ++j) {
      const int64_t w = round + plan.rank * plan.per_pass + j;
      int32_t* in = inputs.data() + static_cast<size_t>(j) * T;
      int32_t* out = targets.data() + static_cast<size_t>(j) * T;
      if (w >= plan.count) {
        std::fill(in, in + T, 0);
        std::fill(out, out + T, -1);
        continue;
      }
      STRATA_RETURN_IF_ERROR(data.tokens_at(static_cast<uint64_t>(w) * T, window));
      std::copy(window.begin(), window.end() - 1, in);
      std::copy(window.begin() + 1, window.end(), out);
    }
    const TokenBatch batch{inputs.data(), targets.data(), plan.per_pass};
    STRATA_RETURN_IF_ERROR(engine.begin_forward(architecture.forward_order()));
    STRATA_ASSIGN_OR_RETURN(MicroBatchLosses pass, model.run_micro_batch(nullptr, &batch, 0.0f));
    STRATA_RETURN_IF_ERROR(engine.end_forward());
    total.eval_loss_sum += pass.eval_loss_sum;
    total.eval_tokens += pass.eval_tokens;
  }
  return total;
}

std::function<Status(std::string_view, int64_t)> checkpoint_pause_hook_from_env() {
  const char* text = std::getenv("STRATA_TEST_CHECKPOINT_PAUSE_MS");
  if (text == nullptr || *text == '\0') return nullptr;
  const long pause_ms = std::clamp(std::strtol(text, nullptr, 10), 0L, 10'000L);
  return [pause_ms](std::string_view point, int64_t step) -> Status {
    const std::string line = "strata-test: checkpoint " + std::string(point) + " step " + std::to_string(step) + "\n";
    // One write(2): the line arrives whole even as other threads log.
    if (::write(STDERR_FILENO, line.data(), line.size()) < 0) return Status::FromErrno(errno, "write(stderr)");
    std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
    return Status::Ok();
  };
}

nlohmann::json node_startup_json(const RendezvousOptions& process, const EnginePlan& plan, const EngineOptions& engine_options) {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "?");
  uint64_t nvme_free = 0;
  struct statvfs fs {};
  if (plan.nvme_bytes > 0 && ::statvfs(engine_options.nvme_path.c_str(), &fs) == 0)
    nvme_free = static_cast<uint64_t>(fs.f_bavail) * static_cast<uint64_t>(fs.f_frsize);
  const uint64_t host_available = static_cast<uint64_t>(::sysconf(_SC_AVPHYS_PAGES)) * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return {{"node", process.node_rank},       {"host", host},
          {"rank", process.rank},            {"pinned_bytes", plan.pinned_bytes},
          {"host_available_bytes", host_available}, {"nvme_path", plan.nvme_bytes > 0 ? engine_options.nvme_path : std::string()},
          {"nvme_bytes", plan.nvme_bytes},   {"nvme_free_bytes", nvme_free}};
}

StatusOr<std::string> node_summary_text(const std::vector<std::string>& gathered) {
  std::map<int, std::vector<nlohmann::json>> nodes;
  for (size_t r = 0; r < gathered.size(); ++r) {
    nlohmann::json j = nlohmann::json::parse(gathered[r], nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("node")) return DataLossError("rank " + std::to_string(r) + " sent a start-up summary that is not JSON");
    nodes[j["node"].get<int>()].push_back(std::move(j));
  }
  std::string text = "nodes: " + std::to_string(nodes.size()) + "\n";
  for (const auto& [node, ranks] : nodes) {
    uint64_t pinned = 0, nvme = 0;
    std::string rank_list;
    for (const nlohmann::json& j : ranks) {
      pinned += j["pinned_bytes"].get<uint64_t>();
      nvme += j["nvme_bytes"].get<uint64_t>();
      if (!rank_list.empty()) rank_list += ',';
      rank_list += std::to_string(j["rank"].get<int>());
    }
    const nlohmann::json& first = ranks.front();
    text += "  node " + std::to_string(node) + " (" + first["host"].get<std::string>() + "): ranks " + rank_list + "; pinned " +
            engine_internal::format_bytes(pinned) + " planned, host memory " +
            engine_internal::format_bytes(first["host_available_bytes"].get<uint64_t>()) + " available";
    if (nvme > 0)
      text += "; nvme " + engine_internal::format_bytes(nvme) + " planned under " + first["nvme_path"].get<std::string>() + ", " +
              engine_internal::format_bytes(first["nvme_free_bytes"].get<uint64_t>()) + " free after its files";
    text += "\n";
  }
  return text;
}

StatusOr<RunShape> run_shape(const TrainerOptions& options) {
  const StrataConfig& config = options.config;
  if (options.model == nullptr) return InvalidArgumentError("the trainer was given no model architecture");
  const lm::Architecture& model = *options.model;
  RunShape shape;
  shape.world = static_cast<int>(config.strata.world_size);
  shape.accumulation = static_cast<int>(config.gradient_accumulation_steps.value_or(1));
  shape.micro = config.train_micro_batch_size_per_gpu.value_or(1);
  shape.seq_len = options.data.seq_len > 0 ? options.data.seq_len : model.context_length();
  shape.total_steps = options.eval_only ? 0 : options.steps;
  shape.device_kind = resolve_device(config);
  if (shape.seq_len > model.context_length())
    return InvalidArgumentError("strata.data.seq_len (" + std::to_string(shape.seq_len) + ") is longer than the model's context (" +
                                std::to_string(model.context_length()) + ")");
  shape.global_tokens_per_step = shape.micro * shape.world * shape.seq_len * shape.accumulation;
  return shape;
}

int64_t evaluation_sequences(const TrainerOptions& options, const RunShape& shape) {
  int64_t eval_sequences = options.eval_only ? 0 : options.eval_sequences;
  if (eval_sequences > 0 && eval_sequences % shape.world != 0) eval_sequences = (eval_sequences + shape.world - 1) / shape.world * shape.world;
  if (eval_sequences > 0 && options.data.kind != DataKind::kSynthetic && options.data.eval_fraction <= 0.0) {
    STRATA_LOG(kWarn) << "no evaluation: strata.data.eval_fraction is 0 for " << options.data.path;
    eval_sequences = 0;
  }
  const lm::Architecture& model = *options.model;
  if (eval_sequences > 0 && options.eval_every > 0 && !model.evaluates_while_training())
    STRATA_LOG(kInfo) << "the " << model.family() << " model evaluates in forward-only passes: the evaluation batch is measured after the last "
                      << "step (--eval-every " << options.eval_every << " does not apply)";
  return eval_sequences;
}

Status open_resume(const std::string& directory, const lm::Architecture& model, RunSources& sources) {
  STRATA_ASSIGN_OR_RETURN(CheckpointRef latest, latest_complete(directory));
  STRATA_ASSIGN_OR_RETURN(sources.resume, CheckpointReader::open(latest.path));
  nlohmann::json& state = sources.trainer_state;
  state = nlohmann::json::parse(sources.resume->trainer_state(), nullptr, /*allow_exceptions=*/false);
  if (state.is_discarded() || !state.is_object() || !state.contains("step") || !state["step"].is_number_integer() ||
      state["step"].get<int64_t>() < 0)
    return DataLossError("the trainer state of " + latest.path + " is not the JSON object train_gpt writes");
  const std::string saved_model = state.value("model", nlohmann::json::object()).dump();
  if (saved_model != model.model_json())
    return InvalidArgumentError("checkpoint " + latest.path + " holds a model " + saved_model + " but this run's model is " + model.model_json());
  STRATA_LOG(kInfo) << "resuming from " << latest.path << " (step " << latest.step << ", saved with " << sources.resume->world_size() << " ranks)";
  return {};
}

StatusOr<RunSources> open_sources(const TrainerOptions& options, const RunShape& shape) {
  const lm::Architecture& model = *options.model;
  RunSources sources;
  SyntheticLanguageOptions synthetic = options.synthetic;
  synthetic.vocab_size = model.vocab_size();
  STRATA_ASSIGN_OR_RETURN(sources.dataset, TokenDataset::open(options.data, synthetic));
  if (sources.dataset->vocab_size() > model.vocab_size())
    return InvalidArgumentError("the data's vocabulary (" + std::to_string(sources.dataset->vocab_size()) + " tokens, " +
                                sources.dataset->describe() + ") is larger than the model's vocab_size (" +
                                std::to_string(model.vocab_size()) + ")");
  if (options.eval_only) STRATA_RETURN_IF_ERROR(check_eval_windows(*sources.dataset, options.eval_sequences, shape.seq_len));
  sources.eval_sequences = evaluation_sequences(options, shape);
  if (!options.resume_dir.empty()) STRATA_RETURN_IF_ERROR(open_resume(options.resume_dir, model, sources));
  if (!options.init_from.empty() && !sources.resume) {
    STRATA_ASSIGN_OR_RETURN(sources.init_weights, model.open_weights(options.init_from));
  }
  return sources;
}

StatusOr<std::unique_ptr<LocalCluster>> make_cluster(const TrainerOptions& options, const RunShape& shape) {
  const StrataConfig& config = options.config;
  LocalClusterOptions cluster_options;
  cluster_options.world_size = shape.world;
  cluster_options.device = shape.device_kind;
  cluster_options.device_budget_bytes = config.strata.device_budget_mib > 0 ? static_cast<size_t>(config.strata.device_budget_mib) * kMiB
                                        : shape.device_kind == DeviceKind::kCpu ? size_t{1} << 30
                                                                                : 0;
  cluster_options.compute_threads = static_cast<int>(config.strata.compute_threads);
  cluster_options.device_thread_nice = static_cast<int>(config.strata.device_thread_nice);
  if (shape.device_kind != DeviceKind::kCpu && (config.strata.compute_threads != 0 || config.strata.device_thread_nice != kCpuDeviceThreadNice))
    STRATA_LOG(kWarn) << "strata.compute_threads and strata.device_thread_nice shape the CPU device's threads; this run computes on "
                      << device_kind_name(shape.device_kind) << ", so they are ignored";
  cluster_options.matmul_precision = config.strata.matmul_precision;
  cluster_options.process_group = options.process_group;
  if (options.process_group) {
    if (options.process_group->world_size != shape.world)
      return InvalidArgumentError("strata.world_size (--world-size) is " + std::to_string(shape.world) + " but the launcher's WORLD_SIZE is " +
                                  std::to_string(options.process_group->world_size) + "; drop --world-size or make them agree");
    // Not yet across processes: the export gathers whole groups through one process's memory.
    if (!options.export_dir.empty()) return UnimplementedError("--export-dir with process ranks is not supported yet; export with thread ranks");
  }
  return LocalCluster::create(cluster_options);
}

StatusOr<std::unique_ptr<CheckpointSaver>> make_saver(const TrainerOptions& options, const RunShape& shape, const LocalCluster& cluster) {
  CheckpointSaverOptions saver_options;
  saver_options.directory = options.save_dir;
  saver_options.world_size = shape.world;
  saver_options.first_rank = cluster.first_rank();  // process ranks: each process writes its own rank's file
  saver_options.local_ranks = cluster.local_ranks();
  saver_options.keep_last = options.keep_checkpoints;
  for (const auto& spec : options.model->group_specs()) {
    STRATA_ASSIGN_OR_RETURN(GroupLayout layout, layout_group(spec, 0, shape.world));
    saver_options.checkpoint_elements += layout.padded_numel;
  }
  // Delayed overlap saves the stale parameter copy as a fourth segment.
  if (options.config.strata.optimizer_overlap == OverlapMode::kDelayed) saver_options.state_segments = kCheckpointStateKinds + 1;
  // Rotation keeps the newest checkpoint whose step ended with a finite loss.
  saver_options.is_healthy = [](std::string_view state) {
    const auto parsed = nlohmann::json::parse(state, nullptr, /*allow_exceptions=*/false);
    return parsed.is_object() && parsed.value("loss_finite", true);
  };
  saver_options.fault_hook = checkpoint_pause_hook_from_env();
  return CheckpointSaver::create(saver_options);
}

Status SharedRun::prepare() {
  model_options.batch = shape.micro;
  model_options.seq_len = shape.seq_len;
  model_options.eval_batch = options.eval_only ? shape.micro : sources.eval_sequences / shape.world;
  model_options.checkpointing = options.checkpointing;
  model_options.head_chunk_rows = options.head_chunk_rows;
  if (!options.export_dir.empty()) {
    size_t largest = 0;
    for (const auto& spec : model.group_specs()) {
      STRATA_ASSIGN_OR_RETURN(GroupLayout layout, layout_group(spec, 0, shape.world));
      largest = std::max(largest, layout.padded_numel);
    }
    exchange.assign(largest, 0.0f);
  }
  // Every position of every sequence is computed (ignored targets too), so all count.
  model_flops_per_token = lm::training_flops_per_token(model.flop_shape(), shape.seq_len);
  result.total_steps = shape.total_steps;
  result.vocab_size = model.vocab_size();
  result.entropy_floor = sources.dataset->entropy_floor();
  result.parameters = model.parameter_count();
  result.world_size = shape.world;
  result.device = std::string(device_kind_name(shape.device_kind));
  result.resumed_from_step = start_step;
  result.model_flops_per_token = model_flops_per_token;
  return {};
}

TrainerResult SharedRun::summarize() {
  result.stopped_by_signal = stop_signal;
  result.nonfinite_steps = judge.skipped_steps();
  if (stop_signal != 0 && options.out) *options.out << stopped_line(options, result, stop_signal, end_step) << "\n" << std::flush;
  result.steps = board ? board->records() : std::vector<StepRecord>{};
  if (!result.steps.empty()) result.final_loss = result.steps.back().loss;
  if (eval_tokens > 0) result.eval_loss = eval_sum / double(eval_tokens);
  result.param_checksum = checksum.load();
  double square_sum = 0.0;
  for (const double part : square_sums) square_sum += part;
  result.param_norm = std::sqrt(square_sum);
  const double tokens = double(shape.global_tokens_per_step) * double(end_step - start_step);
  result.tokens_per_s = result.train_seconds > 0 ? tokens / result.train_seconds : 0.0;
  result.model_tflops = lm::tflops(tokens * double(model_flops_per_token), result.train_seconds);
  return result;
}

Status finish_saving(const TrainerOptions& options, CheckpointSaver& saver, Status status, TrainerResult& result) {
  Status saved = saver.finish();
  if (!saved.ok() && status.ok()) {
    if (options.config.strata.on_save_failure == SaveFailurePolicy::kContinue)
      STRATA_LOG(kWarn) << saved.to_string() << "\n  (strata.checkpoint.on_save_failure=continue: the run still succeeds)";
    else
      status = std::move(saved).with_context("the last good checkpoint is " + (saver.last_committed_step() >= 0
                                                                                    ? checkpoint_path(options.save_dir, saver.last_committed_step())
                                                                                    : std::string("none")));
  }
  if (saver.last_committed_step() >= 0) result.last_checkpoint = checkpoint_path(options.save_dir, saver.last_committed_step());
  return status;
}

}  // namespace strata::train::internal
