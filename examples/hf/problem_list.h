// One error that lists every problem found, so a user fixes a checkpoint in one round
// rather than one message at a time.
#pragma once

#include <algorithm>
#include <span>
#include <string>

#include "engine/core/status.h"

namespace strata::hf {

// OK when `problems` is empty; else kInvalidArgument "<head>: p1; p2; ...", showing the
// first `shown` and counting the rest.
inline Status problem_list_error(const std::string& head, std::span<const std::string> problems, size_t shown = 12) {
  if (problems.empty()) return Status::Ok();
  std::string text = head + ": ";
  const size_t count = std::min(problems.size(), shown);
  for (size_t i = 0; i < count; ++i) text += (i ? "; " : "") + problems[i];
  if (problems.size() > count) text += "; and " + std::to_string(problems.size() - count) + " more";
  return InvalidArgumentError(text);
}

}  // namespace strata::hf
