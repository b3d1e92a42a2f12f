// Hugging Face checkpoints in and out of the engine, for any model family.
//
// A family says how its engine tensors relate to the checkpoint's with an HfNameMap: for
// each (group, tensor) of the engine, the checkpoint tensor it comes from, where in that
// tensor its first element lies, and the checkpoint tensor's full shape. An engine tensor
// is a contiguous row-major range of a checkpoint tensor, so one checkpoint tensor may be
// split over several groups (a 128k-row embedding as groups of vocabulary rows), and two
// engine tensors may read the same one.
//
// Loading (load_hf_weights) first checks every mapped tensor — present, with the expected
// shape, a float dtype, the range inside it, and every element of each checkpoint tensor
// it uses covered by some engine tensor — and returns one error listing every problem.
// Then, group by group, each rank reads only the element ranges that fall into its own
// master shard, straight into a one-shard buffer that goes to the shard's tier
// (write_state_shard), so the model is never whole in host memory.
//
// Exporting (HfGroupExport) turns full groups (what a trainer assembles from every
// rank's shard, one group at a time) into the checkpoint's tensors for write_hf_checkpoint,
// holding one group at a time; group_order() is the sequence of groups it will ask for,
// so other ranks can contribute in the same order.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/status.h"
#include "engine/engine.h"
#include "engine/partition.h"
#include "examples/hf/hf_checkpoint.h"
#include "examples/hf/hf_export.h"

namespace strata::hf {

// Where one engine tensor lives in the checkpoint.
struct HfTensorSlice {
  // The checkpoint tensor's name; empty: the checkpoint does not hold this engine tensor and
  // a load keeps its values (an adapter added to a checkpoint's model).
  std::string name;
  uint64_t element_offset = 0;  // the engine tensor's first element within it (row-major)
  std::vector<int64_t> shape;   // the checkpoint tensor's whole shape
  // The engine tensor's leading elements the checkpoint holds; the rest (a vocabulary's
  // padding rows) are neither read nor written: loads leave them zero, exports skip them.
  // 0 = the whole engine tensor.
  uint64_t mapped_elements = 0;

  uint64_t mapped(const TensorLayout& tensor) const { return mapped_elements > 0 ? mapped_elements : tensor.numel; }
  bool kept() const { return name.empty(); }
};
using HfNameMap = std::function<HfTensorSlice(const GroupLayout& group, const TensorLayout& tensor)>;

struct HfLoadOptions {
  // Tensors the checkpoint may hold that no engine tensor reads (buffers, tied copies)
  // and that are not worth a warning. Others are listed in one warning.
  std::function<bool(std::string_view name)> is_ignored;
};

// The layouts of `specs` with ids 0, 1, ... and world size 1: a family's groups as its
// name map is checked, loaded and exported against (errors name a bad spec).
StatusOr<std::vector<GroupLayout>> single_rank_layouts(std::span<const GroupSpec> specs);

// One integer field of a family's config (Config::*field) under its key in Hugging Face's
// config.json: a family lists its keys once and writes config.json from them
// (put_config_keys), or checks a checkpoint's against them.
template <class Config>
struct ConfigKey {
  const char* key;
  int64_t Config::*field;
};
template <class Config, size_t N>
void put_config_keys(nlohmann::json& json, const Config& config, const ConfigKey<Config> (&keys)[N]) {
  for (const ConfigKey<Config>& k : keys) json[k.key] = config.*k.field;
}

// Checks `map` against `source` for every tensor of `layouts` (see the top of this file):
// OK, or kInvalidArgument listing every problem, naming the source.
Status check_hf_mapping(const HfTensorSource& source, std::span<const GroupLayout> layouts, const HfNameMap& map,
                        const HfLoadOptions& options = {});

// Where a load puts rank `rank`'s shard of each group (fp32 values), and where it reads
// the shard first when a tensor of the group is kept (HfTensorSlice::kept()). The load
// moves `chunk_elements` values at a time (elements [first, first + size) of the shard),
// or whole shards (first 0) when it is 0.
struct HfShardAccess {
  std::function<Status(int group, size_t first, std::span<float> values)> read;
  std::function<Status(int group, size_t first, std::span<const float> values)> write;
  size_t chunk_elements = 0;
};

// Loads rank `rank`'s shard of every group of `layouts` from `source` through `map` (any
// float dtype the source holds), group by group, checking first (check_hf_mapping: nothing
// is written when a check fails).
Status load_hf_shards(std::span<const GroupLayout> layouts, int rank, const HfTensorSource& source, const HfNameMap& map,
                      const HfShardAccess& access, const HfLoadOptions& options = {});

// load_hf_shards into the fp32 master shards of every group of `engine`, then
// refresh_parameters(). Optimizer moments are left as they are (zero on a fresh engine).
// Call after start(), between steps.
Status load_hf_weights(Engine& engine, int rank, const HfTensorSource& source, const HfNameMap& map,
                       const HfLoadOptions& options = {});

// Fills `out` (layout(group).numel floats) with the full, unpadded fp32 group.
using FullGroupSource = std::function<Status(int group, std::span<float> out)>;

class HfGroupExport {
 public:
  // The checkpoint's tensors in order of first appearance in `layouts` (group by group,
  // tensor by tensor), each written as `dtype`; every one must be tiled exactly by the
  // engine tensors mapped to it (no gap, no overlap), else kInvalidArgument naming it.
  static StatusOr<HfGroupExport> plan(std::span<const GroupLayout> layouts, const HfNameMap& map, hf::SafetensorsDType dtype);

  const std::vector<HfExportTensor>& tensors() const { return tensors_; }
  // The groups fill() asks `source` for, in order, when the tensors are written in order.
  const std::vector<int>& group_order() const { return group_order_; }
  // Elements [first, first + out.size()) of tensors()[index], from the groups `source`
  // gives; keeps the last group asked for and asks again only when another is needed.
  Status fill(const FullGroupSource& source, size_t index, uint64_t first, std::span<float> out);

 private:
  struct Piece {             // one engine tensor's part of a checkpoint tensor
    uint64_t first = 0;      // within the checkpoint tensor
    uint64_t count = 0;
    int group = 0;           // index into the layouts given to plan()
    size_t group_offset = 0; // the engine tensor's first element within its group
  };
  std::vector<HfExportTensor> tensors_;
  std::vector<std::vector<Piece>> pieces_;  // per tensor, by `first`
  std::vector<int> group_ids_;              // per group (GroupLayout::id, what `source` is asked for)
  std::vector<size_t> group_numel_;         // per group
  std::vector<int> group_order_;
  std::vector<float> group_values_;
  int held_group_ = -1;
};

// The order an export of `layouts` asks for the groups in (HfGroupExport::group_order();
// it does not depend on the dtype written).
StatusOr<std::vector<int>> export_group_order(std::span<const GroupLayout> layouts, const HfNameMap& map);

// Writes `dir` from full groups (write_hf_checkpoint with HfGroupExport).
Status export_hf_from_groups(const std::string& dir, const nlohmann::json& config, std::span<const GroupLayout> layouts,
                             const HfNameMap& map, hf::SafetensorsDType dtype, const FullGroupSource& source,
                             const HfExportOptions& options = {});

}  // namespace strata::hf
