#include "engine/core/config_schema.h"

#include <algorithm>
#include <cctype>

#include "engine/core/check.h"

namespace strata::config_detail {

namespace {

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      const bool same = std::tolower(static_cast<unsigned char>(a[i - 1])) == std::tolower(static_cast<unsigned char>(b[j - 1]));
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (same ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string_view parent_of(std::string_view path) {
  const size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? std::string_view() : path.substr(0, dot);
}

std::string_view leaf_of(std::string_view path) {
  const size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? path : path.substr(dot + 1);
}

}  // namespace

KeySpec alias_key(std::string path, std::string target) {
  KeySpec spec;
  spec.path = std::move(path);
  spec.role = Role::kAlias;
  spec.target = std::move(target);
  return spec;
}

// DeepSpeed's deprecated booleans (cpu_offload, cpu_offload_param): true means
// offloading to cpu, false leaves the placement alone.
KeySpec deprecated_cpu_offload_key(std::string path, std::string target) {
  KeySpec spec = alias_key(std::move(path), std::move(target));
  spec.transform = [](const Json& value, const KeyContext& ctx) -> StatusOr<std::optional<Json>> {
    if (!value.is_boolean()) return value_error(ctx, "true or false", value);
    if (!value.get<bool>()) return std::optional<Json>();
    return std::optional<Json>(Json("cpu"));
  };
  return spec;
}

KeySpec ignored_key(std::string path, std::string reason) {
  KeySpec spec;
  spec.path = std::move(path);
  spec.role = Role::kIgnored;
  spec.reason = std::move(reason);
  return spec;
}

KeySpec restricted_key(std::string path, Json allowed, std::string reason) {
  KeySpec spec;
  spec.path = std::move(path);
  spec.role = Role::kRestricted;
  spec.allowed = std::move(allowed);
  spec.reason = std::move(reason);
  return spec;
}

Schema index_schema(std::vector<KeySpec> keys) {
  Schema schema;
  schema.keys = std::move(keys);
  for (size_t i = 0; i < schema.keys.size(); ++i) {
    const std::string& path = schema.keys[i].path;
    STRATA_CHECK(schema.index.emplace(path, i).second);  // a key declared twice is a bug in the table
    for (size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', dot + 1)) {
      schema.sections.insert(path.substr(0, dot));
    }
  }
  return schema;
}

const Schema& schema() {
  static const Schema built = [] {
    Schema schema = index_schema(build_schema());
    for (const KeySpec& spec : schema.keys) {
      if (spec.role == Role::kAlias) STRATA_CHECK(schema.find(spec.target) != nullptr);
    }
    return schema;
  }();
  return built;
}

ConfigExtension make_config_extension(std::vector<KeySpec> keys,
                                      std::function<void(const StrataConfig&, const std::string&, std::vector<std::string>&)> check) {
  ConfigExtension extension;
  extension.schema = index_schema(std::move(keys));
  for (const KeySpec& spec : extension.schema.keys) {
    STRATA_CHECK(schema().find(spec.path) == nullptr);  // an extension adds keys, it does not redefine the engine's
    STRATA_CHECK(spec.role == Role::kValue);
  }
  extension.check = std::move(check);
  return extension;
}

const KeySpec* KeyTables::find(std::string_view path) const {
  if (const KeySpec* spec = schema().find(path)) return spec;
  return extension_ != nullptr ? extension_->schema.find(path) : nullptr;
}

bool KeyTables::is_section(std::string_view path) const {
  return schema().is_section(path) || (extension_ != nullptr && extension_->schema.is_section(path));
}

std::vector<const Schema*> KeyTables::all() const {
  std::vector<const Schema*> tables = {&schema()};
  if (extension_ != nullptr) tables.push_back(&extension_->schema);
  return tables;
}

namespace {

// "(did you mean ...?)" for an unknown key: a near miss among its siblings first, then
// the same name elsewhere in the schema.
std::string suggestion_for(std::string_view path, const KeyTables& tables) {
  const std::string_view parent = parent_of(path);
  const std::string_view leaf = leaf_of(path);
  std::vector<const KeySpec*> keys;
  std::set<std::string, std::less<>> sections;
  for (const Schema* table : tables.all()) {
    for (const KeySpec& spec : table->keys) keys.push_back(&spec);
    sections.insert(table->sections.begin(), table->sections.end());
  }
  std::vector<std::string> siblings;
  for (const KeySpec* spec : keys) {
    if (parent_of(spec->path) == parent) siblings.push_back(spec->path);
  }
  for (const std::string& section : sections) {
    if (parent_of(section) == parent) siblings.push_back(section);
  }
  const size_t limit = std::max<size_t>(2, leaf.size() / 4);
  size_t best_distance = limit + 1;
  std::string best;
  for (const std::string& candidate : siblings) {
    const size_t distance = edit_distance(leaf, leaf_of(candidate));
    if (distance < best_distance) {
      best_distance = distance;
      best = candidate;
    }
  }
  if (!best.empty()) return " (did you mean " + json_quoted(best) + "?)";
  std::vector<std::string> elsewhere;
  for (const KeySpec* spec : keys) {
    if (leaf_of(spec->path) == leaf) elsewhere.push_back(json_quoted(spec->path));
  }
  for (const std::string& section : sections) {
    if (leaf_of(section) == leaf) elsewhere.push_back(json_quoted(section));
  }
  if (!elsewhere.empty() && elsewhere.size() <= 3) return " (did you mean " + join(elsewhere, " or ") + "?)";
  return "";
}

}  // namespace

std::string unknown_key_message(std::string_view path, std::string_view source, const KeyTables& tables) {
  return "unknown key " + json_quoted(path) + where(source) + suggestion_for(path, tables);
}

std::string ignored_key_message(const KeySpec& spec, std::string_view source) {
  return std::string(source) + ": " + spec.path + " is a DeepSpeed setting Strata does not act on (" + spec.reason + "); ignored";
}

Status combine_errors(const std::vector<std::string>& errors, std::string_view source) {
  if (errors.size() == 1) return InvalidArgumentError(errors.front());
  std::string message = std::to_string(errors.size()) + " problems" + where(source) + ":";
  for (const std::string& error : errors) message += "\n  - " + error;
  return InvalidArgumentError(std::move(message));
}

std::string overrides_note(const StrataConfig& config) {
  for (const auto& [key, origin] : config.given) {
    if (origin == kCommandLine) return " (with command-line overrides)";
  }
  return "";
}

}  // namespace strata::config_detail
