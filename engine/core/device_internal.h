// Helpers shared by the device implementations (CpuDevice, CudaDevice); not part of the
// public device interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "engine/core/device.h"
#include "engine/core/status.h"

namespace strata::internal {

// "3145728 bytes (3.0 MiB)".
std::string format_bytes(size_t bytes);

// The error for an allocation the budget refuses: names the device, the request (bytes
// and purpose), the budget, the bytes in use and reserved, and the high-water mark.
Status budget_exceeded_error(std::string_view device_name, size_t requested_bytes, std::string_view purpose,
                             const MemoryStats& stats);

// The error bookkeeping of one stream whose work items (CPU stream tasks, CUDA host
// functions) are numbered from 1 in enqueue order: the first error is kept until
// reported; items that run after it are skipped (counted), and so are items enqueued
// before the report, whose authors did not know about the failure. Not thread-safe: the
// stream calls it under its own mutex.
class StreamErrors {
 public:
  // Whether item `number` must be skipped instead of run (counts it when an error is pending).
  bool skip(uint64_t number) {
    if (!error_.ok()) {
      ++skipped_;
      return true;
    }
    return number <= skip_through_;
  }
  // Keeps `error` (raised by item `number`) unless an earlier one is pending.
  void record(uint64_t number, Status error) {
    if (!error_.ok() || error.ok()) return;
    error_ = std::move(error);
    error_number_ = number;
  }
  // Reports (and clears) the pending error if item `through` or an earlier one raised it;
  // items up to `enqueued` (the last enqueued now) are skipped. `items` names the work
  // items in the message ("task(s)", "host function(s)").
  Status take(uint64_t through, uint64_t enqueued, std::string_view stream_name, std::string_view items) {
    if (error_.ok() || error_number_ > through) return {};
    Status error = std::move(error_);
    error_ = Status();
    if (skipped_ > 0) {
      error.with_context(std::to_string(skipped_) + " later " + std::string(items) + " on stream '" + std::string(stream_name) +
                         "' were skipped (cancelled) because of this error");
    }
    skipped_ = 0;
    skip_through_ = enqueued;
    return error;
  }
  bool pending() const { return !error_.ok(); }

 private:
  Status error_;              // the first unreported error
  uint64_t error_number_ = 0; // the item that raised it
  uint64_t skip_through_ = 0; // items up to this number are skipped (enqueued before an error was reported)
  uint64_t skipped_ = 0;      // items skipped since error_ was raised
};

// Folds the errors of several streams into one: the first, with every later one kept as
// an "also:" context line, and a count of them.
class StreamErrorFold {
 public:
  void add(Status error) {
    if (error.ok()) return;
    if (first_.ok()) {
      first_ = std::move(error);
      return;
    }
    ++more_;
    first_.with_context("also: " + error.to_string());
  }
  // The folded error (ok when none was added); `device_name` names the streams' device.
  Status take(std::string_view device_name) {
    if (more_ > 0) first_.with_context(std::to_string(more_) + " more stream(s) of " + std::string(device_name) + " failed (listed above)");
    more_ = 0;
    return std::move(first_);
  }

 private:
  Status first_;
  size_t more_ = 0;
};

// Rounds `value` up to a multiple of `alignment` (a power of two).
constexpr size_t round_up(size_t value, size_t alignment) { return (value + alignment - 1) & ~(alignment - 1); }

}  // namespace strata::internal
