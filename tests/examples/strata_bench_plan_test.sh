#!/usr/bin/env bash
# strata-bench step's plan flags (docs/profile.md): --plan-only prints the plan and its
# predicted step and leaves --nvme-path uncreated; a run's JSON carries predicted_step_s
# beside step_s and predicted_busy_s beside busy_s; --profile names a missing file;
# --placement auto picks a placement whose plan passes its checks, and that then runs, and
# says so clearly when nothing fits.
#
#   strata_bench_plan_test.sh PATH_TO_STRATA_BENCH SOURCE_DIR
set -uo pipefail

bench=${1:?usage: strata_bench_plan_test.sh PATH_TO_STRATA_BENCH SOURCE_DIR}
source_dir=${2:?usage: strata_bench_plan_test.sh PATH_TO_STRATA_BENCH SOURCE_DIR}
profile=$source_dir/examples/profiles/h200-datasheet.json
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export XDG_CACHE_HOME=$tmp/cache  # no profile kept on the machine running the tests leaks in
small=(--layers 2 --width 64 --batch 8 --steps 3 --device-budget-mib 64)
failures=0
fail() { echo "FAILED: $*" >&2; failures=$((failures + 1)); }
last_json() { tail -n 1 "$1"; }
has() { grep -q -- "$2" "$1" || fail "$3: no '$2' in $(cat "$1")"; }

"$bench" step "${small[@]}" --offload-param nvme --offload-optimizer nvme --nvme-path "$tmp/nvme/sub" --profile "$profile" \
  --plan-only > "$tmp/plan.out" 2> "$tmp/plan.err" || fail "--plan-only exited $? ($(cat "$tmp/plan.err"))"
has "$tmp/plan.out" "predicted step (profile" "--plan-only"
has "$tmp/plan.out" '"plan_only":true' "--plan-only's JSON"
has "$tmp/plan.out" '"predicted_step_s":[0-9]' "--plan-only's JSON"
[[ -e $tmp/nvme ]] && fail "--plan-only created the NVMe path"

"$bench" step "${small[@]}" --plan-only > "$tmp/none.out" 2>&1 || fail "--plan-only without a profile exited $?"
has "$tmp/none.out" "predicted step: none (no machine profile" "--plan-only without a profile"
has "$tmp/none.out" '"predicted_step_s":null' "--plan-only without a profile"

"$bench" step "${small[@]}" --profile "$profile" --json > "$tmp/run.out" 2> "$tmp/run.err" || fail "a run exited $? ($(cat "$tmp/run.err"))"
for key in '"step_s":' '"busy_s":{' '"predicted_step_s":[0-9]' '"predicted_busy_s":{"compute":'; do
  last_json "$tmp/run.out" | grep -q -- "$key" || fail "the run's JSON has no $key: $(last_json "$tmp/run.out")"
done

"$bench" step "${small[@]}" --profile "$tmp/missing.json" > "$tmp/missing.out" 2>&1 && fail "a missing --profile file was accepted"
has "$tmp/missing.out" "$tmp/missing.json" "a missing --profile file"

"$bench" step "${small[@]}" --nvme-path "$tmp/auto-nvme" --profile "$profile" --placement auto --json > "$tmp/auto.out" 2> "$tmp/auto.err" ||
  fail "--placement auto exited $? ($(cat "$tmp/auto.err"))"
has "$tmp/auto.err" "  chosen: params " "--placement auto"
has "$tmp/auto.err" "  runner-up: " "--placement auto"
last_json "$tmp/auto.out" | grep -q '"predicted_step_s":[0-9]' || fail "--placement auto's run has no prediction"

"$bench" step --layers 2 --width 4096 --batch 8 --steps 3 --device-budget-mib 1 --profile "$profile" --placement auto --plan-only \
  > "$tmp/nofit.out" 2>&1 && fail "--placement auto with nothing that fits succeeded"
has "$tmp/nofit.out" "none of the" "--placement auto with nothing that fits"

if [[ $failures -ne 0 ]]; then exit 1; fi
echo "strata-bench step's plan flags: all checks passed"
