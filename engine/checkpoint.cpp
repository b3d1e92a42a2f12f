#include "engine/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <type_traits>
#include <utility>

#include <nlohmann/json.hpp>

#include "engine/core/check.h"
#include "engine/core/json_depth.h"
#include "engine/core/log.h"
#include "engine/engine_plan.h"
#include "engine/core/thread.h"
#include "offload/checksum.h"

namespace strata {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr std::string_view kFormatName = "strata-checkpoint";
constexpr int kFormatVersion = 1;            // master, exp_avg, exp_avg_sq per group
constexpr int kFormatVersionStale = 2;       // and the stale parameters (delayed overlap mode)
constexpr int kStaleKinds = kCheckpointStateKinds + 1;
constexpr size_t kDirectIoAlignment = 4096;
constexpr std::string_view kManifestName = "manifest.json";
// A manifest nests 6 levels (manifest, files, file, segments, segment, checksums); deeper
// is damage, refused before parsing (dumping it for its checksum recurses per level).
constexpr size_t kManifestDepth = 6;
constexpr size_t kMaxManifestDepth = 8;
constexpr std::string_view kTrainerStateName = "trainer_state.json";
constexpr std::string_view kTmpPrefix = ".tmp-";

constexpr std::array<CheckpointStateKind, kCheckpointStateKinds> kAllKinds = {
    CheckpointStateKind::kMaster, CheckpointStateKind::kExpAvg, CheckpointStateKind::kExpAvgSq};
// Segment s of a group in a rank file, for either layout.
constexpr std::array<CheckpointStateKind, kStaleKinds> kSegmentKinds = {
    CheckpointStateKind::kMaster, CheckpointStateKind::kExpAvg, CheckpointStateKind::kExpAvgSq, CheckpointStateKind::kStaleParams};

std::string hex64(uint64_t value) {
  char text[20];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(value));
  return text;
}

bool parse_hex64(const std::string& text, uint64_t* value) {
  if (text.empty() || text.size() > 16) return false;
  uint64_t result = 0;
  for (char c : text) {
    int digit;
    if (c >= '0' && c <= '9') digit = c - '0';
    else if (c >= 'a' && c <= 'f') digit = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') digit = c - 'A' + 10;
    else return false;
    result = (result << 4) | static_cast<uint64_t>(digit);
  }
  *value = result;
  return true;
}

std::string rank_file_name(int rank, int world_size) {
  return "rank-" + std::to_string(rank) + "-of-" + std::to_string(world_size) + ".bin";
}

// The chunk checksums of `bytes` bytes at `data`.
std::vector<uint64_t> chunk_checksums(const void* data, size_t bytes, size_t chunk_bytes) {
  std::vector<uint64_t> sums;
  const auto* cursor = static_cast<const unsigned char*>(data);
  for (size_t done = 0; done < bytes; done += chunk_bytes) {
    sums.push_back(xxhash64(cursor + done, std::min(chunk_bytes, bytes - done)));
  }
  return sums;
}

// Opens `path` with `flags`, with O_DIRECT when `direct` and the file system takes it at
// 4 KiB (a file system that wants more alignment gets buffered I/O). *direct is set to what
// was used.
StatusOr<File> open_maybe_direct(const std::string& path, int flags, bool* direct) {
  STRATA_ASSIGN_OR_RETURN(File file, File::open(path, {.flags = flags,
                                                       .direct_io = *direct ? FileDirectIo::kPreferred : FileDirectIo::kOff,
                                                       .max_direct_alignment = kDirectIoAlignment}));
  if (*direct && !file.direct_io()) {
    STRATA_LOG_ONCE(kWarn) << "checkpoint: the file system under '" << fs::path(path).parent_path().string()
                           << "' refuses O_DIRECT at " << kDirectIoAlignment << " bytes; using buffered I/O for checkpoint files";
  }
  *direct = file.direct_io();
  return file;
}

// Writes `data` to a new file at `path` (buffered) and fsyncs it.
Status write_file_durably(const std::string& path, std::string_view data) {
  STRATA_ASSIGN_OR_RETURN(File file, File::open(path, {.flags = O_WRONLY | O_CREAT | O_TRUNC}));
  STRATA_RETURN_IF_ERROR(file.write_all(data.data(), data.size()));
  return file.sync();
}

StatusOr<std::string> read_small_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int error = errno;
    if (error == ENOENT) return NotFoundError(path + " does not exist");
    return Status::FromErrno(error != 0 ? error : EIO, "open(" + path + ")");
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return IoError("reading " + path + " failed");
  return text.str();
}

// "step-<N>" -> N, or -1.
int64_t parse_step_name(std::string_view name) {
  constexpr std::string_view kPrefix = "step-";
  if (name.size() <= kPrefix.size() || name.substr(0, kPrefix.size()) != kPrefix) return -1;
  int64_t step = 0;
  for (char c : name.substr(kPrefix.size())) {
    if (c < '0' || c > '9') return -1;
    if (step > (INT64_MAX - 9) / 10) return -1;
    step = step * 10 + (c - '0');
  }
  return step;
}

// The manifest's checksum: XXH64 of its canonical text without the checksum field.
uint64_t manifest_checksum(json manifest) {
  manifest.erase("manifest_checksum");
  const std::string text = manifest.dump();
  return xxhash64(text.data(), text.size());
}

json group_to_json(const GroupLayout& layout) {
  json tensors = json::array();
  for (const TensorLayout& tensor : layout.tensors) {
    tensors.push_back({{"name", tensor.name}, {"shape", tensor.shape}, {"offset", tensor.offset}, {"numel", tensor.numel}});
  }
  json group = {{"id", layout.id},
                {"name", layout.name},
                {"numel", layout.numel},
                {"shard_numel", layout.shard_numel},
                {"tensors", std::move(tensors)}};
  // Only where true, so manifests without frozen groups stay as they were.
  if (!layout.trainable) group["frozen"] = true;
  return group;
}

// Same groups (names, sizes, tensors) and world size.
Status check_same_layouts(const std::vector<GroupLayout>& expected, const std::vector<GroupLayout>& got, int rank) {
  if (expected.size() != got.size()) {
    return InvalidArgumentError("rank " + std::to_string(rank) + " has " + std::to_string(got.size()) +
                                " groups, another rank of the same save has " + std::to_string(expected.size()));
  }
  for (size_t g = 0; g < expected.size(); ++g) {
    const GroupLayout& a = expected[g];
    const GroupLayout& b = got[g];
    if (a.name != b.name || a.numel != b.numel || a.shard_numel != b.shard_numel || a.world_size != b.world_size ||
        a.tensors.size() != b.tensors.size() || a.trainable != b.trainable) {
      return InvalidArgumentError("rank " + std::to_string(rank) + "'s group " + std::to_string(g) + " ('" + b.name + "', " +
                                  std::to_string(b.numel) + " elements, shard " + std::to_string(b.shard_numel) +
                                  (b.trainable ? "" : ", frozen") + ") differs from another rank's ('" + a.name + "', " +
                                  std::to_string(a.numel) + " elements, shard " + std::to_string(a.shard_numel) +
                                  (a.trainable ? "" : ", frozen") + ")");
    }
  }
  return Status::Ok();
}

}  // namespace

std::string_view checkpoint_state_kind_name(CheckpointStateKind kind) {
  switch (kind) {
    case CheckpointStateKind::kMaster: return "master";
    case CheckpointStateKind::kExpAvg: return "exp_avg";
    case CheckpointStateKind::kExpAvgSq: return "exp_avg_sq";
    case CheckpointStateKind::kStaleParams: return "stale_params";
  }
  return "?";
}

std::string checkpoint_dir_name(int64_t step) { return "step-" + std::to_string(step); }
std::string checkpoint_path(const std::string& save_dir, int64_t step) {
  return (fs::path(save_dir) / checkpoint_dir_name(step)).string();
}

// ---------------------------------------------------------------------------------------
// RankSnapshot
// ---------------------------------------------------------------------------------------

StatusOr<RankSnapshot> RankSnapshot::allocate(std::vector<GroupLayout> layouts, int rank, int64_t engine_steps,
                                               StaleParameters stale) {
  if (layouts.empty()) return InvalidArgumentError("checkpoint snapshot: no groups");
  const int kinds = stale == StaleParameters::kPresent ? kStaleKinds : kCheckpointStateKinds;
  const int world_size = layouts.front().world_size;
  if (rank < 0 || rank >= world_size) {
    return InvalidArgumentError("checkpoint snapshot: rank " + std::to_string(rank) + " is outside world size " +
                                std::to_string(world_size));
  }
  RankSnapshot snapshot;
  for (size_t g = 0; g < layouts.size(); ++g) {
    const GroupLayout& layout = layouts[g];
    if (layout.id != static_cast<int>(g)) {
      return InvalidArgumentError("checkpoint snapshot: group '" + layout.name + "' has id " + std::to_string(layout.id) +
                                  " at index " + std::to_string(g) + " (groups must be in id order)");
    }
    if (layout.world_size != world_size) {
      return InvalidArgumentError("checkpoint snapshot: group '" + layout.name + "' is laid out for " +
                                  std::to_string(layout.world_size) + " ranks, group 0 for " + std::to_string(world_size));
    }
    if (layout.shard_numel == 0 || (layout.shard_numel * sizeof(float)) % kDirectIoAlignment != 0) {
      return InvalidArgumentError("checkpoint snapshot: group '" + layout.name + "' has shard_numel " +
                                  std::to_string(layout.shard_numel) + ", not a positive multiple of 1024 elements");
    }
    if (!layout.trainable) {  // a frozen group has no state to save
      snapshot.blocks_.emplace_back();
      continue;
    }
    const size_t bytes = static_cast<size_t>(kinds) * layout.shard_numel * sizeof(float);
    StatusOr<AlignedBuffer> block = AlignedBuffer::allocate(bytes, kDirectIoAlignment);
    if (!block.ok()) {
      return std::move(block).status().with_context("checkpoint snapshot: cannot allocate " + std::to_string(bytes) +
                                                    " bytes for group '" + layout.name + "'");
    }
    std::memset(block->data(), 0, bytes);
    snapshot.blocks_.push_back(std::move(block).value());
  }
  snapshot.layouts_ = std::move(layouts);
  snapshot.kinds_ = kinds;
  snapshot.rank_ = rank;
  snapshot.engine_steps_ = engine_steps;
  return snapshot;
}

