#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, then configures, builds and runs a
# small project outside the tree that does find_package(Strata) and links Strata::strata_engine.
set -euo pipefail
build_dir=$1
source_dir=$2
work=${STRATA_TEST_TMPDIR:-$(mktemp -d)}/install-test
rm -rf "$work"
mkdir -p "$work"
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$source_dir/tests/install/consumer" -B "$work/consumer-build" "${generator[@]}" \
  -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/consumer-build" >/dev/null
"$work/consumer-build/consumer"
rm -rf "$work"
