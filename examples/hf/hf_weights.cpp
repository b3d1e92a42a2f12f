#include "examples/hf/hf_weights.h"

#include <algorithm>
#include <map>
#include <set>

#include "engine/core/log.h"
#include "examples/hf/problem_list.h"

namespace strata::hf {
namespace {

using hf::shape_text;

std::string range_text(uint64_t begin, uint64_t end) {
  std::string text = "[";  // appended piece by piece: GCC 12's -Wrestrict misfires on "[" + std::to_string(...)
  text += std::to_string(begin);
  text += ", ";
  text += std::to_string(end);
  text += ")";
  return text;
}

std::string engine_tensor_name(const GroupLayout& group, const TensorLayout& tensor) { return group.name + "/" + tensor.name; }

// The element ranges of a checkpoint tensor no range in `ranges` covers.
std::vector<std::pair<uint64_t, uint64_t>> uncovered(std::vector<std::pair<uint64_t, uint64_t>> ranges, uint64_t numel) {
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<uint64_t, uint64_t>> gaps;
  uint64_t reached = 0;
  for (const auto& [begin, end] : ranges) {
    if (begin > reached) gaps.emplace_back(reached, begin);
    reached = std::max(reached, end);
  }
  if (reached < numel) gaps.emplace_back(reached, numel);
  return gaps;
}

}  // namespace

StatusOr<std::vector<GroupLayout>> single_rank_layouts(std::span<const GroupSpec> specs) {
  std::vector<GroupLayout> layouts;
  for (size_t g = 0; g < specs.size(); ++g) {
    STRATA_ASSIGN_OR_RETURN(GroupLayout layout, layout_group(specs[g], static_cast<int>(g), 1));
    layouts.push_back(std::move(layout));
  }
  return layouts;
}

Status check_hf_mapping(const HfTensorSource& source, std::span<const GroupLayout> layouts, const HfNameMap& map,
                        const HfLoadOptions& options) {
  std::vector<std::string> problems;
  std::set<std::string> faulty;                                             // reported once each
  std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> reads;  // checkpoint tensor -> element ranges read
  for (const GroupLayout& layout : layouts) {
    for (const TensorLayout& t : layout.tensors) {
      const HfTensorSlice slice = map(layout, t);
      if (slice.kept()) continue;
      const std::string engine_name = engine_tensor_name(layout, t);
      if (faulty.count(slice.name) != 0) continue;
      const std::optional<HfTensorRef> ref = source.find(slice.name);
      std::string problem;
      if (!ref) {
        problem = "'" + slice.name + "' is missing (expected shape " + shape_text(slice.shape) + ", for " + engine_name + ")";
      } else if (!std::equal(ref->shape().begin(), ref->shape().end(), slice.shape.begin(), slice.shape.end())) {
        problem = "'" + slice.name + "' has shape " + shape_text(ref->shape()) + ", expected " + shape_text(slice.shape);
      } else if (!hf::safetensors_dtype_is_float(ref->dtype())) {
        problem = "'" + slice.name + "' has dtype " + std::string(hf::safetensors_dtype_name(ref->dtype())) +
                  ", which does not convert to fp32";
      } else if (slice.mapped(t) > t.numel || slice.element_offset + slice.mapped(t) > ref->numel()) {
        problem = engine_name + " " + shape_text(t.shape) + " reads elements " +
                  range_text(slice.element_offset, slice.element_offset + slice.mapped(t)) + " of '" + slice.name + "', which has " +
                  std::to_string(ref->numel());
      }
      if (!problem.empty()) {
        faulty.insert(slice.name);
        problems.push_back(std::move(problem));
        continue;
      }
      reads[slice.name].emplace_back(slice.element_offset, slice.element_offset + slice.mapped(t));
    }
  }
  for (const auto& [name, ranges] : reads) {
    if (faulty.count(name) != 0) continue;
    const auto gaps = uncovered(ranges, source.find(name)->numel());
    if (gaps.empty()) continue;
    std::string text = "elements " + range_text(gaps.front().first, gaps.front().second);
    if (gaps.size() > 1) text += " and " + std::to_string(gaps.size() - 1) + " more ranges";
    problems.push_back(text + " of '" + name + "' are read by no engine tensor (the model's mapping leaves a gap)");
  }

  std::string unused;
  size_t unused_count = 0;
  for (const std::string& name : source.tensor_names()) {
    if (reads.count(name) != 0 || faulty.count(name) != 0 || (options.is_ignored && options.is_ignored(name))) continue;
    if (++unused_count <= 12) unused += (unused.empty() ? "" : ", ") + name;
  }
  if (unused_count > 12) unused += ", and " + std::to_string(unused_count - 12) + " more";
  if (unused_count > 0) STRATA_LOG(kWarn) << source.where() << " has tensors the model does not use (ignored): " << unused;

  return problem_list_error(source.where() + " does not hold this model's weights", problems);
}

namespace {

// Elements [first, first + values.size()) of rank `rank`'s shard of one group: read first
// where a tensor is kept, the mapped tensors' elements from the source, then written.
Status load_hf_chunk(const GroupLayout& layout, int rank, size_t first, std::span<float> values, const HfTensorSource& source,
                     const HfNameMap& map, const HfShardAccess& access) {
  std::fill(values.begin(), values.end(), 0.0f);
  // A tensor the checkpoint does not hold keeps its values: start from the shard as it is.
  const bool keeps = std::any_of(layout.tensors.begin(), layout.tensors.end(), [&](const TensorLayout& t) { return map(layout, t).kept(); });
  if (keeps) STRATA_RETURN_IF_ERROR(access.read(layout.id, first, values));
  const size_t begin = layout.shard_begin(rank) + first;
  const size_t end = begin + values.size();
  for (const TensorLayout& t : layout.tensors) {
    const HfTensorSlice slice = map(layout, t);
    if (slice.kept()) continue;
    // Elements past the mapped ones (vocabulary padding) keep the zeros assigned above.
    const size_t lo = std::max(begin, t.offset), hi = std::min(end, t.offset + static_cast<size_t>(slice.mapped(t)));
    if (lo >= hi) continue;
    const std::optional<HfTensorRef> ref = source.find(slice.name);  // checked by the caller
    STRATA_RETURN_IF_ERROR_CTX(source.read_fp32(*ref, slice.element_offset + (lo - t.offset), values.subspan(lo - begin, hi - lo)),
                               source.where() + ": loading " + engine_tensor_name(layout, t) + " on rank " + std::to_string(rank));
  }
  return access.write(layout.id, first, values);
}

}  // namespace

Status load_hf_shards(std::span<const GroupLayout> layouts, int rank, const HfTensorSource& source, const HfNameMap& map,
                      const HfShardAccess& access, const HfLoadOptions& options) {
  STRATA_RETURN_IF_ERROR(check_hf_mapping(source, layouts, map, options));
  size_t largest = 0;
  for (const GroupLayout& layout : layouts) largest = std::max(largest, layout.shard_numel);
  const size_t chunk = access.chunk_elements == 0 ? largest : std::min(largest, access.chunk_elements);
  std::vector<float> values(chunk);
  for (const GroupLayout& layout : layouts)
    for (size_t first = 0; first < layout.shard_numel; first += chunk) {
      const std::span<float> part(values.data(), std::min(chunk, layout.shard_numel - first));
      STRATA_RETURN_IF_ERROR(load_hf_chunk(layout, rank, first, part, source, map, access));
    }
  return {};
}

Status load_hf_weights(Engine& engine, int rank, const HfTensorSource& source, const HfNameMap& map, const HfLoadOptions& options) {
  std::vector<GroupLayout> layouts;
  layouts.reserve(static_cast<size_t>(engine.group_count()));
  for (int g = 0; g < engine.group_count(); ++g) layouts.push_back(engine.layout(g));
  HfShardAccess access;
  access.read = [&](int g, size_t first, std::span<float> values) { return engine.read_state_range(g, Engine::StateKind::kMaster, first, values); };
  access.write = [&](int g, size_t first, std::span<const float> values) {
    return engine.write_state_range(g, Engine::StateKind::kMaster, first, values);
  };
  access.chunk_elements = kStateChunkElements;
  STRATA_RETURN_IF_ERROR(load_hf_shards(layouts, rank, source, map, access, options));
  return engine.refresh_parameters();
}

// ---------------------------------------------------------------------------------------
// Export

StatusOr<HfGroupExport> HfGroupExport::plan(std::span<const GroupLayout> layouts, const HfNameMap& map, hf::SafetensorsDType dtype) {
  HfGroupExport result;
  std::map<std::string, size_t, std::less<>> index_of;
  for (size_t g = 0; g < layouts.size(); ++g) {
    const GroupLayout& layout = layouts[g];
    result.group_ids_.push_back(layout.id);
    result.group_numel_.push_back(layout.numel);
    for (const TensorLayout& t : layout.tensors) {
      HfTensorSlice slice = map(layout, t);
      if (slice.kept()) continue;  // not a checkpoint tensor: not exported
      const auto [it, inserted] = index_of.emplace(slice.name, result.tensors_.size());
      if (inserted) {
        result.tensors_.push_back({slice.name, slice.shape, dtype});
        result.pieces_.emplace_back();
      } else if (result.tensors_[it->second].shape != slice.shape) {
        return InvalidArgumentError("export: " + engine_tensor_name(layout, t) + " maps to '" + slice.name + "' of shape " +
                                    shape_text(slice.shape) + ", but an earlier tensor gave it shape " +
                                    shape_text(result.tensors_[it->second].shape));
      }
      result.pieces_[it->second].push_back({slice.element_offset, slice.mapped(t), static_cast<int>(g), t.offset});
    }
  }
  for (size_t i = 0; i < result.tensors_.size(); ++i) {
    auto& pieces = result.pieces_[i];
    std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.first < b.first; });
    uint64_t reached = 0;
    for (const Piece& piece : pieces) {
      if (piece.first != reached)
        return InvalidArgumentError("export: the engine's tensors " + std::string(piece.first > reached ? "leave a gap in" : "overlap in") +
                                    " '" + result.tensors_[i].name + "' at element " + std::to_string(std::min(piece.first, reached)));
      reached += piece.count;
    }
    if (reached != result.tensors_[i].numel())
      return InvalidArgumentError("export: the engine's tensors fill " + std::to_string(reached) + " of the " +
                                  std::to_string(result.tensors_[i].numel()) + " elements of '" + result.tensors_[i].name + "' " +
                                  shape_text(result.tensors_[i].shape));
    for (const Piece& piece : pieces) {
      const int id = result.group_ids_[static_cast<size_t>(piece.group)];
      if (result.group_order_.empty() || result.group_order_.back() != id) result.group_order_.push_back(id);
    }
  }
  return result;
}

