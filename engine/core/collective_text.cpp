#include "engine/core/collective_text.h"

#include <cstdio>

namespace strata {

std::string seconds_text(std::chrono::milliseconds duration) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f s", static_cast<double>(duration.count()) / 1000.0);
  return text;
}

std::string rank_list_text(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(ranks[i]);
  }
  return text;
}

std::string ranks_text(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + rank_list_text(ranks);
}

}  // namespace strata
