#include "engine/core/config_codecs.h"

#include <cctype>

namespace strata::config_detail {

std::string lowercase(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string json_quoted(std::string_view text) { return dump_json(Json(std::string(text))); }

std::string describe(const Json& value) {
  if (value.is_object()) return "an object";
  if (value.is_array()) {
    std::string text = dump_json(value);
    return text.size() <= 60 ? text : "an array";
  }
  return dump_json(value);
}

std::string format_number(double value) {
  if (std::floor(value) == value && std::fabs(value) < 1e15) return std::to_string(static_cast<int64_t>(value));
  return dump_json(Json(value));
}

std::string join(const std::vector<std::string>& items, std::string_view separator) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += separator;
    out += items[i];
  }
  return out;
}

Json scalar_from_text(std::string_view text) {
  Json parsed = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded() || parsed.is_structured()) return Json(std::string(text));
  return parsed;
}

std::string where(std::string_view source) {
  return source == kCommandLine ? std::string(" on the command line") : " in " + std::string(source);
}

Status value_error(const KeyContext& ctx, std::string_view expected, const Json& got) {
  return InvalidArgumentError(std::string(ctx.key) + ": expected " + std::string(expected) + ", got " + describe(got) +
                              where(ctx.source));
}

}  // namespace strata::config_detail