std::span<float> RankSnapshot::shard(int group, CheckpointStateKind kind) {
  if (static_cast<int>(kind) >= kinds_ || !layouts_[static_cast<size_t>(group)].trainable) return {};
  const size_t shard = layouts_[static_cast<size_t>(group)].shard_numel;
  return {blocks_[static_cast<size_t>(group)].as<float>() + static_cast<size_t>(kind) * shard, shard};
}

std::span<const float> RankSnapshot::shard(int group, CheckpointStateKind kind) const {
  if (static_cast<int>(kind) >= kinds_ || !layouts_[static_cast<size_t>(group)].trainable) return {};
  const size_t shard = layouts_[static_cast<size_t>(group)].shard_numel;
  return {blocks_[static_cast<size_t>(group)].as<float>() + static_cast<size_t>(kind) * shard, shard};
}

std::span<const float> RankSnapshot::group_block(int group) const {
  if (!layouts_[static_cast<size_t>(group)].trainable) return {};
  const size_t shard = layouts_[static_cast<size_t>(group)].shard_numel;
  return {blocks_[static_cast<size_t>(group)].as<float>(), static_cast<size_t>(kinds_) * shard};
}

size_t RankSnapshot::bytes() const {
  size_t total = 0;
  for (const GroupLayout& layout : layouts_)
    if (layout.trainable) total += static_cast<size_t>(kinds_) * layout.shard_numel * sizeof(float);
  return total;
}

// ---------------------------------------------------------------------------------------
// CheckpointSaver
// ---------------------------------------------------------------------------------------

namespace {

struct SegmentRecord {
  int group = 0;
  CheckpointStateKind kind = CheckpointStateKind::kMaster;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  std::vector<uint64_t> checksums;
};

struct FileRecord {
  std::string name;
  int rank = -1;  // -1: the trainer state
  uint64_t bytes = 0;
  std::vector<SegmentRecord> segments;
};

json file_to_json(const FileRecord& file) {
  json segments = json::array();
  for (const SegmentRecord& segment : file.segments) {
    json sums = json::array();
    for (uint64_t sum : segment.checksums) sums.push_back(hex64(sum));
    json entry = {{"offset", segment.offset}, {"bytes", segment.bytes}, {"checksums", std::move(sums)}};
    if (file.rank >= 0) {
      entry["group"] = segment.group;
      entry["state"] = std::string(checkpoint_state_kind_name(segment.kind));
    }
    segments.push_back(std::move(entry));
  }
  json entry = {{"name", file.name}, {"bytes", file.bytes}, {"segments", std::move(segments)}};
  if (file.rank >= 0) entry["rank"] = file.rank;
  return entry;
}

struct SaveJob {
  int64_t step = 0;
  // Arrived snapshots, kept until the save commits or fails for good (a retry rewrites them).
  std::vector<std::optional<RankSnapshot>> snapshots;
  std::vector<bool> arrived;
  std::vector<bool> written;  // this attempt's rank file is written (or was skipped after a failure)
  int arrived_count = 0;
  int written_count = 0;
  std::optional<std::string> trainer_state;
  std::vector<GroupLayout> layouts;  // from the first snapshot
  int64_t engine_steps = 0;
  bool stale_parameters = false;                 // from the first snapshot
  std::optional<LossScaler::State> loss_scaler;  // from the first snapshot
  std::vector<FileRecord> rank_files;  // indexed by rank
  std::vector<std::optional<json>> peer_files;  // process ranks: other processes' files, as their manifest entries
  Status status;                       // the first failure
  // Writer-thread only:
  std::string tmp_dir;
  bool tmp_created = false;
};

}  // namespace

class CheckpointSaver::Impl {
 public:
  explicit Impl(CheckpointSaverOptions options) : options_(std::move(options)) {}
  ~Impl() {
    Status status = finish();
    if (!status.ok()) STRATA_LOG(kError) << "checkpoint saver: an error nobody collected: " << status.to_string();
  }

  Status start() {
    std::error_code error;
    fs::create_directories(options_.directory, error);
    if (error) {
      return FailedPreconditionError("checkpoint: cannot create the save directory '" + options_.directory +
                                     "': " + error.message());
    }
    if (!fs::is_directory(options_.directory, error)) {
      return InvalidArgumentError("checkpoint: save directory '" + options_.directory + "' is not a directory");
    }
    STRATA_RETURN_IF_ERROR(probe_writable());
    if (commits()) {  // process ranks: the processes of one run share D; the committer locks it
      STRATA_RETURN_IF_ERROR(lock_directory());
      STRATA_RETURN_IF_ERROR(check_free_space());
    }
    STRATA_ASSIGN_OR_RETURN(io_, IoEngine::create(options_.io));
    STRATA_ASSIGN_OR_RETURN(thread_, spawn_thread("strata:ckpt", [this] { run(); }));
    return Status::Ok();
  }

  const std::string& directory() const { return options_.directory; }

  Status submit(int64_t step, RankSnapshot snapshot) {
    const int rank = snapshot.rank();
    const std::string what = "checkpoint step " + std::to_string(step) + ", rank " + std::to_string(rank);
    if (step < 0) return InvalidArgumentError(what + ": the step is negative");
    if (snapshot.world_size() != options_.world_size) {
      return InvalidArgumentError(what + ": the snapshot is laid out for " + std::to_string(snapshot.world_size()) +
                                  " ranks, the saver expects " + std::to_string(options_.world_size));
    }
    if (!is_local(rank))
      return InvalidArgumentError(what + ": this saver writes ranks " + std::to_string(options_.first_rank) + ".." +
                                  std::to_string(options_.first_rank + local_count() - 1) + " only");
    std::unique_lock<std::mutex> lock(mutex_);
    SaveJob* job = nullptr;
    STRATA_ASSIGN_OR_RETURN(job, job_for_locked(lock, step, what));
    if (job->arrived[static_cast<size_t>(rank)]) return InvalidArgumentError(what + ": this rank already submitted");
    if (job->arrived_count == 0) {
      job->layouts = snapshot.layouts();
      job->engine_steps = snapshot.engine_steps();
      job->stale_parameters = snapshot.has_stale_parameters();
      job->loss_scaler = snapshot.loss_scaler();
    } else {
      STRATA_RETURN_IF_ERROR_CTX(check_same_layouts(job->layouts, snapshot.layouts(), rank), what);
      if (snapshot.engine_steps() != job->engine_steps) {
        return InvalidArgumentError(what + ": engine step count " + std::to_string(snapshot.engine_steps()) +
                                    " differs from another rank's " + std::to_string(job->engine_steps));
      }
      if (snapshot.has_stale_parameters() != job->stale_parameters) {
        return InvalidArgumentError(what + std::string(": the snapshot ") + (job->stale_parameters ? "lacks" : "has") +
                                    " stale parameters and another rank's " + (job->stale_parameters ? "has" : "lacks") +
                                    " them (all ranks must run in the same overlap mode)");
      }
    }
    job->arrived[static_cast<size_t>(rank)] = true;
    ++job->arrived_count;
    job->snapshots[static_cast<size_t>(rank)] = std::move(snapshot);
    work_cv_.notify_all();
    return Status::Ok();
  }

  Status submit_trainer_state(int64_t step, std::string text) {
    const std::string what = "checkpoint step " + std::to_string(step) + ": trainer state";
    if (!json::accept(text)) return InvalidArgumentError(what + " is not valid JSON: '" + text.substr(0, 120) + "'");
    std::unique_lock<std::mutex> lock(mutex_);
    SaveJob* job = nullptr;
    STRATA_ASSIGN_OR_RETURN(job, job_for_locked(lock, step, what));
    if (job->trainer_state) return InvalidArgumentError(what + " was already submitted");
    job->trainer_state = std::move(text);
    work_cv_.notify_all();
    return Status::Ok();
  }

  Status poll() {
    std::lock_guard<std::mutex> lock(mutex_);
    return take_errors_locked();
  }

