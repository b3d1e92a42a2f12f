// The engine's implementation (engine.h is the API). Internal to engine/.
//
// Threads per rank:
//   - the model's thread: calls the API, enqueues compute, gathers, gradient reductions;
//   - the fetcher: follows the schedule ahead of compute, moving each upcoming group's
//     shard NVMe -> pinned -> device and all-gathering it into a gather slot;
//   - the lander: waits for each gradient shard's device->host copy, accumulates it in
//     fp32 across micro-batches and takes its sum of squares and inf/NaN flag;
//   - the optimizer stage (engine/optimizer_stage.h, its own queue and worker): steps
//     each group's shard (CPU Adam, state in pinned memory or streamed from NVMe in
//     chunks) and writes the new parameters where the next fetch reads them.
// The model thread, fetcher and lander coordinate through the engine's mutex and
// condition variable (host-side facts: which event was recorded for which use, which
// parameter version a group holds); the optimizer stage reports through hooks; device
// ordering goes through streams and events. The plan is engine/engine_plan.h.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "offload/nvme_store.h"
#include "offload/pinned_arena.h"
#include "optim/cpu_adam.h"

namespace strata::engine_internal {

// Per group state of this rank.
struct GroupState {
  GroupLayout layout;
  bool persistent = false;           // stays gathered on the device

  // Parameter shard copies (parameter dtype): one, or two in delayed mode (indexed by
  // version parity).
  std::vector<DeviceBuffer> param_device;  // param_tier == kDevice
  std::vector<PinnedBuffer> param_host;    // kPinned / kHost
  std::vector<NvmeExtent> param_nvme;      // kNvme

  // Optimizer state (fp32), allocated by the optimizer stage: host buffers, or device
  // memory (NVMe-resident state lives in the stage's NvmeAdamState).
  PinnedBuffer master, exp_avg, exp_avg_sq;  // kPinned / kHost
  DeviceBuffer state_device;         // kDevice: master, exp_avg, exp_avg_sq, gradient accumulator (4 x shard fp32)

  // Gradient shards on the host when they are not spilled to NVMe: the landing buffer
  // (transfer dtype) and the fp32 accumulator (micro-batches > 1); two each in delayed
  // mode (by step parity).
  std::vector<PinnedBuffer> grad_landing;
  std::vector<PinnedBuffer> grad_accum;

  // Persistent groups: the gathered copy, and the event marking the end of its last use.
  DeviceBuffer persistent_full;
  DeviceBuffer persistent_shard;     // device staging shard (world > 1 with host or NVMe parameters)
  PinnedBuffer persistent_stage;     // NVMe read staging
  std::unique_ptr<Event> persistent_ready;
  std::unique_ptr<Event> persistent_released;
  std::unique_ptr<Event> persistent_h2d_done;

  std::vector<DecayRun> decay_runs;

  TraceClock::time_point compute_begin;      // start of the current use's compute (compute stream thread)
};

// Enqueues `work` on `stream` with its execution interval traced: host callbacks on the
// same stream stamp when the stream reaches the work and when it has finished it.
inline Status traced(Tracer& tracer, Stream& stream, Stage stage, int group, std::string label, const std::function<Status()>& work) {
  auto begin = std::make_shared<TraceClock::time_point>();
  STRATA_RETURN_IF_ERROR(stream.enqueue_host([begin] {
    *begin = TraceClock::now();
    return Status();
  }));
  STRATA_RETURN_IF_ERROR(work());
  return stream.enqueue_host([&tracer, begin, stage, group, label = std::move(label)]() mutable {
    tracer.record(stage, group, *begin, TraceClock::now(), std::move(label));
    return Status();
  });
}

}  // namespace strata::engine_internal
