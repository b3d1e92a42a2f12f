#include "examples/gpt/gpt_architecture.h"

#include <filesystem>
#include <system_error>

#include <nlohmann/json.hpp>

#include "examples/gpt/gpt_weights.h"
#include "examples/gpt/safetensors.h"

namespace strata::gpt {
namespace {

class Gpt2WeightFile final : public lm::WeightSource {
 public:
  explicit Gpt2WeightFile(SafetensorsReader reader) : reader_(std::move(reader)) {}
  std::string describe() const override { return reader_.path(); }
  DType stored_dtype() const override {
    for (const SafetensorsTensor& tensor : reader_.tensors()) {
      if (tensor.dtype == SafetensorsDType::kBF16) return DType::kBFloat16;
      if (tensor.dtype == SafetensorsDType::kF16) return DType::kFloat16;
      if (tensor.dtype == SafetensorsDType::kF32) return DType::kFloat32;
    }
    return DType::kFloat32;
  }
  const SafetensorsReader& reader() const { return reader_; }

 private:
  SafetensorsReader reader_;
};

StatusOr<SafetensorsDType> export_dtype(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return SafetensorsDType::kF32;
    case DType::kBFloat16: return SafetensorsDType::kBF16;
    case DType::kFloat16: return SafetensorsDType::kF16;
    default: return InvalidArgumentError("GPT-2 export: weights are written as fp32, bf16 or fp16, not " + std::string(dtype_name(dtype)));
  }
}

}  // namespace

StatusOr<std::shared_ptr<const GptArchitecture>> GptArchitecture::create(const GptConfig& config) {
  STRATA_RETURN_IF_ERROR(validate_gpt_config(config));
  return std::shared_ptr<const GptArchitecture>(new GptArchitecture(config));
}

std::string GptArchitecture::describe() const { return describe_gpt_config(config_); }

std::string GptArchitecture::model_json() const {
  const GptConfig& c = config_;
  return nlohmann::json{{"n_layer", c.n_layer}, {"n_head", c.n_head}, {"n_embd", c.n_embd}, {"n_ctx", c.n_ctx}, {"vocab_size", c.vocab_size}}
      .dump();
}

int64_t GptArchitecture::parameter_count() const { return gpt_parameter_count(config_); }
std::vector<GroupSpec> GptArchitecture::group_specs() const { return gpt_group_specs(config_); }
std::vector<int> GptArchitecture::schedule() const { return gpt_schedule(config_); }
std::vector<int> GptArchitecture::forward_order() const { return gpt_forward_order(config_); }

GptModelOptions GptArchitecture::model_options(const lm::ModelRunOptions& options) const {
  GptModelOptions model;
  model.config = config_;
  model.param_dtype = options.param_dtype;
  model.batch = options.batch;
  model.seq_len = options.seq_len;
  model.eval_batch = options.eval_batch;
  model.checkpointing = options.checkpointing;
  model.head_chunk_rows = options.head_chunk_rows;
  return model;
}

StatusOr<lm::ActivationPlan> GptArchitecture::plan_activations(const lm::ModelRunOptions& options, DeviceKind device) const {
  STRATA_ASSIGN_OR_RETURN(GptActivationPlan plan, plan_gpt_activations(model_options(options), device));
  lm::ActivationPlan out;
  out.device_bytes = plan.device_bytes;
  out.pinned_bytes = plan.pinned_bytes;
  out.compute_dtype = plan.compute_dtype;
  out.text = plan.text();
  return out;
}

StatusOr<std::unique_ptr<lm::CausalLm>> GptArchitecture::create(Engine& engine, const lm::ModelRunOptions& options) const {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<GptModel> model, GptModel::create(engine, model_options(options)));
  return std::unique_ptr<lm::CausalLm>(std::move(model));
}

StatusOr<std::unique_ptr<lm::WeightSource>> GptArchitecture::open_weights(const std::string& path) const {
  std::error_code ec;
  const std::string file = std::filesystem::is_directory(path, ec) ? (std::filesystem::path(path) / "model.safetensors").string() : path;
  STRATA_ASSIGN_OR_RETURN(SafetensorsReader reader, SafetensorsReader::open(file));
  STRATA_RETURN_IF_ERROR(check_gpt2_file(reader, gpt2_dims(config_)));
  return std::unique_ptr<lm::WeightSource>(new Gpt2WeightFile(std::move(reader)));
}

Status GptArchitecture::load_weights(Engine& engine, int rank, const lm::WeightSource& source) const {
  const auto* file = dynamic_cast<const Gpt2WeightFile*>(&source);
  if (file == nullptr) return InvalidArgumentError("GPT-2 weights: " + source.describe() + " was not opened by the GPT-2 architecture");
  return load_gpt2_weights(engine, rank, file->reader(), config_);
}

Status GptArchitecture::export_weights(const std::string& dir, const lm::FullGroupSource& source, const lm::ExportSettings& settings) const {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return IoError("cannot create the export directory " + dir + ": " + ec.message());
  ExportOptions options;
  STRATA_ASSIGN_OR_RETURN(options.dtype, export_dtype(settings.dtype));
  options.metadata = settings.metadata;
  const std::string path = (std::filesystem::path(dir) / "model.safetensors").string();
  STRATA_RETURN_IF_ERROR(write_gpt2_safetensors(path, config_, source, options));
  return write_gpt2_config_json((std::filesystem::path(dir) / "config.json").string(), config_);
}

}  // namespace strata::gpt
