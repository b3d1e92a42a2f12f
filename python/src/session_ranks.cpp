// Session's collectives with more than one process (one rank each; see session.h): whole
// groups all-gathered, checkpoints committed by rank 0 once every rank's files are in,
// Hugging Face exports written by rank 0, and the outcome of each agreed by every rank.
//
// Each call runs the same collectives in the same order on every rank, and a rank that
// fails along the way still takes part in them (sending a failure instead of its data),
// so that every rank returns an error naming it instead of waiting for it: the
// collectives' timeout is left for a rank that is lost or stuck.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "python/src/session.h"

namespace strata::python {
namespace {

nlohmann::json status_json(const Status& status) {
  if (status.ok()) return nlohmann::json{{"ok", true}};
  return nlohmann::json{{"ok", false}, {"code", static_cast<int>(status.code())}, {"text", status.to_string()}};
}

// Another rank's failure as reported to it: its code, and its whole trail as the message.
Status peer_status(const nlohmann::json& outcome, int rank) {
  if (!outcome.is_object() || outcome.value("ok", false)) return {};
  const int code = outcome.value("code", static_cast<int>(StatusCode::kInternal));
  const bool known = code > static_cast<int>(StatusCode::kOk) && code <= static_cast<int>(StatusCode::kUnimplemented);
  return Status(known ? static_cast<StatusCode>(code) : StatusCode::kInternal,
                "rank " + std::to_string(rank) + " failed: " + outcome.value("text", std::string("(no message)")));
}

// The part of a group each rank's shard holds: [begin, begin + count) of the unpadded group.
size_t shard_count(const GroupLayout& layout, int rank) {
  const size_t begin = layout.shard_begin(rank);
  return begin < layout.numel ? std::min(layout.shard_numel, layout.numel - begin) : 0;
}

}  // namespace

StatusOr<std::vector<nlohmann::json>> Session::exchange(const nlohmann::json& mine, std::string_view what) {
  Rendezvous* processes = cluster_->rendezvous();
  if (processes == nullptr) return InternalError(std::string(what) + ": more than one rank, but no rendezvous");
  StatusOr<std::vector<std::string>> texts = processes->all_gather_strings(mine.dump());
  if (!texts.ok()) return std::move(texts).status().with_context(std::string(what) + ": exchanging with the other ranks");
  std::vector<nlohmann::json> all;
  for (const std::string& text : *texts) all.push_back(nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false));
  return all;
}

Status Session::agree(Status mine, std::string_view what) {
  STRATA_ASSIGN_OR_RETURN(const std::vector<nlohmann::json> all, exchange(status_json(mine), what));
  return first_failure(all, std::move(mine), what);
}

Status Session::first_failure(const std::vector<nlohmann::json>& all, Status mine, std::string_view what) const {
  if (!mine.ok()) return mine;
  for (size_t r = 0; r < all.size(); ++r) {
    Status theirs = peer_status(all[r], static_cast<int>(r));
    if (!theirs.ok()) return std::move(theirs).with_context(std::string(what) + " on rank " + std::to_string(rank_));
  }
  return {};
}

StatusOr<ChosenPlacement> Session::placement_of_rank_0() {
  constexpr std::string_view what = "strata.placement \"auto\" (rank 0's choice)";
  StatusOr<ChosenPlacement> mine = rank_ == 0 ? search_placement() : StatusOr<ChosenPlacement>(ChosenPlacement{});
  nlohmann::json sent = status_json(mine.status());
  if (rank_ == 0 && mine.ok()) {
    sent["placement"] = session_placement_json(mine->placement);
    sent["text"] = mine->text;
  }
  STRATA_ASSIGN_OR_RETURN(const std::vector<nlohmann::json> all, exchange(sent, what));
  if (rank_ == 0) return mine;
  STRATA_RETURN_IF_ERROR(peer_status(all[0], 0).with_context(std::string(what)));
  ChosenPlacement chosen;
  STRATA_ASSIGN_OR_RETURN(chosen.placement, session_placement_from_json(all[0].value("placement", nlohmann::json())));
  chosen.text = all[0].value("text", std::string());
  return chosen;
}

Status Session::settle_for_exchange() {
  if (settled_) return {};
  // The engine's fetcher issues all-gathers on the gather communicator ahead of use, into
  // the next step; finished, it has none in flight and plans none until the next gather,
  // so this rank's collectives come in the same order as every other rank's.
  STRATA_RETURN_IF_ERROR(engine_->finish());
  if (!exchange_stream_) {
    STRATA_ASSIGN_OR_RETURN(exchange_stream_, cluster_->device(rank_).create_stream("strata:session-exchange"));
  }
  settled_ = true;
  return {};
}

