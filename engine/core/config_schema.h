// The config's key table (engine/core/config.h is the interface): what each dotted key
// is (implemented, an alias, a DeepSpeed key without effect, or one accepted at one value
// only) and how it is stored. config_keys.cpp lists the keys; the parser, overrides,
// to_json and describe_config_keys read this table; a layer above the engine adds its own
// keys through a ConfigExtension (examples/run_config).
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

// A table with its index and sections; a key listed twice is a bug in the table (checked).
Schema index_schema(std::vector<KeySpec> keys);

// The engine's table, built once.
const Schema& schema();

// A key of a layer above the engine, bound to a field of that layer's own settings (the
// StrataConfig the parser passes is not used).
template <class T, class Codec>
KeySpec bound_key(std::string path, T* field, Codec codec) {
  return value_key(std::move(path), [field](StrataConfig&) -> T& { return *field; }, std::move(codec));
}

}  // namespace strata::config_detail

namespace strata {

// Keys a layer above the engine adds to the config (config.h): its keys, bound to its
// settings with bound_key, and its cross-field checks, which finalize() runs after the
// engine's own (`in` names the file and the overrides, as the engine's messages do).
struct ConfigExtension {
  config_detail::Schema schema;
  std::function<void(const StrataConfig& config, const std::string& in, std::vector<std::string>& errors)> check;
};

}  // namespace strata

namespace strata::config_detail {

// An extension from its keys (none of them the engine's) and its checks.
ConfigExtension make_config_extension(std::vector<KeySpec> keys,
                                      std::function<void(const StrataConfig&, const std::string&, std::vector<std::string>&)> check);

// The engine's keys and an extension's (none when null), looked up together.
class KeyTables {
 public:
  explicit KeyTables(const ConfigExtension* extension) : extension_(extension) {}
  const KeySpec* find(std::string_view path) const;
  bool is_section(std::string_view path) const;
  // The engine's table, then the extension's.
  std::vector<const Schema*> all() const;

 private:
  const ConfigExtension* extension_;
};

// "unknown key ... (did you mean ...?)": a near miss among the key's siblings first, then
// the same name elsewhere in the schema.
std::string unknown_key_message(std::string_view path, std::string_view source, const KeyTables& tables);
// The warning for a DeepSpeed key Strata does not act on.
std::string ignored_key_message(const KeySpec& spec, std::string_view source);

// Several problems as one error ("N problems in <file>:" and one line each).
Status combine_errors(const std::vector<std::string>& errors, std::string_view source);
// " (with command-line overrides)" when any key was set on the command line.
std::string overrides_note(const StrataConfig& config);

}  // namespace strata::config_detail
