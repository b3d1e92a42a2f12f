#include "examples/profile/host_probe.h"

#include <sched.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "optim/cpu_isa.h"

namespace strata::profile {

namespace {

// The first line of a small text file, without its newline; "" when it cannot be read.
std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  while (!line.empty() && (line.back() == ' ' || line.back() == '\n')) line.pop_back();
  return line;
}

// The value after "key:" on the first line of `path` that starts with `key`.
std::string keyed_value(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key, 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const size_t begin = line.find_first_not_of(" \t", colon + 1);
    return begin == std::string::npos ? "" : line.substr(begin);
  }
  return "";
}

// A /proc/meminfo field ("MemTotal", "MemAvailable") in bytes; 0 when absent.
uint64_t meminfo_bytes(const std::string& key) {
  const std::string value = keyed_value("/proc/meminfo", key + ":");
  return value.empty() ? 0 : std::stoull(value) * 1024;  // "12345 kB"
}

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

std::string filesystem_name(const struct statfs& fs) {
  switch (static_cast<unsigned long>(fs.f_type)) {
    case 0xEF53: return "ext4";  // ext2/3/4 share the magic
    case 0x58465342: return "xfs";
    case 0x9123683E: return "btrfs";
    case 0x01021994: return "tmpfs";
    case 0x794C7630: return "overlay";
    case 0xF2F52010: return "f2fs";
    case 0x2FC12FC1: return "zfs";
    case 0x6969: return "nfs";
    case 0x65735546: return "fuse";
    default: break;
  }
  char hex[32];
  std::snprintf(hex, sizeof(hex), "0x%lx", static_cast<unsigned long>(fs.f_type));
  return std::string("unknown (statfs type ") + hex + ")";
}

}  // namespace

StatusOr<HostInfo> probe_host() {
  HostInfo h;
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return Status::FromErrno(errno, "gethostname");
  h.hostname = name;
  h.cpu_model = keyed_value("/proc/cpuinfo", "model name");
  if (h.cpu_model.empty()) h.cpu_model = "unknown";
  h.cores = usable_cores();
  h.isa = std::string(cpu_isa_name(best_cpu_isa()));
  h.avx512_bf16 = cpu_features().avx512_bf16;
  h.gpu = "none";
  h.memory_total_bytes = meminfo_bytes("MemTotal");
  h.memory_available_bytes = meminfo_bytes("MemAvailable");
  if (h.memory_total_bytes == 0) return NotFoundError("/proc/meminfo gives no MemTotal");
  struct rlimit limit {};
  if (::getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return Status::FromErrno(errno, "getrlimit(RLIMIT_MEMLOCK)");
  if (limit.rlim_cur != RLIM_INFINITY) h.memlock_limit_bytes = static_cast<uint64_t>(limit.rlim_cur);
  return h;
}

StatusOr<DiskInfo> probe_disk(const std::string& path) {
  DiskInfo d;
  d.path = std::filesystem::absolute(path).lexically_normal().string();
  struct statfs fs {};
  if (::statfs(path.c_str(), &fs) != 0) return Status::FromErrno(errno, "statfs of '" + path + "'");
  d.filesystem = filesystem_name(fs);
  struct statvfs vfs {};
  if (::statvfs(path.c_str(), &vfs) != 0) return Status::FromErrno(errno, "statvfs of '" + path + "'");
  d.free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return Status::FromErrno(errno, "stat of '" + path + "'");
  d.model = "unknown";
  if (major(st.st_dev) == 0) {
    d.block_device = "none (a file system without a block device)";
    return d;
  }
  // /sys/dev/block/M:m links to .../block/<disk>[/<partition>]; a partition's drive is its parent.
  const std::string sys = "/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" + std::to_string(minor(st.st_dev));
  std::error_code error;
  const std::filesystem::path resolved = std::filesystem::canonical(sys, error);
  if (error) {
    d.block_device = "unknown (" + sys + ": " + error.message() + ")";
    return d;
  }
  d.block_device = resolved.filename().string();
  const bool partition = std::filesystem::exists(resolved / "partition", error);
  const std::filesystem::path drive = partition ? resolved.parent_path() : resolved;
  if (std::string model = first_line((drive / "device" / "model").string()); !model.empty()) d.model = model;
  if (std::string rotational = first_line((drive / "queue" / "rotational").string()); !rotational.empty()) {
    d.rotational = rotational == "1";
  }
  return d;
}

std::string utc_now_iso8601() {
  const std::time_t now = std::time(nullptr);
  std::tm utc {};
  gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

}  // namespace strata::profile
