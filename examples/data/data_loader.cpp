// The data loader: (step, micro-batch, rank) -> a batch of samples, and its resumable state.
#include "examples/data/token_data.h"

#include <algorithm>
#include <string>

#include <nlohmann/json.hpp>


namespace strata::data {

namespace {

using json = nlohmann::json;

}  // namespace

// ---------------------------------------------------------------------------------------
// DataLoader

StatusOr<DataLoader> DataLoader::create(std::shared_ptr<const TokenDataset> dataset, const DataLoaderOptions& options) {
  if (dataset == nullptr) return InvalidArgumentError("data loader: no dataset");
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return InvalidArgumentError("data loader: rank " + std::to_string(options.rank) + " of world size " +
                                std::to_string(options.world_size));
  }
  if (options.global_batch < 1 || options.global_batch % options.world_size != 0) {
    return InvalidArgumentError("data loader: the global batch of " + std::to_string(options.global_batch) +
                                " rows does not split evenly over " + std::to_string(options.world_size) + " ranks");
  }
  if (options.seq_len < 1) return InvalidArgumentError("data loader: seq_len " + std::to_string(options.seq_len) + " must be >= 1");
  if (options.micro_batches < 1) {
    return InvalidArgumentError("data loader: micro_batches " + std::to_string(options.micro_batches) + " must be >= 1");
  }
  if (const auto row = dataset->row_length(); row && *row != static_cast<uint64_t>(options.seq_len) + 1) {
    return InvalidArgumentError("data loader: seq_len " + std::to_string(options.seq_len) + " needs rows of " +
                                std::to_string(options.seq_len + 1) + " tokens (seq_len + 1), but the rows of " + dataset->describe() +
                                " are " + std::to_string(*row) + "; set seq_len to " + std::to_string(*row - 1) +
                                " or prepare the data again with --seq-len " + std::to_string(options.seq_len));
  }
  const auto tokens = dataset->split_tokens(options.split);
  if (tokens.has_value() && *tokens < static_cast<uint64_t>(options.seq_len) + 1) {
    if (options.split == DataSplit::kEval && *tokens == 0) {
      return InvalidArgumentError("data loader: " + dataset->describe() +
                                  " has no eval split (strata.data.eval_fraction is 0); set it to hold out data for eval loss");
    }
    return InvalidArgumentError("data loader: the " + std::string(data_split_name(options.split)) + " split of " +
                                dataset->describe() + " has " + std::to_string(*tokens) +
                                " tokens, fewer than one sample (seq_len + 1 = " + std::to_string(options.seq_len + 1) + ")");
  }
  return DataLoader(std::move(dataset), options);
}

Status DataLoader::fill(uint64_t batch_index, std::span<int32_t> inputs, std::span<int32_t> targets,
                        std::optional<std::span<int32_t>> positions) const {
  const size_t elements = batch_elements();
  if (inputs.size() != elements || targets.size() != elements || (positions && positions->size() != elements)) {
    return InvalidArgumentError("data loader: a batch is " + std::to_string(local_rows()) + " x " + std::to_string(options_.seq_len) +
                                " = " + std::to_string(elements) + " tokens; got buffers of " + std::to_string(inputs.size()) + ", " +
                                std::to_string(targets.size()) + (positions ? " and " + std::to_string(positions->size()) : std::string()));
  }
  const auto seq_len = static_cast<size_t>(options_.seq_len);
  std::vector<int32_t> sample(seq_len + 1);
  std::vector<uint8_t> flags(seq_len + 1);
  const uint64_t first_row = batch_index * static_cast<uint64_t>(options_.global_batch) +
                             static_cast<uint64_t>(options_.rank) * static_cast<uint64_t>(local_rows());
  for (int64_t row = 0; row < local_rows(); ++row) {
    STRATA_RETURN_IF_ERROR(dataset_->sample_with_flags(options_.split, options_.seed, first_row + static_cast<uint64_t>(row), sample, flags));
    const size_t base = static_cast<size_t>(row) * seq_len;
    int32_t position = 0;
    for (size_t t = 0; t < seq_len; ++t) {
      inputs[base + t] = sample[t];
      targets[base + t] = (flags[t + 1] & kTokenIsTarget) != 0 ? sample[t + 1] : -1;
      // Padding carries no document start, so it continues the document's count.
      position = (t == 0 || (flags[t] & kTokenStartsDocument) != 0) ? 0 : position + 1;
      if (positions) (*positions)[base + t] = position;
    }
  }
  return Status::Ok();
}

