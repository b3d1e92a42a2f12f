#!/usr/bin/env bash
# The trainer under an address-space limit (`ulimit -v`, as some clusters set) ends at once
# with the allocation the limit refused, however it is started. OpenBLAS's threaded build
# starts a thread pool when the library loads; a pool thread that cannot map its 128 MiB
# buffer retries forever, and stopping the pool waited for it: the program hung before its
# first line. Each case asks for activations far above the limit (--micro-batch 512 is
# about 4 GiB; the device budget allows it), so the run must fail at that allocation:
#
#   1. train_gpt under `ulimit -v 1000000` (1 GB), the limit of the report: a pool of a few
#      threads already cannot map its buffers there on a machine with many cores;
#   2. train_gpt under 130 MB more than its shared libraries map (`ulimit -v`; about 50 MB
#      for a CPU-only build, over 800 MB where CUDA's libraries are linked) with 1 MiB thread
#      stacks (`ulimit -s 1024`): too little for even one pool thread's buffer on top of the
#      loaded program, so the pool would hang on any machine with two cores or more, while the
#      program's own threads still fit before its first allocations;
#   3. case 2 as strata-train (the same program under its other name: messages name it);
#   4. case 2 under strata-launch, which starts train_gpt as a rank;
#   5. train_gpt with the tiny model's own activations (the default micro-batch), under a
#      sweep of limits from 150 MB to 750 MB above what its libraries map: where the model
#      and its activations fit but OpenBLAS's working buffers (128 MiB for each thread that
#      multiplies) do not, the first matrix product retried its refused buffer forever
#      (1.2 to 1.45 GB in a CUDA build, which maps about 850 MB). Each run must succeed or
#      fail with OUT_OF_MEMORY naming the allocation (the buffers are now mapped when the
#      model allocates, kernels::cpu::reserve_blas_buffers).
#
# A run that has not ended after 60 s (the sweep: 20 s) is killed and fails the test (a
# hang, not an error).
#
#   address_space_limit_test.sh BUILD_DIR
set -uo pipefail

build_dir=$(cd "${1:?usage: address_space_limit_test.sh BUILD_DIR}" && pwd)
bin=$build_dir/bin
failures=0

# The trainer's flags: the tiny model, activations of about 4 GiB, a budget that allows them.
train_args=(--device cpu --preset tiny --steps 2 --micro-batch 512 --device-budget-mib 65536)

# run_case NAME VMEM_KB STACK_KB EXPECTED_PREFIX COMMAND...: runs COMMAND under the limits
# and checks it ended by itself, non-zero, with "<prefix>OUT_OF_MEMORY: ... '<allocation>'":
# the activations where the limit leaves room for the model (a CPU-only build), an earlier
# allocation (the parameters) where CUDA's libraries take most of it. With may_succeed=1
# in the environment an exit 0 passes too, and the run has 20 s.
run_case() {
  local name=$1 vmem=$2 stack=$3 prefix=$4
  shift 4
  local err seconds=60
  [[ ${may_succeed:-0} -eq 1 ]] && seconds=20
  err=$(mktemp)
  (
    ulimit -s "$stack" && ulimit -v "$vmem" || exit 99
    exec timeout -k 5 "$seconds" "$@" >/dev/null 2>"$err"
  )
  local rc=$?
  local why=""
  if [[ $rc -eq 99 ]]; then
    why="could not set the limits (ulimit -s $stack, ulimit -v $vmem)"
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    why="still running after $seconds s (exit $rc from timeout): it hung instead of failing"
  elif [[ $rc -eq 0 && ${may_succeed:-0} -eq 1 ]]; then
    echo "ok: $name: exit 0 (it fits)"
    rm -f "$err"
    return
  elif [[ $rc -eq 0 ]]; then
    why="succeeded, but its 4 GiB of activations cannot fit under the limit"
  elif ! grep -Eq "^${prefix}OUT_OF_MEMORY: .*'[^']+'" "$err"; then
    why="exit $rc without an OUT_OF_MEMORY error naming the allocation"
  fi
  if [[ -n $why ]]; then
    echo "FAILED: $name: $why; its stderr:" >&2
    tail -5 "$err" >&2
    failures=$((failures + 1))
  else
    echo "ok: $name: exit $rc, $(grep -E "OUT_OF_MEMORY" "$err" | head -1 | cut -c1-160)"
  fi
  rm -f "$err"
}

# What the program's shared libraries (and itself) map, in KiB: the floor of any limit.
mapped_kb() {
  { echo "$1"; ldd "$1" | awk '/=> \// {print $3}'; } | xargs stat -L -c %s | awk '{s += $1} END {printf "%d", s / 1024}'
}
low=$(( $(mapped_kb "$bin/train_gpt") + 130000 ))
default_stack=$(ulimit -s)
run_case "train_gpt, ulimit -v 1000000" 1000000 "$default_stack" "train_gpt: " \
  "$bin/train_gpt" "${train_args[@]}"
run_case "train_gpt, ulimit -v $low -s 1024" "$low" 1024 "train_gpt: " \
  "$bin/train_gpt" "${train_args[@]}"
run_case "strata-train, ulimit -v $low -s 1024" "$low" 1024 "strata-train: " \
  "$bin/strata-train" "${train_args[@]}"
run_case "strata-launch -- train_gpt, ulimit -v $low -s 1024" "$low" 1024 "\\[rank 0\\] train_gpt: " \
  "$bin/strata-launch" --nproc-per-node 1 -- "$bin/train_gpt" "${train_args[@]}"
for extra in 150000 250000 350000 450000 550000 650000 750000; do
  vmem=$(( $(mapped_kb "$bin/train_gpt") + extra ))
  may_succeed=1 run_case "train_gpt (its own activations), ulimit -v $vmem" "$vmem" "$default_stack" "train_gpt: " \
    "$bin/train_gpt" --device cpu --preset tiny --steps 2
done

if [[ $failures -gt 0 ]]; then
  echo "address_space_limit_test: $failures case(s) failed" >&2
  exit 1
fi
echo "address_space_limit_test: all cases passed"
