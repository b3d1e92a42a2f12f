// What a machine profile records about the machine itself, read from /proc, /sys and
// the system's calls: the CPU, the memory, the lockable memory and the disk behind a path.
// None of it is measured; each probe says "unknown" where the system does not tell.
#pragma once

#include <string>

#include "engine/core/status.h"
#include "examples/profile/machine_profile.h"

namespace strata::profile {

// The host: name, CPU model, cores this process may use, the CPU Adam ISA, the memory
// (MemTotal, MemAvailable) and RLIMIT_MEMLOCK. `gpu` is left for the caller to fill.
StatusOr<HostInfo> probe_host();

// The file system and the block device under `path` (which must exist): statfs for the
// file system, st_dev through /sys/dev/block for the device, its model and whether it
// rotates, statvfs for the free bytes.
StatusOr<DiskInfo> probe_disk(const std::string& path);

// Now, as ISO 8601 in UTC ("2026-12-03T15:40:00Z").
std::string utc_now_iso8601();

}  // namespace strata::profile
