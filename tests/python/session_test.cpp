// The session under the Python extension, driven from C++ as the front end drives it.
#include "python/src/session.h"

#include <gtest/gtest.h>

#include <bit>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tests/support/test_support.h"

namespace strata::python {
namespace {

std::string config_text(const std::string& nvme_path) {
  std::string text = R"({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
    "strata": {"device": "cpu", "device_budget_mib": 64, "pinned_budget_mib": 64})";
  if (!nvme_path.empty())
    text += R"(, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ")" + nvme_path +
            R"("}, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + nvme_path + R"("}})";
  return text + "}";
}

// bf16-exact values, none zero.
std::vector<float> bf16_values(size_t n, float base) {
  std::vector<float> values(n);
  for (size_t i = 0; i < n; ++i) values[i] = bf16_bits_to_float(float_to_bf16_bits(base + 0.37f * static_cast<float>(i + 1)));
  return values;
}

void expect_bits_equal(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i])) << "element " << i;
}

// An fp32 engine with a trainable group (id 0) and a frozen bf16 group (id 1) of odd shapes.
class SessionWithFrozenBf16Group : public ::testing::Test {
 protected:
  void SetUp() override {
    STRATA_ASSERT_OK_AND_ASSIGN(session_, Session::create(config_text(dir_.str()), "<test>"));
    ASSERT_EQ(session_->param_dtype(), DType::kFloat32);
    STRATA_ASSERT_OK_AND_ASSIGN(const int block, session_->register_group("block", {{"w", {3, 5}, true}, {"b", {5}, true}}, true, DType::kFloat32));
    STRATA_ASSERT_OK_AND_ASSIGN(const int base, session_->register_group("base", {{"x", {7, 3}, true}, {"y", {5}, true}}, false, DType::kBFloat16));
    ASSERT_EQ(block, 0);
    ASSERT_EQ(base, 1);
    STRATA_ASSERT_OK(session_->start());
    trainable_ = std::vector<float>(session_->layout(0).numel, 0.5f);
    frozen_ = bf16_values(session_->layout(1).numel, -3.0f);
    STRATA_ASSERT_OK(session_->write_group(0, trainable_));
    STRATA_ASSERT_OK(session_->write_group(1, frozen_));
    STRATA_ASSERT_OK(session_->refresh());
  }

  testing::TempDir dir_;
  std::unique_ptr<Session> session_;
  std::vector<float> trainable_, frozen_;
};

TEST_F(SessionWithFrozenBf16Group, ShowsTheFrozenGroupInItsElementsAndDtype) {
  const GroupLayout& base = session_->layout(1);
  ASSERT_EQ(base.tensors.size(), 2u);
  EXPECT_EQ(base.tensors[0].shape, (std::vector<int64_t>{7, 3}));
  EXPECT_EQ(base.tensors[1].shape, (std::vector<int64_t>{5}));
  EXPECT_EQ(base.tensors[0].numel, 21u);
  EXPECT_GE(base.tensors[1].offset, 21u);
  EXPECT_EQ(base.numel, base.tensors[1].offset + 5);
  EXPECT_EQ(base.padded_numel % 2, 0u);
  EXPECT_EQ(session_->group_dtype(1), DType::kBFloat16);
  EXPECT_EQ(session_->group_dtype(0), DType::kFloat32);
  EXPECT_EQ(session_->layout(0).tensors[0].shape, (std::vector<int64_t>{3, 5}));
}

TEST_F(SessionWithFrozenBf16Group, ReadsTheFrozenValuesBackBitForBitFromNvme) {
  std::vector<float> back(session_->layout(1).numel, 0.0f);
  STRATA_ASSERT_OK(session_->read_group(1, back));
  expect_bits_equal(back, frozen_);
}

TEST_F(SessionWithFrozenBf16Group, GathersTheFrozenGroupAsBf16Elements) {
  STRATA_ASSERT_OK(session_->begin_micro_batch());
  STRATA_ASSERT_OK_AND_ASSIGN(const Region region, session_->gather(1));
  const GroupLayout& base = session_->layout(1);
  EXPECT_EQ(region.dtype, DType::kBFloat16);
  EXPECT_EQ(region.numel, base.padded_numel);
  const auto* halves = static_cast<const uint16_t*>(region.data);
  for (const TensorLayout& t : base.tensors)
    for (size_t i = 0; i < t.numel; ++i)
      ASSERT_EQ(halves[t.offset + i], float_to_bf16_bits(frozen_[t.offset + i])) << t.name << " " << i;
  STRATA_ASSERT_OK(session_->release(1));
}

