#include "tests/examples/hf_reference_runner.h"

#include <cstdlib>

namespace strata::testing {

std::string reference_python() {
  const char* python = std::getenv("STRATA_REFERENCE_PYTHON");
  return python == nullptr ? std::string() : std::string(python);
}

TrainRun run_hf_reference(const TempDir& dir, const std::vector<std::string>& args) {
  std::vector<std::string> script_args = {(source_dir() / "tests/examples/hf_reference.py").string()};
  script_args.insert(script_args.end(), args.begin(), args.end());
  StartedRun started = start_program(dir, reference_python(), script_args);
  return finish_run(started);
}

}  // namespace strata::testing
