#!/bin/sh
# Runs the CUDA cases of the kernel tests under compute-sanitizer's memcheck (out-of-
# bounds and misaligned device accesses, leaks of device memory) and racecheck (shared-
# memory hazards: the attention kernels' tiles and per-warp P / dS rows).
# Usage: compute_sanitizer_test.sh <test binary>... (CTest passes the kernel tests).
# Exits 77 (CTest: skipped) with the reason when the tool or a GPU is missing.
set -u
sanitizer=$(command -v compute-sanitizer || true)
if [ -z "$sanitizer" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ]; then
  sanitizer=/usr/local/cuda/bin/compute-sanitizer
fi
if [ -z "$sanitizer" ]; then
  echo "skipped: compute-sanitizer not found (PATH, /usr/local/cuda/bin)"
  exit 77
fi
if ! { nvidia-smi -L 2>/dev/null | grep -q '^GPU'; } && [ ! -e /dev/nvidia0 ]; then
  echo "skipped: no GPU visible (nvidia-smi -L lists none, no /dev/nvidia0)"
  exit 77
fi
status=0
for tool in memcheck racecheck; do
  for test in "$@"; do
    # Parameterised kernel tests name their CUDA cases .../cuda_<dtype>; the others
    # (adam, cast) run every device in one case, so they run whole.
    filter='*'
    if "$test" --gtest_list_tests | grep -q 'cuda_'; then filter='*cuda_*'; fi
    echo "== $tool: $(basename "$test") --gtest_filter=$filter"
    if ! "$sanitizer" --tool "$tool" --error-exitcode 99 "$test" --gtest_filter="$filter" --gtest_brief=1; then
      echo "FAILED: $tool on $(basename "$test")"
      status=1
    fi
  done
done
exit $status