TEST_F(SessionWithFrozenBf16Group, StepsTheTrainableGroupAndLeavesTheFrozenOneAsItWas) {
  STRATA_ASSERT_OK(session_->begin_micro_batch());
  for (int g : {0, 1}) {
    STRATA_ASSERT_OK(session_->gather(g).status());
    STRATA_ASSERT_OK(session_->release(g));
  }
  const Status frozen_gradient = session_->gradient_buffer(1).status();
  EXPECT_EQ(frozen_gradient.code(), StatusCode::kFailedPrecondition) << frozen_gradient.to_string();
  STRATA_ASSERT_OK_AND_ASSIGN(const Region grads, session_->gradient_buffer(0));
  ASSERT_EQ(grads.dtype, DType::kFloat32);
  std::fill_n(static_cast<float*>(grads.data), session_->layout(0).numel, 1.0f);
  STRATA_ASSERT_OK(session_->grads_ready(0));
  STRATA_ASSERT_OK_AND_ASSIGN(const std::optional<StepReport> report, session_->end_micro_batch(1.0));
  ASSERT_TRUE(report.has_value());
  EXPECT_EQ(session_->steps_taken(), 1);

  std::vector<float> block(session_->layout(0).numel), base(session_->layout(1).numel);
  STRATA_ASSERT_OK(session_->read_group(0, block));
  STRATA_ASSERT_OK(session_->read_group(1, base));
  for (const float v : block) EXPECT_LT(v, 0.5f);  // a positive gradient moved every weight down
  expect_bits_equal(base, frozen_);
  STRATA_EXPECT_OK(session_->close());
}

TEST_F(SessionWithFrozenBf16Group, RefusesAWriteOfTheWrongSizeNamingTheGroup) {
  const Status status = session_->write_group(1, std::vector<float>(3, 0.0f));
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("base"), std::string::npos) << status.to_string();
}

TEST(Session, RefusesARegistrationAfterStart) {
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Session> session, Session::create(config_text(""), "<test>"));
  STRATA_ASSERT_OK(session->register_group("g", {{"w", {4}, true}}, true, DType::kFloat32).status());
  STRATA_ASSERT_OK(session->start());
  const Status status = session->register_group("late", {{"v", {4}, true}}, true, DType::kFloat32).status();
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("late"), std::string::npos) << status.to_string();
}

// The CPU device's caller computes on its own thread: a gather is ready when it returns,
// regions are host memory, and there is no stream to join.
TEST(Session, OnTheCpuDeviceRegionsAreHostMemoryAndNoStreamIsJoined) {
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Session> session, Session::create(config_text(""), "<test>"));
  STRATA_ASSERT_OK(session->register_group("g", {{"w", {4}, true}}, true, DType::kFloat32).status());
  STRATA_ASSERT_OK(session->start());
  EXPECT_EQ(session->device_kind(), DeviceKind::kCpu);
  const Status joined = session->use_caller_stream(0);
  EXPECT_EQ(joined.code(), StatusCode::kUnimplemented) << joined.to_string();
  STRATA_ASSERT_OK(session->write_group(0, std::vector<float>{1, 2, 3, 4}));
  STRATA_ASSERT_OK(session->refresh());
  STRATA_ASSERT_OK(session->begin_micro_batch());
  STRATA_ASSERT_OK_AND_ASSIGN(const Region gathered, session->gather(0));
  EXPECT_EQ(gathered.device, DeviceKind::kCpu);
  EXPECT_EQ(static_cast<const float*>(gathered.data)[2], 3.0f);  // ready on return, read on this thread
  STRATA_EXPECT_OK(session->release(0));
  STRATA_EXPECT_OK(session->close());
}

TEST(Session, RejectsATrainerOnlyKeyNamingIt) {
  const std::string text = R"({"train_micro_batch_size_per_gpu": 1, "strata": {"device": "cpu", "steps": 3}})";
  const auto session = Session::create(text, "<test>");
  ASSERT_FALSE(session.ok());
  EXPECT_NE(session.status().message().find("strata.steps"), std::string::npos) << session.status().to_string();
}

