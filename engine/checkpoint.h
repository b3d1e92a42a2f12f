// Checkpoints: per-rank shard files plus a manifest with checksums, written in the
// background while training continues, made visible atomically, and loadable with any
// world size.
//
// On disk, for a save directory D and step N:
//
//   D/step-<N>/manifest.json            written last; its presence marks the checkpoint complete
//   D/step-<N>/rank-<r>-of-<W>.bin      rank r's shards: for each group in id order, the fp32
//                                       master, exp_avg and exp_avg_sq shards (shard_numel
//                                       floats each, little-endian), back to back, then (a
//                                       delayed-mode save) the stale parameter shard
//   D/step-<N>/trainer_state.json       the caller's JSON blob, byte for byte
//
// The manifest holds the format version, the step, the engine's step count, the world
// size, whether the rank files carry stale parameters, every group's layout (id, name,
// numel, shard_numel, tensors with their offsets and shapes), and for every file its size
// and the XXH64 checksum of every chunk (chunk_bytes, 1 MiB by default) of every segment;
// and its own checksum.
//
// Stale parameters (format version 2): in delayed overlap mode each step computes with
// parameters one update behind the masters; a save from such an engine (once a step was
// taken) adds that copy per group, as fp32 values of the parameter dtype ("stale_params"
// segments after exp_avg_sq; the manifest says "stale_parameters": true and "version": 2).
// Loading puts it back, so the resumed run computes its first step with the parameters
// the saving run used and ends on the same bits. Saves without it (exact mode) are format
// version 1, byte for byte what they were; both versions load. A delayed-mode checkpoint
// loaded into an exact-mode run drops the stale copy (exact mode computes with the
// masters); a checkpoint without one loaded into a delayed-mode run starts as a fresh
// delayed run does from the masters (its first two steps compute with them). Both say so
// in an info line.
//
// Frozen groups (GroupSpec::trainable false: PEFT base weights) are not saved. The
// manifest lists them among the groups with "frozen": true (the field appears on frozen
// groups only, so a manifest without them is what it always was) and the rank files hold
// no segments for them: only the trainable groups' state, in id order. Loading requires
// the engine's groups to be frozen exactly where the checkpoint's are (a mismatch is an
// error naming the group); load_engine_state() leaves frozen groups as they are, and the
// caller loads their weights from where they came from (write_state_shard(kMaster) of a
// frozen group writes its parameters), as it did for the run that saved.
//
// Saving (CheckpointSaver): every rank hands over a RankSnapshot — its shards copied into
// host memory the snapshot owns — and returns to training; the saver's thread writes the
// files through the I/O engine (O_DIRECT where the file system takes it, else buffered,
// logged once) into D/.tmp-step-<N>/, fsyncs each file, writes the manifest, fsyncs it
// and the directory, renames the directory to D/step-<N>/ (atomically replacing an older
// save of the same step) and fsyncs D. A crash at any point leaves either the previous
// state or the complete checkpoint; a failed save (disk full, I/O error) removes its
// temporary directory and leaves every earlier checkpoint as it was. A failed save is
// logged when it fails (naming the step and the file) and tried once more from the
// snapshots it still holds; a save that fails again is kept as an error, returned by the
// next poll() (which does not block), wait() or finish().
//
// At create() the saver checks D before any step runs: created if missing, writable (a
// probe file is created, fsynced and removed), and, given checkpoint_elements, with free
// space for checkpoints_of_room checkpoints (statvfs). It locks D for its life with
// flock(D/.strata-save.lock), which holds the owner's pid: a second saver on D, in this
// process or another, is refused naming D and the holder.
//
// Rotation (keep_last) never deletes the newest checkpoint is_healthy() accepts (the
// trainer marks one whose step ended with a finite loss), even when it is older than the
// newest keep_last.
//
// Loading (CheckpointReader): open() checks the manifest and every file's size (a short
// file is kDataLoss "truncated"); read_range()/load_shard() read any element range of a
// group's unpadded flat state, from whichever rank files hold it, verifying the checksum
// of every chunk they touch (a mismatch is kDataLoss naming the file, the segment and the
// byte range). A checkpoint saved with N ranks loads on M ranks: rank r of M asks for
// [r * shard_numel_M, (r + 1) * shard_numel_M), and elements past the group's numel
// (padding) read as zeros.
//
// latest_complete(D) finds the newest D/step-<N> that is complete and verifies;
// anything else (a .tmp-step-* directory left by a crash, a missing or damaged manifest,
// a truncated or corrupted file) is skipped with a warning naming why.
//
// Engine glue: snapshot_engine_state() + CheckpointSaver::submit() save from an Engine;
// load_engine_state() loads into one (write_state_shard, refresh_parameters,
// set_steps_taken).
//
// Memory: a RankSnapshot is a full copy of the rank's fp32 optimizer state (12 bytes per
// trainable parameter / world size, 16 with stale parameters); the saver keeps at most
// max_pending_saves steps of them, each until its save has committed or failed for good
// (the retry rewrites them).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/file.h"
#include "engine/core/status.h"
#include "engine/engine.h"
#include "engine/partition.h"
#include "offload/io_engine.h"

