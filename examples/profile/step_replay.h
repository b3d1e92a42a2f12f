// A replay of the step's schedule, group by group: the bound the stage sums cannot see,
// where the order of the work makes a resource wait (docs/profile.md).
//
// One micro-batch uses the groups in the model's schedule; the first half of the uses are
// the forward, the rest the backward, and each use computes for its share (by parameter
// count) of the phase's predicted seconds. Each use's parameters are fetched (an NVMe read,
// then a host-to-device copy) once the use `prefetch_depth + 1` before it has released its
// slot; after a trainable group's last use in a micro-batch its gradient goes to the host
// and lands (and is spilled to NVMe); after the last micro-batch its update reads its
// state, steps Adam and writes its state and new parameters. A group's first use of a step
// waits for its update from the step before (exact overlap) or the one before that
// (delayed); with clipping or loss scaling the updates wait for the whole backward. The
// disk, the copy to the device, the compute stream, the gradients' copy to the host and
// CPU Adam's executor (the landing pass, and Adam unless it runs on the device) each take
// one job at a time (on the CPU device, compute, copies, landing and Adam are one worker:
// the host's cores), a job starting in the first idle gap after it is ready; the compute
// stream keeps its order. The fetches' NVMe reads go one after another and share the disk
// with the updates' traffic (its queue serves both at once, a few requests of each deep): a
// fetch runs at half speed while an update's transfer is under way instead of waiting for
// the whole update (the disk's total time is bounded apart). An update that reads and
// writes its state keeps the disk busy both ways at once (the state ring reads the next
// chunks while the last are written): its bytes go at the mixed rate where measured. With
// a checksum rate (the CPU device), a read is verified on the cores before its bytes are
// used, and a write's checksums are computed on the cores while the disk writes it.
// Four steps are replayed; the result is the last step's length.
#pragma once

#include "examples/profile/step_cost.h"

namespace strata::profile {

struct ReplayRates {
  double disk_read_bytes_per_s = 0;   // 0: the step reads nothing from NVMe, or no rate
  double disk_write_bytes_per_s = 0;
  double disk_mixed_bytes_per_s = 0;  // reads and writes at once, both directions' bytes; 0: not measured
  double h2d_bytes_per_s = 0;
  double d2h_bytes_per_s = 0;
  double landing_bytes_per_s = 0;
  double adam_elements_per_s = 0;
  double forward_seconds = 0;         // the step's forward (all micro-batches)
  double backward_seconds = 0;        // its backward with recompute
  bool shared_host_cores = false;     // the CPU device: compute, copies, landing and Adam take turns on the host's cores
  // The CPU device with checksums on: the store's XXH64 of every byte it reads or writes
  // (one thread's rate) is host work too, taking its turn on the cores; 0 = not priced.
  double checksum_bytes_per_s = 0;
};

// The replayed step's seconds; 0 when the work has no schedule, a use names no group, or a
// rate it needs is missing (the other bounds then stand alone).
double replay_step_seconds(const StepWork& work, const PipelineShape& shape, const ReplayRates& rates);

}  // namespace strata::profile
