#!/usr/bin/env bash
# `strata-bench <subcommand> --help` for every subcommand `strata-bench --help` lists: exit 0
# and the subcommand's usage on stdout ("usage: strata-bench <subcommand>"), also with --help
# after other flags (--json, profile's --quick) and as -h. Fails when the list itself is empty.
#
#   strata_bench_help_test.sh PATH_TO_STRATA_BENCH
set -uo pipefail

bench=${1:?usage: strata_bench_help_test.sh PATH_TO_STRATA_BENCH}
listing=$("$bench" --help) || { echo "FAILED: strata-bench --help exited $?" >&2; exit 1; }
# The subcommands: the first word of each indented line after "subcommands:", up to a blank line.
mapfile -t subcommands < <(printf '%s\n' "$listing" | awk '/^subcommands:/ {on = 1; next} on && /^$/ {exit} on {print $1}')
if [[ ${#subcommands[@]} -eq 0 ]]; then
  echo "FAILED: strata-bench --help lists no subcommands; it printed:" >&2
  printf '%s\n' "$listing" >&2
  exit 1
fi

failures=0
for sub in "${subcommands[@]}"; do
  for form in "--help" "-h" "--json --help" "--quick --help"; do
    # shellcheck disable=SC2086  # $form is one or two flags
    out=$("$bench" "$sub" $form 2>/dev/null)
    rc=$?
    if [[ $rc -ne 0 ]]; then
      echo "FAILED: strata-bench $sub $form exited $rc" >&2
      failures=$((failures + 1))
    elif [[ $out != "usage: strata-bench $sub"* ]]; then
      echo "FAILED: strata-bench $sub $form printed no usage on stdout: '${out:0:80}'" >&2
      failures=$((failures + 1))
    fi
  done
done
if [[ $failures -gt 0 ]]; then exit 1; fi
echo "strata_bench_help_test: ${#subcommands[@]} subcommands answer --help: ${subcommands[*]}"