namespace strata {

using CheckpointStateKind = Engine::StateKind;
inline constexpr int kCheckpointStateKinds = 3;  // master, exp_avg, exp_avg_sq: in every checkpoint
// "master" | "exp_avg" | "exp_avg_sq" | "stale_params"
std::string_view checkpoint_state_kind_name(CheckpointStateKind kind);

// Whether a snapshot or checkpoint carries the stale parameter copy of delayed overlap mode.
enum class StaleParameters : uint8_t { kAbsent, kPresent };

// "step-<N>" and the path D/step-<N>.
std::string checkpoint_dir_name(int64_t step);
std::string checkpoint_path(const std::string& save_dir, int64_t step);

// One rank's shards of every group, in host memory this object owns (4 KiB aligned, so
// the saver writes it with O_DIRECT without a copy). Move-only.
class RankSnapshot {
 public:
  // `layouts` are the groups' layouts for this world size, group i at index i (layout.id
  // == i), all with the same world_size. The buffers start zeroed.
  static StatusOr<RankSnapshot> allocate(std::vector<GroupLayout> layouts, int rank, int64_t engine_steps,
                                         StaleParameters stale = StaleParameters::kAbsent);

  RankSnapshot(RankSnapshot&&) noexcept = default;
  RankSnapshot& operator=(RankSnapshot&&) noexcept = default;
  RankSnapshot(const RankSnapshot&) = delete;
  RankSnapshot& operator=(const RankSnapshot&) = delete;
  ~RankSnapshot() = default;

  int rank() const { return rank_; }
  int world_size() const { return layouts_.empty() ? 1 : layouts_.front().world_size; }
  int64_t engine_steps() const { return engine_steps_; }
  // The engine's loss scaler state (fp16 training), saved in the manifest.
  const std::optional<LossScaler::State>& loss_scaler() const { return loss_scaler_; }
  void set_loss_scaler(const std::optional<LossScaler::State>& state) { loss_scaler_ = state; }
  const std::vector<GroupLayout>& layouts() const { return layouts_; }
  int group_count() const { return static_cast<int>(layouts_.size()); }
  bool has_stale_parameters() const { return kinds_ > kCheckpointStateKinds; }
  int kinds() const { return kinds_; }  // shards per group: 3, or 4 with stale parameters
  // Group `group`'s shard of `kind`: layouts()[group].shard_numel floats (kStaleParams:
  // empty without has_stale_parameters(); every kind empty for a frozen group).
  std::span<float> shard(int group, CheckpointStateKind kind);
  std::span<const float> shard(int group, CheckpointStateKind kind) const;
  // The group's shards back to back (master, exp_avg, exp_avg_sq[, stale params]), as they go to disk.
  std::span<const float> group_block(int group) const;
  size_t bytes() const;  // all groups, all kinds

