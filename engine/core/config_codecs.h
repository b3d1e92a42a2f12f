// The config's value codecs and the text helpers of its messages (engine/core/config.h is
// the interface): one codec per value type, each decoding a JSON value with the error a
// user sees ("<key>: expected ..., got ... in <file>") and encoding what it decodes.
// The config code builds its key table from them (config_schema.h), and so does a layer
// that adds keys of its own (examples/run_config).
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/core/status.h"

namespace strata::config_detail {

using Json = nlohmann::json;

// Where a command-line override comes from, in messages and in StrataConfig::given.
constexpr std::string_view kCommandLine = "command line";

std::string lowercase(std::string_view text);

// JSON text of a value; bytes that are not UTF-8 (a path from a command line can hold
// any) become U+FFFD instead of throwing.
template <class J>
std::string dump_json(const J& value, int indent = -1) {
  return value.dump(indent, ' ', /*ensure_ascii=*/false, J::error_handler_t::replace);
}

std::string json_quoted(std::string_view text);

// A value as a message shows it: scalars as JSON, containers by kind.
std::string describe(const Json& value);

std::string format_number(double value);

std::string join(const std::vector<std::string>& items, std::string_view separator);

// Text from a command line as JSON: numbers, true/false and null as themselves, any
// other text as a string (so a type error shows what was typed).
Json scalar_from_text(std::string_view text);

// ---------------------------------------------------------------------------
// Codecs: one per value type. decode() validates a JSON value and stores it; nothing
// is stored on error. encode() gives the JSON that decode() reads back.
// ---------------------------------------------------------------------------

struct KeyContext {
  std::string_view key;     // the key as the user wrote it (an alias stays an alias)
  std::string_view source;  // file name or "command line"
};

// " in <file>" or " on the command line".
std::string where(std::string_view source);

Status value_error(const KeyContext& ctx, std::string_view expected, const Json& got);

struct IntCodec {
  int64_t min = std::numeric_limits<int64_t>::min();
  int64_t max = std::numeric_limits<int64_t>::max();
  int64_t multiple_of = 1;

  std::string expected() const {
    std::string text;
    constexpr int64_t kNoMax = std::numeric_limits<int64_t>::max();
    if (min == 1 && max == kNoMax) text = "a positive integer";
    else if (min == 0 && max == kNoMax) text = "a non-negative integer";
    else if (max == kNoMax) text = "an integer >= " + std::to_string(min);
    else text = "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
    if (multiple_of > 1) text += " that is a multiple of " + std::to_string(multiple_of);
    return text;
  }

  Status decode(const Json& value, int64_t& out, const KeyContext& ctx) const {
    int64_t number = 0;
    if (value.is_number_unsigned()) {
      if (value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return value_error(ctx, expected(), value);
      }
      number = static_cast<int64_t>(value.get<uint64_t>());
    } else if (value.is_number_integer()) {
      number = value.get<int64_t>();
    } else if (value.is_number_float()) {
      // DeepSpeed files write sizes as 5e8; accept a float that is a whole number.
      const double real = value.get<double>();
      if (!std::isfinite(real) || std::floor(real) != real || real < -9.2e18 || real > 9.2e18) {
        return value_error(ctx, expected(), value);
      }
      number = static_cast<int64_t>(real);
    } else {
      return value_error(ctx, expected(), value);
    }
    if (number < min || number > max || number % multiple_of != 0) return value_error(ctx, expected(), value);
    out = number;
    return {};
  }
  Json encode(int64_t value) const { return value; }
  Json from_text(std::string_view text) const { return scalar_from_text(text); }
};

// The int codec for an `int` field.
struct SmallIntCodec {
  IntCodec inner;
  std::string expected() const { return inner.expected(); }
  Status decode(const Json& value, int& out, const KeyContext& ctx) const {
    int64_t wide = 0;
    Status status = inner.decode(value, wide, ctx);
    if (!status.ok()) return status;
    out = static_cast<int>(wide);
    return {};
  }
  Json encode(int value) const { return value; }
  Json from_text(std::string_view text) const { return scalar_from_text(text); }
};

struct DoubleCodec {
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  bool min_exclusive = false;
  bool max_exclusive = false;

  std::string expected() const {
    const bool has_min = std::isfinite(min);
    const bool has_max = std::isfinite(max);
    if (has_min && has_max) {
      return std::string("a number in ") + (min_exclusive ? "(" : "[") + format_number(min) + ", " + format_number(max) +
             (max_exclusive ? ")" : "]");
    }
    if (has_min) return std::string("a number ") + (min_exclusive ? "> " : ">= ") + format_number(min);
    if (has_max) return std::string("a number ") + (max_exclusive ? "< " : "<= ") + format_number(max);
    return "a number";
  }

