#include "engine/version_board.h"

#include <algorithm>
#include <sstream>

namespace strata::engine_internal {

void VersionBoard::publish(int g, int64_t version) {
  {
    std::lock_guard<std::mutex> lock(sync_.mutex);
    int64_t& v = versions_[static_cast<size_t>(g)];
    v = std::max(v, version);
  }
  sync_.cv.notify_all();
}

int64_t VersionBoard::version(int g) const {
  std::lock_guard<std::mutex> lock(sync_.mutex);
  return versions_[static_cast<size_t>(g)];
}

Status VersionBoard::wait_for(int g, int64_t version, const char* what, const std::function<std::string()>& describe) {
  std::unique_lock<std::mutex> lock(sync_.mutex);
  return stage_wait(lock, sync_.cv, sync_.halt, [&] { return versions_[static_cast<size_t>(g)] >= version; }, what, describe);
}

Status VersionBoard::wait_all(int64_t version, const char* what, const std::function<std::string()>& describe) {
  std::unique_lock<std::mutex> lock(sync_.mutex);
  return stage_wait(lock, sync_.cv, sync_.halt, [&] {
    return std::all_of(versions_.begin(), versions_.end(), [&](int64_t v) { return v >= version; });
  }, what, describe);
}

void VersionBoard::abort(const Status& status) { sync_.abort(status); }

void VersionBoard::stop() { sync_.stop(); }

std::string VersionBoard::describe() const {
  std::lock_guard<std::mutex> lock(sync_.mutex);
  std::ostringstream text;
  text << "parameter versions:";
  for (int64_t v : versions_) {
    if (v == kAlwaysCurrent) text << " frozen";
    else text << " " << v;
  }
  return text.str();
}

}  // namespace strata::engine_internal
