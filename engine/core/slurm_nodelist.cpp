#include "engine/core/slurm_nodelist.h"

#include <algorithm>
#include <charconv>
#include <optional>

namespace strata {

namespace {

// A host list bigger than any cluster: garbage such as "n[0-99999999]" is refused, not expanded.
constexpr size_t kMaxSlurmHosts = size_t{1} << 20;

Status nodelist_error(std::string_view nodelist, std::string_view why) {
  return InvalidArgumentError("Slurm node list '" + std::string(nodelist) + "': " + std::string(why));
}

// Parses a whole decimal number in [0, 10^9] from `text`.
std::optional<long long> parse_list_number(std::string_view text) {
  long long value = 0;
  const auto [ptr, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || ptr != text.data() + text.size() || value < 0 || value > 1000000000)
    return std::nullopt;
  return value;
}

// Expands one name that may hold brackets ("rack[1-2]-n[01,03]") onto `hosts`.
Status expand_slurm_host(std::string_view whole, std::string_view name, std::vector<std::string>& hosts) {
  const size_t open = name.find('[');
  if (open == std::string_view::npos) {
    if (name.find(']') != std::string_view::npos) return nodelist_error(whole, "']' without '['");
    if (hosts.size() >= kMaxSlurmHosts) return nodelist_error(whole, "more than 2^20 hosts");
    hosts.emplace_back(name);
    return Status::Ok();
  }
  const size_t close = name.find(']', open);
  if (close == std::string_view::npos) return nodelist_error(whole, "'[' without ']'");
  const std::string_view prefix = name.substr(0, open);
  const std::string_view ranges = name.substr(open + 1, close - open - 1);
  const std::string_view rest = name.substr(close + 1);
  size_t start = 0;
  while (start <= ranges.size()) {
    const size_t comma = std::min(ranges.find(',', start), ranges.size());
    const std::string_view range = ranges.substr(start, comma - start);
    const size_t dash = range.find('-');
    const std::string_view low_text = range.substr(0, dash);
    const std::string_view high_text = dash == std::string_view::npos ? low_text : range.substr(dash + 1);
    const std::optional<long long> low = parse_list_number(low_text);
    const std::optional<long long> high = parse_list_number(high_text);
    if (!low || !high || *high < *low)
      return nodelist_error(whole, std::string("'").append(range).append("' is not a number or a range low-high"));
    if (static_cast<size_t>(*high - *low) >= kMaxSlurmHosts) return nodelist_error(whole, "more than 2^20 hosts");
    for (long long value = *low; value <= *high; ++value) {
      std::string digits = std::to_string(value);
      // Slurm keeps the low bound's width: node[08-10] -> node08 node09 node10.
      if (digits.size() < low_text.size()) digits.insert(0, low_text.size() - digits.size(), '0');
      STRATA_RETURN_IF_ERROR(expand_slurm_host(whole, std::string(prefix) + digits + std::string(rest), hosts));
    }
    start = comma + 1;
  }
  return Status::Ok();
}

}  // namespace

StatusOr<std::vector<std::string>> expand_slurm_nodelist(std::string_view nodelist) {
  std::vector<std::string> hosts;
  size_t start = 0;
  int depth = 0;
  for (size_t i = 0; i <= nodelist.size(); ++i) {
    const char c = i < nodelist.size() ? nodelist[i] : ',';
    if (c == '[' && ++depth > 1) return nodelist_error(nodelist, "'[' inside brackets");
    if (c == ']' && --depth < 0) return nodelist_error(nodelist, "']' without '['");
    if (i == nodelist.size() && depth > 0) return nodelist_error(nodelist, "'[' without ']'");
    if (c != ',' || depth > 0) continue;  // a comma inside brackets separates ranges, not hosts
    const std::string_view name = nodelist.substr(start, i - start);
    if (name.empty()) return nodelist_error(nodelist, "an empty host name");
    STRATA_RETURN_IF_ERROR(expand_slurm_host(nodelist, name, hosts));
    start = i + 1;
  }
  return hosts;
}

StatusOr<std::vector<int>> expand_slurm_tasks_per_node(std::string_view tasks_per_node) {
  std::vector<int> counts;
  const auto error = [&] {
    return InvalidArgumentError("Slurm tasks-per-node list '" + std::string(tasks_per_node) +
                                "': expected comma-separated counts, each maybe repeated as N(xK), e.g. 2(x3),1");
  };
  size_t start = 0;
  while (start <= tasks_per_node.size()) {
    const size_t comma = std::min(tasks_per_node.find(',', start), tasks_per_node.size());
    std::string_view item = tasks_per_node.substr(start, comma - start);
    long long repeat = 1;
    const size_t paren = item.find("(x");
    if (paren != std::string_view::npos) {
      if (!item.ends_with(')')) return error();
      const std::optional<long long> times = parse_list_number(item.substr(paren + 2, item.size() - paren - 3));
      if (!times || *times < 1 || static_cast<size_t>(*times) > kMaxSlurmHosts) return error();
      repeat = *times;
      item = item.substr(0, paren);
    }
    const std::optional<long long> count = parse_list_number(item);
    if (!count || *count < 1 || *count > (1 << 20) || counts.size() + repeat > kMaxSlurmHosts) return error();
    counts.insert(counts.end(), static_cast<size_t>(repeat), static_cast<int>(*count));
    start = comma + 1;
  }
  return counts;
}

}  // namespace strata
