// A model that computes on its own thread rather than in compute_stream() order (the
// Python front end on the CPU device): it waits for each gathered group with
// wait_gathered() and takes its gradient buffers unwritten (GradientStart::kUnwritten,
// on the CPU device with one rank the landing buffers themselves), writing every element
// itself. It must train the same bits as the same model that synchronizes the compute
// stream after each gather and takes zeroed buffers, in every parameter tier (the direct
// view of device parameters, gather slots, NVMe), in both overlap modes and with
// micro-batches.
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/local_cluster.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

constexpr int kGroups = 3;
constexpr int kSteps = 4;

// Three groups of two tensors each, of sizes that leave padding.
std::vector<GroupSpec> host_model_groups() {
  std::vector<GroupSpec> groups;
  for (int g = 0; g < kGroups; ++g) {
    const int64_t rows = 5 + 3 * g;
    groups.push_back(GroupSpec{"block" + std::to_string(g),
                               {{"weight", {rows, 7}, TensorInit::normal(0.5f)}, {"bias", {rows}, TensorInit::normal(0.1f), false}}});
  }
  return groups;
}

// How the model waits for its gathers and takes its gradient buffers.
enum class HostWaits { kWholeStream, kPerGroup };

struct HostRunSpec {
  Tier param_tier = Tier::kPinned;
  OverlapMode overlap = OverlapMode::kExact;
  HostWaits waits = HostWaits::kWholeStream;
  int prefetch_depth = EngineOptions::kAutoDepth;
  int micro_batches = 1;
};

EngineOptions host_options(const HostRunSpec& spec, const std::string& nvme_path) {
  EngineOptions options;
  options.param_dtype = DType::kFloat32;
  options.grad_wire_dtype = DType::kFloat32;
  options.grad_transfer_dtype = DType::kFloat32;
  options.param_tier = spec.param_tier;
  options.optimizer_tier = Tier::kPinned;
  options.overlap = spec.overlap;
  options.adam.lr = 1e-2;
  options.adam.weight_decay = 0.01;
  options.seed = 7;
  options.optimizer_threads = 1;
  options.nvme_path = nvme_path;
  options.prefetch_depth = spec.prefetch_depth;
  options.gradient_accumulation_steps = spec.micro_batches;
  return options;
}

// The gradient of 0.5 * sum((w - target)^2) over the group's real elements, written by
// this thread into every element of the buffer (padding: zero).
void write_gradient(const GroupLayout& layout, const float* params, float* grads, float target) {
  std::vector<char> covered(layout.padded_numel, 0);
  for (const TensorLayout& t : layout.tensors)
    for (size_t i = t.offset; i < t.offset + t.numel; ++i) {
      grads[i] = params[i] - target;
      covered[i] = 1;
    }
  for (size_t i = 0; i < layout.padded_numel; ++i)
    if (!covered[i]) grads[i] = 0.0f;
}

// One micro-batch: a forward that keeps what the host read, a backward that gathers again
// and writes each group's gradient.
Status host_micro_batch(Engine& engine, float target, HostWaits waits) {
  std::vector<std::vector<float>> seen(kGroups);
  for (int g = 0; g < kGroups; ++g) {  // forward: keep what the host read
    STRATA_ASSIGN_OR_RETURN(const GroupView view, engine.gather(g));
    if (waits == HostWaits::kPerGroup) STRATA_RETURN_IF_ERROR(engine.wait_gathered(g));
    else STRATA_RETURN_IF_ERROR(engine.compute_stream().synchronize());
    const float* params = static_cast<const float*>(view.flat);
    seen[static_cast<size_t>(g)].assign(params, params + engine.layout(g).padded_numel);
    STRATA_RETURN_IF_ERROR(engine.release(g));
  }
  for (int g = kGroups - 1; g >= 0; --g) {  // backward: gather again, write the gradient
    STRATA_ASSIGN_OR_RETURN(const GroupView view, engine.gather(g));
    GroupView grads;
    if (waits == HostWaits::kPerGroup) {
      STRATA_RETURN_IF_ERROR(engine.wait_gathered(g));
      STRATA_ASSIGN_OR_RETURN(grads, engine.gradient_buffer(g, GradientStart::kUnwritten));
    } else {
      STRATA_RETURN_IF_ERROR(engine.compute_stream().synchronize());
      STRATA_ASSIGN_OR_RETURN(grads, engine.gradient_buffer(g));
      STRATA_RETURN_IF_ERROR(engine.compute_stream().synchronize());
    }
    const float* params = static_cast<const float*>(view.flat);
    if (std::memcmp(params, seen[static_cast<size_t>(g)].data(), seen[static_cast<size_t>(g)].size() * sizeof(float)) != 0)
      return InternalError("group " + std::to_string(g) + " gathered other values in backward than in forward");
    write_gradient(engine.layout(g), params, static_cast<float*>(grads.flat), target);
    STRATA_RETURN_IF_ERROR(engine.release(g));
    STRATA_RETURN_IF_ERROR(engine.grads_ready(g));
  }
  return {};
}

