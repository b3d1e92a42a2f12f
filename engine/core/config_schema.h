// The config's key table (engine/core/config.h is the interface): what each dotted key
// is (implemented, an alias, a DeepSpeed key without effect, or one accepted at one value
// only) and how it is stored. config_keys.cpp lists the keys; the parser, overrides,
// to_json and describe_config_keys read this table. Internal to the config code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "engine/core/config.h"
#include "engine/core/config_codecs.h"
#include "engine/core/status.h"

namespace strata::config_detail {

enum class Role : uint8_t {
  kValue,       // implemented: stored in StrataConfig
  kAlias,       // another name for a kValue key (`target`), optionally with a value transform
  kIgnored,     // known to DeepSpeed, without effect in Strata: one warning, not inspected
  kRestricted,  // known, implemented only at `allowed`; any other value is an error
};

struct KeySpec {
  std::string path;
  Role role = Role::kValue;
  // kValue
  std::function<Status(const Json&, StrataConfig&, const KeyContext&)> set;
  std::function<Json(const StrataConfig&)> get;
  std::function<Json(std::string_view)> from_text;
  // kAlias: the key it stands for, and how its value maps (nullopt: no effect).
  std::string target;
  std::function<StatusOr<std::optional<Json>>(const Json&, const KeyContext&)> transform;
  // kIgnored, kRestricted
  std::string reason;
  Json allowed;
};

template <class Access, class Codec>
KeySpec value_key(std::string path, Access access, Codec codec) {
  KeySpec spec;
  spec.path = std::move(path);
  spec.role = Role::kValue;
  spec.set = [access, codec](const Json& value, StrataConfig& config, const KeyContext& ctx) {
    return codec.decode(value, access(config), ctx);
  };
  spec.get = [access, codec](const StrataConfig& config) {
    return codec.encode(access(const_cast<StrataConfig&>(config)));
  };
  spec.from_text = [codec](std::string_view text) { return codec.from_text(text); };
  return spec;
}

KeySpec alias_key(std::string path, std::string target);
// DeepSpeed's deprecated booleans (cpu_offload, cpu_offload_param): true means
// offloading to cpu, false leaves the placement alone.
KeySpec deprecated_cpu_offload_key(std::string path, std::string target);
KeySpec ignored_key(std::string path, std::string reason);
KeySpec restricted_key(std::string path, Json allowed, std::string reason);

// Every key, in the order to_json writes them (config_keys.cpp).
std::vector<KeySpec> build_schema();

struct Schema {
  std::vector<KeySpec> keys;
  std::unordered_map<std::string, size_t> index;  // path -> keys[i]
  std::set<std::string, std::less<>> sections;    // every proper prefix of a key path

  const KeySpec* find(std::string_view path) const {
    auto it = index.find(std::string(path));
    return it == index.end() ? nullptr : &keys[it->second];
  }
  bool is_section(std::string_view path) const { return sections.find(path) != sections.end(); }
};

// The table, built once.
const Schema& schema();

// "unknown key ... (did you mean ...?)": a near miss among the key's siblings first, then
// the same name elsewhere in the schema.
std::string unknown_key_message(std::string_view path, std::string_view source);
// The warning for a DeepSpeed key Strata does not act on.
std::string ignored_key_message(const KeySpec& spec, std::string_view source);

// Several problems as one error ("N problems in <file>:" and one line each).
Status combine_errors(const std::vector<std::string>& errors, std::string_view source);
// " (with command-line overrides)" when any key was set on the command line.
std::string overrides_note(const StrataConfig& config);

}  // namespace strata::config_detail