Status DataLoader::batch_at(uint64_t batch_index, std::span<int32_t> inputs, std::span<int32_t> targets,
                            std::span<int32_t> positions) const {
  return fill(batch_index, inputs, targets, positions);
}

Status DataLoader::batch_at(uint64_t batch_index, std::span<int32_t> inputs, std::span<int32_t> targets) const {
  return fill(batch_index, inputs, targets, std::nullopt);
}

namespace {

StatusOr<uint64_t> batch_index_of(int64_t step, int micro, int micro_batches) {
  if (step < 0 || micro < 0 || micro >= micro_batches) {
    return InvalidArgumentError("data loader: step " + std::to_string(step) + ", micro-batch " + std::to_string(micro) + " of " +
                                std::to_string(micro_batches));
  }
  return static_cast<uint64_t>(step) * static_cast<uint64_t>(micro_batches) + static_cast<uint64_t>(micro);
}

}  // namespace

Status DataLoader::batch(int64_t step, int micro, std::span<int32_t> inputs, std::span<int32_t> targets,
                         std::span<int32_t> positions) const {
  STRATA_ASSIGN_OR_RETURN(const uint64_t index, batch_index_of(step, micro, options_.micro_batches));
  return fill(index, inputs, targets, positions);
}

Status DataLoader::batch(int64_t step, int micro, std::span<int32_t> inputs, std::span<int32_t> targets) const {
  STRATA_ASSIGN_OR_RETURN(const uint64_t index, batch_index_of(step, micro, options_.micro_batches));
  return fill(index, inputs, targets, std::nullopt);
}

Status DataLoader::next(std::span<int32_t> inputs, std::span<int32_t> targets, std::span<int32_t> positions) {
  STRATA_RETURN_IF_ERROR(fill(position_, inputs, targets, positions));
  ++position_;
  return Status::Ok();
}

Status DataLoader::next(std::span<int32_t> inputs, std::span<int32_t> targets) {
  STRATA_RETURN_IF_ERROR(fill(position_, inputs, targets, std::nullopt));
  ++position_;
  return Status::Ok();
}

std::string DataLoader::state_json() const {
  json state = {{"position", position_},
                {"seed", options_.seed},
                {"split", std::string(data_split_name(options_.split))},
                {"global_batch", options_.global_batch},
                {"seq_len", options_.seq_len}};
  return state.dump();
}

Status DataLoader::restore_json(std::string_view text) {
  const json state = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (state.is_discarded() || !state.is_object()) {
    return InvalidArgumentError("data loader state is not a JSON object: '" + std::string(text.substr(0, 200)) + "'");
  }
  auto field = [&](const char* name) -> const json* {
    const auto it = state.find(name);
    return it == state.end() ? nullptr : &*it;
  };
  const json* position = field("position");
  const json* seed = field("seed");
  const json* split = field("split");
  const json* global_batch = field("global_batch");
  const json* seq_len = field("seq_len");
  if (position == nullptr || !position->is_number_unsigned() || seed == nullptr || !seed->is_number_integer() ||
      split == nullptr || !split->is_string() || global_batch == nullptr || !global_batch->is_number_integer() ||
      seq_len == nullptr || !seq_len->is_number_integer()) {
    return InvalidArgumentError("data loader state '" + std::string(text.substr(0, 200)) +
                                "' lacks position, seed, split, global_batch or seq_len");
  }
  if (seed->get<uint64_t>() != options_.seed) {
    return InvalidArgumentError("data loader state was saved with data seed " + std::to_string(seed->get<uint64_t>()) +
                                ", this run uses " + std::to_string(options_.seed));
  }
  if (split->get<std::string>() != data_split_name(options_.split)) {
    return InvalidArgumentError("data loader state is for the " + split->get<std::string>() + " split, this loader reads " +
                                std::string(data_split_name(options_.split)));
  }
  if (global_batch->get<int64_t>() != options_.global_batch) {
    return InvalidArgumentError("data loader state was saved with a global batch of " + std::to_string(global_batch->get<int64_t>()) +
                                " rows, this run uses " + std::to_string(options_.global_batch));
  }
  if (seq_len->get<int64_t>() != options_.seq_len) {
    return InvalidArgumentError("data loader state was saved with seq_len " + std::to_string(seq_len->get<int64_t>()) +
                                ", this run uses " + std::to_string(options_.seq_len));
  }
  position_ = position->get<uint64_t>();
  return Status::Ok();
}

}  // namespace strata::data