  Status wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, [&] { return jobs_.empty(); });
    return take_errors_locked();
  }

  Status finish() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closing_ = true;
      work_cv_.notify_all();
    }
    if (thread_.joinable()) thread_.join();
    std::lock_guard<std::mutex> lock(mutex_);
    return take_errors_locked();
  }

  int64_t last_committed_step() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return last_committed_;
  }

  StatusOr<std::string> local_files(int64_t step) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, [&] { return local_done_.count(step) != 0 || stopped_; });
    const auto found = local_done_.find(step);
    if (found == local_done_.end())
      return FailedPreconditionError("checkpoint step " + std::to_string(step) + ": the saver finished before this process's files were written");
    std::string text = std::move(found->second);
    local_done_.erase(found);
    return text;
  }

  Status add_peer_files(int64_t step, const std::vector<std::string>& texts) {
    const std::string what = "checkpoint step " + std::to_string(step) + ": the other processes' files";
    if (!commits()) return FailedPreconditionError(what + " go to the saver holding rank 0");
    std::unique_lock<std::mutex> lock(mutex_);
    SaveJob* job = nullptr;
    STRATA_ASSIGN_OR_RETURN(job, job_for_locked(lock, step, what));
    for (const std::string& text : texts) {
      const json parsed = json::parse(text, nullptr, /*allow_exceptions=*/false);
      if (parsed.is_object() && parsed.contains("error")) {
        if (job->status.ok()) job->status = IoError(what + ": a process failed to write its rank files: " + parsed["error"].dump());
        continue;
      }
      if (!parsed.is_object() || !parsed.contains("files") || !parsed["files"].is_array())
        return DataLossError(what + ": a record that is not the saver's JSON: " + text.substr(0, 200));
      for (const json& file : parsed["files"]) {
        const int rank = file.value("rank", -1);
        if (is_local(rank)) continue;  // this saver's own
        if (rank < 0 || rank >= options_.world_size || job->written[static_cast<size_t>(rank)] ||
            file.value("name", std::string()) != rank_file_name(rank, options_.world_size))
          return DataLossError(what + ": an unexpected file record " + file.dump().substr(0, 200));
        job->peer_files[static_cast<size_t>(rank)] = file;
        job->written[static_cast<size_t>(rank)] = true;
        ++job->written_count;
      }
    }
    work_cv_.notify_all();
    return Status::Ok();
  }
  uint64_t bytes_written() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return bytes_written_;
  }

 private:
  // The job for `step`, creating it (and blocking while max_pending_saves are unfinished).
  StatusOr<SaveJob*> job_for_locked(std::unique_lock<std::mutex>& lock, int64_t step, const std::string& what) {
    auto find = [&]() -> SaveJob* {
      for (auto& job : jobs_) {
        if (job->step == step) return job.get();
      }
      return nullptr;
    };
    if (closing_) return FailedPreconditionError(what + ": the saver has finished");
    if (SaveJob* existing = find()) return existing;
    // Another rank may create the job while this one waits for room.
    const size_t limit = static_cast<size_t>(std::max(1, options_.max_pending_saves));
    done_cv_.wait(lock, [&] { return jobs_.size() < limit || closing_ || find() != nullptr; });
    if (closing_) return FailedPreconditionError(what + ": the saver has finished");
    if (SaveJob* existing = find()) return existing;
    auto job = std::make_unique<SaveJob>();
    job->step = step;
    job->snapshots.resize(static_cast<size_t>(options_.world_size));
    job->arrived.assign(static_cast<size_t>(options_.world_size), false);
    job->written.assign(static_cast<size_t>(options_.world_size), false);
    job->rank_files.resize(static_cast<size_t>(options_.world_size));
    job->peer_files.resize(static_cast<size_t>(options_.world_size));
    jobs_.push_back(std::move(job));
    done_cv_.notify_all();  // ranks waiting to create the same step
    return jobs_.back().get();
  }

  Status take_errors_locked() {
    if (errors_.empty()) return Status::Ok();
    Status first = std::move(errors_.front());
    const size_t others = errors_.size() - 1;
    errors_.clear();
    if (others > 0) first.with_context(std::to_string(others) + " more checkpoint save(s) failed too");
    return first;
  }

  Status hook(std::string_view point, int64_t step) {
    if (!options_.fault_hook) return Status::Ok();
    return options_.fault_hook(point, step);
  }

  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      work_cv_.wait(lock, [&] { return closing_ || has_work_locked(); });
      if (jobs_.empty()) {
        if (closing_) {
          stopped_ = true;
          done_cv_.notify_all();
          return;
        }
        continue;
      }
      SaveJob& job = *jobs_.front();
      // A snapshot to write? It stays in the job (submit() only fills other slots).
      const int rank = unwritten_rank_locked(job);
      if (rank >= 0) {
        const bool failed = !job.status.ok();
        lock.unlock();
        FileRecord record;
        Status status = failed ? Status::Ok() : write_rank_file(job, *job.snapshots[static_cast<size_t>(rank)], &record);
        lock.lock();
        job.written[static_cast<size_t>(rank)] = true;
        ++job.written_count;
        bytes_written_ += record.bytes;
        if (!status.ok()) {
          if (job.status.ok()) job.status = std::move(status);
        } else if (!failed) {
          job.rank_files[static_cast<size_t>(rank)] = std::move(record);
        }
        if (local_written_locked(job)) {
          local_done_[job.step] = local_files_text_locked(job);
          done_cv_.notify_all();
        }
        continue;
      }
      const bool complete = commits() ? job.written_count == options_.world_size && job.trainer_state.has_value()
                                      : job.written_count == local_count();
      if (!complete && !closing_) continue;  // spurious: has_work said so only if closing or complete
      if (!complete) {
        std::string missing;
        for (size_t r = 0; r < job.arrived.size(); ++r) {
          if (!job.arrived[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        }
        if (!job.trainer_state) missing += std::string(missing.empty() ? "" : ", ") + "the trainer state";
        if (job.status.ok()) {
          job.status = CancelledError("checkpoint step " + std::to_string(job.step) +
                                      " abandoned at finish(): never received " + missing);
        }
      }
      lock.unlock();
      Status status = job.status;
      if (status.ok() && commits()) status = commit(job);
      // A retry rewrites every rank's file from its snapshot: one process only.
      const int attempts = shared_directory() ? 1 : options_.save_attempts;
      for (int attempt = 2; !status.ok() && complete && attempt <= attempts; ++attempt) {
        STRATA_LOG(kWarn) << "checkpoint: saving step " << job.step << " to " << options_.directory
                          << " failed: " << status.to_string() << "; trying again (attempt " << attempt << " of "
                          << options_.save_attempts << ")";
        remove_tmp(job);
        status = rewrite(job);
      }
      if (!status.ok() && commits()) remove_tmp(job);
      for (auto& snapshot : job.snapshots) snapshot.reset();  // frees the memory before relocking
      lock.lock();
      if (status.ok() && commits()) {
        last_committed_ = std::max(last_committed_, job.step);
      } else {
        status.with_context("checkpoint step " + std::to_string(job.step) + " in " + options_.directory + " was not saved");
        STRATA_LOG(kError) << status.to_string();
        errors_.push_back(std::move(status));
      }
      jobs_.pop_front();
      done_cv_.notify_all();
    }
  }

  static int unwritten_rank_locked(const SaveJob& job) {
    for (size_t r = 0; r < job.snapshots.size(); ++r) {
      if (job.snapshots[r].has_value() && !job.written[r]) return static_cast<int>(r);
    }
    return -1;
  }

  bool has_work_locked() const {
    if (jobs_.empty()) return false;
    const SaveJob& job = *jobs_.front();
    if (unwritten_rank_locked(job) >= 0) return true;
    if (!commits()) return job.written_count == local_count();
    return job.written_count == options_.world_size && job.trainer_state.has_value();
  }

  // Process ranks (see CheckpointSaverOptions::first_rank).
  int local_count() const { return options_.local_ranks > 0 ? options_.local_ranks : options_.world_size; }
  bool is_local(int rank) const { return rank >= options_.first_rank && rank < options_.first_rank + local_count(); }
  bool commits() const { return options_.first_rank == 0; }
  bool shared_directory() const { return local_count() < options_.world_size; }

  bool local_written_locked(const SaveJob& job) const {
    for (int r = options_.first_rank; r < options_.first_rank + local_count(); ++r)
      if (!job.written[static_cast<size_t>(r)]) return false;
    return true;
  }

  // This saver's rank files of `job` as add_peer_files() takes them, or the write's failure.
  std::string local_files_text_locked(const SaveJob& job) const {
    if (!job.status.ok()) return json{{"error", job.status.to_string()}}.dump();
    json files = json::array();
    for (int r = options_.first_rank; r < options_.first_rank + local_count(); ++r)
      files.push_back(file_to_json(job.rank_files[static_cast<size_t>(r)]));
    return json{{"files", std::move(files)}}.dump();
  }

  // Writer thread, with every snapshot and the trainer state at hand: the whole save again.
  Status rewrite(SaveJob& job) {
    for (size_t r = 0; r < job.snapshots.size(); ++r) {
      FileRecord record;
      Status status = write_rank_file(job, *job.snapshots[r], &record);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        bytes_written_ += record.bytes;
      }
      STRATA_RETURN_IF_ERROR(std::move(status));
      job.rank_files[r] = std::move(record);
    }
    return commit(job);
  }

  // Start-up: a file can be created, written, fsynced and removed in D.
  Status probe_writable() {
    const std::string path = (fs::path(options_.directory) / (".strata-write-probe-" + std::to_string(::getpid()))).string();
    auto not_writable = [&](const Status& status) {
      return FailedPreconditionError("checkpoint: save directory '" + options_.directory + "' is not writable: " + status.message() +
                                     "; choose a writable --save-dir");
    };
    StatusOr<File> probe = File::open(path, {.flags = O_WRONLY | O_CREAT | O_TRUNC});
    if (!probe.ok()) return not_writable(probe.status());
    const std::vector<char> block(kDirectIoAlignment, 0);
    Status status = probe->write_exact(block.data(), block.size(), 0);
    if (status.ok()) status = probe->sync();
    probe->reset();
    if (::unlink(path.c_str()) != 0 && status.ok()) status = Status::FromErrno(errno, "unlink(" + path + ")");
    if (!status.ok()) return not_writable(status);
    return Status::Ok();
  }

  // Start-up: flock(D/.strata-save.lock) for the saver's life, so two runs never commit
  // into one directory. The file holds the owner's pid to name it in the refusal.
  Status lock_directory() {
    const std::string path = (fs::path(options_.directory) / kCheckpointLockName).string();
    STRATA_ASSIGN_OR_RETURN(lock_file_, File::open(path, {.flags = O_RDWR | O_CREAT}));
    Status locked = lock_file_.try_lock_exclusive();
    if (!locked.ok()) {
      if (locked.error_number() != EWOULDBLOCK) return std::move(locked).with_context("checkpoint: locking the save directory");
      char text[32] = {};
      const ssize_t got = ::pread(lock_file_.fd(), text, sizeof(text) - 1, 0);  // best effort: only names the holder
      const long holder = got > 0 ? std::strtol(text, nullptr, 10) : 0;
      std::string who = holder > 0 ? "pid " + std::to_string(holder) : "pid unknown";
      if (holder == static_cast<long>(::getpid())) who += ", this process: another checkpoint saver is open";
      return AlreadyExistsError("checkpoint: save directory '" + options_.directory + "' is in use by another run (" + who +
                                ", holding " + path + "); give each run its own --save-dir");
    }
    const std::string pid_text = std::to_string(::getpid()) + "\n";
    Status written = lock_file_.truncate(0);
    if (written.ok()) written = lock_file_.write_exact(pid_text.data(), pid_text.size(), 0);
    return written;
  }

  // Start-up: room for checkpoints_of_room checkpoints of the plan's size.
  Status check_free_space() {
    if (options_.checkpoint_elements == 0 || options_.checkpoints_of_room <= 0) return Status::Ok();
    struct statvfs info {};
    if (::statvfs(options_.directory.c_str(), &info) != 0) return Status::FromErrno(errno, "statvfs(" + options_.directory + ")");
    const uint64_t free_bytes = static_cast<uint64_t>(info.f_bavail) * static_cast<uint64_t>(info.f_frsize);
    const uint64_t one = checkpoint_bytes(options_.checkpoint_elements, options_.world_size, options_.state_segments);
    const uint64_t need = one * static_cast<uint64_t>(options_.checkpoints_of_room);
    if (free_bytes >= need) return Status::Ok();
    return FailedPreconditionError(
        "checkpoint: save directory '" + options_.directory + "' has " + engine_internal::format_bytes(free_bytes) + " free, but " +
        std::to_string(options_.checkpoints_of_room) + " checkpoints need " + engine_internal::format_bytes(need) + " (one: " + std::to_string(4 * options_.state_segments) + " B x " +
        std::to_string(options_.checkpoint_elements) + " parameters of fp32 optimizer state + manifest and trainer state = " +
        engine_internal::format_bytes(one) + "); free space there or choose another --save-dir");
  }

  std::string final_dir(const SaveJob& job) const { return checkpoint_path(options_.directory, job.step); }

  // Writer thread: creates the job's temporary directory, replacing one a crash left.
  Status ensure_tmp(SaveJob& job) {
    if (job.tmp_created) return Status::Ok();
    job.tmp_dir = (fs::path(options_.directory) / (std::string(kTmpPrefix) + checkpoint_dir_name(job.step))).string();
    if (shared_directory()) {
      // Other processes write into the same directory, maybe first: nothing there is stale
      // (their files are rewritten whole; the manifest lists only this step's).
      if (::mkdir(job.tmp_dir.c_str(), 0755) != 0 && errno != EEXIST) return Status::FromErrno(errno, "mkdir(" + job.tmp_dir + ")");
      job.tmp_created = true;
      return Status::Ok();
    }
    std::error_code error;
    if (fs::exists(job.tmp_dir, error)) {
      STRATA_LOG(kInfo) << "checkpoint: removing " << job.tmp_dir << ", left by an interrupted save";
      fs::remove_all(job.tmp_dir, error);
      if (error) return IoError("cannot remove the stale " + job.tmp_dir + ": " + error.message());
    }
    if (::mkdir(job.tmp_dir.c_str(), 0755) != 0) return Status::FromErrno(errno, "mkdir(" + job.tmp_dir + ")");
    job.tmp_created = true;
    return Status::Ok();
  }

  void remove_tmp(SaveJob& job) {
    if (!job.tmp_created) return;
    std::error_code error;
    fs::remove_all(job.tmp_dir, error);
    if (error) STRATA_LOG(kWarn) << "checkpoint: cannot remove " << job.tmp_dir << ": " << error.message();
    job.tmp_created = false;
  }

  Status write_rank_file(SaveJob& job, const RankSnapshot& snapshot, FileRecord* record) {
    const std::string context = "checkpoint step " + std::to_string(job.step) + ": writing rank " +
                                std::to_string(snapshot.rank()) + "'s shards";
    STRATA_RETURN_IF_ERROR_CTX(ensure_tmp(job), context);
    record->name = rank_file_name(snapshot.rank(), options_.world_size);
    record->rank = snapshot.rank();
    const std::string path = (fs::path(job.tmp_dir) / record->name).string();
    bool direct = options_.direct_io;
    auto opened = open_maybe_direct(path, O_WRONLY | O_CREAT | O_TRUNC, &direct);
    if (!opened.ok()) return std::move(opened).status().with_context(context);
    const File file = std::move(opened).value();
    STRATA_RETURN_IF_ERROR_CTX(hook("rank_file_open", job.step), context);

    const uint64_t total = snapshot.bytes();
    // Reserve the space first: a full disk fails here, before any write, naming the file.
    Status reserved = file.allocate(0, total);
    if (!reserved.ok() && reserved.error_number() != EOPNOTSUPP) return std::move(reserved).with_context(context);

    STRATA_ASSIGN_OR_RETURN(IoFile io_file, io_->register_file(file.fd(), path));
    uint64_t offset = 0;
    Status submit_status;
    for (int g = 0; g < snapshot.group_count() && submit_status.ok(); ++g) {
      if (!snapshot.layouts()[static_cast<size_t>(g)].trainable) continue;  // frozen: no segments
      const size_t shard_bytes = snapshot.layouts()[static_cast<size_t>(g)].shard_numel * sizeof(float);
      for (int k = 0; k < snapshot.kinds(); ++k) {
        const CheckpointStateKind kind = kSegmentKinds[static_cast<size_t>(k)];
        const std::span<const float> data = snapshot.shard(g, kind);
        record->segments.push_back(SegmentRecord{g, kind, offset + static_cast<size_t>(kind) * shard_bytes, shard_bytes,
                                                 chunk_checksums(data.data(), shard_bytes, options_.chunk_bytes)});
      }
      const std::span<const float> block = snapshot.group_block(g);
      IoRequest request;
      request.op = IoOp::kWrite;
      request.file = io_file;
      request.buffer = const_cast<float*>(block.data());  // a write only reads it
      request.bytes = block.size_bytes();
      request.offset = offset;
      auto ticket = io_->submit(std::move(request));
      if (!ticket.ok()) submit_status = ticket.status();
      offset += block.size_bytes();
    }
    Status status = io_->wait_all();
    if (status.ok()) status = submit_status;
    Status unregister = io_->unregister_file(io_file);
    STRATA_RETURN_IF_ERROR_CTX(std::move(status), context);
    STRATA_RETURN_IF_ERROR_CTX(std::move(unregister), context);
    STRATA_RETURN_IF_ERROR_CTX(file.sync(), context);
    record->bytes = total;
    STRATA_RETURN_IF_ERROR_CTX(hook("rank_file_written", job.step), context);
    return Status::Ok();
  }

  Status commit(SaveJob& job) {
    const std::string context = "checkpoint step " + std::to_string(job.step) + ": committing";
    STRATA_RETURN_IF_ERROR_CTX(ensure_tmp(job), context);
    // The trainer state, byte for byte.
    const std::string& state = *job.trainer_state;
    const std::string state_path = (fs::path(job.tmp_dir) / kTrainerStateName).string();
    STRATA_RETURN_IF_ERROR_CTX(write_file_durably(state_path, state), context);
    FileRecord state_record;
    state_record.name = std::string(kTrainerStateName);
    state_record.bytes = state.size();
    state_record.segments.push_back(
        SegmentRecord{0, CheckpointStateKind::kMaster, 0, state.size(), chunk_checksums(state.data(), state.size(), options_.chunk_bytes)});

    json groups = json::array();
    for (const GroupLayout& layout : job.layouts) groups.push_back(group_to_json(layout));
    json files = json::array();
    for (size_t r = 0; r < job.rank_files.size(); ++r)
      files.push_back(job.peer_files[r] ? *job.peer_files[r] : file_to_json(job.rank_files[r]));
    files.push_back(file_to_json(state_record));
    json manifest = {{"format", kFormatName},
                     {"version", job.stale_parameters ? kFormatVersionStale : kFormatVersion},
                     {"step", job.step},
                     {"engine_steps", job.engine_steps},
                     {"world_size", options_.world_size},
                     {"checksum", "xxh64"},
                     {"chunk_bytes", options_.chunk_bytes},
                     {"groups", std::move(groups)},
                     {"files", std::move(files)}};
    if (job.stale_parameters) manifest["stale_parameters"] = true;
    if (job.loss_scaler) {
      const LossScaler::State& scaler = *job.loss_scaler;
      manifest["loss_scaler"] = {{"scale", scaler.scale},
                                 {"clean_steps", scaler.clean_steps},
                                 {"remaining_hysteresis", scaler.remaining_hysteresis},
                                 {"skipped_steps", scaler.skipped_steps}};
    }
    manifest["manifest_checksum"] = hex64(manifest_checksum(manifest));
    STRATA_RETURN_IF_ERROR_CTX(hook("before_manifest", job.step), context);
    const std::string manifest_text = manifest.dump(1) + "\n";
    STRATA_RETURN_IF_ERROR_CTX(write_file_durably((fs::path(job.tmp_dir) / kManifestName).string(), manifest_text), context);
    STRATA_RETURN_IF_ERROR_CTX(fsync_directory(job.tmp_dir), context);
    STRATA_RETURN_IF_ERROR_CTX(hook("before_rename", job.step), context);

    // Make it visible: a plain rename, or an atomic exchange with an older save of the
    // same step (which is then removed).
    const std::string target = final_dir(job);
    std::error_code error;
    if (fs::exists(target, error)) {
      if (::renameat2(AT_FDCWD, job.tmp_dir.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) != 0) {
        return Status::FromErrno(errno, "renameat2(" + job.tmp_dir + ", " + target + ", RENAME_EXCHANGE)").with_context(context);
      }
      fs::remove_all(job.tmp_dir, error);  // now the older save
      if (error) STRATA_LOG(kWarn) << "checkpoint: cannot remove the replaced save at " << job.tmp_dir << ": " << error.message();
    } else if (::rename(job.tmp_dir.c_str(), target.c_str()) != 0) {
      return Status::FromErrno(errno, "rename(" + job.tmp_dir + ", " + target + ")").with_context(context);
    }
    job.tmp_created = false;
    STRATA_RETURN_IF_ERROR_CTX(fsync_directory(options_.directory), context);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      bytes_written_ += state.size() + manifest_text.size();
    }
    STRATA_LOG(kInfo) << "checkpoint: saved step " << job.step << " to " << target;
    prune();
    return Status::Ok();
  }

  // Keeps the newest keep_last step-* directories, and the newest healthy one.
  void prune() {
    if (options_.keep_last <= 0) return;
    std::vector<std::pair<int64_t, fs::path>> steps;
    std::error_code error;
    for (const auto& entry : fs::directory_iterator(options_.directory, error)) {
      const int64_t step = parse_step_name(entry.path().filename().string());
      if (step >= 0) steps.emplace_back(step, entry.path());
    }
    std::sort(steps.begin(), steps.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    size_t fallback = steps.size();
    for (size_t i = 0; i < steps.size() && fallback == steps.size(); ++i) {
      if (is_healthy(steps[i].second)) fallback = i;
    }
    for (size_t i = static_cast<size_t>(options_.keep_last); i < steps.size(); ++i) {
      if (i == fallback) {
        STRATA_LOG(kInfo) << "checkpoint: keeping " << steps[i].second.string() << " beyond keep_last " << options_.keep_last
                          << ": it is the newest whose step ended with a finite loss";
        continue;
      }
      fs::remove_all(steps[i].second, error);
      if (error) STRATA_LOG(kWarn) << "checkpoint: cannot remove old " << steps[i].second.string() << ": " << error.message();
      else STRATA_LOG(kDebug) << "checkpoint: removed old " << steps[i].second.string() << " (keep_last " << options_.keep_last << ")";
    }
  }

  // A checkpoint to fall back to: options_.is_healthy accepts its trainer state (one that
  // cannot be read is not).
  bool is_healthy(const fs::path& checkpoint) const {
    if (!options_.is_healthy) return true;
    auto text = read_small_file((checkpoint / kTrainerStateName).string());
    return text.ok() && options_.is_healthy(*text);
  }

  const CheckpointSaverOptions options_;
  std::unique_ptr<IoEngine> io_;
  mutable std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<std::unique_ptr<SaveJob>> jobs_;
  std::vector<Status> errors_;
  bool closing_ = false;
  int64_t last_committed_ = -1;
  std::map<int64_t, std::string> local_done_;  // process ranks: local_files() texts not yet taken
  bool stopped_ = false;                       // the writer thread has returned
  uint64_t bytes_written_ = 0;
  std::thread thread_;
  File lock_file_;  // holds the save directory's flock for the saver's life
};

