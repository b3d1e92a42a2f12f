#include "engine/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>

#include "engine/checkpoint_format.h"
#include "engine/core/check.h"
#include "engine/core/log.h"
#include "engine/engine_plan.h"
#include "engine/core/thread.h"
#include "offload/checksum.h"

namespace strata {

namespace fs = std::filesystem;
using namespace checkpoint_format;

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
        const json& error = parsed["error"];
        std::string ranks;
        if (parsed.contains("ranks") && parsed["ranks"].is_array())
          for (const json& r : parsed["ranks"]) ranks += (ranks.empty() ? " (rank " : ", ") + r.dump();
        if (!ranks.empty()) ranks += ")";
        if (job->status.ok())
          job->status = IoError(what + ": a process" + ranks + " failed to write its rank files: " + (error.is_string() ? error.get<std::string>() : error.dump()));
        mark_failed_ranks_locked(*job, parsed);
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

  std::string failed_files(const Status& why) const { return failure_record(why).dump(); }

 private:
  // This saver's ranks, failed for `why`: what add_peer_files() takes from a process whose
  // part of a step failed.
  json failure_record(const Status& why) const {
    json ranks = json::array();
    for (int r = options_.first_rank; r < options_.first_rank + local_count(); ++r) ranks.push_back(r);
    return json{{"error", why.to_string()}, {"ranks", std::move(ranks)}};
  }

  // An error record's ranks count as written (with nothing to commit: the job has failed),
  // so the step ends once every rank is accounted for instead of waiting for files that
  // will never come. This saver's own ranks too: a process that failed before its
  // snapshots reached the saver passes its own record.
  static void mark_failed_ranks_locked(SaveJob& job, const json& record) {
    if (!record.contains("ranks") || !record["ranks"].is_array()) return;
    for (const json& rank : record["ranks"]) {
      if (!rank.is_number_integer()) continue;
      const int r = rank.get<int>();
      if (r < 0 || static_cast<size_t>(r) >= job.written.size() || job.written[static_cast<size_t>(r)] || job.snapshots[static_cast<size_t>(r)])
        continue;  // out of range, already written, or a snapshot the writer thread will account for
      job.written[static_cast<size_t>(r)] = true;
      ++job.written_count;
    }
  }

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
      if (!status.ok() && commits()) {
        // Process ranks: once every rank is accounted for, no process writes into the
        // temporary directory any more; what the others wrote there goes with this saver's.
        if (complete && shared_directory()) adopt_tmp(job);
        remove_tmp(job);
      }
      for (auto& snapshot : job.snapshots) snapshot.reset();  // frees the memory before relocking
      lock.lock();
      if (status.ok()) {
        if (commits()) last_committed_ = std::max(last_committed_, job.step);
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
    if (!job.status.ok()) return failure_record(job.status).dump();
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
    job.tmp_dir = tmp_path(job);
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

  // The job's temporary directory, as this saver's to remove, when it exists.
  void adopt_tmp(SaveJob& job) {
    if (job.tmp_created) return;
    job.tmp_dir = tmp_path(job);
    std::error_code error;
    job.tmp_created = fs::exists(job.tmp_dir, error);
  }

  std::string tmp_path(const SaveJob& job) const {
    return (fs::path(options_.directory) / (std::string(kTmpPrefix) + checkpoint_dir_name(job.step))).string();
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
std::string CheckpointSaver::failed_files(const Status& why) const { return impl_->failed_files(why); }
uint64_t CheckpointSaver::bytes_written() const { return impl_->bytes_written(); }

}  // namespace strata
