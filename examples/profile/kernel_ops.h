// The memory-bound ops `strata-bench kernels` times, and how many element accesses (reads
// plus writes, in the kernels' dtype) each is counted as per element of its count: the
// bytes behind the rate the machine profile keeps for it. The bench counts its work with
// this table and the cost model prices a model's declared ops (examples/lm/memory_bound_work.h)
// with it, so both mean the same bytes.
#pragma once

#include <optional>
#include <string_view>

#include "examples/profile/machine_profile.h"

namespace strata::profile {

// e.g. "gelu fwd" -> 2 (reads x, writes y), "swiglu bwd" -> 5; "residual add" (not timed
// by the bench) -> 3. nullopt for a name the table does not know.
std::optional<double> memory_op_accesses(std::string_view op);

// The profile's rate for `op` in bytes/s: the median over its measurements of that op (one
// per model shape the bench ran), else streaming_rate().
double memory_op_rate(const MachineProfile& profile, std::string_view op);

// A plain stream through memory the bench does not time (a residual add, a memset): on the
// CPU device the host copy rate (bytes copied per second), elsewhere the median over the
// memory-bound ops. The median of the CPU's ops mixes fast passes (the norms) with slow
// ones (GELU, the loss's exponentials) and is no streaming rate.
double streaming_rate(const MachineProfile& profile);

}  // namespace strata::profile
