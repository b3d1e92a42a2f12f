// The version board: the hand-off from the optimizer stage to the parameter fetcher (and
// the model thread). The optimizer publishes each group's parameter version once its new
// parameters are in place; a fetch waits for the version its use needs.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "engine/core/status.h"
#include "engine/stage_wait.h"

namespace strata::engine_internal {

// The parameter version (updates applied) of every group's copy the fetcher reads. A
// frozen group's one copy is every version: it reads as always current.
class VersionBoard {
 public:
  static constexpr int64_t kAlwaysCurrent = std::numeric_limits<int64_t>::max();
  explicit VersionBoard(const std::vector<bool>& trainable) {
    for (bool t : trainable) versions_.push_back(t ? 0 : kAlwaysCurrent);
  }
  void publish(int g, int64_t version);  // versions only grow
  int64_t version(int g) const;
  Status wait_for(int g, int64_t version, const char* what, const std::function<std::string()>& describe);
  Status wait_all(int64_t version, const char* what, const std::function<std::string()>& describe);
  void abort(const Status& status);
  void stop();
  std::string describe() const;

 private:
  mutable StageSync sync_;
  std::vector<int64_t> versions_;
};

}  // namespace strata::engine_internal