 private:
  RankSnapshot() = default;
  std::vector<GroupLayout> layouts_;
  std::vector<AlignedBuffer> blocks_;  // per group: kinds_ * shard_numel floats, aligned for O_DIRECT
  int kinds_ = kCheckpointStateKinds;
  int rank_ = 0;
  int64_t engine_steps_ = 0;
  std::optional<LossScaler::State> loss_scaler_;
};

struct CheckpointSaverOptions {
  std::string directory;                       // D: created (with parents) if missing
  int world_size = 1;                          // rank snapshots each save waits for
  int keep_last = 0;                           // after a commit, delete all but the newest keep_last step-* directories (0 = keep all)
  int max_pending_saves = 1;                   // a submit that starts a new step blocks while this many saves are unfinished
  bool direct_io = true;                       // O_DIRECT where the file system takes it
  size_t chunk_bytes = size_t{1} << 20;        // checksum granularity, a positive multiple of 4096
  IoEngineOptions io;                          // the saver's own I/O engine
  // Tests: called on the saver's thread at "rank_file_open", "rank_file_written",
  // "before_manifest", "before_rename"; an error it returns fails the save there (the
  // hook may also end the process to simulate a crash).
  std::function<Status(std::string_view point, int64_t step)> fault_hook;
  // Free space: the fp32 state elements of one checkpoint (every group's padded_numel, all
  // ranks); create() refuses D unless it has room for checkpoints_of_room checkpoints of
  // checkpoint_bytes(checkpoint_elements, world_size) each. 0 = no space check.
  uint64_t checkpoint_elements = 0;
  int state_segments = kCheckpointStateKinds;  // 4 where the engine saves stale parameters (delayed overlap)
  int checkpoints_of_room = 2;
  int save_attempts = 2;  // a failed save is written again, from its snapshots, up to this many tries in all
  // Rotation: whether a committed checkpoint's trainer state marks it as one to fall back
  // to; the newest such checkpoint is never rotated away. Unset: every checkpoint is.
  std::function<bool(std::string_view trainer_state)> is_healthy;
  // Process ranks (one saver per process, all on one shared save directory): this saver
  // writes the rank files of ranks [first_rank, first_rank + local_ranks) only; 0 = all
  // world_size ranks (one process). The saver holding rank 0 locks D, and commits a step
  // once the other processes' file records have arrived through add_peer_files(); the
  // others only write their files into D/.tmp-step-<N>/ (never removing anything there).
  int first_rank = 0;
  int local_ranks = 0;
};

// The bytes one checkpoint of `elements` fp32 state elements (all ranks) takes on disk:
// 4 B per element per segment (master, exp_avg, exp_avg_sq, and stale parameters in
// delayed overlap), each rank file rounded to 4 KiB, and 64 KiB for the manifest and the
// trainer state.
uint64_t checkpoint_bytes(uint64_t elements, int world_size, int state_segments = kCheckpointStateKinds);
// The name of the lock file create() holds in the save directory.
inline constexpr std::string_view kCheckpointLockName = ".strata-save.lock";

class CheckpointSaver {
 public:
  static StatusOr<std::unique_ptr<CheckpointSaver>> create(const CheckpointSaverOptions& options);
  // Finishes (waits for every save) and logs any error nobody collected.
  ~CheckpointSaver();
  CheckpointSaver(const CheckpointSaver&) = delete;
  CheckpointSaver& operator=(const CheckpointSaver&) = delete;

  const std::string& directory() const;

  // Hands over rank snapshot.rank()'s shards for checkpoint `step` (any thread; each rank
  // once per step). Checks the snapshot against the save's other ranks (world size,
  // group names and sizes) and returns; the writing runs on the saver's thread. The save
  // commits once all world_size ranks and the trainer state have arrived.
  Status submit(int64_t step, RankSnapshot snapshot);
  // The caller's trainer state for checkpoint `step`: JSON text (checked to parse),
  // stored byte for byte. Exactly once per step, from any one rank.
  Status submit_trainer_state(int64_t step, std::string json);

  // Does not block: the first save failure (after its retry) not yet returned, naming its
  // step and file; Ok while none. For a trainer to learn of a failure at the next step.
  Status poll();
  // Blocks until every save submitted so far has committed or failed; returns the first
  // failure not yet returned (naming its step, and how many others failed).
  Status wait();
  // wait(), then stops the thread; later submits fail.
  Status finish();