uint64_t checkpoint_bytes(uint64_t elements, int world_size, int state_segments) {
  const uint64_t ranks = static_cast<uint64_t>(std::max(1, world_size));
  const uint64_t per_rank = (elements * 4 * static_cast<uint64_t>(std::max(1, state_segments)) / ranks + kDirectIoAlignment - 1) / kDirectIoAlignment * kDirectIoAlignment;
  return per_rank * ranks + (uint64_t{64} << 10);
}

StatusOr<std::unique_ptr<CheckpointSaver>> CheckpointSaver::create(const CheckpointSaverOptions& options) {
  if (options.directory.empty()) return InvalidArgumentError("checkpoint: the save directory is empty");
  if (options.world_size < 1) {
    return InvalidArgumentError("checkpoint: world_size " + std::to_string(options.world_size) + " must be >= 1");
  }
  if (options.chunk_bytes == 0 || options.chunk_bytes % kDirectIoAlignment != 0) {
    return InvalidArgumentError("checkpoint: chunk_bytes " + std::to_string(options.chunk_bytes) +
                                " must be a positive multiple of 4096");
  }
  if (options.first_rank < 0 || options.local_ranks < 0 || options.first_rank + std::max(options.local_ranks, 1) > options.world_size)
    return InvalidArgumentError("checkpoint: ranks " + std::to_string(options.first_rank) + " + " + std::to_string(options.local_ranks) +
                                " do not fit world_size " + std::to_string(options.world_size));
  auto impl = std::make_unique<Impl>(options);
  STRATA_RETURN_IF_ERROR(impl->start());
  return std::unique_ptr<CheckpointSaver>(new CheckpointSaver(std::move(impl)));
}

