#include <algorithm>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/core/config.h"
#include "engine/core/config_schema.h"
#include "engine/core/file.h"
#include "engine/core/log.h"

namespace strata {

using namespace config_detail;

namespace {

// ---------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------

struct ParseState {
  KeyTables tables;  // the engine's keys and the caller's extension
  std::string_view source;
  std::vector<std::string> errors;
  std::vector<std::string> warnings;
  std::vector<std::string> auto_keys;
  struct Assignment {
    const KeySpec* spec;
    std::string path;
    Json value;
  };
  std::vector<Assignment> assignments;
};

bool is_deepspeed_key(std::string_view path) { return path != "strata" && path.rfind("strata.", 0) != 0; }

void walk_object(const Json& object, const std::string& prefix, ParseState& state) {
  const KeyTables& sc = state.tables;
  for (const auto& [key, value] : object.items()) {
    const std::string path = prefix.empty() ? key : prefix + "." + key;
    if (key.empty() || key.find('.') != std::string::npos) {
      state.errors.push_back("unknown key " + json_quoted(path) + where(state.source) + " (keys are nested objects, not dotted names)");
      continue;
    }
    const KeySpec* spec = sc.find(path);
    if (spec == nullptr) {
      if (sc.is_section(path)) {
        if (value.is_null()) continue;  // DeepSpeed allows "aio": null and the like
        if (!value.is_object()) {
          state.errors.push_back(path + ": expected an object, got " + describe(value) + where(state.source));
          continue;
        }
        walk_object(value, path, state);
        continue;
      }
      state.errors.push_back(unknown_key_message(path, state.source, state.tables));
      continue;
    }
    switch (spec->role) {
      case Role::kIgnored:
        state.warnings.push_back(ignored_key_message(*spec, state.source));
        break;
      case Role::kRestricted:
        if (!value.is_null() && value != spec->allowed) {
          state.errors.push_back(path + ": expected " + spec->allowed.dump() + " (" + spec->reason + "), got " + describe(value) +
                                 where(state.source));
        }
        break;
      case Role::kValue:
      case Role::kAlias:
        if (value.is_null()) break;  // null is DeepSpeed's "not given"
        // Hugging Face's DeepSpeed integration writes "auto" for values it fills in;
        // here it means "not given", so Strata's default (or derivation) applies.
        if (is_deepspeed_key(path) && value.is_string() && value.get<std::string>() == "auto") {
          state.auto_keys.push_back(path);
          break;
        }
        state.assignments.push_back({spec, path, value});
        break;
    }
  }
}

// Tracks object keys while nlohmann parses, to reject duplicates as DeepSpeed does
// (nlohmann would keep the last one silently).
class DuplicateKeyTracker {
 public:
  bool on_event(Json::parse_event_t event, const Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start: frames_.push_back({true, {}, {}}); break;
      case Json::parse_event_t::array_start: frames_.push_back({false, {}, {}}); break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        if (!frames_.empty()) frames_.pop_back();
        break;
      case Json::parse_event_t::key: {
        if (frames_.empty() || !parsed.is_string()) break;
        Frame& frame = frames_.back();
        frame.key = parsed.get<std::string>();
        if (!frame.keys.insert(frame.key).second) duplicates_.push_back(current_path());
        break;
      }
      case Json::parse_event_t::value: break;
    }
    return true;
  }
  const std::vector<std::string>& duplicates() const { return duplicates_; }