Status host_step(Engine& engine, int64_t step, const HostRunSpec& spec) {
  STRATA_RETURN_IF_ERROR(engine.begin_step(1e-2));
  for (int micro = 0; micro < spec.micro_batches; ++micro) {
    if (micro > 0) STRATA_RETURN_IF_ERROR(engine.begin_micro_batch());
    STRATA_RETURN_IF_ERROR(host_micro_batch(engine, static_cast<float>(step) + 0.5f * static_cast<float>(micro), spec.waits));
  }
  return engine.step(0.0).status();
}

// The masters of every group after kSteps steps.
StatusOr<std::vector<std::vector<float>>> train_on_host(const HostRunSpec& spec) {
  testing::TempDir dir;
  LocalClusterOptions cluster_options;
  cluster_options.device_budget_bytes = size_t{64} << 20;
  cluster_options.compute_threads = 1;
  STRATA_ASSIGN_OR_RETURN(auto cluster, LocalCluster::create(cluster_options));
  STRATA_ASSIGN_OR_RETURN(auto engine, Engine::create(host_options(spec, dir.str()), cluster->device(0), cluster->gather_communicator(0),
                                                      cluster->reduce_communicator(0)));
  for (const GroupSpec& group : host_model_groups()) STRATA_RETURN_IF_ERROR(engine->register_group(group).status());
  STRATA_RETURN_IF_ERROR(engine->start());
  for (int64_t step = 0; step < kSteps; ++step) STRATA_RETURN_IF_ERROR(host_step(*engine, step, spec));
  STRATA_RETURN_IF_ERROR(engine->finish());
  std::vector<std::vector<float>> masters;
  for (int g = 0; g < kGroups; ++g) {
    masters.emplace_back(engine->layout(g).shard_numel);
    STRATA_RETURN_IF_ERROR(engine->read_state_shard(g, Engine::StateKind::kMaster, masters.back()));
  }
  return masters;
}

bool same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t g = 0; g < a.size(); ++g)
    if (a[g].size() != b[g].size() || std::memcmp(a[g].data(), b[g].data(), a[g].size() * sizeof(float)) != 0) return false;
  return true;
}

struct HostCase {
  const char* name;
  Tier param_tier;
  OverlapMode overlap;
  int prefetch_depth;
  int micro_batches;
};

class HostModelTiers : public ::testing::TestWithParam<HostCase> {};

TEST_P(HostModelTiers, WaitingPerGroupWithUnwrittenBuffersTrainsTheSameBitsAsWholeStreamWaits) {
  const HostCase& c = GetParam();
  HostRunSpec spec{c.param_tier, c.overlap, HostWaits::kWholeStream, c.prefetch_depth, c.micro_batches};
  STRATA_ASSERT_OK_AND_ASSIGN(const auto stream_waits, train_on_host(spec));
  spec.waits = HostWaits::kPerGroup;
  STRATA_ASSERT_OK_AND_ASSIGN(const auto group_waits, train_on_host(spec));
  EXPECT_TRUE(same_bits(group_waits, stream_waits));
  // The model moved the weights: the comparison is not of two untouched initial states.
  EXPECT_NE(group_waits[0][0], 0.0f);
}

INSTANTIATE_TEST_SUITE_P(Tiers, HostModelTiers,
                         ::testing::Values(HostCase{"DeviceDirectView", Tier::kDevice, OverlapMode::kExact, EngineOptions::kAutoDepth, 1},
                                           HostCase{"DeviceDelayed", Tier::kDevice, OverlapMode::kDelayed, EngineOptions::kAutoDepth, 1},
                                           HostCase{"DeviceMicroBatches", Tier::kDevice, OverlapMode::kExact, EngineOptions::kAutoDepth, 3},
                                           HostCase{"PinnedSlots", Tier::kPinned, OverlapMode::kExact, 1, 1},
                                           HostCase{"PinnedDelayedMicroBatches", Tier::kPinned, OverlapMode::kDelayed, EngineOptions::kAutoDepth, 2},
                                           HostCase{"Nvme", Tier::kNvme, OverlapMode::kExact, 2, 1}),
                         [](const ::testing::TestParamInfo<HostCase>& info) { return std::string(info.param.name); });

TEST(HostModelTest, WaitGatheredOfAGroupThatIsNotGatheredIsRefused) {
  testing::TempDir dir;
  LocalClusterOptions cluster_options;
  cluster_options.device_budget_bytes = size_t{64} << 20;
  cluster_options.compute_threads = 1;
  STRATA_ASSERT_OK_AND_ASSIGN(auto cluster, LocalCluster::create(cluster_options));
  STRATA_ASSERT_OK_AND_ASSIGN(auto engine, Engine::create(host_options({}, dir.str()), cluster->device(0), cluster->gather_communicator(0),
                                                          cluster->reduce_communicator(0)));
  for (const GroupSpec& group : host_model_groups()) STRATA_ASSERT_OK(engine->register_group(group).status());
  STRATA_ASSERT_OK(engine->start());
  STRATA_ASSERT_OK(engine->begin_step());
  EXPECT_EQ(engine->wait_gathered(0).code(), StatusCode::kFailedPrecondition);
  STRATA_ASSERT_OK(engine->gather(0).status());
  STRATA_ASSERT_OK(engine->wait_gathered(0));
  STRATA_ASSERT_OK(engine->release(0));
  EXPECT_EQ(engine->wait_gathered(0).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine->wait_gathered(kGroups).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata
