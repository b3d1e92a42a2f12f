// Faults injected into the I/O engine (IoEngineOptions::faults) under a training engine
// whose parameters and optimizer state live on NVMe, and under the checkpoint saver.
//
// Engine: an EIO or ENOSPC at a chosen read or write of the NVMe swap file ends the run
// with an error that names the file and the operation, on every rank, in bounded time;
// faults the I/O engine must absorb (short transfers, a few -EAGAIN, a slow disk) leave
// the weights bit-identical to a clean run.
//
// Checkpoints: a fault at each of the saver's writes in turn fails that save naming the
// rank file (or, when absorbed, the save commits and verifies); the previous checkpoint
// stays, latest_complete() picks it, and a run resumed from it ends with the straight
// run's weights, bit for bit.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/checkpoint.h"
#include "engine/engine.h"
#include "engine/local_cluster.h"
#include "examples/models/linear_stack.h"
#include "offload/io_engine.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

using testing::contains;

models::LinearStackConfig tiny_model() {
  models::LinearStackConfig model;
  model.features = 24;
  model.width = 40;
  model.layers = 3;
  model.global_rows = 8;
  return model;
}

// One training run: steps [first_step, end_step) on `world` ranks, optionally resumed
// from a checkpoint and saving after chosen steps (waiting for each save, so its outcome
// belongs to its step).
struct RunSpec {
  int world = 1;
  Tier param_tier = Tier::kNvme;
  Tier optimizer_tier = Tier::kNvme;
  int first_step = 0;
  int end_step = 4;
  IoEngineKind io_engine = IoEngineKind::kAuto;
  std::shared_ptr<IoFaultInjector> engine_faults;  // into every rank's NVMe store
  const CheckpointReader* resume = nullptr;
  CheckpointSaver* saver = nullptr;
  std::vector<int> save_after;  // steps (1-based counts) after which to save
};

struct RunResult {
  Status status;                              // the first failure of any rank
  std::vector<Status> save_status;            // per entry of save_after
  std::vector<std::vector<float>> masters;    // per group, the full flat fp32 master
};

RunResult train(const RunSpec& spec, const std::string& work_dir) {
  RunResult result;
  LocalClusterOptions cluster_options;
  cluster_options.world_size = spec.world;
  cluster_options.device_budget_bytes = size_t{256} << 20;
  cluster_options.compute_threads = 1;
  cluster_options.collective_timeout = std::chrono::seconds(60);
  auto cluster = LocalCluster::create(cluster_options);
  if (!cluster.ok()) {
    result.status = cluster.status();
    return result;
  }
  const models::LinearStackConfig model_config = tiny_model();
  const auto specs = models::linear_stack_groups(model_config);
  for (size_t g = 0; g < specs.size(); ++g) result.masters.emplace_back(layout_group(specs[g], static_cast<int>(g), 1)->numel);
  result.save_status.resize(spec.save_after.size());
  std::mutex mutex;
  result.status = (*cluster)->run([&](int rank) -> Status {
    EngineOptions options;
    options.rank = rank;
    options.world_size = spec.world;
    options.param_dtype = DType::kFloat32;
    options.grad_wire_dtype = DType::kFloat32;
    options.grad_transfer_dtype = DType::kFloat32;
    options.param_tier = spec.param_tier;
    options.optimizer_tier = spec.optimizer_tier;
    options.nvme_path = work_dir + "/nvme";
    options.io_faults = spec.engine_faults;
    options.io_engine = spec.io_engine;
    options.adam.lr = 1e-2;
    options.adam.weight_decay = 0.01;
    options.gradient_clipping = 1.0f;
    options.seed = 99;
    options.optimizer_threads = 1;
    options.activation_bytes = models::linear_stack_activation_bytes(model_config, model_config.global_rows / spec.world,
                                                                     options.param_dtype);
    STRATA_ASSIGN_OR_RETURN(auto engine, Engine::create(options, (*cluster)->device(rank), (*cluster)->gather_communicator(rank),
                                                        (*cluster)->reduce_communicator(rank)));
    STRATA_ASSIGN_OR_RETURN(auto model, models::LinearStackModel::create(*engine, model_config, rank, spec.world, true));
    STRATA_RETURN_IF_ERROR(engine->start());
    STRATA_RETURN_IF_ERROR(model->allocate());
    if (spec.resume != nullptr) STRATA_RETURN_IF_ERROR(load_engine_state(*engine, rank, *spec.resume));
    for (int step = spec.first_step; step < spec.end_step; ++step) {
      STRATA_RETURN_IF_ERROR(model->train_step(step, 1, 1e-2).status());
      for (size_t i = 0; i < spec.save_after.size(); ++i) {
        if (spec.save_after[i] != step + 1) continue;
        STRATA_ASSIGN_OR_RETURN(RankSnapshot snapshot, snapshot_engine_state(*engine, rank));
        STRATA_RETURN_IF_ERROR(spec.saver->submit(step + 1, std::move(snapshot)));
        if (rank == 0) {
          STRATA_RETURN_IF_ERROR(spec.saver->submit_trainer_state(step + 1, "{\"next_step\": " + std::to_string(step + 1) + "}"));
          result.save_status[i] = spec.saver->wait();
        }
      }
    }
    STRATA_RETURN_IF_ERROR(engine->finish());
    std::vector<float> shard;
    for (int g = 0; g < engine->group_count(); ++g) {
      const GroupLayout& layout = engine->layout(g);
      shard.resize(layout.shard_numel);
      STRATA_RETURN_IF_ERROR(engine->read_state_shard(g, Engine::StateKind::kMaster, shard));
      std::lock_guard<std::mutex> lock(mutex);
      for (size_t i = 0; i < layout.shard_numel && layout.shard_begin(rank) + i < layout.numel; ++i) {
        result.masters[static_cast<size_t>(g)][layout.shard_begin(rank) + i] = shard[i];
      }
    }
    return Status::Ok();
  });
  return result;
}

// train(), failing the test instead of hanging: a run that has not ended after `limit`
// aborts the test program (a hang has no other way out of a test).
RunResult train_within(const RunSpec& spec, const std::string& work_dir, std::chrono::seconds limit) {
  auto run = std::async(std::launch::async, [&] { return train(spec, work_dir); });
  if (run.wait_for(limit) != std::future_status::ready) {
    ADD_FAILURE() << "the run did not end within " << limit.count() << " s: a hang";
    std::fflush(nullptr);
    std::abort();
  }
  return run.get();
}

void expect_same_masters(const RunResult& got, const RunResult& expected, const std::string& what) {
  ASSERT_EQ(got.masters.size(), expected.masters.size());
  for (size_t g = 0; g < got.masters.size(); ++g) {
    EXPECT_EQ(std::memcmp(got.masters[g].data(), expected.masters[g].data(), got.masters[g].size() * sizeof(float)), 0)
        << what << ": group " << g << " differs from the clean run";
  }
}

IoFaultRule rule_for(std::optional<IoOp> op, std::string file, IoFaultAction action, int error_number, uint64_t first) {
  IoFaultRule rule;
  rule.match.op = op;
  rule.match.file_contains = std::move(file);
  rule.match.first = first;
  rule.action = action;
  rule.error_number = error_number;
  return rule;
}

// How many transfers a clean run makes on rank 0's swap file: reads, writes.
std::pair<uint64_t, uint64_t> count_swap_transfers(const RunSpec& base, const std::string& work_dir) {
  constexpr uint64_t kNever = ~uint64_t{0};
  auto counter = std::make_shared<IoFaultInjector>(std::vector<IoFaultRule>{
      rule_for(IoOp::kRead, "strata-rank0.swap", IoFaultAction::kFail, EIO, kNever),
      rule_for(IoOp::kWrite, "strata-rank0.swap", IoFaultAction::kFail, EIO, kNever)});
  RunSpec spec = base;
  spec.engine_faults = counter;
  const RunResult run = train(spec, work_dir);
  EXPECT_TRUE(run.status.ok()) << run.status.to_string();
  return {counter->matched(0), counter->matched(1)};
}

// ---------------------------------------------------------------------------------------
// Engine level
// ---------------------------------------------------------------------------------------

struct EngineFault {
  std::string name;
  IoOp op;
  IoFaultAction action;
  int error_number;
};

class EngineFaultTest : public ::testing::TestWithParam<IoEngineKind> {};

// The clean run of `base` on the test's I/O engine; skips where io_uring is refused.
#define TRAIN_CLEAN_OR_SKIP(clean, base, work_dir)                                                   \
  const RunResult clean = train(base, work_dir);                                                     \
  if (clean.status.code() == StatusCode::kUnavailable) GTEST_SKIP() << clean.status.to_string();     \
  STRATA_ASSERT_OK(clean.status)

// Every failing fault, at the first, a middle and the last read or write of rank 0's swap
// file of a 2-rank run with parameters and optimizer state on NVMe.
TEST_P(EngineFaultTest, AFailedNvmeTransferEndsTheRunNamingTheFileAndTheOperation) {
  testing::TempDir dir;
  RunSpec base;
  base.world = 2;
  base.io_engine = GetParam();
  TRAIN_CLEAN_OR_SKIP(clean, base, dir.str() + "/clean");
  const auto [reads, writes] = count_swap_transfers(base, dir.str() + "/count");
  ASSERT_GT(reads, 2u);
  ASSERT_GT(writes, 2u);
  int case_index = 0;
  for (const EngineFault& fault : {EngineFault{"read EIO", IoOp::kRead, IoFaultAction::kFail, EIO},
                                   EngineFault{"write EIO", IoOp::kWrite, IoFaultAction::kFail, EIO},
                                   EngineFault{"write ENOSPC", IoOp::kWrite, IoFaultAction::kFail, ENOSPC},
                                   EngineFault{"read ENOSPC", IoOp::kRead, IoFaultAction::kFail, ENOSPC}}) {
    const uint64_t total = fault.op == IoOp::kRead ? reads : writes;
    for (uint64_t ordinal : {uint64_t{1}, total / 2, total}) {
      SCOPED_TRACE(fault.name + " at transfer " + std::to_string(ordinal) + " of " + std::to_string(total));
      auto injector = std::make_shared<IoFaultInjector>(
          std::vector<IoFaultRule>{rule_for(fault.op, "strata-rank0.swap", fault.action, fault.error_number, ordinal)});
      RunSpec spec = base;
      spec.engine_faults = injector;
      const std::string work_dir = dir.str() + "/case-" + std::to_string(case_index++);
      const RunResult run = train_within(spec, work_dir, std::chrono::seconds(120));
      ASSERT_EQ(injector->injected().size(), 1u);
      ASSERT_FALSE(run.status.ok()) << "the injected fault went unnoticed";
      const std::string text = run.status.to_string();
      const std::string file = work_dir + "/nvme/strata-rank0.swap";
      EXPECT_TRUE(contains(text, (fault.op == IoOp::kRead ? "read of " : "write of "))) << text;
      EXPECT_TRUE(contains(text, (fault.op == IoOp::kRead ? " from " : " to ") + file + ": " + std::strerror(fault.error_number)))
          << text;
      EXPECT_TRUE(contains(text, std::string("nvme store: ") + (fault.op == IoOp::kRead ? "read" : "write") + " of extent '"))
          << text;
    }
  }
}