CheckpointSaver::CheckpointSaver(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CheckpointSaver::~CheckpointSaver() = default;
const std::string& CheckpointSaver::directory() const { return impl_->directory(); }
Status CheckpointSaver::submit(int64_t step, RankSnapshot snapshot) { return impl_->submit(step, std::move(snapshot)); }
Status CheckpointSaver::submit_trainer_state(int64_t step, std::string json_text) {
  return impl_->submit_trainer_state(step, std::move(json_text));
}
Status CheckpointSaver::poll() { return impl_->poll(); }
Status CheckpointSaver::wait() { return impl_->wait(); }
Status CheckpointSaver::finish() { return impl_->finish(); }
int64_t CheckpointSaver::last_committed_step() const { return impl_->last_committed_step(); }
StatusOr<std::string> CheckpointSaver::local_files(int64_t step) { return impl_->local_files(step); }
Status CheckpointSaver::add_peer_files(int64_t step, const std::vector<std::string>& texts) {
  return impl_->add_peer_files(step, texts);
}
uint64_t CheckpointSaver::bytes_written() const { return impl_->bytes_written(); }

// ---------------------------------------------------------------------------------------
// CheckpointReader
// ---------------------------------------------------------------------------------------

struct CheckpointReader::File {
  std::string name;
  std::string path;
  int rank = -1;
  uint64_t bytes = 0;
  bool direct = false;
  ::strata::File fd;
  std::vector<Segment> segments;  // rank files: group_segment_[group] + kind
};

CheckpointReader::~CheckpointReader() = default;

namespace {

// Typed access to manifest fields with errors naming the field.
class ManifestFields {
 public:
  explicit ManifestFields(std::string path) : path_(std::move(path)) {}

  template <class T>
  StatusOr<T> get(const json& object, std::string_view key, std::string_view where) const {
    if (!object.is_object()) return error(std::string(where) + " is not an object");
    const auto it = object.find(key);
    if (it == object.end()) return error(std::string(where) + " has no field '" + std::string(key) + "'");
    const std::string field = std::string(where) + "." + std::string(key);
    // json's own conversion truncates 1.5, wraps -1 into a size_t and makes 1e300 an
    // undefined int: integers are checked here, in their own type.
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      return integer<T>(*it, field);
    } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
      if (!it->is_array()) return error(field + " is not an array");
      std::vector<int64_t> values;
      for (size_t i = 0; i < it->size(); ++i) {
        STRATA_ASSIGN_OR_RETURN(const int64_t value, integer<int64_t>((*it)[i], field + "[" + std::to_string(i) + "]"));
        values.push_back(value);
      }
      return values;
    } else {
      try {
        return it->template get<T>();
      } catch (const json::exception& e) {
        return error(field + " has the wrong type (" + e.what() + ")");
      }
    }
  }
  template <class T>
  StatusOr<T> integer(const json& value, const std::string& field) const {
    if (value.is_number_unsigned() && std::in_range<T>(value.get<uint64_t>())) return static_cast<T>(value.get<uint64_t>());
    if (value.is_number_integer() && !value.is_number_unsigned() && std::in_range<T>(value.get<int64_t>())) {
      return static_cast<T>(value.get<int64_t>());
    }
    return error(field + " is " + (value.is_structured() ? std::string("an ") + value.type_name() : value.dump()) + ", not an integer in [" + std::to_string(std::numeric_limits<T>::min()) + ", " +
                 std::to_string(std::numeric_limits<T>::max()) + "]");
  }
  StatusOr<const json*> array(const json& object, std::string_view key, std::string_view where) const {
    if (!object.is_object()) return error(std::string(where) + " is not an object");
    const auto it = object.find(key);
    if (it == object.end() || !it->is_array()) return error(std::string(where) + "." + std::string(key) + " is missing or not an array");
    return &*it;
  }
  Status error(const std::string& what) const { return DataLossError(path_ + ": " + what); }

 private:
  std::string path_;
};

}  // namespace

