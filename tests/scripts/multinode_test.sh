#!/usr/bin/env bash
# Two "nodes" on one machine: two network namespaces joined by a veth pair, 10.77.0.1 and
# 10.77.0.2, each running one strata-launch (--nnodes 2, 2 processes each) with its own
# nvme_path. Everything it creates is torn down on every exit (success, failure, Ctrl-C,
# SIGTERM from CTest's timeout): the launchers' process groups and whatever is left in the
# namespaces are killed, the namespaces deleted (which removes the veth pair), and the
# script then checks that no namespace and no process of this run remains.
#
#   multinode_test.sh BUILD_DIR            the rendezvous probe (build/bin/rendezvous_probe):
#                                          4 ranks join across the namespaces, all-gather
#                                          their ranks and nodes, write into their node's
#                                          nvme_path; then again with rank 3 exiting 3 after
#                                          joining: both nodes must fail, naming it
#   multinode_test.sh --train BUILD_DIR    train_gpt tiny, 8 steps, 2 namespaces x 2 processes:
#                                          param_checksum equal to --world-size 4 threads';
#                                          param_norm and losses within 1e-5 (relative) of 1
#                                          rank; a checkpoint of the 4 processes resumed by 2
#                                          (within 1e-5); rank 3 SIGKILLed, then SIGSTOPped
#                                          (STRATA_COLLECTIVE_TIMEOUT_S=5), after the checkpoint
#                                          of step 2: both nodes exit non-zero in time, naming
#                                          it (the times are printed), and 2 x 2 processes
#                                          resume to the straight run's param_checksum.
#
# Skips (exit 77, the reason on stderr) when not root or when `ip netns` is unavailable.
# Needs iproute2 (ip) and procps (pgrep).
set -uo pipefail

mode=probe
if [[ "${1:-}" == "--train" ]]; then mode=train; shift; fi
build_dir=$(cd "${1:?usage: multinode_test.sh [--train] BUILD_DIR}" && pwd)
timeout_s=${STRATA_MULTINODE_TIMEOUT_S:-90}

