// Command-line flags for the example programs (train_gpt, strata-bench): one tokenizer,
// integers range-checked in the type they are stored in, and the checks on output paths
// that a run makes before it starts. Everything here takes the arguments as strings, so a
// unit test or a fuzz target can call it without a process.
#pragma once

#include <charconv>
#include <concepts>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine/core/config.h"
#include "engine/core/status.h"

namespace strata::flags {

// One flag as written: `--name=value` (inline_value set) or `--name` (the value, if the
// flag takes one, is the next argument).
struct FlagToken {
  std::string name;                         // without the leading "--"
  std::optional<std::string> inline_value;  // after '=' in --name=value
};

// Splits `--name` / `--name=value`; anything not starting with "--" is an error.
StatusOr<FlagToken> split_flag(std::string_view argument);

// The value of `flag`: its inline value, else args[index + 1] (then `index` moves past
// it). A separate value that starts with "--" is refused: it is the next flag, so the
// value is missing (`--save-dir --steps=8`); `--name=--value` says it on purpose.
StatusOr<std::string> take_flag_value(std::span<const std::string> args, size_t& index, const FlagToken& flag);

// `text` as a T in [min, max], parsed in T itself (never through a wider type and then
// narrowed): an error names --flag, the text and the range.
template <std::integral T>
StatusOr<T> parse_flag_integer(std::string_view flag, std::string_view text, T min = std::numeric_limits<T>::min(),
                               T max = std::numeric_limits<T>::max());

// A finite number (strtod syntax); an error names --flag and the text.
StatusOr<double> parse_flag_number(std::string_view flag, std::string_view text);

// Output paths are checked before a run starts rather than when it writes at the end.
enum class OutputKind {
  kFile,       // a file that will be created or replaced; its writer does not create directories
  kDirectory,  // a directory that its writer creates if missing, then fills
};
// Makes sure `path` can be written as `kind`: an existing path must be of that kind and
// writable. A missing file gets its missing parent directories created now (its writer
// would fail on them at the end of the run); a missing directory needs a nearest existing
// ancestor that is a writable directory. The error names `what` (the flag or key) and
// the path.
Status prepare_output_path(std::string_view what, const std::string& path, OutputKind kind);

// The error for an integer outside [min, max] (shared by the template below).
Status integer_range_error(std::string_view flag, std::string_view text, std::string_view min, std::string_view max,
                           std::string_view why);

template <std::integral T>
StatusOr<T> parse_flag_integer(std::string_view flag, std::string_view text, T min, T max) {
  T value{};
  const char* first = text.data();
  const char* last = text.data() + text.size();
  if (!text.empty() && text.front() == '+') ++first;  // from_chars takes no '+'
  // A negative number for an unsigned type is out of range, not malformed.
  if (std::is_unsigned_v<T> && text.size() > 1 && text[0] == '-' && text[1] >= '0' && text[1] <= '9')
    return integer_range_error(flag, text, std::to_string(min), std::to_string(max), "is out of range");
  const auto [end, error] = std::from_chars(first, last, value, 10);
  if (error == std::errc::result_out_of_range || (error == std::errc() && end == last && (value < min || value > max)))
    return integer_range_error(flag, text, std::to_string(min), std::to_string(max), "is out of range");
  if (error != std::errc() || end != last || first == last)
    return integer_range_error(flag, text, std::to_string(min), std::to_string(max), "is not an integer");
  return value;
}

}  // namespace strata::flags
