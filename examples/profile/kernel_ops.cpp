#include "examples/profile/kernel_ops.h"

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

namespace strata::profile {

namespace {

constexpr std::array<std::pair<std::string_view, double>, 13> kAccesses{{
    {"layernorm fwd", 2},      // x -> y
    {"layernorm bwd", 3},      // dy, x -> dx
    {"rmsnorm fwd", 2},
    {"rmsnorm bwd", 3},
    {"gelu fwd", 2},           // x -> y
    {"gelu bwd", 3},           // dy, x -> dx
    {"swiglu fwd", 3},         // gate, up -> y
    {"swiglu bwd", 5},         // dy, gate, up -> dgate, dup
    {"rope fwd", 2},
    {"rope bwd", 2},
    {"cross-entropy fwd", 1},  // the logits, read for the log-sum-exp
    {"cross-entropy bwd", 2},  // logits -> their gradient
    {"residual add", 3},       // a, b -> a + b
}};

}  // namespace

std::optional<double> memory_op_accesses(std::string_view op) {
  for (const auto& [name, accesses] : kAccesses)
    if (name == op) return accesses;
  return std::nullopt;
}

double memory_op_rate(const MachineProfile& profile, std::string_view op) {
  std::vector<double> rates;
  for (const KernelRate& k : profile.compute.kernels)
    if (k.kind == "memory" && k.op == op && k.rate_per_s > 0) rates.push_back(k.rate_per_s);
  if (rates.empty()) return streaming_rate(profile);
  std::sort(rates.begin(), rates.end());
  const size_t n = rates.size();
  return n % 2 == 1 ? rates[n / 2] : (rates[n / 2 - 1] + rates[n / 2]) / 2;
}

double streaming_rate(const MachineProfile& profile) {
  if (profile.copy.host_copy && profile.copy.d2h_bytes_per_s > 0) return profile.copy.d2h_bytes_per_s;
  return profile.compute.memory_bytes_per_s;
}

}  // namespace strata::profile
