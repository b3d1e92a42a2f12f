// Slurm's compressed lists (host names and tasks per node), as srun sets them in
// SLURM_JOB_NODELIST and SLURM_TASKS_PER_NODE; engine/core/launch_env.h reads them.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "engine/core/status.h"

namespace strata {

// Slurm's compressed host lists, in order: "node[01-04],gpu7" -> node01 node02 node03
// node04 gpu7 (zero padding kept; several brackets in one name expand left to right,
// "r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2). An error names the text and what is wrong.
StatusOr<std::vector<std::string>> expand_slurm_nodelist(std::string_view nodelist);
// Slurm's tasks-per-node lists: "2(x3),1" -> 2 2 2 1.
StatusOr<std::vector<int>> expand_slurm_tasks_per_node(std::string_view tasks_per_node);

}  // namespace strata
