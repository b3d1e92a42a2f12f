// A replay of the step's schedule, group by group: the bound the stage sums cannot see,
// where the order of the work makes a resource wait, and each stage's time in flight
// when stages share the host's cores or the disk (docs/profile.md).
//
// One micro-batch uses the groups in the model's schedule; the first half of the uses are
// the forward, the rest the backward, and each use computes for its share (by parameter
// count) of the phase's predicted seconds. Each use's parameters are fetched (an NVMe read,
// then a host-to-device copy) once the use `prefetch_depth + 1` before it has released its
// slot; after a trainable group's last use in a micro-batch its gradient is cast, goes to
// the host and lands (and is spilled to NVMe); after the last micro-batch its update reads
// its state, steps Adam and writes its state and new parameters. A group's first use of a
// step waits for its update from the step before (exact overlap) or the one before that
// (delayed); with clipping or loss scaling the updates wait for the whole backward.
//
// Every piece of that work is a job on a lane that runs one job at a time, the ready job
// that became ready first (the engine's streams and queues): the parameter fetches' disk
// reads, the updates' disk reads, their disk writes (and the spilled gradients), the
// store's checksums, the copy to the device, the compute stream, the gradient cast, the
// copy to the host, the landing pass and CPU Adam (one lane, its executor, unless Adam runs
// on the device). The lanes run at once and share what they share:
// - the disk: its jobs share its time equally, with the gain of mixed traffic (from the
//   profile's mixed rate) while reads and writes both run (shared_lanes.h);
// - on the CPU device, the host's cores: compute, the cast and the landing want every core,
//   CPU Adam its threads, a copy one, the checksums the store's verifier threads; while
//   the jobs running want more cores than there are, each goes at cores / wanted of its
//   pace (the scheduler's fair share), which stretches each stage's time in flight.
// An update with its optimizer state on NVMe streams it through the state ring chunk by
// chunk (a read into a free slot, Adam, the write back; a slot is free once the chunk
// `state_ring_slots` before it is written), so its reads and writes overlap only where
// the ring has chunks of both in flight: within an update of more chunks than slots, or
// between updates that follow one another. With a checksum rate (the CPU device), a read is
// verified before its bytes are used, and a write is done once both the disk and its
// hashing are. Six steps are replayed; the step is the mean of the last two.
#pragma once

#include "engine/trace.h"
#include "examples/profile/step_cost.h"

namespace strata::profile {

struct ReplayRates {
  double disk_read_bytes_per_s = 0;   // 0: the step reads nothing from NVMe, or no rate
  double disk_write_bytes_per_s = 0;
  double disk_mixed_bytes_per_s = 0;  // reads and writes at once, both directions' bytes; 0: not measured
  double h2d_bytes_per_s = 0;
  double d2h_bytes_per_s = 0;
  double cast_bytes_per_s = 0;        // the gradients' cast before their copy to the host (0: not priced)
  double landing_bytes_per_s = 0;
  double adam_elements_per_s = 0;
  double forward_seconds = 0;         // the step's forward (all micro-batches)
  double backward_seconds = 0;        // its backward with recompute
  // The CPU device: the cores the host's work shares (compute, copies, cast, landing,
  // Adam, checksums); 0 on a GPU, where the device computes and copies.
  int host_cores = 0;
  int adam_threads = 1;               // CPU Adam's threads (its profile figure's)
  // The CPU device with checksums on: the store's XXH64 of every byte it reads or writes,
  // one thread's rate, on `checksum_threads` verifier threads; 0 = not priced.
  double checksum_bytes_per_s = 0;
  int checksum_threads = 2;
};

struct ReplayResult {
  double step_seconds = 0;  // the mean of the last two replayed steps; 0: no replay (below)
  // Per engine stage, the union of its jobs' intervals within the window of the two steps
  // before the last (replayed steps on both sides of it), per step, as the engine measures
  // busy_s.
  // Only the work replayed: not the collectives, nor new parameters uploaded to a GPU.
  StageSeconds in_flight{};
};

// No replay (step_seconds 0) when the work has no schedule, a use names no group, or a
// rate it needs is missing (the other bounds then stand alone).
ReplayResult replay_step(const StepWork& work, const PipelineShape& shape, const ReplayRates& rates);

}  // namespace strata::profile