// Each rank sends its shard followed by one flag element (1: it could not read the shard),
// so a rank's failure reaches every rank at the same group. The front end computes on the
// CPU device, whose memory is host memory: the buffers are plain vectors.
// Host memory in and out. The CPU device's communicator takes host memory as device
// memory; NCCL's takes the GPU's, so on CUDA both ends are staged through device buffers.
Status Session::all_gather_floats(std::span<const float> send, std::span<float> all) {
  Communicator& comm = cluster_->gather_communicator(rank_);
  Device& device = cluster_->device(rank_);
  Stream& stream = *exchange_stream_;
  if (device.kind() == DeviceKind::kCpu) {
    STRATA_RETURN_IF_ERROR(comm.all_gather(send.data(), all.data(), send.size(), DType::kFloat32, stream));
    return stream.synchronize();
  }
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer device_send, device.allocate(send.size_bytes(), "exchange send buffer"));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer device_all, device.allocate(all.size_bytes(), "exchange receive buffer"));
  STRATA_RETURN_IF_ERROR(device.copy_async(device_send.data(), send.data(), send.size_bytes(), CopyKind::kHostToDevice, stream));
  STRATA_RETURN_IF_ERROR(comm.all_gather(device_send.data(), device_all.data(), send.size(), DType::kFloat32, stream));
  STRATA_RETURN_IF_ERROR(device.copy_async(all.data(), device_all.data(), all.size_bytes(), CopyKind::kDeviceToHost, stream));
  return stream.synchronize();  // before the buffers go
}

Status Session::all_gather_group(int group, std::span<float> full) {
  STRATA_RETURN_IF_ERROR(settle_for_exchange());
  const GroupLayout& l = layout(group);
  const size_t stride = l.shard_numel + 1;
  std::vector<float> send(stride, 0.0f);
  Status local = read_shard(group, std::span<float>(send).first(l.shard_numel));
  send.back() = local.ok() ? 0.0f : 1.0f;
  std::vector<float> all(stride * static_cast<size_t>(world_size_));
  const std::string what = "gathering group " + l.name + " from every rank";
  STRATA_RETURN_IF_ERROR_CTX(all_gather_floats(send, all), what);
  if (!local.ok()) return std::move(local).with_context(what);
  std::string failed;
  for (int r = 0; r < world_size_; ++r)
    if (all[static_cast<size_t>(r) * stride + l.shard_numel] != 0.0f) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
  if (!failed.empty()) return UnavailableError("rank(s) " + failed + " could not read their shard of group " + l.name + " (their own error says why)");
  for (int r = 0; r < world_size_; ++r) {
    const size_t count = shard_count(l, r);
    std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(r) * stride), count,
                full.begin() + static_cast<std::ptrdiff_t>(l.shard_begin(r)));
  }
  return {};
}

