// engine/core/config.cpp under fuzzing: any text either parses to a config or comes back
// as an error; a config that parses and finalizes survives the documented round trip
// (parse_config_json(to_json(c)) gives back c).
#include <string>
#include <string_view>

#include "engine/core/config.h"
#include "tests/fuzz/fuzz_targets.h"

namespace strata::fuzz {

int fuzz_config(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  StatusOr<StrataConfig> config = parse_config_json(text, "fuzz.json");
  if (!config.ok()) {
    STRATA_FUZZ_CHECK(!config.status().message().empty(), "config: an error without a message");
    return 0;
  }
  if (!finalize(*config, kConfiguredWorldSize).ok()) return 0;
  const std::string written = to_json(*config);
  StatusOr<StrataConfig> reread = parse_config_json(written, "fuzz-roundtrip.json");
  STRATA_FUZZ_CHECK(reread.ok(), "config: to_json of a finalized config does not parse back:\n" + written + "\n" +
                                     reread.status().to_string());
  STRATA_FUZZ_CHECK(finalize(*reread, kConfiguredWorldSize).ok(), "config: the round-tripped config does not finalize:\n" + written);
  STRATA_FUZZ_CHECK(to_json(*reread) == written, "config: the round trip changed the config:\n" + written + "\nbecame\n" + to_json(*reread));
  return 0;
}

}  // namespace strata::fuzz
