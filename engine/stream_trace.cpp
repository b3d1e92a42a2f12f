#include "engine/stream_trace.h"

#include <utility>

namespace strata {

StreamTrace::Opened& StreamTrace::Opened::operator=(Opened&& other) noexcept {
  if (this != &other) {
    reset();
    owner_ = std::exchange(other.owner_, nullptr);
    stream_ = std::exchange(other.stream_, nullptr);
    begin_ = std::move(other.begin_);
  }
  return *this;
}

void StreamTrace::Opened::reset() {
  if (owner_ != nullptr && begin_ != nullptr) {
    std::lock_guard<std::mutex> lock(owner_->mutex_);
    owner_->give_back(std::move(begin_));
  }
  owner_ = nullptr;
  stream_ = nullptr;
  begin_.reset();
}

StatusOr<std::unique_ptr<StreamTrace>> StreamTrace::create(Device& device, Tracer& tracer, const StreamTraceOptions& options) {
  if (options.max_events < 2) {
    return InvalidArgumentError("stream trace: max_events is " + std::to_string(options.max_events) +
                                "; an interval takes two timing events, so it must be at least 2");
  }
  return std::unique_ptr<StreamTrace>(new StreamTrace(device, tracer, options));
}

void StreamTrace::give_back(std::unique_ptr<TimingEvent> event) {
  // Re-recording a pooled event moves it, so one still in flight may be reused.
  free_.push_back(std::move(event));
}

StatusOr<std::unique_ptr<TimingEvent>> StreamTrace::acquire_locked() {
  if (free_.empty() && stats_.events_created >= options_.max_events) STRATA_RETURN_IF_ERROR(collect_locked());
  if (!free_.empty()) {
    std::unique_ptr<TimingEvent> event = std::move(free_.back());
    free_.pop_back();
    return event;
  }
  if (stats_.events_created >= options_.max_events) return std::unique_ptr<TimingEvent>();
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<TimingEvent> event, device_.create_timing_event());
  ++stats_.events_created;
  return event;
}

StatusOr<StreamTrace::Opened> StreamTrace::open(Stream& stream) {
  std::unique_ptr<TimingEvent> begin;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    STRATA_ASSIGN_OR_RETURN(begin, acquire_locked());
    if (begin != nullptr) {
      Status recorded = stream.record(*begin);
      if (!recorded.ok()) {
        give_back(std::move(begin));
        return std::move(recorded).with_context("stream trace: the begin event on stream '" + stream.name() + "'");
      }
    }
  }
  Opened opened;
  opened.owner_ = this;
  opened.stream_ = &stream;
  opened.begin_ = std::move(begin);
  return opened;
}

Status StreamTrace::close(Opened opened, Stage stage, int group, std::string label) {
  if (opened.owner_ != this) {
    return FailedPreconditionError("stream trace: close() of an interval this trace did not open (" + std::string(stage_name(stage)) +
                                   " " + label + ")");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (opened.begin_ == nullptr) {
    ++stats_.dropped;
    return {};
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<TimingEvent> end, acquire_locked());
  if (end == nullptr) {
    ++stats_.dropped;
    give_back(std::move(opened.begin_));
    return {};
  }
  // Recorded under the lock, so each stream's queue is in the order its ends complete.
  Status recorded = opened.stream_->record(*end);
  if (!recorded.ok()) {
    give_back(std::move(end));
    give_back(std::move(opened.begin_));
    return std::move(recorded).with_context("stream trace: the end event of " + std::string(stage_name(stage)) + " " + label);
  }
  pending_[opened.stream_].push_back({std::move(opened.begin_), std::move(end), stage, group, std::move(label)});
  return {};
}

Status StreamTrace::traced(Stream& stream, Stage stage, int group, std::string label, const std::function<Status()>& work) {
  STRATA_ASSIGN_OR_RETURN(Opened opened, open(stream));
  STRATA_RETURN_IF_ERROR(work());
  return close(std::move(opened), stage, group, std::move(label));
}

StatusOr<bool> StreamTrace::resolve_front(std::deque<Pending>& queue) {
  Pending& front = queue.front();
  StatusOr<std::optional<TimingEvent::Clock::time_point>> end = front.end->completion_time();
  if (end.ok() && !end->has_value()) return false;
  // The begin event is earlier in the same stream: complete whenever the end is.
  StatusOr<std::optional<TimingEvent::Clock::time_point>> begin = end.ok() ? front.begin->completion_time() : end;
  Status failure = !end.ok() ? end.status() : begin.status();
  if (failure.ok() && !begin->has_value()) return false;
  if (failure.ok()) {
    tracer_.record(front.stage, front.group, **begin, **end, std::move(front.label));
    ++stats_.resolved;
  } else {
    ++stats_.dropped;
  }
  give_back(std::move(front.begin));
  give_back(std::move(front.end));
  queue.pop_front();
  // A skipped event (kCancelled) is the stream's error, reported by its synchronize.
  if (!failure.ok() && failure.code() != StatusCode::kCancelled) return std::move(failure).with_context("stream trace: collecting an interval");
  return true;
}

Status StreamTrace::collect_locked() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    std::deque<Pending>& queue = it->second;
    while (!queue.empty()) {
      STRATA_ASSIGN_OR_RETURN(const bool resolved, resolve_front(queue));
      if (!resolved) break;
    }
    it = queue.empty() ? pending_.erase(it) : std::next(it);
  }
  return {};
}

Status StreamTrace::collect() {
  std::lock_guard<std::mutex> lock(mutex_);
  return collect_locked();
}

StreamTraceStats StreamTrace::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  StreamTraceStats stats = stats_;
  for (const auto& [stream, queue] : pending_) stats.pending += queue.size();
  return stats;
}

}  // namespace strata
