// The words the communicators and the rendezvous use in their errors for durations and
// for sets of ranks, so every collective's error reads alike.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace strata {

// "2.5 s": one decimal, as the timeouts are configured.
std::string seconds_text(std::chrono::milliseconds duration);

// "1, 3": the ranks in the order given.
std::string rank_list_text(const std::vector<int>& ranks);

// "rank 1" or "ranks 1, 3".
std::string ranks_text(const std::vector<int>& ranks);

}  // namespace strata