 private:
  struct Frame {
    bool is_object;
    std::set<std::string> keys;
    std::string key;
  };
  std::string current_path() const {
    std::string path;
    for (const Frame& frame : frames_) {
      if (!path.empty()) path += '.';
      path += frame.is_object ? frame.key : std::string("[]");
    }
    return path;
  }
  std::vector<Frame> frames_;
  std::vector<std::string> duplicates_;
};

// Deeper documents are refused while parsing: nlohmann's parser is iterative but dump()
// (used to quote a value in an error) recurses once per level, and 100k levels overflow
// the stack. No DeepSpeed or Strata key nests more than a few levels.
constexpr int kMaxJsonDepth = 64;

// Thrown by the parse callback to stop at the first over-deep container; caught in
// parse_config_json and never escapes this file.
struct JsonTooDeep {};

Status too_deep_error(std::string_view source) {
  return InvalidArgumentError("the JSON in " + std::string(source) + " nests objects and arrays more than " +
                              std::to_string(kMaxJsonDepth) + " levels deep; a config never needs that many (is it the intended file?)");
}

Status malformed_json_error(const Json::parse_error& error, std::string_view text, std::string_view source) {
  // Line and column of the byte where parsing stopped (1-based, as editors count).
  const size_t stop = std::min<size_t>(error.byte == 0 ? 0 : error.byte - 1, text.size());
  size_t line = 1;
  size_t line_start = 0;
  for (size_t i = 0; i < stop; ++i) {
    if (text[i] == '\n') {
      ++line;
      line_start = i + 1;
    }
  }
  const size_t column = stop - line_start + 1;
  // nlohmann's text: "[json.exception.parse_error.101] parse error at line 3, column 7: <what>".
  std::string what = error.what();
  if (const size_t colon = what.find(": "); colon != std::string::npos) what = what.substr(colon + 2);
  return InvalidArgumentError("malformed JSON in " + std::string(source) + " at line " + std::to_string(line) + ", column " +
                              std::to_string(column) + ": " + what);
}

// Applies the collected assignments in schema order: aliases resolve to their target,
// two keys setting the same target must agree.
void apply_assignments(ParseState& state, StrataConfig& config) {
  struct Resolved {
    std::string from_path;
    Json value;
  };
  std::unordered_map<std::string, Resolved> by_target;
  for (const ParseState::Assignment& assignment : state.assignments) {
    const KeySpec* spec = assignment.spec;
    Json value = assignment.value;
    std::string target = spec->path;
    if (spec->role == Role::kAlias) {
      target = spec->target;
      if (spec->transform) {
        const KeyContext ctx{assignment.path, state.source};
        StatusOr<std::optional<Json>> mapped = spec->transform(value, ctx);
        if (!mapped.ok()) {
          state.errors.push_back(mapped.status().message());
          continue;
        }
        if (!mapped->has_value()) continue;
        value = **mapped;
      }
    }
    auto [it, inserted] = by_target.try_emplace(target, Resolved{assignment.path, value});
    if (!inserted && it->second.value != value) {
      state.errors.push_back(json_quoted(it->second.from_path) + " (" + describe(it->second.value) + ") and " + json_quoted(assignment.path) +
                             " (" + describe(value) + ") both set " + target + " and disagree" + where(state.source) +
                             "; give one of them");
    }
  }
  for (const Schema* table : state.tables.all()) {
    for (const KeySpec& spec : table->keys) {
      if (spec.role != Role::kValue) continue;
      auto it = by_target.find(spec.path);
      if (it == by_target.end()) continue;
      const KeyContext ctx{it->second.from_path, state.source};
      Status status = spec.set(it->second.value, config, ctx);
      if (!status.ok()) {
        state.errors.push_back(status.message());
        continue;
      }
      config.given[spec.path] = std::string(state.source);
    }
  }
}

void set_at_path(nlohmann::ordered_json& root, std::string_view path, const Json& value) {
  nlohmann::ordered_json* node = &root;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string part(path.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start));
    if (dot == std::string_view::npos) {
      (*node)[part] = nlohmann::ordered_json::parse(dump_json(value));
      return;
    }
    node = &(*node)[part];
    start = dot + 1;
  }
}

StatusOr<std::string> read_whole_file(const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(const File file, File::open(path));
  return file.read_to_end();
}

}  // namespace

// ---------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------

StatusOr<StrataConfig> parse_config_json(std::string_view text, std::string_view source_name, const ConfigExtension* extension) {
  DuplicateKeyTracker duplicates;
  Json document;
  try {
    Json::parser_callback_t callback = [&duplicates](int depth, Json::parse_event_t event, Json& parsed) {
      const bool opens = event == Json::parse_event_t::object_start || event == Json::parse_event_t::array_start;
      // `depth` counts the containers around this one; the top-level object is at 0.
      if (opens && depth >= kMaxJsonDepth) throw JsonTooDeep{};
      return duplicates.on_event(event, parsed);
    };
    document = Json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const JsonTooDeep&) {
    return too_deep_error(source_name);
  } catch (const Json::parse_error& error) {
    return malformed_json_error(error, text, source_name);
  } catch (const Json::exception& error) {
    return InvalidArgumentError("malformed JSON in " + std::string(source_name) + ": " + error.what());
  }
  ParseState state{.tables = KeyTables(extension), .source = source_name};
  for (const std::string& path : duplicates.duplicates()) {
    state.errors.push_back("duplicate key " + json_quoted(path) + where(source_name));
  }
  if (!document.is_object()) {
    state.errors.push_back("the config" + where(source_name) + " must be a JSON object, got " + describe(document));
    return combine_errors(state.errors, source_name);
  }
  StrataConfig config;
  config.source = std::string(source_name);
  walk_object(document, "", state);
  apply_assignments(state, config);
  for (const std::string& warning : state.warnings) STRATA_LOG(kWarn) << warning;
  if (!state.auto_keys.empty()) {
    STRATA_LOG(kInfo) << source_name << ": \"auto\" (Strata's default or derived value) for " << join(state.auto_keys, ", ");
  }
  if (!state.errors.empty()) return combine_errors(state.errors, source_name);
  return config;
}