// Faults a disk may give that the I/O engine must absorb: the weights are the clean
// run's, bit for bit.
TEST_P(EngineFaultTest, ShortTransfersEagainAndASlowDiskLeaveTheWeightsBitIdentical) {
  testing::TempDir dir;
  RunSpec base;
  base.world = 2;
  base.io_engine = GetParam();
  TRAIN_CLEAN_OR_SKIP(clean, base, dir.str() + "/clean");
  IoFaultRule short_all = rule_for(std::nullopt, ".swap", IoFaultAction::kShort, 0, 1);
  short_all.match.count = 0;
  IoFaultRule slow = rule_for(std::nullopt, ".swap", IoFaultAction::kDelay, 0, 1);
  slow.match.count = 20;
  slow.delay = std::chrono::milliseconds(5);
  // -EAGAIN on every third transfer: a retry is the next transfer, so none sees two in a row.
  IoFaultRule every_third = rule_for(std::nullopt, ".swap", IoFaultAction::kFail, EAGAIN, 3);
  every_third.match.count = 0;
  every_third.match.every = 3;
  struct Case {
    std::string name;
    std::vector<IoFaultRule> rules;
  };
  int case_index = 0;
  for (const Case& c : {Case{"every transfer short", {short_all}}, Case{"EAGAIN on every third transfer", {every_third}},
                        Case{"20 slow transfers", {slow}}}) {
    SCOPED_TRACE(c.name);
    auto injector = std::make_shared<IoFaultInjector>(c.rules);
    RunSpec spec = base;
    spec.engine_faults = injector;
    const RunResult run = train_within(spec, dir.str() + "/absorb-" + std::to_string(case_index++), std::chrono::seconds(120));
    STRATA_ASSERT_OK(run.status);
    EXPECT_GT(injector->injected().size(), 0u);
    expect_same_masters(run, clean, c.name);
  }
}

INSTANTIATE_TEST_SUITE_P(Engines, EngineFaultTest, ::testing::Values(IoEngineKind::kIoUring, IoEngineKind::kPsync),
                         [](const ::testing::TestParamInfo<IoEngineKind>& info) {
                           return std::string(io_engine_kind_name(info.param));
                         });

// ---------------------------------------------------------------------------------------
// Checkpoint level
// ---------------------------------------------------------------------------------------

struct SaveFault {
  std::string name;
  IoFaultAction action;
  int error_number;
  bool absorbed;  // the save must commit anyway
};

