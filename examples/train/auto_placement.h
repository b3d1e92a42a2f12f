// --placement auto for the trainer: the search of examples/profile/placement_search.h over
// parameter and optimizer tiers (device, cpu, and nvme when --nvme-path is given), prefetch
// depth 0, 1, 2 or 4, the micro-batch sizes that keep the batch per rank (micro-batch x
// gradient accumulation), activation checkpointing off, device or pinned, and optimizer
// overlap exact or delayed (only the configured one when strata.optimizer_overlap was given,
// or with fp16 loss scaling). Each candidate is rank 0's plan (examples/train/plan_preview.h),
// checked against the device and pinned budgets and the host's memory (with the model's
// pinned block inputs) and against the free space under nvme_path (read, never created), and
// predicted with the run's machine profile, which auto needs.
#pragma once

#include "examples/profile/placement_search.h"
#include "examples/train/trainer.h"

namespace strata::train {

StatusOr<profile::PlacementChoice> choose_placement(const TrainerOptions& options);

// The placement written into the options: the config's tiers, prefetch depth, batch split
// and overlap, and the trainer's activation checkpointing.
void apply_placement(const profile::Placement& placement, TrainerOptions& options);

}  // namespace strata::train