std::string placement_auto_config(const std::string& nvme_path, int device_budget_mib) {
  const char* source = std::getenv("STRATA_SOURCE_DIR");
  const std::string profile = std::string(source ? source : ".") + "/examples/profiles/h200-datasheet.json";
  return R"({"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "strata": {"device": "cpu", "device_budget_mib": )" + std::to_string(device_budget_mib) + R"(, "nvme_path": ")" + nvme_path +
         R"(", "placement": "auto", "profile": ")" + profile + R"("}})";
}

SessionWork dense_work(int64_t weights) {
  SessionWork work;
  work.flops.matmul_weights = weights;
  work.flops.attention_layers = 2;
  work.flops.attention_width = 64;
  work.seq_len = 128;
  return work;
}

TEST(SessionPlacementAuto, MakesTheEngineWithAChoiceWhosePlanFitsTheDeviceBudget) {
  testing::TempDir dir;
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Session> session, Session::create(placement_auto_config(dir.str(), 4), "<test>"));
  ASSERT_TRUE(session->placement_auto());
  // Six 576 KiB groups (above the persistence threshold): the 4 MiB device budget cannot
  // keep them all beside the gradient buffers, so the parameters go to a host tier or NVMe.
  for (int g = 0; g < 6; ++g)
    STRATA_ASSERT_OK(session->register_group("g" + std::to_string(g), {{"w", {384, 384}, true}}, true, DType::kFloat32).status());
  session->declare_work(dense_work(6 * 384 * 384));
  STRATA_ASSERT_OK(session->start());
  EXPECT_NE(session->placement_text().find("chosen: params "), std::string::npos) << session->placement_text();
  EXPECT_LE(session->plan().device_bytes, session->plan().device_budget_bytes);
  EXPECT_NE(session->plan().text.find("parameters: fp32 on "), std::string::npos);
  EXPECT_EQ(session->plan().text.find("parameters: fp32 on device"), std::string::npos) << session->plan().text;
  const std::vector<float> values(session->layout(0).numel, 0.25f);
  STRATA_ASSERT_OK(session->write_group(0, values));
  std::vector<float> back(values.size());
  STRATA_ASSERT_OK(session->read_group(0, back));
  expect_bits_equal(back, values);
  STRATA_EXPECT_OK(session->close());
}

TEST(SessionPlacementAuto, NeedsTheModelsWorkBeforeStart) {
  testing::TempDir dir;
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Session> session, Session::create(placement_auto_config(dir.str(), 64), "<test>"));
  STRATA_ASSERT_OK(session->register_group("g", {{"w", {4}, true}}, true, DType::kFloat32).status());
  const Status status = session->start();
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("strata.placement"), std::string::npos) << status.to_string();
}

// What rank 0 hands the other ranks: the decided fields survive the trip, and a message
// that lacks one or names no tier is refused, naming the field.
TEST(SessionPlacementAuto, APlacementCrossesToTheOtherRanksAsJsonAndAWrongOneIsNamed) {
  profile::Placement p;
  p.params = Tier::kNvme;
  p.optimizer = Tier::kPinned;
  p.prefetch_depth = 4;
  p.overlap = OverlapMode::kDelayed;
  STRATA_ASSERT_OK_AND_ASSIGN(const profile::Placement back, session_placement_from_json(session_placement_json(p)));
  EXPECT_EQ(back.params, Tier::kNvme);
  EXPECT_EQ(back.optimizer, Tier::kPinned);
  EXPECT_EQ(back.prefetch_depth, 4);
  EXPECT_EQ(back.overlap, OverlapMode::kDelayed);

  nlohmann::json wrong = session_placement_json(p);
  wrong["optimizer"] = "tape";
  EXPECT_NE(session_placement_from_json(wrong).status().message().find("\"optimizer\" is 'tape'"), std::string::npos);
  wrong = session_placement_json(p);
  wrong.erase("prefetch_depth");
  EXPECT_NE(session_placement_from_json(wrong).status().message().find("prefetch_depth"), std::string::npos);
  EXPECT_FALSE(session_placement_from_json(nlohmann::json::array()).ok());
}

}  // namespace
}  // namespace strata::python