// A checkpoint of step 2 is made once; each case copies it, resumes from it and saves
// step 3 with a fault on one of that save's writes. EIO hits each write in turn; ENOSPC
// and a short write hit the first, a middle and the last. A failing save is reported
// naming the rank file and the operation, leaves no trace, and latest_complete() picks
// step 2; an absorbed fault commits step 3, which verifies. Either way a run resumed from
// the newest checkpoint ends at the straight run's weights, bit for bit.
TEST(CheckpointFaultTest, EachSaveWriteFailingKeepsThePreviousCheckpointAndResumesExactly) {
  testing::TempDir dir;
  RunSpec straight;
  straight.world = 1;
  straight.param_tier = Tier::kPinned;
  straight.optimizer_tier = Tier::kNvme;
  const RunResult reference = train(straight, dir.str() + "/straight");
  STRATA_ASSERT_OK(reference.status);

  // Small requests: several writes per rank file. The first run also counts the writes
  // of a save (a rule that never fires).
  CheckpointSaverOptions saver_base;
  saver_base.world_size = 1;
  saver_base.io.max_request_bytes = 4096;
  const std::string step2_dir = dir.str() + "/base/ckpt";
  uint64_t save_writes = 0;
  {
    auto counter = std::make_shared<IoFaultInjector>(
        std::vector<IoFaultRule>{rule_for(IoOp::kWrite, ".tmp-step-2/", IoFaultAction::kFail, EIO, ~uint64_t{0})});
    CheckpointSaverOptions options = saver_base;
    options.directory = step2_dir;
    options.io.faults = counter;
    STRATA_ASSERT_OK_AND_ASSIGN(auto saver, CheckpointSaver::create(options));
    RunSpec spec = straight;
    spec.end_step = 2;
    spec.saver = saver.get();
    spec.save_after = {2};
    const RunResult run = train(spec, dir.str() + "/base");
    STRATA_ASSERT_OK(run.status);
    STRATA_ASSERT_OK(run.save_status[0]);
    STRATA_ASSERT_OK(saver->finish());
    save_writes = counter->matched(0);
  }
  ASSERT_GE(save_writes, 3u);

  std::vector<std::pair<SaveFault, uint64_t>> cases;
  for (uint64_t ordinal = 1; ordinal <= save_writes; ++ordinal) cases.push_back({{"EIO", IoFaultAction::kFail, EIO, false}, ordinal});
  for (uint64_t ordinal : {uint64_t{1}, (save_writes + 1) / 2, save_writes}) {
    cases.push_back({{"ENOSPC", IoFaultAction::kFail, ENOSPC, false}, ordinal});
    cases.push_back({{"short write", IoFaultAction::kShort, 0, true}, ordinal});
  }
  int case_index = 0;
  for (const auto& [fault, ordinal] : cases) {
    SCOPED_TRACE(fault.name + " at save write " + std::to_string(ordinal) + " of " + std::to_string(save_writes));
    const std::string work_dir = dir.str() + "/case-" + std::to_string(case_index++);
    const std::string save_dir = work_dir + "/ckpt";
    fs::create_directories(work_dir);
    fs::copy(step2_dir, save_dir, fs::copy_options::recursive);
    STRATA_ASSERT_OK_AND_ASSIGN(auto step2, CheckpointReader::open(checkpoint_path(save_dir, 2)));

    IoFaultRule rule = rule_for(IoOp::kWrite, ".tmp-step-3/", fault.action, fault.error_number, ordinal);
    rule.short_bytes = 1024;  // the saver's requests here are 4 KiB; a buffered file takes any length
    auto injector = std::make_shared<IoFaultInjector>(std::vector<IoFaultRule>{rule});
    CheckpointSaverOptions options = saver_base;
    options.directory = save_dir;
    options.direct_io = fault.action != IoFaultAction::kShort;  // O_DIRECT cannot move 1 KiB
    options.io.faults = injector;
    // One attempt: the error the fault gives is what this test reads (the saver's retry,
    // which would commit step 3 on its second try, is checkpoint_test's).
    options.save_attempts = 1;
    STRATA_ASSERT_OK_AND_ASSIGN(auto saver, CheckpointSaver::create(options));
    RunSpec saving = straight;
    saving.first_step = 2;
    saving.end_step = 3;
    saving.resume = step2.get();
    saving.saver = saver.get();
    saving.save_after = {3};
    const RunResult run = train_within(saving, work_dir, std::chrono::seconds(120));
    STRATA_ASSERT_OK(run.status);  // the save's failure is the saver's to report
    STRATA_ASSERT_OK(saver->finish());
    ASSERT_EQ(injector->injected().size(), 1u);
    const Status& faulted = run.save_status[0];
    if (fault.absorbed) {
      STRATA_ASSERT_OK(faulted);
    } else {
      ASSERT_FALSE(faulted.ok());
      const std::string text = faulted.to_string();
      EXPECT_TRUE(contains(text, "write of ")) << text;
      EXPECT_TRUE(contains(text, " to " + save_dir + "/.tmp-step-3/rank-0-of-1.bin: " + std::strerror(fault.error_number)))
          << text;
      EXPECT_TRUE(contains(text, "checkpoint step 3 in " + save_dir + " was not saved")) << text;
      EXPECT_FALSE(fs::exists(save_dir + "/.tmp-step-3"));
      EXPECT_FALSE(fs::exists(save_dir + "/step-3"));
    }
    STRATA_ASSERT_OK_AND_ASSIGN(CheckpointRef latest, latest_complete(save_dir));
    EXPECT_EQ(latest.step, fault.absorbed ? 3 : 2);
    STRATA_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::open(latest.path));
    STRATA_ASSERT_OK(reader->verify());
    RunSpec resumed = straight;
    resumed.first_step = static_cast<int>(latest.step);
    resumed.resume = reader.get();
    const RunResult finished = train_within(resumed, work_dir + "/resumed", std::chrono::seconds(120));
    STRATA_ASSERT_OK(finished.status);
    expect_same_masters(finished, reference, "resumed from step " + std::to_string(latest.step));
  }
}

}  // namespace
}  // namespace strata
