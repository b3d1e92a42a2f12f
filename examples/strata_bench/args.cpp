#include <algorithm>
#include <cstdio>

#include "examples/strata_bench/bench.h"

namespace strata::bench {

StatusOr<Args> Args::parse(int argc, char** argv, const std::vector<std::string>& value_flags,
                           const std::vector<std::string>& boolean_flags) {
  Args args;
  auto contains = [](const std::vector<std::string>& list, const std::string& name) {
    return std::find(list.begin(), list.end(), name) != list.end();
  };
  const std::vector<std::string> arguments(argv, argv + argc);
  for (size_t i = 0; i < arguments.size(); ++i) {
    STRATA_ASSIGN_OR_RETURN(const flags::FlagToken token, flags::split_flag(arguments[i]));
    if (contains(boolean_flags, token.name)) {
      if (token.inline_value) return InvalidArgumentError("flag --" + token.name + " takes no value");
      args.values_[token.name] = "true";
    } else if (contains(value_flags, token.name)) {
      STRATA_ASSIGN_OR_RETURN(args.values_[token.name], flags::take_flag_value(arguments, i, token));
    } else {
      return InvalidArgumentError("unknown flag --" + token.name);
    }
  }
  return args;
}

std::string Args::get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

StatusOr<int64_t> Args::get_int(const std::string& name, int64_t fallback) const { return get_integer<int64_t>(name, fallback); }

StatusOr<double> Args::get_double(const std::string& name, double fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  return flags::parse_flag_number(name, it->second);
}

int report_failure(const char* subcommand, const Status& status) {
  std::fprintf(stderr, "strata-bench %s: %s\n", subcommand, status.to_string().c_str());
  return status.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace strata::bench
