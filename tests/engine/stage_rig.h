// What a stage test builds a stage from, without an Engine: the CPU device and its
// streams, the plan make_engine_plan gives for the options and groups, the pinned arena
// and (for NVMe tiers) the store the plan sizes, as the engine builds them at start().
// The hand-offs (boards, shard store) are each test's own: real ones it observes, or
// fakes it fills.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine/core/device.h"
#include "engine/engine_options.h"
#include "engine/engine_plan.h"
#include "engine/engine_plan_types.h"
#include "engine/partition.h"
#include "engine/stream_trace.h"
#include "engine/trace.h"
#include "offload/nvme_store.h"
#include "offload/pinned_arena.h"
#include "tests/support/test_support.h"

namespace strata::engine_internal {

// A group of one tensor of `elements` fp32 values (decayed), or frozen.
inline GroupSpec one_tensor_group(const std::string& name, int64_t elements, bool trainable = true) {
  GroupSpec spec;
  spec.name = name;
  spec.tensors.push_back({"w", {elements}, TensorInit::normal(0.02f), true});
  spec.trainable = trainable;
  return spec;
}

// Options for a one-rank CPU run in fp32 (parameters, wire and transfer): values compare
// exactly. Tiers pinned, exact overlap, one micro-batch.
inline EngineOptions fp32_options() {
  EngineOptions o;
  o.param_dtype = DType::kFloat32;
  o.grad_wire_dtype = DType::kFloat32;
  o.grad_transfer_dtype = DType::kFloat32;
  o.optimizer_threads = 1;
  o.pin_memory = false;
  o.adam.lr = 0.01;
  o.adam.weight_decay = 0.0;
  return o;
}

struct StageRig {
  EngineOptions options;
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> compute, h2d, gather, reduce, d2h, update;
  Tracer tracer{0};
  std::unique_ptr<StreamTrace> stream_trace;
  std::vector<GroupLayout> layouts;
  EnginePlan plan;
  std::unique_ptr<PinnedArena> arena;
  std::unique_ptr<NvmeStore> nvme;  // when a tier is kNvme (options.nvme_path set)

  // The plan for `specs` under `options`, and what it sizes: streams, arena, store.
  static StatusOr<std::unique_ptr<StageRig>> create(const EngineOptions& options, const std::vector<GroupSpec>& specs) {
    auto rig = std::make_unique<StageRig>();
    rig->options = options;
    STRATA_ASSIGN_OR_RETURN(rig->device, create_cpu_device({.budget_bytes = size_t{256} << 20, .compute = {.threads = 1}}));
    Device& d = *rig->device;
    for (auto [stream, name] : {std::pair{&rig->compute, "compute"}, {&rig->h2d, "h2d"}, {&rig->gather, "gather"},
                                {&rig->reduce, "reduce"}, {&rig->d2h, "d2h"}, {&rig->update, "update"}}) {
      STRATA_ASSIGN_OR_RETURN(*stream, d.create_stream(name));
    }
    STRATA_ASSIGN_OR_RETURN(rig->stream_trace, StreamTrace::create(d, rig->tracer));
    for (size_t g = 0; g < specs.size(); ++g) {
      STRATA_ASSIGN_OR_RETURN(GroupLayout layout, layout_group(specs[g], static_cast<int>(g), options.world_size));
      rig->layouts.push_back(std::move(layout));
    }
    PlanInputs inputs;
    inputs.options = &rig->options;
    inputs.layouts = rig->layouts;
    inputs.device_budget_bytes = d.memory_stats().budget_bytes;
    STRATA_ASSIGN_OR_RETURN(rig->plan, make_engine_plan(inputs));
    PinnedArenaOptions arena;
    const size_t host_bytes = rig->plan.pinned_bytes + rig->plan.host_bytes;
    arena.bytes = host_bytes + host_bytes / 32 + (size_t{4} << 20);
    arena.lock = false;
    arena.register_with_gpu = false;
    STRATA_ASSIGN_OR_RETURN(rig->arena, PinnedArena::create(arena));
    if (!options.nvme_path.empty()) {
      NvmeStoreOptions store;
      store.nvme_path = options.nvme_path;
      store.initial_bytes = rig->plan.nvme_bytes;
      store.checksums = options.nvme_checksum;
      store.io.max_request_bytes = std::max<size_t>(4096, options.nvme_block_bytes);
      store.io.kind = options.io_engine;
      store.io.faults = options.io_faults;
      STRATA_ASSIGN_OR_RETURN(rig->nvme, NvmeStore::open(store));
    }
    return rig;
  }
  ~StageRig() {
    if (device) (void)device->synchronize();
  }
};

// A stage test's base: a temporary directory (NVMe tiers) and the rig, destroyed after
// everything the derived fixture built from them.
class StageTest : public ::testing::Test {
 protected:
  strata::testing::TempDir dir_;
  std::unique_ptr<StageRig> rig_;
};

// fp32 values v[i] = scale * (i + 1) for a shard of n elements.
inline std::vector<float> ramp(size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * static_cast<float>(i + 1);
  return v;
}

}  // namespace strata::engine_internal
