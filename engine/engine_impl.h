// The records the engine's stages share (engine.h is the API). Internal to engine/.
//
// Threads per rank, each stage with its own queue (engine/stage_wait.h):
//   - the model's thread: calls the API (engine.cpp), enqueues compute, plans uses
//     (use_planner.h) and hands gradients to the gradient path;
//   - the parameter fetcher (param_fetcher.h): follows the planned uses ahead of compute,
//     NVMe -> pinned -> device -> all-gather into the gather-slot ring;
//   - the lander (gradient_path.h): waits for each gradient shard's device->host copy,
//     accumulates it in fp32 across micro-batches, takes its statistics, spills it to NVMe
//     when the optimizer state lives there;
//   - the optimizer stage (optimizer_stage.h): steps each group's shard (CPU Adam on host
//     state or on NVMe state streamed in chunks, or the device Adam) and writes the new
//     parameters through the shard store (shard_store.h), publishing their version.
// Device ordering goes through streams and events; host facts through each stage's own
// mutex, and errors reach every stage's next wait.
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
#include "engine/stream_trace.h"
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

  StreamTrace::Opened compute_trace;         // the current use's compute interval, opened by gather() (model thread)
};

}  // namespace strata::engine_internal