  Status decode(const Json& value, double& out, const KeyContext& ctx) const {
    if (!value.is_number()) return value_error(ctx, expected(), value);
    const double number = value.get<double>();
    const bool low = min_exclusive ? number <= min : number < min;
    const bool high = max_exclusive ? number >= max : number > max;
    if (!std::isfinite(number) || low || high) return value_error(ctx, expected(), value);
    out = number;
    return {};
  }
  Json encode(double value) const { return value; }
  Json from_text(std::string_view text) const { return scalar_from_text(text); }
};

struct BoolCodec {
  std::string expected() const { return "true or false"; }
  Status decode(const Json& value, bool& out, const KeyContext& ctx) const {
    if (!value.is_boolean()) return value_error(ctx, expected(), value);
    out = value.get<bool>();
    return {};
  }
  Json encode(bool value) const { return value; }
  Json from_text(std::string_view text) const {
    const std::string lower = lowercase(text);
    if (lower == "true" || lower == "1" || lower == "yes" || lower == "on") return true;
    if (lower == "false" || lower == "0" || lower == "no" || lower == "off") return false;
    return Json(std::string(text));
  }
};

struct StringCodec {
  bool allow_empty = true;
  std::string expected() const { return allow_empty ? "a string" : "a non-empty string"; }
  Status decode(const Json& value, std::string& out, const KeyContext& ctx) const {
    if (!value.is_string() || (!allow_empty && value.get<std::string>().empty())) return value_error(ctx, expected(), value);
    out = value.get<std::string>();
    return {};
  }
  Json encode(const std::string& value) const { return value; }
  Json from_text(std::string_view text) const { return Json(std::string(text)); }
};

// A closed set of names. `names` are shown in messages and the first name of each value
// is what encode() writes (the first alias for a value without a name); `aliases` are
// further accepted spellings; `not_implemented`
// are names another system (DeepSpeed) accepts that Strata does not implement.
template <class E>
struct EnumCodec {
  std::vector<std::pair<std::string, E>> names;
  std::vector<std::pair<std::string, E>> aliases;
  std::vector<std::string> not_implemented;
  bool case_insensitive = false;

  std::string expected() const {
    std::vector<std::string> shown;
    for (const auto& [name, value] : names) shown.push_back(json_quoted(name));
    std::string text = "one of " + join(shown, ", ");
    if (case_insensitive) text += " (any case)";
    return text;
  }

  bool same(std::string_view a, std::string_view b) const { return case_insensitive ? lowercase(a) == lowercase(b) : a == b; }

  Status decode(const Json& value, E& out, const KeyContext& ctx) const {
    if (value.is_string()) {
      const std::string text = value.get<std::string>();
      for (const auto* list : {&names, &aliases}) {
        for (const auto& [name, candidate] : *list) {
          if (same(text, name)) {
            out = candidate;
            return {};
          }
        }
      }
      for (const std::string& name : not_implemented) {
        if (same(text, name)) {
          return InvalidArgumentError(std::string(ctx.key) + ": expected " + expected() + ", got " + describe(value) +
                                      " (a DeepSpeed choice Strata does not implement)" + where(ctx.source));
        }
      }
    }
    return value_error(ctx, expected(), value);
  }
  Json encode(E value) const {
    for (const auto* list : {&names, &aliases}) {
      for (const auto& [name, candidate] : *list) {
        if (candidate == value) return name;
      }
    }
    return nullptr;
  }
  Json from_text(std::string_view text) const { return Json(std::string(text)); }
};

// A std::optional<T> field: unset encodes as `unset_name` when there is one (a value
// the inner codec does not know, e.g. "auto"), otherwise as null (the key is left out).
template <class Inner>
struct OptionalCodec {
  Inner inner;
  std::string unset_name;

  std::string expected() const { return unset_name.empty() ? inner.expected() : inner.expected() + " or " + json_quoted(unset_name); }

  template <class T>
  Status decode(const Json& value, std::optional<T>& out, const KeyContext& ctx) const {
    if (!unset_name.empty() && value.is_string() && lowercase(value.get<std::string>()) == unset_name) {
      out.reset();
      return {};
    }
    T decoded{};
    Status status = inner.decode(value, decoded, ctx);
    if (!status.ok()) {
      if (unset_name.empty()) return status;
      return value_error(ctx, expected(), value);
    }
    out = decoded;
    return {};
  }
  template <class T>
  Json encode(const std::optional<T>& value) const {
    if (value.has_value()) return inner.encode(*value);
    return unset_name.empty() ? Json(nullptr) : Json(unset_name);
  }
  Json from_text(std::string_view text) const { return inner.from_text(text); }
};

// optimizer.params.betas: [beta1, beta2], each in [0, 1).
struct BetasCodec {
  std::string expected() const { return "a list of two numbers in [0, 1)"; }
  Status decode(const Json& value, std::array<double, 2>& out, const KeyContext& ctx) const {
    if (!value.is_array() || value.size() != 2) return value_error(ctx, expected(), value);
    std::array<double, 2> betas{};
    for (size_t i = 0; i < 2; ++i) {
      if (!value[i].is_number()) return value_error(ctx, expected(), value);
      betas[i] = value[i].get<double>();
      if (!(betas[i] >= 0.0 && betas[i] < 1.0)) return value_error(ctx, expected(), value);
    }
    out = betas;
    return {};
  }
  Json encode(const std::array<double, 2>& value) const { return Json::array({value[0], value[1]}); }
  Json from_text(std::string_view text) const {
    std::string list(text);
    if (list.empty() || list.front() != '[') list = "[" + list + "]";
    Json parsed = Json::parse(list, nullptr, /*allow_exceptions=*/false);
    return parsed.is_discarded() ? Json(std::string(text)) : parsed;
  }
};

}  // namespace strata::config_detail