Status HfGroupExport::fill(const FullGroupSource& source, size_t index, uint64_t first, std::span<float> out) {
  if (index >= tensors_.size() || first + out.size() > tensors_[index].numel())
    return InvalidArgumentError("export: no elements " + range_text(first, first + out.size()) + " in tensor " + std::to_string(index));
  const std::vector<Piece>& pieces = pieces_[index];
  // The last piece that starts at or before `first`.
  auto piece = std::upper_bound(pieces.begin(), pieces.end(), first, [](uint64_t value, const Piece& p) { return value < p.first; }) - 1;
  for (size_t done = 0; done < out.size(); ++piece) {
    const uint64_t position = first + done;
    if (held_group_ != piece->group) {
      held_group_ = -1;
      group_values_.assign(group_numel_[static_cast<size_t>(piece->group)], 0.0f);
      const int id = group_ids_[static_cast<size_t>(piece->group)];
      STRATA_RETURN_IF_ERROR_CTX(source(id, group_values_), "export: assembling group " + std::to_string(id));
      held_group_ = piece->group;
    }
    const size_t count = static_cast<size_t>(std::min<uint64_t>(out.size() - done, piece->first + piece->count - position));
    const float* from = group_values_.data() + piece->group_offset + (position - piece->first);
    std::copy(from, from + count, out.data() + done);
    done += count;
  }
  return Status::Ok();
}

StatusOr<std::vector<int>> export_group_order(std::span<const GroupLayout> layouts, const HfNameMap& map) {
  STRATA_ASSIGN_OR_RETURN(const HfGroupExport plan, HfGroupExport::plan(layouts, map, hf::SafetensorsDType::kF32));
  return plan.group_order();
}

Status export_hf_from_groups(const std::string& dir, const nlohmann::json& config, std::span<const GroupLayout> layouts,
                             const HfNameMap& map, hf::SafetensorsDType dtype, const FullGroupSource& source,
                             const HfExportOptions& options) {
  STRATA_ASSIGN_OR_RETURN(HfGroupExport plan, HfGroupExport::plan(layouts, map, dtype));
  return write_hf_checkpoint(
      dir, config, plan.tensors(), [&](size_t index, uint64_t first, std::span<float> out) { return plan.fill(source, index, first, out); },
      options);
}

}  // namespace strata::hf
