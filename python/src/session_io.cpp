// Session's state in and out: checkpoints and Hugging Face model directories.
#include <filesystem>
#include <map>
#include <utility>

#include <nlohmann/json.hpp>

#include "examples/hf/hf_checkpoint.h"
#include "examples/hf/hf_export.h"
#include "examples/hf/hf_weights.h"
#include "python/src/session.h"

namespace strata::python {
namespace {

// The name map of an export or load: engine (group, tensor) -> the checkpoint tensor, whole;
// an empty name: a tensor the checkpoint does not hold (kept by a load, not exported).
StatusOr<hf::HfNameMap> name_map(std::span<const GroupLayout> layouts, const std::vector<HfTensorName>& names) {
  std::map<std::pair<int, std::string>, HfTensorName> by_tensor;
  for (const HfTensorName& n : names) {
    if (n.group < 0 || static_cast<size_t>(n.group) >= layouts.size())
      return InvalidArgumentError("tensor " + n.name + " names group " + std::to_string(n.group) + " of " + std::to_string(layouts.size()));
    const GroupLayout& layout = layouts[static_cast<size_t>(n.group)];
    if (n.tensor < 0 || static_cast<size_t>(n.tensor) >= layout.tensors.size())
      return InvalidArgumentError("tensor " + n.name + " names tensor " + std::to_string(n.tensor) + " of group " + layout.name);
    by_tensor[{n.group, layout.tensors[static_cast<size_t>(n.tensor)].name}] = n;
  }
  for (const GroupLayout& layout : layouts)
    for (const TensorLayout& t : layout.tensors)
      if (by_tensor.count({layout.id, t.name}) == 0) return InvalidArgumentError("no checkpoint name for parameter " + t.name);
  return hf::HfNameMap([by_tensor = std::move(by_tensor)](const GroupLayout& group, const TensorLayout& tensor) {
    const HfTensorName& n = by_tensor.at({group.id, tensor.name});
    hf::HfTensorSlice slice;
    slice.name = n.name;
    slice.element_offset = n.element_offset;
    slice.shape = n.full_shape.empty() && n.element_offset == 0 ? tensor.shape : n.full_shape;
    return slice;
  });
}

Status check_between_steps(bool micro_open, std::string_view call) {
  if (micro_open) return FailedPreconditionError(std::string(call) + " inside a step: call it after step() at an accumulation boundary");
  return {};
}

}  // namespace

Status Session::open_saver(const std::string& dir) {
  if (saver_ && saver_->directory() == dir) return {};
  if (saver_) {
    const Status finished = saver_->finish();
    saver_.reset();
    STRATA_RETURN_IF_ERROR(finished);
  }
  CheckpointSaverOptions options;
  options.directory = dir;
  for (int g = 0; g < engine_->group_count(); ++g) options.checkpoint_elements += engine_->layout(g).padded_numel;
  if (options_.overlap == OverlapMode::kDelayed) options.state_segments = kCheckpointStateKinds + 1;
  if (world_size_ > 1) {  // one saver per process on the shared directory: each writes its own rank's file
    options.world_size = world_size_;
    options.first_rank = rank_;
    options.local_ranks = 1;
  }
  STRATA_ASSIGN_OR_RETURN(saver_, CheckpointSaver::create(options));
  return {};
}

StatusOr<std::string> Session::trainer_state_text(const std::string& client_state) const {
  nlohmann::json client = nlohmann::json::parse(client_state, nullptr, /*allow_exceptions=*/false);
  if (client.is_discarded()) return InvalidArgumentError("save_checkpoint(): client_state is not JSON");
  const nlohmann::json state = {{"client_state", client}, {"lr_schedule", schedule_->state_json()}};
  return state.dump();
}

Status Session::save_checkpoint(const std::string& dir, const std::string& client_state) {
  STRATA_RETURN_IF_ERROR(check_open("save_checkpoint"));
  STRATA_RETURN_IF_ERROR(check_between_steps(micro_open_ || micro_ != 0, "save_checkpoint()"));
  if (world_size_ > 1) return save_across_processes(dir, client_state);
  STRATA_RETURN_IF_ERROR(open_saver(dir));
  STRATA_ASSIGN_OR_RETURN(std::string state, trainer_state_text(client_state));
  const int64_t step = engine_->steps_taken();
  STRATA_ASSIGN_OR_RETURN(RankSnapshot snapshot, snapshot_engine_state(*engine_, rank_));
  STRATA_RETURN_IF_ERROR(saver_->submit(step, std::move(snapshot)));
  STRATA_RETURN_IF_ERROR(saver_->submit_trainer_state(step, std::move(state)));
  return saver_->wait();
}

StatusOr<std::string> Session::checkpoint_to_load(const std::string& dir) {
  if (std::filesystem::exists(std::filesystem::path(dir) / "manifest.json")) return dir;
  STRATA_ASSIGN_OR_RETURN(const CheckpointRef ref, latest_complete(dir));
  return ref.path;
}

StatusOr<std::string> Session::load_checkpoint_at(const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::open(path));
  STRATA_RETURN_IF_ERROR(load_engine_state(*engine_, rank_, *reader));
  const nlohmann::json state = nlohmann::json::parse(reader->trainer_state(), nullptr, /*allow_exceptions=*/false);
  if (state.is_discarded() || !state.is_object() || !state.contains("lr_schedule") || !state.contains("client_state"))
    return DataLossError(path + "/trainer_state.json was not written by the Python front end (no lr_schedule and client_state)");
  STRATA_RETURN_IF_ERROR(schedule_->restore_json(state["lr_schedule"].get<std::string>()));
  return state["client_state"].dump();
}

