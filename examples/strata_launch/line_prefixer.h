// Prefixes each line of a byte stream ("[rank 3] ") and hands it on whole, so that the
// output of several processes merged into one stream is never interleaved mid-line:
// every line reaches the sink in one call (one write(2) when the sink is a descriptor).
#pragma once

#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <string_view>

#include "engine/core/status.h"

namespace strata::launch {

// Receives one prefixed line, with its '\n'.
using LineSink = std::function<Status(std::string_view line)>;

// A sink writing each line with one write_all to `fd` (named `name` in errors). Writes of
// up to PIPE_BUF bytes to a pipe are atomic; longer lines stay whole as long as this
// process is the only writer, which it is for the launcher's stdout and stderr.
LineSink fd_line_sink(int fd, std::string name);

class LinePrefixer {
 public:
  // A line longer than this is passed on in pieces of this size, each prefixed, rather
  // than held without bound (a child printing a progress bar without newlines).
  static constexpr size_t kMaxLineBytes = size_t{64} << 10;

  LinePrefixer(std::string prefix, LineSink sink);

  // Passes on every line `bytes` completes; keeps the unfinished tail for the next call.
  Status feed(std::span<const char> bytes);
  // At the end of the stream: passes on an unfinished last line, with a '\n' added.
  Status finish();

 private:
  Status emit(std::string_view text);  // prefix + text (+ '\n' if missing) to the sink

  std::string prefix_;
  LineSink sink_;
  std::string pending_;  // the unfinished line
};

}  // namespace strata::launch