skip() { echo "multinode_test: SKIPPED: $*" >&2; exit 77; }
fail() { echo "multinode_test: FAILED: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || skip "needs root to create network namespaces (ip netns add)"
command -v ip >/dev/null || skip "the ip command (iproute2) is not installed"
ip netns list >/dev/null 2>&1 || skip "ip netns is unavailable here: $(ip netns list 2>&1 | head -1)"

# Names unique to this run: two runs (ctest -j) never share a namespace, link or address space.
tag="strata-mn-$$"
namespaces=("$tag-0" "$tag-1")
addresses=(10.77.0.1 10.77.0.2)
veth=("smn$$a" "smn$$b")  # interface names are at most 15 characters
work=$(mktemp -d "${TMPDIR:-/tmp}/$tag.XXXXXX")
launcher_pids=()  # every launcher started (for the teardown)
node_pids=()      # the current run's launcher of node 0 and of node 1
node_codes=()     # their exit codes, set by wait_for_nodes
node_ended_at=()  # when each exited ($EPOCHREALTIME), set by wait_for_nodes
node_env=()       # VAR=value for the next start_node's launcher and ranks
mounted=          # the tmpfs of run_node_without_room while it is mounted
stop_timeout_s=5  # STRATA_COLLECTIVE_TIMEOUT_S of the run whose rank 3 is stopped (SIGSTOP)

# Stops process groups: SIGTERM to all, then SIGKILL to those still there after 8 s
# (strata-launch's own grace period, --grace-period 5, ends within it).
stop_groups() {
  local pgid alive
  for pgid in "$@"; do kill -TERM -- "-$pgid" 2>/dev/null; done
  for _ in $(seq 80); do
    alive=0
    for pgid in "$@"; do kill -0 -- "-$pgid" 2>/dev/null && alive=1; done
    [[ $alive -eq 0 ]] && return 0
    sleep 0.1
  done
  for pgid in "$@"; do kill -KILL -- "-$pgid" 2>/dev/null; done
  return 0
}

cleanup() {
  local status=$?
  trap - EXIT INT TERM
  [[ ${#launcher_pids[@]} -gt 0 ]] && stop_groups "${launcher_pids[@]}"
  [[ -n "$mounted" ]] && { umount "$mounted" 2>/dev/null || echo "multinode_test: could not unmount $mounted" >&2; }
  for ns in "${namespaces[@]}"; do
    if ip netns list | grep -qw "$ns"; then
      # Anything still running inside (a rank that escaped its launcher's group).
      for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
      ip netns del "$ns" 2>/dev/null || echo "multinode_test: could not delete namespace $ns" >&2
    fi
  done
  wait 2>/dev/null
  # The check that nothing is left behind.
  local left=0
  for ns in "${namespaces[@]}"; do
    if ip netns list | grep -qw "$ns"; then echo "multinode_test: namespace $ns is left behind" >&2; left=1; fi
  done
  if ip link show "${veth[0]}" >/dev/null 2>&1; then echo "multinode_test: link ${veth[0]} is left behind" >&2; left=1; fi
  local stray
  stray=$(pgrep -f -- "$work" || true)
  if [[ -n "$stray" ]]; then echo "multinode_test: processes left behind: $stray" >&2; left=1; fi
  if [[ $left -eq 0 ]]; then
    echo "multinode_test: torn down: no namespace, link or process of this run remains"
    rm -rf "$work"
  else
    status=1
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'echo "multinode_test: interrupted" >&2; exit 130' INT
trap 'echo "multinode_test: terminated" >&2; exit 143' TERM

set_up_network() {
  for i in 0 1; do
    ip netns add "${namespaces[$i]}" || skip "ip netns add ${namespaces[$i]} was refused"
    ip -n "${namespaces[$i]}" link set lo up || fail "bringing up lo in ${namespaces[$i]}"
  done
  ip link add "${veth[0]}" netns "${namespaces[0]}" type veth peer name "${veth[1]}" netns "${namespaces[1]}" ||
    fail "creating the veth pair ${veth[0]} <-> ${veth[1]}"
  for i in 0 1; do
    ip -n "${namespaces[$i]}" addr add "${addresses[$i]}/24" dev "${veth[$i]}" || fail "address ${addresses[$i]}"
    ip -n "${namespaces[$i]}" link set "${veth[$i]}" up || fail "bringing up ${veth[$i]}"
  done
}

# Starts node $1's strata-launch in its namespace, in its own process group (set -m: the
# group id is the pid); its ranks get their own groups and die with it (PR_SET_PDEATHSIG);
# output in $work/node$1.out / .err. The program and its arguments follow.
start_node() {
  local node=$1; shift
  env "${node_env[@]}" ip netns exec "${namespaces[$node]}" "$build_dir/bin/strata-launch" --nproc-per-node 2 --nnodes 2 \
    --node-rank "$node" --master-addr "${addresses[0]}" --master-port 29533 --grace-period 5 -- "$@" \
    >"$work/node$node.out" 2>"$work/node$node.err" &
  node_pids[$node]=$!
  launcher_pids+=("$!")
}

# Waits for both launchers, at most $timeout_s seconds, and records their exit codes in
# node_codes. Fails, showing their output, when one is still running or (unless $1 is
# "any-code") exited non-zero.
wait_for_nodes() {
  local expect=${1:-success} deadline=$((SECONDS + timeout_s)) failed=() running=2
  node_ended_at=("" "")
  # Both watched at once, so that each node's exit time is its own.
  while [[ $running -gt 0 && $SECONDS -lt $deadline ]]; do
    running=0
    for node in 0 1; do
      [[ -n "${node_ended_at[$node]}" ]] && continue
      if kill -0 "${node_pids[$node]}" 2>/dev/null; then running=$((running + 1)); else node_ended_at[$node]=$EPOCHREALTIME; fi
    done
    [[ $running -gt 0 ]] && sleep 0.05
  done
  for node in 0 1; do
    local pid=${node_pids[$node]}
    if kill -0 "$pid" 2>/dev/null; then
      failed+=("node $node still running after ${timeout_s} s")
      continue
    fi
    wait "$pid"
    node_codes[$node]=$?
    [[ $expect == any-code || ${node_codes[$node]} -eq 0 ]] || failed+=("node $node's strata-launch exited ${node_codes[$node]}")
  done
  if [[ ${#failed[@]} -gt 0 ]]; then
    show_output
    fail "${failed[*]}"
  fi
}

show_output() {
  for node in 0 1; do
    echo "--- node $node stdout"; cat "$work/node$node.out"
    echo "--- node $node stderr"; cat "$work/node$node.err"
  done >&2
}

run_probe() {
  for node in 0 1; do
    start_node "$node" "$build_dir/bin/rendezvous_probe" --nvme-path "$work/nvme$node" --nodes 2
  done
  wait_for_nodes
  grep -q '^\[rank 0\] rendezvous_probe: 4 ranks joined via torchrun variables: 0@node0 1@node0 2@node1 3@node1$' \
    "$work/node0.out" || fail "rank 0 did not report 4 ranks on 2 nodes: $(cat "$work/node0.out")"
  # Each node's ranks wrote into that node's nvme_path and nowhere else.
  [[ "$(ls "$work/nvme0" | tr '\n' ' ')" == "rank-0 rank-1 " ]] || fail "node 0's nvme_path holds: $(ls "$work/nvme0")"
  [[ "$(ls "$work/nvme1" | tr '\n' ' ')" == "rank-2 rank-3 " ]] || fail "node 1's nvme_path holds: $(ls "$work/nvme1")"
  echo "multinode_test: 4 ranks joined across 2 namespaces (${addresses[*]}); nvme_path per node checked"
}

# Rank 3 (node 1) exits 3 after joining: every process must end, non-zero, well before the
# timeout, with an error naming rank 3.
run_probe_with_a_lost_rank() {
  local start=$SECONDS
  for node in 0 1; do
    start_node "$node" "$build_dir/bin/rendezvous_probe" --nvme-path "$work/lost$node" --nodes 2 --exit-rank 3 --exit-code 3
  done
  wait_for_nodes any-code
  [[ ${node_codes[0]} -ne 0 && ${node_codes[1]} -ne 0 ]] || { show_output; fail "exit codes ${node_codes[*]}: both nodes must fail"; }
  grep -q '^strata-launch: rank 3 failed: it exited with code 3' "$work/node1.err" ||
    grep -q '^strata-launch: rank 2 failed' "$work/node1.err" || { show_output; fail "node 1's launcher did not report the failed rank"; }
  # Rank 0 notices first and relays its error to the others; whichever prints before its
  # launcher's SIGTERM arrives names rank 3.
  grep -q '^\[rank [012]\] rendezvous_probe: .*rank 3 .*closed its connection' "$work/node0.err" "$work/node1.err" ||
    { show_output; fail "no rank's error names rank 3 as the one that closed its connection"; }
  echo "multinode_test: rank 3 exiting 3 ended both nodes in $((SECONDS - start)) s (exit codes ${node_codes[*]}), the others naming it"
}

# The JSON summary line in file $1 (with or without a "[rank 0] " prefix).
summary_in() { sed -n 's/^\(\[rank 0\] \)\{0,1\}\({.*"param_checksum".*}\)$/\2/p' "$1" | tail -1; }
# A field of that summary: $2 is param_checksum, param_norm or losses (the list's items).
field_in() {
  case "$2" in
    param_checksum) summary_in "$1" | sed -n 's/.*"param_checksum":"\([^"]*\)".*/\1/p' ;;
    losses) summary_in "$1" | sed -n 's/.*"losses":\[\([^]]*\)\].*/\1/p' | tr ',' ' ' ;;
    *) summary_in "$1" | sed -n "s/.*\"$2\":\([-0-9.eE+]*\).*/\1/p" ;;
  esac
}

# The tolerance of runs that reduce in a different order (1 rank or 2 processes against 4):
# relative 1e-5 on param_norm (the L2 norm of the fp32 master weights) and on each step's loss.
tolerance=1e-5
# Fails unless the numbers in $2 and $3 (space-separated, same count) agree within
# $tolerance relative; $1 names what is compared. Prints the largest relative difference.
expect_close() {
  local what=$1 largest
  largest=$(awk -v a="$2" -v b="$3" -v tol="$tolerance" 'BEGIN {
      n = split(a, x, " "); m = split(b, y, " ");
      if (n != m || n == 0) { print "count " n " vs " m; exit 1 }
      worst = 0;
      for (i = 1; i <= n; ++i) {
        d = x[i] - y[i]; if (d < 0) d = -d;
        s = x[i] < 0 ? -x[i] : x[i]; if (s < 1e-30) s = 1e-30;
        if (d / s > worst) worst = d / s;
      }
      printf "%.3g", worst; exit (worst <= tol ? 0 : 1) }') ||
    fail "$what: differ by $largest relative, more than $tolerance: [$2] vs [$3]"
  echo "multinode_test: $what within $tolerance (largest relative difference $largest)"
}

# tests/examples/train_gpt_runner.cpp's tiny settings; global batch 4 x 1 sequence.
train_args=(--preset tiny --n-layer 2 --n-embd 32 --n-ctx 16 --vocab-size 64 --seq-len 16 --lr 3e-3 --seed 11
  --set scheduler.type=WarmupCosineLR --set scheduler.params.warmup_num_steps=3
  --set scheduler.params.total_num_steps=8 --set optimizer.params.weight_decay=0.01
  --set strata.compute_threads=1 --set strata.optimizer_threads=1
  --steps 8 --micro-batch 1 --offload-optimizer nvme --offload-param cpu)

# Runs train_gpt on both nodes (2 x 2 processes) with train_args, each node its own
# nvme_path under $work/$1, and the further arguments; waits for success.
train_on_both_nodes() {
  local name=$1; shift
  for node in 0 1; do start_node "$node" "$build_dir/bin/train_gpt" "${train_args[@]}" --nvme-path "$work/$name-nvme$node" "$@"; done
  wait_for_nodes
  cp "$work/node0.out" "$work/$name.out"
  [[ -n "$(summary_in "$work/$name.out")" ]] || fail "$name: no summary in rank 0's output: $(tail -5 "$work/$name.out")"
}

# 1. 2 namespaces x 2 processes against --world-size 4 threads (bit-identical) and 1 rank
#    with 4 micro-batches of accumulation (the same global batch; within the tolerance).
run_train() {
  local train=$build_dir/bin/train_gpt
  [[ -x "$train" ]] || fail "$train is not built"
  "$train" "${train_args[@]}" --world-size 4 --nvme-path "$work/nvme-threads" >"$work/threads.out" 2>"$work/threads.err" ||
    fail "the --world-size 4 thread run failed: $(tail -5 "$work/threads.err")"
  "$train" "${train_args[@]}" --world-size 1 --grad-accum 4 --nvme-path "$work/nvme-one" >"$work/one.out" 2>"$work/one.err" ||
    fail "the 1-rank run failed: $(tail -5 "$work/one.err")"
  local want
  want=$(field_in "$work/threads.out" param_checksum)
  [[ -n "$want" ]] || fail "no param_checksum in the thread run's output"
  train_on_both_nodes straight
  local got
  got=$(field_in "$work/straight.out" param_checksum)
  [[ "$got" == "$want" ]] || fail "param_checksum of 2 namespaces x 2 processes is $got, --world-size 4 threads gave $want"
  echo "multinode_test: train_gpt 2 namespaces x 2 processes: param_checksum $got, same as --world-size 4 threads"
  # Rank 0's one summary of every node, gathered through the rendezvous.
  grep -q '^\[rank 0\] nodes: 2$' "$work/straight.out" || fail "rank 0 printed no summary of 2 nodes: $(head -40 "$work/straight.out")"
  for node in 0 1; do
    grep -q "^\[rank 0\]   node $node (.*): ranks $((2 * node)),$((2 * node + 1)); pinned .* planned, host memory .* available; nvme .* planned under $work/straight-nvme$node, .* free after its files$" \
      "$work/straight.out" || fail "rank 0's summary has no line for node $node: $(grep -A3 'nodes:' "$work/straight.out")"
  done
  grep -A2 '^\[rank 0\] nodes: 2$' "$work/straight.out" | sed 's/^/multinode_test: /'
  expect_close "4 processes vs 1 rank: param_norm" "$(field_in "$work/straight.out" param_norm)" "$(field_in "$work/one.out" param_norm)"
  expect_close "4 processes vs 1 rank: the 8 losses" "$(field_in "$work/straight.out" losses)" "$(field_in "$work/one.out" losses)"
}

# 2. A checkpoint of step 3 saved by the 4 processes, resumed by 2 processes on node 0
#    (micro-batches of 2 rows: the same global batch of 4 rows) to step 8: the straight run's weights
#    within the tolerance.
run_resume_with_two_processes() {
  train_on_both_nodes saved --steps 3 --save-dir "$work/ckpt4"
  [[ -f "$work/ckpt4/step-3/manifest.json" ]] || fail "the 4 processes committed no checkpoint of step 3: $(ls -R "$work/ckpt4")"
  ip netns exec "${namespaces[0]}" "$build_dir/bin/strata-launch" --nproc-per-node 2 --master-addr "${addresses[0]}" \
    --master-port 29533 --grace-period 5 -- "$build_dir/bin/train_gpt" "${train_args[@]}" --micro-batch 2 \
    --nvme-path "$work/resumed2-nvme" --resume "$work/ckpt4" >"$work/resumed2.out" 2>"$work/resumed2.err" &
  node_pids=("$!"); launcher_pids+=("$!")
  local pid=$! deadline=$((SECONDS + timeout_s))
  while kill -0 "$pid" 2>/dev/null && [[ $SECONDS -lt $deadline ]]; do sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && fail "the 2-process resume still runs after $timeout_s s"
  wait "$pid" || { cat "$work/resumed2.err" >&2; fail "the 2-process resume from the 4-process checkpoint failed"; }
  [[ "$(field_in "$work/resumed2.out" resumed_from_step)" == 3 ]] || fail "the 2-process run did not resume from step 3"
  expect_close "4 processes saved, 2 resumed, vs 4 straight: param_norm" \
    "$(field_in "$work/resumed2.out" param_norm)" "$(field_in "$work/straight.out" param_norm)"
  local all
  all=$(field_in "$work/straight.out" losses | cut -d' ' -f4-)
  expect_close "4 processes saved, 2 resumed, vs 4 straight: losses of steps 4-8" "$(field_in "$work/resumed2.out" losses)" "$all"
}

# Pid of rank $2's train_gpt in namespace $1 (from its RANK variable).
rank_pid() {
  local pid
  for pid in $(ip netns pids "$1" 2>/dev/null); do
    [[ "$(readlink "/proc/$pid/exe" 2>/dev/null)" == "$build_dir/bin/train_gpt" ]] || continue
    tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "RANK=$2" && { echo "$pid"; return 0; }
  done
  return 1
}

# Node 1's nvme_path is a 128 KiB tmpfs, too small for its ranks' NVMe files: both nodes
# fail before step 1, node 1's error naming the node and the path.
run_node_without_room() {
  mkdir -p "$work/full"
  if ! mount -t tmpfs -o size=128k strata-multinode-test "$work/full"; then
    echo "multinode_test: mount -t tmpfs was refused: the node without room is not tested" >&2
    return 0
  fi
  mounted=$work/full
  for node in 0 1; do
    local path=$work/room-nvme$node
    [[ $node -eq 1 ]] && path=$work/full
    start_node "$node" "$build_dir/bin/train_gpt" "${train_args[@]}" --nvme-path "$path"
  done
  wait_for_nodes any-code
  [[ ${node_codes[0]} -ne 0 && ${node_codes[1]} -ne 0 ]] || { show_output; fail "no room: exit codes ${node_codes[*]}: both nodes must fail"; }
  grep -q "start-up checks of rank [23] on node 1 (host .*, nvme_path $work/full), before step 1" "$work/node1.err" ||
    { show_output; fail "no room: node 1's error does not name the node and the path"; }
  grep -q 'nvme_path .* has .* free but rank [23] needs' "$work/node1.err" || { show_output; fail "no room: node 1's error does not say what is short"; }
  ! grep -q '^\[rank [0-3]\] step ' "$work/node0.out" "$work/node1.out" || { show_output; fail "no room: a step ran"; }
  echo "multinode_test: node 1 without NVMe room: both nodes failed before step 1: $(grep -h -m1 'start-up checks' "$work/node1.err" | cut -c1-200)"
  umount "$work/full" && mounted=
}

# 3./4. Rank 3 (node 1) is sent $1 (KILL or STOP; VAR=value arguments after $2 go to every rank) once the checkpoint of step 2 is
#    committed, during the steps after it (each save pauses 4 x 300 ms, so steps are slow
#    enough to land in). Every launcher must exit non-zero within $2 s of the signal, an
#    error on some rank naming rank 3; prints the time. A resume by 2 x 2 processes from the
#    last committed checkpoint must end on the straight run's param_checksum, bit for bit.
run_lost_rank() {
  local signal=$1 bound=$2 name="lost-$1"
  shift 2
  local save="$work/ckpt-$name"
  node_env=(STRATA_TEST_CHECKPOINT_PAUSE_MS=300 "$@")
  for node in 0 1; do
    start_node "$node" "$build_dir/bin/train_gpt" "${train_args[@]}" --nvme-path "$work/$name-nvme$node" --save-dir "$save" --save-every 2
  done
  node_env=()
  local deadline=$((SECONDS + timeout_s))
  until [[ -f "$save/step-2/manifest.json" ]]; do
    [[ $SECONDS -lt $deadline ]] || { show_output; fail "$name: no checkpoint of step 2 within $timeout_s s"; }
    kill -0 "${node_pids[0]}" 2>/dev/null || { show_output; fail "$name: node 0 ended before the checkpoint of step 2"; }
    sleep 0.05
  done
  local victim
  victim=$(rank_pid "${namespaces[1]}" 3) || { show_output; fail "$name: rank 3's process not found in ${namespaces[1]}"; }
  local signalled_at=$EPOCHREALTIME
  kill -"$signal" "$victim"
  wait_for_nodes any-code
  for node in 0 1; do cp "$work/node$node.out" "$work/$name-node$node.out"; cp "$work/node$node.err" "$work/$name-node$node.err"; done
  local slowest
  slowest=$(awk -v a="$signalled_at" -v b="${node_ended_at[0]}" -v c="${node_ended_at[1]}" 'BEGIN { m = b > c ? b : c; printf "%.2f", m - a }')
  [[ ${node_codes[0]} -ne 0 && ${node_codes[1]} -ne 0 ]] || { show_output; fail "$name: exit codes ${node_codes[*]}: both nodes must fail"; }
  awk -v t="$slowest" -v b="$bound" 'BEGIN { exit !(t <= b) }' || { show_output; fail "$name: the last node exited $slowest s after SIG$signal, over $bound s"; }
  # On node 1 rank 2 names rank 3, or its launcher does (which saw rank 3 end). Node 0's ranks
  # fail naming rank 3 too, unless rank 2 gave up on rank 3 first (a stopped rank 3 stalls
  # whichever collective waits on it; rank 2's may time out before node 0's): then node 0's
  # ranks name rank 2, which closed its connection, and rank 2's own error names rank 3.
  # The group does not carry rank 2's reason to node 0.
  grep -Eq '^(\[rank 2\] train_gpt: .*rank 3|strata-launch: rank 3 failed)' "$work/node1.err" ||
    { show_output; fail "$name: neither rank 2 nor node 1's launcher names rank 3"; }
  local blamed='rank 3'
  if ! grep -q '^\[rank [01]\] train_gpt: .*rank 3' "$work/node0.err"; then
    grep -q '^\[rank 2\] train_gpt: .*rank 3' "$work/node1.err" || { show_output; fail "$name: no error on node 0 names rank 3"; }
    blamed='rank 2 (vm pid [0-9]*) closed its connection'
    grep -q "^\[rank [01]\] train_gpt: .*$blamed" "$work/node0.err" ||
      { show_output; fail "$name: no error on node 0 names rank 3, or rank 2 after rank 2 named rank 3"; }
  fi
  local error
  error=$(grep -h "^\[rank [01]\] train_gpt: .*$blamed" "$work/node0.err" | head -1)
  echo "multinode_test: SIG$signal of rank 3 after the checkpoint of step 2: both nodes exited non-zero (${node_codes[*]})" \
    "within $slowest s (node 0 $(awk -v a="$signalled_at" -v b="${node_ended_at[0]}" 'BEGIN { printf "%.2f", b - a }') s," \
    "node 1 $(awk -v a="$signalled_at" -v b="${node_ended_at[1]}" 'BEGIN { printf "%.2f", b - a }') s); first error: ${error:0:300}"
  local last
  last=$(ls -d "$save"/step-*/manifest.json | sed 's|.*/step-\([0-9]*\)/manifest.json|\1|' | sort -n | tail -1)
  train_on_both_nodes "resumed-$name" --resume "$save"
  local got want
  got=$(field_in "$work/resumed-$name.out" param_checksum)
  want=$(field_in "$work/straight.out" param_checksum)
  [[ "$got" == "$want" ]] || fail "$name: the resume from step $last ended on param_checksum $got, the straight run on $want"
  echo "multinode_test: resumed by 2 x 2 processes from the committed step $last: param_checksum $got, the straight run's"
}

set -m  # each background launcher in its own process group, so that stop_groups reaches all of it
set_up_network
case "$mode" in
  probe) run_probe && run_probe_with_a_lost_rank ;;
  train)
    run_train && run_node_without_room && run_resume_with_two_processes && run_lost_rank KILL 60 &&
      run_lost_rank STOP "$((stop_timeout_s + 10))" STRATA_COLLECTIVE_TIMEOUT_S="$stop_timeout_s" ;;
esac
