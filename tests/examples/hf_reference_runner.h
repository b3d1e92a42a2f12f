// Running tests/examples/hf_reference.py (Hugging Face transformers as the reference for the
// Llama-family models) from a test, under the interpreter scripts/test exports as
// STRATA_REFERENCE_PYTHON (made by scripts/reference-venv).
#pragma once

#include <string>
#include <vector>

#include "tests/examples/train_gpt_runner.h"

namespace strata::testing {

// hf_reference.py's exit status when torch or transformers cannot be imported.
inline constexpr int kReferenceUnavailable = 77;

// $STRATA_REFERENCE_PYTHON, or "" when it is unset or empty.
std::string reference_python();

// Runs `reference_python() tests/examples/hf_reference.py args...`, stdout and stderr in files
// under dir; waits for it.
TrainRun run_hf_reference(const TempDir& dir, const std::vector<std::string>& args);

}  // namespace strata::testing

// Skips the test when no reference interpreter was given.
#define STRATA_SKIP_WITHOUT_REFERENCE_PYTHON()                                                                     \
  do {                                                                                                             \
    if (::strata::testing::reference_python().empty())                                                             \
      GTEST_SKIP() << "STRATA_REFERENCE_PYTHON is not set: export the interpreter scripts/reference-venv prints " \
                      "(scripts/test does)";                                                                       \
  } while (0)

// Skips the test when a run of hf_reference.py says transformers cannot be imported.
#define STRATA_SKIP_IF_REFERENCE_UNAVAILABLE(run)                                                   \
  do {                                                                                              \
    if ((run).exit_code == ::strata::testing::kReferenceUnavailable)                                \
      GTEST_SKIP() << ::strata::testing::reference_python() << " cannot run the reference: " << (run).err; \
  } while (0)
