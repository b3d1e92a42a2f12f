// The fuzz harnesses: one function per parser that takes arbitrary bytes, runs them
// through the project's real parser and, when the parser accepts them, checks what it
// returned against the format's invariants. A rejected input is fine (it must only come
// back as a Status); a crash, a sanitizer report, an exception or a broken invariant is
// a bug. libFuzzer drives them (fuzz_main.cpp, one executable per harness, STRATA_FUZZ=ON)
// and fuzz_replay_test replays the seed corpus and every regression input through them
// in the ordinary and ASan builds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace strata::fuzz {

// engine/core/config_parse.cpp with strata-train's keys (examples/run_config): parse, then
// finalize and the to_json round trip.
int fuzz_config(const uint8_t* data, size_t size);
// examples/hf/safetensors.cpp: a whole file (8-byte length, JSON header, data section).
int fuzz_safetensors_header(const uint8_t* data, size_t size);
// examples/data/token_data.cpp: a whole llm.c token file (header, then tokens).
int fuzz_token_header(const uint8_t* data, size_t size);
// engine/checkpoint_reader.cpp: manifest.json's text, as written and with its checksum resealed.
int fuzz_checkpoint_manifest(const uint8_t* data, size_t size);
// train_gpt's command line (examples/flags/flags.h), one argument per line.
int fuzz_flags(const uint8_t* data, size_t size);

struct FuzzTarget {
  std::string_view name;  // the folder under tests/fuzz/corpus and tests/fuzz/regressions
  int (*run)(const uint8_t* data, size_t size);
};
inline constexpr FuzzTarget kFuzzTargets[] = {
    {"config", fuzz_config},
    {"safetensors_header", fuzz_safetensors_header},
    {"token_header", fuzz_token_header},
    {"checkpoint_manifest", fuzz_checkpoint_manifest},
    {"flags", fuzz_flags},
};

// Reports a broken invariant (what, and the input's size) and aborts: the harnesses are
// test programs, and libFuzzer saves the input that aborted.
[[noreturn]] void fuzz_invariant_failed(std::string_view what);
#define STRATA_FUZZ_CHECK(condition, what) \
  do {                                     \
    if (!(condition)) ::strata::fuzz::fuzz_invariant_failed(what); \
  } while (0)

// Quiets the library's logging (warnings about ignored keys would flood the fuzzer's output).
void fuzz_quiet_logs();

}  // namespace strata::fuzz
