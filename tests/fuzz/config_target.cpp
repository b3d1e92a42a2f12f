// The config parser (engine/core/config_parse.cpp) under fuzzing, with strata-train's keys
// (examples/run_config) as the shipped configs use them: any text either parses to a config
// or comes back as an error; a config that parses and finalizes survives the documented
// round trip (parse_config_json(to_json(c)) gives back c).
#include <string>
#include <string_view>

#include "examples/run_config/run_config.h"
#include "tests/fuzz/fuzz_targets.h"

namespace strata::fuzz {

int fuzz_config(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  StatusOr<RunConfig> config = parse_run_config_json(text, "fuzz.json");
  if (!config.ok()) {
    STRATA_FUZZ_CHECK(!config.status().message().empty(), "config: an error without a message");
    return 0;
  }
  if (!finalize_run_config(*config, kConfiguredWorldSize).ok()) return 0;
  const std::string written = run_config_to_json(*config);
  StatusOr<RunConfig> reread = parse_run_config_json(written, "fuzz-roundtrip.json");
  STRATA_FUZZ_CHECK(reread.ok(), "config: to_json of a finalized config does not parse back:\n" + written + "\n" +
                                     reread.status().to_string());
  STRATA_FUZZ_CHECK(finalize_run_config(*reread, kConfiguredWorldSize).ok(),
                    "config: the round-tripped config does not finalize:\n" + written);
  STRATA_FUZZ_CHECK(run_config_to_json(*reread) == written,
                    "config: the round trip changed the config:\n" + written + "\nbecame\n" + run_config_to_json(*reread));
  return 0;
}

}  // namespace strata::fuzz