namespace {

Status parse_manifest_groups(const json& manifest, const ManifestFields& fields, CheckpointManifest& out) {
  STRATA_ASSIGN_OR_RETURN(const json* groups, fields.array(manifest, "groups", "the manifest"));
  uint64_t block_offset = 0;
  size_t segments = 0;  // of a rank file, before the group's
  for (size_t g = 0; g < groups->size(); ++g) {
    const json& entry = (*groups)[g];
    const std::string where = "groups[" + std::to_string(g) + "]";
    SavedGroup group;
    STRATA_ASSIGN_OR_RETURN(group.id, fields.get<int>(entry, "id", where));
    STRATA_ASSIGN_OR_RETURN(group.name, fields.get<std::string>(entry, "name", where));
    STRATA_ASSIGN_OR_RETURN(group.numel, fields.get<size_t>(entry, "numel", where));
    STRATA_ASSIGN_OR_RETURN(group.shard_numel, fields.get<size_t>(entry, "shard_numel", where));
    if (group.id != static_cast<int>(g)) return fields.error(where + " has id " + std::to_string(group.id));
    if (entry.contains("frozen")) {
      STRATA_ASSIGN_OR_RETURN(group.frozen, fields.get<bool>(entry, "frozen", where));
    }
    // A rank file holds three (or, with stale parameters, four) shards of every trainable
    // group (none of a frozen one); its size must fit 64 bits.
    uint64_t block_bytes = 0;
    uint64_t block_end = 0;
    const uint64_t kinds = group.frozen ? 0 : static_cast<uint64_t>(out.kinds);
    if (__builtin_mul_overflow(uint64_t{group.shard_numel}, kinds * sizeof(float), &block_bytes) ||
        __builtin_add_overflow(block_offset, block_bytes, &block_end)) {
      return fields.error(where + " ('" + group.name + "'): shard_numel " + std::to_string(group.shard_numel) +
                          " makes the rank files larger than 2^64 bytes");
    }
    if (group.shard_numel == 0 || group.shard_numel < group.numel / static_cast<size_t>(out.world_size) +
                                                          (group.numel % static_cast<size_t>(out.world_size) != 0)) {
      return fields.error(where + " ('" + group.name + "'): shard_numel " + std::to_string(group.shard_numel) + " x " +
                          std::to_string(out.world_size) + " ranks does not cover its " + std::to_string(group.numel) +
                          " elements");
    }
    STRATA_ASSIGN_OR_RETURN(const json* tensors, fields.array(entry, "tensors", where));
    for (size_t t = 0; t < tensors->size(); ++t) {
      const std::string twhere = where + ".tensors[" + std::to_string(t) + "]";
      SavedTensor tensor;
      STRATA_ASSIGN_OR_RETURN(tensor.name, fields.get<std::string>((*tensors)[t], "name", twhere));
      STRATA_ASSIGN_OR_RETURN(tensor.shape, fields.get<std::vector<int64_t>>((*tensors)[t], "shape", twhere));
      STRATA_ASSIGN_OR_RETURN(tensor.offset, fields.get<size_t>((*tensors)[t], "offset", twhere));
      STRATA_ASSIGN_OR_RETURN(tensor.numel, fields.get<size_t>((*tensors)[t], "numel", twhere));
      if (tensor.offset > group.numel || tensor.numel > group.numel - tensor.offset) {
        return fields.error(twhere + " (offset " + std::to_string(tensor.offset) + ", numel " + std::to_string(tensor.numel) +
                            ") ends past its group's numel " + std::to_string(group.numel));
      }
      group.tensors.push_back(std::move(tensor));
    }
    out.group_base.push_back(block_offset);
    out.group_segment.push_back(group.frozen ? kNoSegment : segments);
    if (!group.frozen) segments += static_cast<size_t>(out.kinds);
    block_offset = block_end;
    out.groups.push_back(std::move(group));
  }
  out.rank_file_bytes = block_offset;
  out.rank_file_segments = segments;
  return Status::Ok();
}

Status parse_manifest_segments(const json& entry, const ManifestFields& fields, const std::string& where,
                               const CheckpointManifest& manifest, ManifestFile& file) {
  const bool is_rank_file = file.rank >= 0;
  STRATA_ASSIGN_OR_RETURN(const json* segments, fields.array(entry, "segments", where));
  const size_t kinds = static_cast<size_t>(manifest.kinds);
  const size_t expected_segments = is_rank_file ? manifest.rank_file_segments : 1;
  // Rank files: segment s belongs to the trainable group whose segments start at or before it.
  size_t group_of_segment = 0;
  if (segments->size() != expected_segments) {
    return fields.error(where + " ('" + file.name + "') has " + std::to_string(segments->size()) + " segments, expected " +
                        std::to_string(expected_segments));
  }
  for (size_t s = 0; s < segments->size(); ++s) {
    const json& sentry = (*segments)[s];
    const std::string swhere = where + ".segments[" + std::to_string(s) + "]";
    ManifestSegment segment;
    STRATA_ASSIGN_OR_RETURN(segment.offset, fields.get<uint64_t>(sentry, "offset", swhere));
    STRATA_ASSIGN_OR_RETURN(segment.bytes, fields.get<uint64_t>(sentry, "bytes", swhere));
    STRATA_ASSIGN_OR_RETURN(const std::vector<std::string> sums, fields.get<std::vector<std::string>>(sentry, "checksums", swhere));
    if (is_rank_file) {
      while (manifest.group_segment[group_of_segment] == kNoSegment || manifest.group_segment[group_of_segment] + kinds <= s)
        ++group_of_segment;
      segment.group = static_cast<int>(group_of_segment);
      segment.kind = kSegmentKinds[s % kinds];
      const size_t shard_bytes = manifest.groups[static_cast<size_t>(segment.group)].shard_numel * sizeof(float);
      const uint64_t expected_offset = manifest.group_base[static_cast<size_t>(segment.group)] +
                                       static_cast<uint64_t>(s % kinds) * shard_bytes;
      if (segment.offset != expected_offset || segment.bytes != shard_bytes) {
        return fields.error(swhere + " is at [" + std::to_string(segment.offset) + ", +" + std::to_string(segment.bytes) +
                            "), expected [" + std::to_string(expected_offset) + ", +" + std::to_string(shard_bytes) + ")");
      }
    } else if (segment.offset != 0 || segment.bytes != file.bytes) {
      return fields.error(swhere + " does not cover the whole trainer state");
    }
    const uint64_t chunks = segment.bytes / manifest.chunk_bytes + (segment.bytes % manifest.chunk_bytes != 0);
    if (sums.size() != chunks) {
      return fields.error(swhere + " has " + std::to_string(sums.size()) + " checksums for " + std::to_string(chunks) + " chunks");
    }
    for (const std::string& text : sums) {
      uint64_t value = 0;
      if (!parse_hex64(text, &value)) return fields.error(swhere + " has a checksum that is not hex: '" + text + "'");
      segment.checksums.push_back(value);
    }
    file.segments.push_back(std::move(segment));
  }
  return Status::Ok();
}

Status parse_manifest_files(const json& manifest, const ManifestFields& fields, CheckpointManifest& out) {
  STRATA_ASSIGN_OR_RETURN(const json* files, fields.array(manifest, "files", "the manifest"));
  if (files->size() != static_cast<size_t>(out.world_size) + 1) {
    return fields.error("lists " + std::to_string(files->size()) + " files, expected " + std::to_string(out.world_size) +
                        " rank files and the trainer state");
  }
  for (size_t f = 0; f < files->size(); ++f) {
    const json& entry = (*files)[f];
    const std::string where = "files[" + std::to_string(f) + "]";
    ManifestFile file;
    STRATA_ASSIGN_OR_RETURN(file.name, fields.get<std::string>(entry, "name", where));
    STRATA_ASSIGN_OR_RETURN(file.bytes, fields.get<uint64_t>(entry, "bytes", where));
    const bool is_rank_file = f < static_cast<size_t>(out.world_size);
    if (is_rank_file) {
      STRATA_ASSIGN_OR_RETURN(file.rank, fields.get<int>(entry, "rank", where));
      if (file.rank != static_cast<int>(f) || file.name != rank_file_name(file.rank, out.world_size)) {
        return fields.error(where + " ('" + file.name + "') is not rank " + std::to_string(f) + "'s file");
      }
      if (file.bytes != out.rank_file_bytes) {
        return fields.error(where + " ('" + file.name + "') has " + std::to_string(file.bytes) + " bytes, the groups need " +
                            std::to_string(out.rank_file_bytes));
      }
    } else if (file.name != kTrainerStateName) {
      return fields.error(where + " is '" + file.name + "', expected " + std::string(kTrainerStateName));
    }
    if (file.name.find('/') != std::string::npos) return fields.error(where + " names a path, not a file");
    STRATA_RETURN_IF_ERROR(parse_manifest_segments(entry, fields, where, out, file));
    out.files.push_back(std::move(file));
  }
  return Status::Ok();
}

}  // namespace

StatusOr<CheckpointManifest> parse_checkpoint_manifest(std::string_view text, const std::string& manifest_path) {
  if (const size_t depth = json_nesting_depth(text); depth > kMaxManifestDepth) {
    return DataLossError(manifest_path + " nests " + std::to_string(depth) + " levels of objects and arrays; a manifest has " +
                         std::to_string(kManifestDepth) + ": the manifest is damaged");
  }
  json manifest = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (manifest.is_discarded() || !manifest.is_object()) {
    return DataLossError(manifest_path + " is not a JSON object (" + std::to_string(text.size()) + " bytes): the manifest is damaged");
  }
  const ManifestFields fields(manifest_path);
  STRATA_ASSIGN_OR_RETURN(const std::string format, fields.get<std::string>(manifest, "format", "the manifest"));
  if (format != kFormatName) return fields.error("format is '" + format + "', expected '" + std::string(kFormatName) + "'");
  STRATA_ASSIGN_OR_RETURN(const int version, fields.get<int>(manifest, "version", "the manifest"));
  if (version != kFormatVersion && version != kFormatVersionStale) {
    return fields.error("format version " + std::to_string(version) + " is not one of the supported " + std::to_string(kFormatVersion) +
                        " and " + std::to_string(kFormatVersionStale));
  }
  bool stale_parameters = false;
  if (manifest.contains("stale_parameters")) {
    STRATA_ASSIGN_OR_RETURN(stale_parameters, fields.get<bool>(manifest, "stale_parameters", "the manifest"));
  }
  if (stale_parameters != (version == kFormatVersionStale)) {
    return fields.error("format version " + std::to_string(version) + (stale_parameters ? " with" : " without") +
                        " stale_parameters (version " + std::to_string(kFormatVersionStale) + " has them, version " +
                        std::to_string(kFormatVersion) + " does not)");
  }
  STRATA_ASSIGN_OR_RETURN(const std::string stored_sum, fields.get<std::string>(manifest, "manifest_checksum", "the manifest"));
  uint64_t expected_sum = 0;
  if (!parse_hex64(stored_sum, &expected_sum)) return fields.error("manifest_checksum '" + stored_sum + "' is not hex");
  const uint64_t actual_sum = manifest_checksum(manifest);
  if (actual_sum != expected_sum) {
    return fields.error("checksum mismatch of the manifest itself: stored " + stored_sum + ", computed " + hex64(actual_sum));
  }

  CheckpointManifest out;
  out.kinds = stale_parameters ? kStaleKinds : kCheckpointStateKinds;
  STRATA_ASSIGN_OR_RETURN(out.step, fields.get<int64_t>(manifest, "step", "the manifest"));
  STRATA_ASSIGN_OR_RETURN(out.engine_steps, fields.get<int64_t>(manifest, "engine_steps", "the manifest"));
  if (manifest.contains("loss_scaler")) {
    const json& entry = manifest["loss_scaler"];
    const std::string where = "the manifest's loss_scaler";
    LossScaler::State scaler{};
    STRATA_ASSIGN_OR_RETURN(scaler.scale, fields.get<float>(entry, "scale", where));
    STRATA_ASSIGN_OR_RETURN(scaler.clean_steps, fields.get<int>(entry, "clean_steps", where));
    STRATA_ASSIGN_OR_RETURN(scaler.remaining_hysteresis, fields.get<int>(entry, "remaining_hysteresis", where));
    STRATA_ASSIGN_OR_RETURN(scaler.skipped_steps, fields.get<uint64_t>(entry, "skipped_steps", where));
    if (!(scaler.scale > 0.0f) || !std::isfinite(scaler.scale)) return fields.error(where + ": scale " + std::to_string(scaler.scale) + " is not positive");
    out.loss_scaler = scaler;
  }
  STRATA_ASSIGN_OR_RETURN(out.world_size, fields.get<int>(manifest, "world_size", "the manifest"));
  STRATA_ASSIGN_OR_RETURN(out.chunk_bytes, fields.get<size_t>(manifest, "chunk_bytes", "the manifest"));
  if (out.world_size < 1) return fields.error("world_size " + std::to_string(out.world_size) + " is below 1");
  if (out.chunk_bytes == 0 || out.chunk_bytes % kDirectIoAlignment != 0) {
    return fields.error("chunk_bytes " + std::to_string(out.chunk_bytes) + " is not a positive multiple of 4096");
  }
  STRATA_RETURN_IF_ERROR(parse_manifest_groups(manifest, fields, out));
  STRATA_RETURN_IF_ERROR(parse_manifest_files(manifest, fields, out));
  return out;
}