// A save, as the native trainer's process ranks save: every rank writes its own rank file
// into D/.tmp-step-<N>/ and hands its records to rank 0 (through the rendezvous), whose
// saver writes the trainer state and the manifest and renames the directory into place.
// Before that the ranks agree on the directory and the step; after it, on the outcome, so
// that no rank reports the checkpoint saved before rank 0 has committed it.
Status Session::save_across_processes(const std::string& dir, const std::string& client_state) {
  const int64_t step = engine_->steps_taken();
  Status ready = settle_for_exchange();
  if (ready.ok()) ready = open_saver(dir);
  std::string state;
  if (ready.ok() && rank_ == 0) {
    StatusOr<std::string> text = trainer_state_text(client_state);
    if (text.ok()) state = std::move(text).value();
    else ready = text.status();
  }
  nlohmann::json mine = status_json(ready);
  mine["dir"] = dir;
  mine["step"] = step;
  STRATA_ASSIGN_OR_RETURN(const std::vector<nlohmann::json> all, exchange(mine, "save_checkpoint()"));
  STRATA_RETURN_IF_ERROR(first_failure(all, ready, "save_checkpoint()"));
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].value("dir", std::string()) != dir || all[r].value("step", int64_t{-1}) != step)
      return InvalidArgumentError("save_checkpoint(): rank " + std::to_string(rank_) + " saves step " + std::to_string(step) + " to " + dir +
                                  ", rank " + std::to_string(r) + " step " + std::to_string(all[r].value("step", int64_t{-1})) + " to " +
                                  all[r].value("dir", std::string()) + ": every rank must save the same step to the same directory");
  }
  // Rank 0's trainer state goes first: once it is in, the step ends (committed or failed)
  // when every rank's records are, whatever fails after.
  Status local = rank_ == 0 ? saver_->submit_trainer_state(step, std::move(state)) : Status();
  const bool state_in = rank_ == 0 && local.ok();
  if (local.ok()) {
    StatusOr<RankSnapshot> snapshot = snapshot_engine_state(*engine_, rank_);
    local = snapshot.ok() ? saver_->submit(step, std::move(snapshot).value()) : snapshot.status();
  }
  std::string records;
  if (local.ok()) {
    StatusOr<std::string> written = saver_->local_files(step);  // waits for this rank's file, fsynced
    if (written.ok()) records = std::move(written).value();
    else local = written.status();
  }
  if (!local.ok()) {
    local.with_context("checkpoint step " + std::to_string(step) + " in " + dir + " was not saved");
    records = saver_->failed_files(local);
  }
  Rendezvous& processes = *cluster_->rendezvous();
  StatusOr<std::vector<std::string>> every = processes.all_gather_strings(records);
  if (!every.ok()) {
    if (state_in) {  // the step cannot end without the records: abandoned, so that no later save waits behind it
      (void)saver_->finish();
      saver_.reset();
    }
    return std::move(every).status().with_context("save_checkpoint(): exchanging the rank files' records of step " + std::to_string(step));
  }
  Status outcome = local;
  if (state_in) {
    Status added = saver_->add_peer_files(step, *every);
    // The saver is waited on for this step's outcome (a failure's too, so no later wait
    // reports it again); a step it could not take the records of never ends: start afresh.
    Status saved = added.ok() ? saver_->wait() : saver_->finish();
    if (!added.ok()) saver_.reset();
    if (outcome.ok()) outcome = !added.ok() ? std::move(added) : std::move(saved);
  } else {
    Status saved = saver_->wait();  // this rank's write, and any failure not yet collected
    if (outcome.ok()) outcome = std::move(saved);
  }
  return agree(std::move(outcome), "save_checkpoint()");
}

// Rank 0 picks the checkpoint (D itself, or D's newest complete one) and every rank loads
// its shards of it, whatever world size saved it (the engine reshards on load).
StatusOr<std::string> Session::load_across_processes(const std::string& dir) {
  Status located;
  std::string path;
  if (rank_ == 0) {
    StatusOr<std::string> found = checkpoint_to_load(dir);
    if (found.ok()) path = std::move(found).value();
    else located = found.status();
  }
  nlohmann::json mine = status_json(located);
  mine["path"] = path;
  STRATA_ASSIGN_OR_RETURN(const std::vector<nlohmann::json> all, exchange(mine, "load_checkpoint()"));
  STRATA_RETURN_IF_ERROR(first_failure(all, located, "load_checkpoint()"));
  path = all.front().value("path", std::string());
  StatusOr<std::string> client = load_checkpoint_at(path);
  STRATA_RETURN_IF_ERROR(agree(client.status(), "load_checkpoint(" + path + ")"));
  return client;
}

// Rank 0 writes the export, asking for whole groups in the export's order; the other ranks
// take part in the same all-gathers, in that order. When rank 0's write stops early (a
// full disk) it completes the gathers, so the others finish, and every rank returns its error.
Status Session::export_across_processes(const std::string& dir, const nlohmann::json& config, std::span<const GroupLayout> layouts,
                                        const hf::HfNameMap& map, hf::SafetensorsDType dtype, const hf::HfExportOptions& options) {
  STRATA_ASSIGN_OR_RETURN(const std::vector<int> order, hf::export_group_order(layouts, map));
  // The directory is checked before anything is gathered for it.
  Status ready = rank_ == 0 ? hf::check_export_directory(dir) : Status();
  STRATA_RETURN_IF_ERROR(agree(std::move(ready), "export_hf(" + dir + ")"));
  size_t next = 0;             // the next group of `order` to gather
  bool gathers_failed = false; // a gather failed on every rank (or the communicator did): no more
  auto gather_next = [&](int group, std::span<float> out) -> Status {
    if (next >= order.size() || order[next] != group)
      return InternalError("export_hf(): the export asked for group " + std::to_string(group) + " off its planned order");
    ++next;
    Status gathered = all_gather_group(group, out);
    gathers_failed = !gathered.ok();
    return gathered;
  };
  Status outcome;
  if (rank_ == 0) outcome = hf::export_hf_from_groups(dir, config, layouts, map, dtype, gather_next, options);
  std::vector<float> scratch;
  while (!gathers_failed && next < order.size()) {
    scratch.resize(layout(order[next]).numel);
    Status gathered = gather_next(order[next], scratch);
    if (outcome.ok()) outcome = std::move(gathered);
  }
  return agree(std::move(outcome), "export_hf(" + dir + ")");
}

}  // namespace strata::python
