#include "examples/strata_launch/line_prefixer.h"

#include <utility>

#include "engine/core/file.h"

namespace strata::launch {

LineSink fd_line_sink(int fd, std::string name) {
  return [fd, name = std::move(name)](std::string_view line) { return write_all(fd, name, line.data(), line.size()); };
}

LinePrefixer::LinePrefixer(std::string prefix, LineSink sink) : prefix_(std::move(prefix)), sink_(std::move(sink)) {}

Status LinePrefixer::feed(std::span<const char> bytes) {
  std::string_view rest(bytes.data(), bytes.size());
  while (!rest.empty()) {
    const size_t newline = rest.find('\n');
    const size_t room = kMaxLineBytes - pending_.size();
    if (newline == std::string_view::npos && rest.size() < room) {
      pending_.append(rest);
      return Status::Ok();
    }
    const size_t take = newline == std::string_view::npos ? room : std::min(newline + 1, room);
    pending_.append(rest.substr(0, take));
    rest.remove_prefix(take);
    STRATA_RETURN_IF_ERROR(emit(pending_));
    pending_.clear();
  }
  return Status::Ok();
}

Status LinePrefixer::finish() {
  if (pending_.empty()) return Status::Ok();
  Status status = emit(pending_);
  pending_.clear();
  return status;
}

Status LinePrefixer::emit(std::string_view text) {
  std::string line;
  line.reserve(prefix_.size() + text.size() + 1);
  line.append(prefix_).append(text);
  if (line.back() != '\n') line.push_back('\n');
  return sink_(line);
}

}  // namespace strata::launch
