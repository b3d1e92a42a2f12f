// The facade's own record per group (engine.h is the API). Internal to engine.cpp: the
// stages share no record; each owns its state and they meet at hand-offs (the gradient
// board, the version board, the shard store).
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

namespace strata::engine_internal {

// What the model thread keeps per group; each stage keeps its own per-group state
// (parameter copies: the shard store; gradient buffers: the gradient path; optimizer state:
// the optimizer stage; persistent gathered copies: the fetcher).
struct GroupState {
  GroupLayout layout;
  StreamTrace::Opened compute_trace;         // the current use's compute interval, opened by gather() (model thread)
};

}  // namespace strata::engine_internal