StatusOr<std::string> Session::load_checkpoint(const std::string& dir) {
  STRATA_RETURN_IF_ERROR(check_open("load_checkpoint"));
  STRATA_RETURN_IF_ERROR(check_between_steps(micro_open_ || micro_ != 0, "load_checkpoint()"));
  if (world_size_ > 1) return load_across_processes(dir);
  STRATA_ASSIGN_OR_RETURN(const std::string path, checkpoint_to_load(dir));
  return load_checkpoint_at(path);
}

Status Session::export_hf(const std::string& dir, const std::string& config_json, const std::vector<HfTensorName>& names,
                          const std::string& tokenizer_dir, uint64_t shard_bytes, const std::string& dtype) {
  STRATA_RETURN_IF_ERROR(check_open("export_hf"));
  STRATA_RETURN_IF_ERROR(check_between_steps(micro_open_ || micro_ != 0, "export_hf()"));
  const nlohmann::json config = nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) return InvalidArgumentError("export_hf(): the model config is not a JSON object");
  STRATA_ASSIGN_OR_RETURN(const hf::SafetensorsDType file_dtype, hf::parse_safetensors_dtype(dtype));
  const std::vector<GroupLayout> all = layouts();
  STRATA_ASSIGN_OR_RETURN(const hf::HfNameMap map, name_map(all, names));
  hf::HfExportOptions options;
  options.tokenizer_source_dir = tokenizer_dir;
  if (shard_bytes > 0) options.shard_bytes = shard_bytes;
  if (world_size_ > 1) return export_across_processes(dir, config, all, map, file_dtype, options);
  auto source = [&](int group, std::span<float> out) { return read_group(group, out); };
  return hf::export_hf_from_groups(dir, config, all, map, file_dtype, source, options);
}

Status Session::load_hf(const std::string& dir, const std::vector<HfTensorName>& names) {
  STRATA_RETURN_IF_ERROR(check_open("load_hf"));
  STRATA_RETURN_IF_ERROR(check_between_steps(micro_open_ || micro_ != 0, "load_hf()"));
  const std::vector<GroupLayout> all = layouts();
  STRATA_ASSIGN_OR_RETURN(const hf::HfNameMap map, name_map(all, names));
  STRATA_ASSIGN_OR_RETURN(hf::HfCheckpoint checkpoint, hf::HfCheckpoint::open(dir));
  hf::HfShardAccess access;
  // Whole shards (chunk_elements 0, so first is 0): a packed group's words are not its elements.
  access.read = [this](int g, size_t, std::span<float> shard) { return read_shard(g, shard); };
  access.write = [this](int g, size_t, std::span<const float> shard) { return write_shard(g, shard); };
  STRATA_RETURN_IF_ERROR(hf::load_hf_shards(all, rank_, checkpoint, map, access));
  return engine_->refresh_parameters();
}

}  // namespace strata::python