StatusOr<std::string> reseal_checkpoint_manifest(std::string_view text) {
  if (json_nesting_depth(text) > kMaxManifestDepth) return InvalidArgumentError("reseal_checkpoint_manifest: nested too deeply");
  json manifest = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (manifest.is_discarded() || !manifest.is_object()) return InvalidArgumentError("reseal_checkpoint_manifest: not a JSON object");
  manifest["manifest_checksum"] = hex64(manifest_checksum(manifest));
  return manifest.dump(1) + "\n";
}

StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::open(const std::string& checkpoint_dir,
                                                                   const CheckpointReadOptions& options) {
  std::unique_ptr<CheckpointReader> reader(new CheckpointReader());
  reader->options_ = options;
  reader->path_ = checkpoint_dir;
  std::error_code error;
  if (!fs::is_directory(checkpoint_dir, error)) return NotFoundError("checkpoint " + checkpoint_dir + " is not a directory");
  const std::string manifest_path = (fs::path(checkpoint_dir) / kManifestName).string();
  auto manifest_text = read_small_file(manifest_path);
  if (!manifest_text.ok()) {
    if (manifest_text.status().code() == StatusCode::kNotFound) {
      return NotFoundError("checkpoint " + checkpoint_dir + " has no " + std::string(kManifestName) +
                           " (an incomplete save)");
    }
    return std::move(manifest_text).status();
  }
  STRATA_ASSIGN_OR_RETURN(CheckpointManifest manifest, parse_checkpoint_manifest(*manifest_text, manifest_path));
  reader->step_ = manifest.step;
  reader->engine_steps_ = manifest.engine_steps;
  reader->loss_scaler_ = manifest.loss_scaler;
  reader->world_size_ = manifest.world_size;
  reader->chunk_bytes_ = manifest.chunk_bytes;
  reader->kinds_ = manifest.kinds;
  reader->groups_ = std::move(manifest.groups);
  reader->group_base_ = std::move(manifest.group_base);
  reader->group_segment_ = std::move(manifest.group_segment);

  for (ManifestFile& entry : manifest.files) {
    File file;
    file.name = std::move(entry.name);
    file.rank = entry.rank;
    file.bytes = entry.bytes;
    file.segments = std::move(entry.segments);
    file.path = (fs::path(checkpoint_dir) / file.name).string();
    const bool is_rank_file = file.rank >= 0;

    // Size: a short file is truncated.
    struct stat info {};
    if (::stat(file.path.c_str(), &info) != 0) {
      const int stat_errno = errno;
      if (stat_errno == ENOENT) {
        return DataLossError("checkpoint " + checkpoint_dir + ": " + file.name + " is missing (the manifest lists it)");
      }
      return Status::FromErrno(stat_errno, "stat(" + file.path + ")");
    }
    const uint64_t size = static_cast<uint64_t>(info.st_size);
    if (size < file.bytes) {
      return DataLossError("checkpoint " + checkpoint_dir + ": " + file.path + " is truncated: it has " + std::to_string(size) +
                           " bytes, the manifest says " + std::to_string(file.bytes));
    }
    if (size > file.bytes) {
      return DataLossError("checkpoint " + checkpoint_dir + ": " + file.path + " has " + std::to_string(size) +
                           " bytes, more than the " + std::to_string(file.bytes) + " the manifest says");
    }
    if (is_rank_file) {
      file.direct = options.direct_io;
      STRATA_ASSIGN_OR_RETURN(file.fd, open_maybe_direct(file.path, O_RDONLY, &file.direct));
    }
    reader->files_.push_back(std::move(file));
  }

  // The trainer state: small, read and checked now.
  File& state_file = reader->files_.back();
  STRATA_ASSIGN_OR_RETURN(reader->trainer_state_, read_small_file(state_file.path));
  if (reader->trainer_state_.size() != state_file.bytes) {
    return DataLossError("checkpoint " + checkpoint_dir + ": " + state_file.path + " changed size while being read");
  }
  if (options.verify_checksums) {
    const Segment& segment = state_file.segments.front();
    const std::vector<uint64_t> sums = chunk_checksums(reader->trainer_state_.data(), reader->trainer_state_.size(), reader->chunk_bytes_);
    for (size_t c = 0; c < sums.size(); ++c) {
      if (sums[c] != segment.checksums[c]) {
        return DataLossError("checkpoint " + checkpoint_dir + ": checksum mismatch in " + state_file.path + " chunk " +
                             std::to_string(c) + ": stored " + hex64(segment.checksums[c]) + ", computed " + hex64(sums[c]));
      }
    }
  }
  return reader;
}

Status CheckpointReader::read_segment(const File& file, const Segment& segment, uint64_t offset, size_t bytes,
                                      void* out) const {
  if (bytes == 0) return Status::Ok();
  if (offset + bytes > segment.bytes) {
    return InternalError("checkpoint read past a segment of " + file.path + ": [" + std::to_string(offset) + ", +" +
                         std::to_string(bytes) + ") of " + std::to_string(segment.bytes));
  }
  const size_t chunk = chunk_bytes_;
  STRATA_ASSIGN_OR_RETURN(const AlignedBuffer buffer, AlignedBuffer::allocate(chunk, kDirectIoAlignment));
  auto* destination = static_cast<unsigned char*>(out);
  for (uint64_t c = offset / chunk; c * chunk < offset + bytes; ++c) {
    const uint64_t chunk_begin = c * chunk;
    const size_t chunk_size = static_cast<size_t>(std::min<uint64_t>(chunk, segment.bytes - chunk_begin));
    STRATA_RETURN_IF_ERROR(file.fd.read_exact(buffer.data(), chunk_size, segment.offset + chunk_begin));
    if (options_.verify_checksums) {
      const uint64_t sum = xxhash64(buffer.data(), chunk_size);
      if (sum != segment.checksums[c]) {
        return DataLossError("checksum mismatch in " + file.path + " (group " + std::to_string(segment.group) + " '" +
                             groups_[static_cast<size_t>(segment.group)].name + "', " +
                             std::string(checkpoint_state_kind_name(segment.kind)) + ", bytes [" +
                             std::to_string(segment.offset + chunk_begin) + ", " +
                             std::to_string(segment.offset + chunk_begin + chunk_size) + ") of the file): stored " +
                             hex64(segment.checksums[c]) + ", computed " + hex64(sum));
      }
    }
    const uint64_t copy_begin = std::max(offset, chunk_begin);
    const uint64_t copy_end = std::min<uint64_t>(offset + bytes, chunk_begin + chunk_size);
    std::memcpy(destination + (copy_begin - offset), buffer.data() + (copy_begin - chunk_begin), copy_end - copy_begin);
  }
  return Status::Ok();
}

Status CheckpointReader::check_layout(const GroupLayout& layout) const {
  if (layout.id < 0 || static_cast<size_t>(layout.id) >= groups_.size()) {
    return InvalidArgumentError("checkpoint " + path_ + " has " + std::to_string(groups_.size()) + " groups; the model's group " +
                                std::to_string(layout.id) + " ('" + layout.name + "') is not among them");
  }
  const SavedGroup& saved = groups_[static_cast<size_t>(layout.id)];
  const std::string what = "checkpoint " + path_ + ": group " + std::to_string(layout.id);
  if (saved.name != layout.name) {
    return InvalidArgumentError(what + " is '" + saved.name + "' in the checkpoint but '" + layout.name + "' in the model");
  }
  if (saved.tensors.size() != layout.tensors.size()) {
    return InvalidArgumentError(what + " ('" + saved.name + "') has " + std::to_string(saved.tensors.size()) +
                                " tensors in the checkpoint, " + std::to_string(layout.tensors.size()) + " in the model");
  }
  auto shape_text = [](const std::vector<int64_t>& shape) {
    std::string text = "[";
    for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
    return text + "]";
  };
  for (size_t t = 0; t < saved.tensors.size(); ++t) {
    const SavedTensor& a = saved.tensors[t];
    const TensorLayout& b = layout.tensors[t];
    if (a.name != b.name || a.shape != b.shape || a.offset != b.offset || a.numel != b.numel) {
      return InvalidArgumentError(what + " ('" + saved.name + "'), tensor " + std::to_string(t) + ": the checkpoint has '" +
                                  a.name + "' " + shape_text(a.shape) + " at offset " + std::to_string(a.offset) +
                                  ", the model '" + b.name + "' " + shape_text(b.shape) + " at offset " + std::to_string(b.offset));
    }
  }
  if (saved.numel != layout.numel) {
    return InvalidArgumentError(what + " ('" + saved.name + "') has " + std::to_string(saved.numel) +
                                " elements in the checkpoint, " + std::to_string(layout.numel) + " in the model");
  }
  if (saved.frozen == layout.trainable) {
    return InvalidArgumentError(what + " ('" + saved.name + "') is " + (saved.frozen ? "frozen" : "trainable") +
                                " in the checkpoint but " + (layout.trainable ? "trainable" : "frozen") +
                                " in the model: a group must be frozen in both or in neither");
  }
  return Status::Ok();
}