StatusOr<StrataConfig> load_config_file(const std::string& path, const ConfigExtension* extension) {
  StatusOr<std::string> text = read_whole_file(path);
  if (!text.ok()) return std::move(text).status().with_context("while reading the config file " + path);
  return parse_config_json(*text, path, extension);
}

Status apply_override(StrataConfig& config, std::string_view dotted_key, std::string_view value, const ConfigExtension* extension) {
  const KeyTables sc(extension);
  const KeyContext ctx{dotted_key, kCommandLine};
  const KeySpec* spec = sc.find(dotted_key);
  if (spec == nullptr) {
    if (sc.is_section(dotted_key)) {
      return InvalidArgumentError(json_quoted(dotted_key) + " is a section, not a key; override one of its keys (e.g. " +
                                  json_quoted(std::string(dotted_key) + ".<key>") + ")");
    }
    return InvalidArgumentError(unknown_key_message(dotted_key, kCommandLine, sc));
  }
  switch (spec->role) {
    case Role::kIgnored:
      return InvalidArgumentError(std::string(dotted_key) + " is a DeepSpeed setting Strata does not act on (" + spec->reason +
                                  "); it cannot be overridden");
    case Role::kRestricted:
      if (scalar_from_text(value) == spec->allowed) return {};
      return InvalidArgumentError(std::string(dotted_key) + " can only be " + spec->allowed.dump() + " (" + spec->reason + ")");
    case Role::kValue:
    case Role::kAlias:
      break;
  }
  const KeySpec* target = spec;
  if (spec->role == Role::kAlias) target = sc.find(spec->target);
  Json parsed = target->from_text(value);
  if (spec->role == Role::kAlias && spec->transform) {
    // The alias's own type: a deprecated boolean flag.
    Json raw = BoolCodec{}.from_text(value);
    STRATA_ASSIGN_OR_RETURN(std::optional<Json> mapped, spec->transform(raw, ctx));
    if (!mapped.has_value()) return {};
    parsed = *mapped;
  }
  Status status = target->set(parsed, config, ctx);
  if (!status.ok()) return status;
  config.given[target->path] = std::string(kCommandLine);
  return {};
}

std::optional<std::string> config_key_for_flag(std::string_view flag, const ConfigExtension* extension) {
  while (!flag.empty() && flag.front() == '-') flag.remove_prefix(1);
  static const std::unordered_map<std::string_view, std::string_view> kFlags = {
      {"offload-param", "zero_optimization.offload_param.device"},
      {"offload-optimizer", "zero_optimization.offload_optimizer.device"},
      {"batch-size", "train_batch_size"},
      {"micro-batch", "train_micro_batch_size_per_gpu"},
      {"grad-accum", "gradient_accumulation_steps"},
      {"lr", "optimizer.params.lr"},
      {"zero-stage", "zero_optimization.stage"},
      {"clip", "gradient_clipping"},
      {"aio-block-size", "aio.block_size"},
      {"aio-queue-depth", "aio.queue_depth"},
      {"bf16", "bf16.enabled"},
      {"fp16", "fp16.enabled"},
  };
  if (auto it = kFlags.find(flag); it != kFlags.end()) return std::string(it->second);
  std::string key = "strata." + std::string(flag);
  std::replace(key.begin(), key.end(), '-', '_');
  const KeySpec* spec = KeyTables(extension).find(key);
  if (spec != nullptr && (spec->role == Role::kValue || spec->role == Role::kAlias)) return key;
  return std::nullopt;
}

std::vector<ConfigKeyInfo> describe_config_keys(const ConfigExtension* extension) {
  std::vector<ConfigKeyInfo> keys;
  for (const Schema* table : KeyTables(extension).all()) {
    for (const KeySpec& spec : table->keys) {
      switch (spec.role) {
        case Role::kValue: keys.push_back({spec.path, ConfigKeyKind::kImplemented, ""}); break;
        case Role::kAlias: keys.push_back({spec.path, ConfigKeyKind::kAlias, spec.target}); break;
        case Role::kIgnored: keys.push_back({spec.path, ConfigKeyKind::kIgnored, spec.reason}); break;
        case Role::kRestricted:
          keys.push_back({spec.path, ConfigKeyKind::kRestricted, "only " + spec.allowed.dump() + ": " + spec.reason});
          break;
      }
    }
  }
  return keys;
}

std::string to_json(const StrataConfig& config, const ConfigExtension* extension) {
  nlohmann::ordered_json root = nlohmann::ordered_json::object();
  for (const Schema* table : KeyTables(extension).all()) {
    for (const KeySpec& spec : table->keys) {
      if (spec.role != Role::kValue) continue;
      const Json value = spec.get(config);
      if (!value.is_null()) set_at_path(root, spec.path, value);
    }
  }
  return dump_json(root, 2);
}

}  // namespace strata
