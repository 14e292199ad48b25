#!/usr/bin/env bash
# The CPU throughput and agent benchmarks for two commits, alternating in one run, so a
# change's before and after meet the same machine state (this CPU's speed moves between
# minutes). Each round runs both commands on the old tree (a git worktree at REV), then
# on this checkout; the JSON files land in OUT as throughput-{before,after}-K.json and
# agent-{before,after}-K.json.
#     bash benchmarks/before_after.sh 0198bd5 3 /tmp/before-after
set -euo pipefail
rev="${1:?a commit to compare against}"; rounds="${2:-3}"; out="${3:-/tmp/before-after}"
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
old="$(mktemp -d)/before"
git -C "$root" worktree add --detach -q "$old" "$rev"
trap 'git -C "$root" worktree remove --force "$old"' EXIT
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for side in before after; do
    if [ "$side" = before ]; then tree="$old"; else tree="$root"; fi
    cd "$tree/benchmarks"
    PYTHONPATH="$tree:$tree/integrations" "$python" throughput.py --streams 1 16 --repeats 3 \
      --json "$out/throughput-$side-$round.json" > "$out/throughput-$side-$round.log" 2>&1
    PYTHONPATH="$tree:$tree/integrations" "$python" agent.py --sessions 1 --steps 4 --cache-gb 8 \
      --methods "dense + prefix cache" "SpecPrefill + reuse" "SpecPrefill + densify" \
      --json "$out/agent-$side-$round.json" > "$out/agent-$side-$round.log" 2>&1
  done
done
