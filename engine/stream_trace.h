// Intervals of stream work traced from timing events, not host callbacks.
//
// A host function in a CUDA stream (cudaLaunchHostFunc) holds the stream until a runtime
// thread has run it, so stamping the clock with one before and after each piece of work
// costs the stream throughput. StreamTrace records a timing event (device.h) before the
// work and one after it instead; the device stamps them as the stream reaches them, and
// collect() turns the pairs whose end has completed into Tracer intervals, off the
// stream, at points the engine passes anyway (the end of a step, finish()).
//
// An interval means what the host callbacks gave before: from the moment the stream
// reached the work (the work before it, and any event it waits on, done) to the moment
// it finished it.
//
// Bounded: the events come from a pool of at most max_events (two per interval in
// flight); a resolved interval gives its two back. When the pool is exhausted, open() or
// close() first resolves what has completed (non-blocking); if nothing has, the interval
// is dropped and counted (stats().dropped), never waited for: a trace must not stall the
// pipeline nor hang it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/core/device.h"
#include "engine/trace.h"

namespace strata {

struct StreamTraceOptions {
  size_t max_events = 4096;  // timing events the pool may create (two per interval in flight)
};

struct StreamTraceStats {
  size_t pending = 0;         // intervals closed whose end has not been collected yet
  size_t events_created = 0;  // timing events in the pool, in use or free (<= max_events)
  uint64_t resolved = 0;      // intervals handed to the tracer
  uint64_t dropped = 0;       // intervals not traced: the pool was exhausted, or the stream skipped their events after an error
};

class StreamTrace {
 public:
  // The start of an interval on one stream: its begin event. Move-only; giving it to
  // close() ends the interval, and destroying it unclosed gives its event back. Must not
  // outlive the StreamTrace that opened it. An Opened without an event (the pool was
  // exhausted) closes into a dropped interval.
  class Opened {
   public:
    Opened() = default;
    Opened(Opened&& other) noexcept { *this = std::move(other); }
    Opened& operator=(Opened&& other) noexcept;
    Opened(const Opened&) = delete;
    Opened& operator=(const Opened&) = delete;
    ~Opened() { reset(); }
    // Gives the begin event back to the pool (the interval is forgotten).
    void reset();

   private:
    friend class StreamTrace;
    StreamTrace* owner_ = nullptr;
    Stream* stream_ = nullptr;
    std::unique_ptr<TimingEvent> begin_;
  };

  static StatusOr<std::unique_ptr<StreamTrace>> create(Device& device, Tracer& tracer, const StreamTraceOptions& options = {});
  StreamTrace(const StreamTrace&) = delete;
  StreamTrace& operator=(const StreamTrace&) = delete;

  // Records the begin event on `stream`: call before enqueueing the work.
  StatusOr<Opened> open(Stream& stream);
  // Records the end event on the stream `opened` was opened on, after the work; the
  // interval is resolved by a later collect().
  Status close(Opened opened, Stage stage, int group, std::string label);
  // open(), work() (which enqueues the work on `stream`), close().
  Status traced(Stream& stream, Stage stage, int group, std::string label, const std::function<Status()>& work);

  // Hands every interval whose events have completed to the tracer, in stream order, and
  // their events back to the pool. Never blocks on the device: after a synchronize of the
  // streams (finish()), it resolves everything closed. Errors are the device's (a failed
  // event query); an interval whose events a stream skipped after an error is dropped,
  // since that error is reported by the stream's own synchronize.
  Status collect();

  StreamTraceStats stats() const;

 private:
  StreamTrace(Device& device, Tracer& tracer, const StreamTraceOptions& options) : device_(device), tracer_(tracer), options_(options) {}

  struct Pending {
    std::unique_ptr<TimingEvent> begin;
    std::unique_ptr<TimingEvent> end;
    Stage stage;
    int group;
    std::string label;
  };

  // With mutex_ held: a free event, a new one while the pool may grow, or (after a
  // collect that freed none) nullptr.
  StatusOr<std::unique_ptr<TimingEvent>> acquire_locked();
  Status collect_locked();
  // Resolves the oldest pending interval of one stream if its end has completed; false when it has not.
  StatusOr<bool> resolve_front(std::deque<Pending>& queue);
  void give_back(std::unique_ptr<TimingEvent> event);

  Device& device_;
  Tracer& tracer_;
  const StreamTraceOptions options_;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<TimingEvent>> free_;   // guarded by mutex_
  // Closed intervals per stream, in the order their end events were recorded (which is
  // the order they complete in). Keys are only compared, never dereferenced.
  std::map<const Stream*, std::deque<Pending>> pending_;  // guarded by mutex_
  StreamTraceStats stats_;                                // guarded by mutex_ (pending is counted on demand)
};

}  // namespace strata
