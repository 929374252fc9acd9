#!/usr/bin/env bash
# pathtrace's main job against the built-in lab: for each Service path of the
# seed article (socket LB, tc, kube-proxy netfilter, OVS-style bypass), bring the
# lab up, trace its node while the lab's Pod sends requests, print the verdicts.
# Usage: tools/demo.sh [BIN] [MODE...]   (as root; leaves nothing behind)
set -euo pipefail
bin=${1:-bin/pathtrace}
shift || true
modes=("$@")
[ ${#modes[@]} -gt 0 ] || modes=(socket tc tc-legacy netfilter nowhere)
name=ptlab-demo
out=$(mktemp)
trap '"$bin" lab down --name "$name" >/dev/null 2>&1 || true; rm -f "$out"' EXIT

for mode in "${modes[@]}"; do
  echo "================================================================"
  echo "lab mode: $mode"
  "$bin" lab up --name "$name" --mode "$mode"
  cmd=("$bin" --host-netns "/run/netns/$name-node" --svc 10.120.0.80:80/tcp --svc 10.120.0.10:53/udp --duration 20s)
  echo "\$ ${cmd[*]}"
  "${cmd[@]}" >"$out" &
  pid=$!
  # The node block is printed once every observer is attached.
  for _ in $(seq 100); do grep -q '^OBSERVERS' "$out" && break; sleep 0.1; done
  echo "\$ $bin lab client --name $name --requests 3"
  "$bin" lab client --name "$name" --requests 3 || true
  sleep 0.5
  kill -INT "$pid"
  wait "$pid"
  # The verdict table and summary (the node block is in the full output).
  sed -n '/^ID /,/^DROPS/p' "$out" | sed '$d'
done