Status CheckpointReader::read_range(int group, CheckpointStateKind kind, uint64_t first, std::span<float> out) const {
  if (group < 0 || static_cast<size_t>(group) >= groups_.size()) {
    return InvalidArgumentError("checkpoint " + path_ + ": no group " + std::to_string(group) + " (it has " +
                                std::to_string(groups_.size()) + ")");
  }
  if (static_cast<int>(kind) >= kinds_) {
    return InvalidArgumentError("checkpoint " + path_ + " has no " + std::string(checkpoint_state_kind_name(kind)) +
                                " (not a delayed-mode save)");
  }
  const SavedGroup& saved = groups_[static_cast<size_t>(group)];
  if (saved.frozen) {
    return FailedPreconditionError("checkpoint " + path_ + ": group " + std::to_string(group) + " ('" + saved.name +
                                   "') is frozen; checkpoints hold no state of frozen groups (load their weights from their source)");
  }
  const uint64_t end = first + out.size();
  const uint64_t data_end = std::min<uint64_t>(end, saved.numel);
  uint64_t element = first;
  while (element < data_end) {
    const uint64_t rank = element / saved.shard_numel;
    const uint64_t rank_end = std::min<uint64_t>(data_end, (rank + 1) * saved.shard_numel);
    const File& file = files_[static_cast<size_t>(rank)];
    const Segment& segment = file.segments[group_segment_[static_cast<size_t>(group)] + static_cast<size_t>(kind)];
    const uint64_t local = element - rank * saved.shard_numel;
    STRATA_RETURN_IF_ERROR_CTX(read_segment(file, segment, local * sizeof(float), (rank_end - element) * sizeof(float),
                                            out.data() + (element - first)),
                               "reading group '" + saved.name + "' " + std::string(checkpoint_state_kind_name(kind)) +
                                   " elements [" + std::to_string(first) + ", " + std::to_string(end) + ") from checkpoint " + path_);
    element = rank_end;
  }
  // Padding (and anything past the group) reads as zeros.
  const uint64_t zero_from = std::max(first, data_end);
  if (zero_from < end) std::fill(out.begin() + static_cast<ptrdiff_t>(zero_from - first), out.end(), 0.0f);
  return Status::Ok();
}

Status CheckpointReader::load_shard(int group, CheckpointStateKind kind, int rank, int world_size, std::span<float> out) const {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return InvalidArgumentError("checkpoint load_shard: rank " + std::to_string(rank) + " of world size " + std::to_string(world_size));
  }
  if (group >= 0 && static_cast<size_t>(group) < groups_.size() &&
      out.size() * static_cast<size_t>(world_size) < groups_[static_cast<size_t>(group)].numel) {
    return InvalidArgumentError("checkpoint load_shard: " + std::to_string(world_size) + " shards of " +
                                std::to_string(out.size()) + " elements do not cover group '" +
                                groups_[static_cast<size_t>(group)].name + "' (" +
                                std::to_string(groups_[static_cast<size_t>(group)].numel) + " elements)");
  }
  return read_range(group, kind, static_cast<uint64_t>(rank) * out.size(), out);
}

Status CheckpointReader::verify() const {
  for (size_t f = 0; f + 1 < files_.size(); ++f) {
    const File& file = files_[f];
    STRATA_ASSIGN_OR_RETURN(const AlignedBuffer scratch, AlignedBuffer::allocate(chunk_bytes_, kDirectIoAlignment));
    for (const Segment& segment : file.segments) {
      // read_segment checks every chunk; read a chunk at a time into scratch.
      for (uint64_t at = 0; at < segment.bytes; at += chunk_bytes_) {
        const size_t bytes = static_cast<size_t>(std::min<uint64_t>(chunk_bytes_, segment.bytes - at));
        STRATA_RETURN_IF_ERROR(read_segment(file, segment, at, bytes, scratch.data()));
      }
    }
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------
// latest_complete
// ---------------------------------------------------------------------------------------

StatusOr<CheckpointRef> latest_complete(const std::string& save_dir, const LatestCompleteOptions& options) {
  std::error_code error;
  if (!fs::is_directory(save_dir, error)) return NotFoundError("checkpoint save directory " + save_dir + " does not exist");
  std::vector<std::pair<int64_t, std::string>> candidates;
  std::vector<std::string> skipped;
  for (const auto& entry : fs::directory_iterator(save_dir, error)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(kTmpPrefix, 0) == 0) {
      const std::string why = entry.path().string() + ": an interrupted save (never committed)";
      STRATA_LOG(kWarn) << "checkpoint: skipping " << why;
      skipped.push_back(why);
      continue;
    }
    const int64_t step = parse_step_name(name);
    if (step >= 0 && entry.is_directory(error)) candidates.emplace_back(step, entry.path().string());
  }
  if (error) return IoError("cannot list " + save_dir + ": " + error.message());
  std::sort(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [step, path] : candidates) {
    CheckpointReadOptions read_options;
    read_options.verify_checksums = options.verify_checksums;
    auto reader = CheckpointReader::open(path, read_options);
    Status status = reader.ok() ? Status::Ok() : reader.status();
    if (status.ok() && options.verify_checksums) status = (*reader)->verify();
    if (status.ok()) return CheckpointRef{path, step};
    STRATA_LOG(kWarn) << "checkpoint: skipping " << path << ": " << status.to_string();
    skipped.push_back(path + ": " + status.message());
  }
  std::string text = "no complete checkpoint in " + save_dir;
  if (!skipped.empty()) {
    text += " (skipped:";
    for (const std::string& why : skipped) text += " " + why + ";";
    text += ")";
  }
  return NotFoundError(text);
}

// ---------------------------------------------------------------------------------------
// Engine glue
// ---------------------------------------------------------------------------------------

StatusOr<RankSnapshot> snapshot_engine_state(Engine& engine, int rank) {
  std::vector<GroupLayout> layouts;
  for (int g = 0; g < engine.group_count(); ++g) layouts.push_back(engine.layout(g));
  const StaleParameters stale = engine.has_stale_parameters() ? StaleParameters::kPresent : StaleParameters::kAbsent;
  STRATA_ASSIGN_OR_RETURN(RankSnapshot snapshot, RankSnapshot::allocate(std::move(layouts), rank, engine.steps_taken(), stale));
  snapshot.set_loss_scaler(engine.loss_scaler_state());
  for (int g = 0; g < snapshot.group_count(); ++g) {
    if (!snapshot.layouts()[static_cast<size_t>(g)].trainable) continue;  // frozen: not saved
    for (int k = 0; k < snapshot.kinds(); ++k) {
      const CheckpointStateKind kind = kSegmentKinds[static_cast<size_t>(k)];
      STRATA_RETURN_IF_ERROR_CTX(engine.read_state_shard(g, kind, snapshot.shard(g, kind)),
                                 "checkpoint snapshot: group '" + snapshot.layouts()[static_cast<size_t>(g)].name + "' " +
                                     std::string(checkpoint_state_kind_name(kind)));
    }
  }
  return snapshot;
}

namespace {

// After refresh_parameters(): the delayed-mode stale copy, where both sides have one.
Status load_stale_parameters(Engine& engine, int rank, const CheckpointReader& reader) {
  const bool delayed = engine.overlap_mode() == OverlapMode::kDelayed;
  if (reader.has_stale_parameters() && !delayed) {
    if (rank == 0)
      STRATA_LOG(kInfo) << "checkpoint " << reader.path() << " was saved in delayed overlap mode; this run is exact and "
                      << "computes with the masters (the saved stale parameters are not used)";
    return Status::Ok();
  }
  if (!reader.has_stale_parameters()) {
    if (delayed && rank == 0) {
      STRATA_LOG(kInfo) << "checkpoint " << reader.path() << " has no stale parameters (saved in exact mode, or before "
                        << "the first step): this delayed-mode run starts from the masters";
    }
    return Status::Ok();
  }
  std::vector<float> shard;
  for (int g = 0; g < engine.group_count(); ++g) {
    const GroupLayout& layout = engine.layout(g);
    if (!layout.trainable) continue;
    shard.resize(layout.shard_numel);
    STRATA_RETURN_IF_ERROR(reader.load_shard(g, CheckpointStateKind::kStaleParams, rank, layout.world_size, shard));
    STRATA_RETURN_IF_ERROR_CTX(engine.write_state_shard(g, CheckpointStateKind::kStaleParams, shard),
                               "loading checkpoint " + reader.path() + " into group '" + layout.name + "'");
  }
  return Status::Ok();
}

}  // namespace

Status load_engine_state(Engine& engine, int rank, const CheckpointReader& reader) {
  if (static_cast<size_t>(engine.group_count()) != reader.groups().size()) {
    return InvalidArgumentError("checkpoint " + reader.path() + " has " + std::to_string(reader.groups().size()) +
                                " groups, the model " + std::to_string(engine.group_count()));
  }
  std::vector<float> shard;
  for (int g = 0; g < engine.group_count(); ++g) {
    const GroupLayout& layout = engine.layout(g);
    STRATA_RETURN_IF_ERROR(reader.check_layout(layout));
    if (!layout.trainable) continue;  // frozen: its weights are the caller's to load
    shard.resize(layout.shard_numel);
    for (CheckpointStateKind kind : kAllKinds) {
      STRATA_RETURN_IF_ERROR(reader.load_shard(g, kind, rank, layout.world_size, shard));
      STRATA_RETURN_IF_ERROR_CTX(engine.write_state_shard(g, kind, shard),
                                 "loading checkpoint " + reader.path() + " into group '" + layout.name + "'");
    }
  }
  STRATA_RETURN_IF_ERROR_CTX(engine.refresh_parameters(), "loading checkpoint " + reader.path());
  STRATA_RETURN_IF_ERROR(load_stale_parameters(engine, rank, reader));
  engine.set_steps_taken(reader.engine_steps());
  engine.set_step_number(reader.step());
  if (reader.loss_scaler() && engine.loss_scaler_state()) {
    STRATA_RETURN_IF_ERROR_CTX(engine.restore_loss_scaler_state(*reader.loss_scaler()), "loading checkpoint " + reader.path());
  } else if (engine.loss_scaler_state()) {
    STRATA_LOG(kWarn) << "checkpoint " << reader.path() << " has no loss scaler state (saved without fp16 loss scaling): "
                      << "the loss scale starts at its initial value";
  }
  return Status::Ok();
}

}  // namespace strata
