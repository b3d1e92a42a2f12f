#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include "examples/strata_bench/bench.h"

namespace strata::bench {

StatusOr<Args> Args::parse(int argc, char** argv, const std::vector<std::string>& value_flags,
                           const std::vector<std::string>& boolean_flags) {
  Args args;
  auto contains = [](const std::vector<std::string>& list, const std::string& name) {
    return std::find(list.begin(), list.end(), name) != list.end();
  };
  for (int i = 0; i < argc; ++i) {
    std::string token = argv[i];
    if (token.rfind("--", 0) != 0) return InvalidArgumentError("unexpected argument '" + token + "'");
    std::string name = token.substr(2);
    std::optional<std::string> value;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    if (contains(boolean_flags, name)) {
      if (value) return InvalidArgumentError("flag --" + name + " takes no value");
      args.values_[name] = "true";
    } else if (contains(value_flags, name)) {
      if (!value) {
        if (i + 1 >= argc) return InvalidArgumentError("flag --" + name + " needs a value");
        value = argv[++i];
      }
      args.values_[name] = *value;
    } else {
      return InvalidArgumentError("unknown flag --" + name);
    }
  }
  return args;
}

std::string Args::get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

StatusOr<int64_t> Args::get_int(const std::string& name, int64_t fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(it->second.c_str(), &end, 10);
  if (errno != 0 || end == it->second.c_str() || *end != '\0')
    return InvalidArgumentError("--" + name + " expects an integer, got '" + it->second + "'");
  return static_cast<int64_t>(value);
}

StatusOr<double> Args::get_double(const std::string& name, double fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(it->second.c_str(), &end);
  if (errno != 0 || end == it->second.c_str() || *end != '\0')
    return InvalidArgumentError("--" + name + " expects a number, got '" + it->second + "'");
  return value;
}

int report_failure(const char* subcommand, const Status& status) {
  std::fprintf(stderr, "strata-bench %s: %s\n", subcommand, status.to_string().c_str());
  return status.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace strata::bench