  // Process ranks: blocks until this saver's rank files of `step` are written and fsynced,
  // and returns their records as text for add_peer_files() on the saver holding rank 0 —
  // or, when a write failed, a text that makes that saver fail the step naming it.
  StatusOr<std::string> local_files(int64_t step);
  // Process ranks: the text for add_peer_files() of a process whose part of a step failed
  // before its snapshots reached the saver (`why`; local_files() would wait for them).
  std::string failed_files(const Status& why) const;
  // Process ranks, on the saver holding rank 0: every process's local_files() or
  // failed_files() text for `step` (its own file records are skipped). The step commits
  // once all ranks' files are in; a failure text fails it, and the step ends (as failed,
  // for wait()) once every rank's files are in or failed — this saver's own ranks
  // included, when its own text is a failure. The trainer state must have been submitted.
  Status add_peer_files(int64_t step, const std::vector<std::string>& texts);

  int64_t last_committed_step() const;  // -1 before the first commit
  uint64_t bytes_written() const;       // by committed and failed saves, all files

  class Impl;

 private:
  explicit CheckpointSaver(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What the manifest says about a group.
struct SavedTensor {
  std::string name;
  std::vector<int64_t> shape;
  size_t offset = 0;  // first element within the flat group
  size_t numel = 0;
};
struct SavedGroup {
  int id = 0;
  std::string name;
  size_t numel = 0;        // unpadded
  size_t shard_numel = 0;  // per rank, at the saved world size
  bool frozen = false;     // "frozen": true: no segments in the rank files
  std::vector<SavedTensor> tensors;
};

inline constexpr size_t kNoSegment = static_cast<size_t>(-1);

// What the manifest says about one stored range of a file: a rank file holds one segment
// per (group, kind), group-major; the trainer state one segment covering it.
struct ManifestSegment {
  int group = 0;
  CheckpointStateKind kind = CheckpointStateKind::kMaster;
  uint64_t offset = 0;              // bytes into the file
  uint64_t bytes = 0;
  std::vector<uint64_t> checksums;  // XXH64 of each chunk_bytes chunk, the last one short
};
struct ManifestFile {
  std::string name;  // within the checkpoint directory
  int rank = -1;     // -1 for the trainer state
  uint64_t bytes = 0;
  std::vector<ManifestSegment> segments;
};
// A manifest parsed and checked on its own, before any file it lists is touched.
struct CheckpointManifest {
  int64_t step = 0;
  int64_t engine_steps = 0;
  std::optional<LossScaler::State> loss_scaler;
  int world_size = 1;
  size_t chunk_bytes = 0;
  int kinds = kCheckpointStateKinds;  // segments per group in the rank files: 4 with stale parameters (version 2)
  std::vector<SavedGroup> groups;
  std::vector<uint64_t> group_base;  // per group: byte offset of its block in every rank file
  std::vector<size_t> group_segment; // per group: index of its first segment in a rank file (kNoSegment: frozen)
  size_t rank_file_segments = 0;     // segments per rank file: kinds per trainable group
  uint64_t rank_file_bytes = 0;      // every rank file's size: the trainable groups' blocks back to back
  std::vector<ManifestFile> files;   // rank files in rank order, then trainer_state.json
};

// Parses manifest.json's text and checks it: a JSON object, the format and version, its
// own checksum, the field types, a layout whose groups, files, segments and checksum
// counts agree. kDataLoss naming `manifest_path` and the field.
StatusOr<CheckpointManifest> parse_checkpoint_manifest(std::string_view text, const std::string& manifest_path);
// `text` (a manifest's JSON object) with manifest_checksum set to match the rest: for
// tests and the fuzz harness, which edit manifests and must pass the checksum to reach
// the checks behind it. kInvalidArgument when `text` is not a JSON object.
StatusOr<std::string> reseal_checkpoint_manifest(std::string_view text);

struct CheckpointReadOptions {
  bool verify_checksums = true;  // verify every chunk read
  bool direct_io = true;         // O_DIRECT reads where the file system takes them
};

class CheckpointReader {
 public:
  // Opens a checkpoint directory (D/step-<N>): reads and checks the manifest (present,
  // parses, its checksum, format version, consistent layout) and every file's size
  // (kDataLoss "truncated" naming the file, its size and the size expected). Reads no
  // shard data.
  static StatusOr<std::unique_ptr<CheckpointReader>> open(const std::string& checkpoint_dir,
                                                          const CheckpointReadOptions& options = {});
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const std::string& path() const { return path_; }
  int64_t step() const { return step_; }
  int64_t engine_steps() const { return engine_steps_; }
  const std::optional<LossScaler::State>& loss_scaler() const { return loss_scaler_; }
  int world_size() const { return world_size_; }
  const std::string& trainer_state() const { return trainer_state_; }  // as submitted
  const std::vector<SavedGroup>& groups() const { return groups_; }
  // The rank files carry the stale parameters of a delayed-mode save (kStaleParams reads them).
  bool has_stale_parameters() const { return kinds_ > kCheckpointStateKinds; }

  // Checks that `layout` (any world size) describes the saved group with its id: same
  // name, numel and tensors (names, shapes, offsets). The error names the difference.
  Status check_layout(const GroupLayout& layout) const;

  // Reads elements [first, first + out.size()) of group `group`'s unpadded flat `kind`
  // state; elements at or past numel read as 0. Thread-safe (pread, no shared buffers).
  Status read_range(int group, CheckpointStateKind kind, uint64_t first, std::span<float> out) const;
  // Rank `rank` of `world_size`'s shard, whose size is out.size() (that world size's
  // shard_numel): read_range(group, kind, rank * out.size(), out).
  Status load_shard(int group, CheckpointStateKind kind, int rank, int world_size, std::span<float> out) const;

  // Reads every byte of every file and checks every checksum.
  Status verify() const;

 private:
  using Segment = ManifestSegment;
  struct File;
  CheckpointReader() = default;
  // Reads [segment_offset, segment_offset + bytes) of a segment into `out`, verifying the
  // checksums of the chunks it touches.
  Status read_segment(const File& file, const Segment& segment, uint64_t offset, size_t bytes, void* out) const;

  CheckpointReadOptions options_;
  std::string path_;
  int64_t step_ = 0;
  int64_t engine_steps_ = 0;
  std::optional<LossScaler::State> loss_scaler_;
  int world_size_ = 1;
  size_t chunk_bytes_ = 0;
  int kinds_ = kCheckpointStateKinds;  // segments per group in the rank files
  std::string trainer_state_;
  std::vector<SavedGroup> groups_;
  std::vector<File> files_;        // rank files in rank order, then trainer_state.json
  std::vector<size_t> group_base_; // per group: byte offset of its block in every rank file
  std::vector<size_t> group_segment_; // per group: its first segment in a rank file (kNoSegment: frozen)
};

struct CheckpointRef {
  std::string path;  // D/step-<N>
  int64_t step = 0;
};

struct LatestCompleteOptions {
  bool verify_checksums = true;  // read every file of the candidate and check every checksum
};

// The newest complete checkpoint in `save_dir`. Candidates are D/step-<N> directories,
// newest first; one that fails CheckpointReader::open (or verify(), with
// verify_checksums) is skipped with a warning naming the directory and why, as are
// D/.tmp-step-* directories (an interrupted save). kNotFound when none is complete,
// naming D and what was skipped.
StatusOr<CheckpointRef> latest_complete(const std::string& save_dir, const LatestCompleteOptions& options = {});

// Engine glue. `rank` is the engine's rank (EngineOptions::rank).
// Copies this rank's master, exp_avg and exp_avg_sq shards of every trainable group out of the
// engine (waiting for pending updates), and the stale parameters when the engine has them
// (delayed overlap mode), with engine.steps_taken(). Call between steps.
StatusOr<RankSnapshot> snapshot_engine_state(Engine& engine, int rank);
// Loads this rank's shards of every trainable group from `reader` (any saved world size):
// checks every group's layout (frozen groups included: frozen in both or neither), write_state_shard() for the three kinds, refresh_parameters(), the
// stale parameters when both the checkpoint and the engine are delayed-mode (see above),
// set_steps_taken(reader.engine_steps()), set_step_number(reader.step()), and the loss
// scaler's state when both the checkpoint and the engine have one. Call after start(),
// between steps.
Status load_engine_state(Engine& engine, int rank, const CheckpointReader& reader);

}  // namespace strata
