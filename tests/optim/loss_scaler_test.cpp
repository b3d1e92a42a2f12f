// The dynamic loss scaler: growth after a clean window, backoff after `hysteresis`
// overflows, the floor, static scaling and checkpoint state.
#include "optim/loss_scaler.h"

#include <gtest/gtest.h>

#include "tests/support/test_support.h"

namespace strata {
namespace {

TEST(LossScalerTest, GrowsAfterACleanWindowAndBacksOffAfterHysteresis) {
  STRATA_ASSERT_OK_AND_ASSIGN(LossScaler scaler, LossScaler::create({.initial_scale = 1024.0f, .growth_interval = 3, .hysteresis = 2}));
  EXPECT_EQ(scaler.scale(), 1024.0f);
  EXPECT_EQ(scaler.inverse_scale(), 1.0f / 1024.0f);
  EXPECT_FALSE(scaler.update(false));
  EXPECT_FALSE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 1024.0f);
  EXPECT_FALSE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 2048.0f);
  // The first overflow is tolerated (hysteresis 2) but still skips the step.
  EXPECT_TRUE(scaler.update(true));
  EXPECT_EQ(scaler.scale(), 2048.0f);
  EXPECT_TRUE(scaler.update(true));
  EXPECT_EQ(scaler.scale(), 1024.0f);
  EXPECT_EQ(scaler.skipped_steps(), 2u);
}

TEST(LossScalerTest, NeverDropsBelowTheFloorAndStaticScalingStaysPut) {
  STRATA_ASSERT_OK_AND_ASSIGN(LossScaler dynamic, LossScaler::create({.initial_scale = 4.0f, .hysteresis = 1, .min_scale = 2.0f}));
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(dynamic.update(true));
  EXPECT_EQ(dynamic.scale(), 2.0f);
  STRATA_ASSERT_OK_AND_ASSIGN(LossScaler fixed, LossScaler::create({.initial_scale = 128.0f, .growth_interval = 1, .dynamic = false}));
  EXPECT_TRUE(fixed.update(true));
  EXPECT_FALSE(fixed.update(false));
  EXPECT_EQ(fixed.scale(), 128.0f);
}

TEST(LossScalerTest, StateRoundTripsThroughACheckpoint) {
  STRATA_ASSERT_OK_AND_ASSIGN(LossScaler a, LossScaler::create({.initial_scale = 256.0f, .growth_interval = 2, .hysteresis = 3}));
  EXPECT_FALSE(a.update(false));
  EXPECT_TRUE(a.update(true));
  STRATA_ASSERT_OK_AND_ASSIGN(LossScaler b, LossScaler::create({.initial_scale = 1.0f, .growth_interval = 2, .hysteresis = 3}));
  b.restore(a.state());
  for (bool overflow : {false, true, true, false, false, false}) EXPECT_EQ(a.update(overflow), b.update(overflow));
  EXPECT_EQ(a.scale(), b.scale());
  EXPECT_EQ(a.skipped_steps(), b.skipped_steps());
}

TEST(LossScalerTest, RejectsBadOptionsWithReasons) {
  EXPECT_FALSE(LossScaler::create({.initial_scale = 0.0f}).ok());
  EXPECT_FALSE(LossScaler::create({.growth_factor = 0.5f}).ok());
  EXPECT_FALSE(LossScaler::create({.backoff_factor = 1.0f}).ok());
  auto window = LossScaler::create({.growth_interval = 0});
  ASSERT_FALSE(window.ok());
  EXPECT_NE(window.status().message().find("growth interval"), std::string::npos);
  EXPECT_FALSE(LossScaler::create({.hysteresis = 0}).ok());
}

}  // namespace
}  // namespace strata
