#!/usr/bin/env bash
# The agent loop's grid on the GPU machine (random Qwen3-8B / 0.6B shapes, 32K, 6 steps,
# one session a row), a cell at a time. A cell is REPLY:TOOL:KEEP:ROWS, ROWS "base"
# (mlx-lm, dense, the engine's default: keep changes none of them) or "sparse" (reuse and
# densify at that keep). Each cell writes $OUT/rREPLY-tTOOL-base.json or
# $OUT/rREPLY-kKEEP-tTOOL-sparse.json (docs/agent-gpu-grid holds the lease's); the
# cost model persists on the machine from cell to cell, as it does for a user, and its
# points are copied to $OUT/costs after every cell. MLX installed first
# (../shared/gpu/README.md, export PYTHONPATH=/tmp/site:$PWD).
#     bash benchmarks/agent_grid.sh 150:0.5:0.1:base 150:2:0.1:sparse
set -euo pipefail
cd "$(dirname "$0")"
out="${OUT:-/tmp}"
for cell in "$@"; do
  IFS=: read -r reply tool keep rows <<< "$cell"
  case "$rows" in
    base) methods=("mlx-lm + prompt cache" "dense + prefix cache" "engine default")
          name="r$reply-t$tool-base" ;;
    sparse) methods=("SpecPrefill + reuse" "SpecPrefill + densify")
            name="r$reply-k$keep-t$tool-sparse" ;;
    *) echo "rows must be base or sparse: $cell" >&2; exit 2 ;;
  esac
  python3 agent.py --target-shape qwen3-8b --tokens 32000 --steps 6 --sessions 1 \
    --reply-tokens "$reply" --tool-seconds "$tool" --keep "$keep" --methods "${methods[@]}" \
    --json "$out/$name.json" > "/tmp/$name.log" 2>&1
  costs="${SPECPREFILL_CACHE_DIR:-$HOME/.cache/specprefill-engine}/costs"
  rm -rf "$out/costs" && if [ -d "$costs" ]; then cp -r "$costs" "$out/costs"; fi
  echo "$cell done $(date +%T)"
done
