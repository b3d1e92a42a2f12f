#include "examples/flags/flags.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <system_error>

namespace strata::flags {

StatusOr<FlagToken> split_flag(std::string_view argument) {
  if (argument.substr(0, 2) != "--" || argument.size() == 2)
    return InvalidArgumentError("unexpected argument \"" + std::string(argument) + "\" (flags start with --; see --help)");
  FlagToken token;
  std::string_view name = argument.substr(2);
  if (const size_t eq = name.find('='); eq != std::string_view::npos) {
    token.inline_value = std::string(name.substr(eq + 1));
    name = name.substr(0, eq);
  }
  token.name = std::string(name);
  return token;
}

StatusOr<std::string> take_flag_value(std::span<const std::string> args, size_t& index, const FlagToken& flag) {
  if (flag.inline_value) return *flag.inline_value;
  if (index + 1 >= args.size()) return InvalidArgumentError("--" + flag.name + " needs a value");
  const std::string& next = args[index + 1];
  if (next.rfind("--", 0) == 0)
    return InvalidArgumentError("--" + flag.name + " needs a value, but the next argument is the flag \"" + next +
                                "\" (write --" + flag.name + "=" + next + " if that is the value)");
  ++index;
  return next;
}

Status integer_range_error(std::string_view flag, std::string_view text, std::string_view min, std::string_view max,
                           std::string_view why) {
  return InvalidArgumentError("--" + std::string(flag) + " " + std::string(why) + ": got \"" + std::string(text) +
                              "\", expected an integer in [" + std::string(min) + ", " + std::string(max) + "]");
}

StatusOr<double> parse_flag_number(std::string_view flag, std::string_view text) {
  const std::string copy(text);  // strtod needs a terminated string
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(copy.c_str(), &end);
  if (errno != 0 || copy.empty() || end != copy.c_str() + copy.size() || !std::isfinite(value))
    return InvalidArgumentError("--" + std::string(flag) + " expects a finite number, got \"" + copy + "\"");
  return value;
}

namespace {

Status output_path_error(std::string_view what, const std::string& path, const std::string& problem) {
  return FailedPreconditionError(std::string(what) + " " + path + ": " + problem + " (checked before training starts)");
}

bool writable(const std::filesystem::path& path) { return ::access(path.c_str(), W_OK) == 0; }

}  // namespace

Status prepare_output_path(std::string_view what, const std::string& path, OutputKind kind) {
  namespace fs = std::filesystem;
  if (path.empty()) return output_path_error(what, path, "the path is empty");
  std::error_code error;
  const fs::path target = fs::absolute(path, error);
  if (error) return output_path_error(what, path, error.message());
  const fs::file_status status = fs::status(target, error);
  if (fs::exists(status)) {
    if (kind == OutputKind::kFile && fs::is_directory(status)) return output_path_error(what, path, "is a directory, not a file");
    if (kind == OutputKind::kDirectory && !fs::is_directory(status)) return output_path_error(what, path, "exists and is not a directory");
    if (!writable(target)) return output_path_error(what, path, std::string("is not writable: ") + std::strerror(errno));
    return {};
  }
  if (kind == OutputKind::kFile) {
    const fs::path parent = target.parent_path();
    fs::create_directories(parent, error);
    if (error) return output_path_error(what, path, "cannot create its directory " + parent.string() + ": " + error.message());
    if (!writable(parent))
      return output_path_error(what, path, "its directory " + parent.string() + " is not writable: " + std::strerror(errno));
    return {};
  }
  // A directory its writer will create: the nearest existing ancestor must be a
  // writable directory.
  fs::path ancestor = target.parent_path();
  while (!fs::exists(ancestor, error) && ancestor != ancestor.parent_path()) ancestor = ancestor.parent_path();
  if (!fs::is_directory(ancestor, error))
    return output_path_error(what, path, "cannot be created: " + ancestor.string() + " is not a directory");
  if (!writable(ancestor))
    return output_path_error(what, path, "cannot be created: the directory " + ancestor.string() + " is not writable (" +
                                             std::strerror(errno) + ")");
  return {};
}

}  // namespace strata::flags
