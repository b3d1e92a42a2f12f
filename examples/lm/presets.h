// Named model presets, the same way in every family: a table of Preset<Config> entries,
// looked up by name, listed in the table's order.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/status.h"

namespace strata::lm {

template <class Config>
struct Preset {
  const char* name;
  Config config;
};

// The names of `presets`, in order.
template <class Config>
std::vector<std::string> preset_names(std::span<const Preset<Config>> presets) {
  std::vector<std::string> names;
  for (const Preset<Config>& preset : presets) names.emplace_back(preset.name);
  return names;
}

// The config of the preset named `name`; otherwise NotFound "unknown <what> preset "x";
// known presets: a, b, ...".
template <class Config>
StatusOr<Config> find_preset(std::span<const Preset<Config>> presets, std::string_view name, std::string_view what) {
  for (const Preset<Config>& preset : presets)
    if (name == preset.name) return preset.config;
  std::string names;
  for (const Preset<Config>& preset : presets) names += std::string(names.empty() ? "" : ", ") + preset.name;
  return NotFoundError("unknown " + std::string(what) + " preset \"" + std::string(name) + "\"; known presets: " + names);
}

}  // namespace strata::lm
