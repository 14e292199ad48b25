#!/usr/bin/env bash
# The Qwen2.5-Coder pair (1.5B target, 0.5B draft) on the GPU machine, which has no
# network: both models quantized here to 4-bit MLX folders (1.3 GB), carried in parts of
# 56 MiB, one per device call, next to MLX's CUDA build (../shared/gpu/README.md). A call
# carries at most 64 MiB with the tree, so the demo weights leave the tree for those
# calls (`git checkout -- specprefill_engine/assets` restores them).
#
# Here, in the project's root (`pip install -e ".[pair]"`, then
# `python -m specprefill_engine.gguf qwen2.5-coder-1.5b qwen2.5-coder-0.5b`):
#     bash benchmarks/pair_gpu.sh prepare        # .gpu/pair/p1 .. pN, git-ignored
# There, one call per part:  mkdir -p /tmp/pairparts && cp .gpu/pair/pK/* /tmp/pairparts/
# then, once MLX is installed (export PYTHONPATH=/tmp/site:$PWD):
#     bash benchmarks/pair_gpu.sh install        # assemble, check, unpack to /tmp/pair
#     bash benchmarks/pair_gpu.sh ttft           # TTFT at 8K / 16K / 32K -> $OUT
#     bash benchmarks/pair_gpu.sh first          # a fresh engine's first requests at 16K
#     bash benchmarks/pair_gpu.sh quality 540    # the quality grid, a process per kind, 540 s
#     SCORERS=draft bash benchmarks/pair_gpu.sh quality 520 two_hop two_hop:32768  # jobs of its own
#     bash benchmarks/pair_gpu.sh agent          # the agent loop with real tool calls
#     bash benchmarks/pair_gpu.sh loop           # agent.py's scripted loop at 16K, 4 sessions
#     bash benchmarks/pair_gpu.sh short          # a later turn's short reply at 16K, vs mlx-lm
#     SEED=1 bash benchmarks/pair_gpu.sh session # ten questions, files read into the chat
set -euo pipefail
cd "$(dirname "$0")/.."
PAIR=/tmp/pair
case "${1:-}" in
prepare)
  python="${PYTHON:-.venv/bin/python}"
  exclude="$(git rev-parse --git-path info/exclude)"
  grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
  rm -rf .gpu/pair && mkdir -p .gpu/pair
  tmp="$(mktemp -d)"
  for name in qwen2.5-coder-1.5b qwen2.5-coder-0.5b; do
    folder="$("$python" -c "from specprefill_engine import gguf; print(gguf.convert('$name'))")"
    "$python" -m mlx_lm convert --hf-path "$folder" --mlx-path "$tmp/$name" -q --q-bits 4 \
      --q-group-size 64 >/dev/null
  done
  (cd "$tmp" && tar cf pair.tar qwen2.5-coder-1.5b qwen2.5-coder-0.5b \
    && sha256sum pair.tar > pair.sha256 && split -b 56M pair.tar pair.part- && rm pair.tar)
  i=0
  for part in "$tmp"/pair.part-*; do i=$((i + 1)); mkdir -p ".gpu/pair/p$i"; mv "$part" ".gpu/pair/p$i/"; done
  mv "$tmp/pair.sha256" ".gpu/pair/p$i/"
  rm -rf "$tmp"
  du -sh .gpu/pair/p* | tail -n 2
  echo "$i parts: carry each .gpu/pair/pK in a call of its own: mkdir -p /tmp/pairparts && cp .gpu/pair/pK/* /tmp/pairparts/"
  ;;
install)
  cd /tmp/pairparts
  cat pair.part-* > pair.tar && sha256sum -c pair.sha256 && rm pair.part-*
  mkdir -p "$PAIR" && tar xf pair.tar -C "$PAIR" && rm pair.tar
  ls "$PAIR"
  ;;
ttft)
  python3 benchmarks/gpu_ttft.py --target-path "$PAIR/qwen2.5-coder-1.5b" \
    --draft-path "$PAIR/qwen2.5-coder-0.5b" --lengths 8192 16384 32768 --keeps 0.1 0.3 \
    --json "${OUT:-/tmp}/pair-ttft-gpu.json"
  ;;
first)
  python3 benchmarks/first_request.py --target "$PAIR/qwen2.5-coder-1.5b" \
    --draft "$PAIR/qwen2.5-coder-0.5b" --lengths 16384 --json "${OUT:-/tmp}/pair-first-request-gpu.json"
  ;;
quality)
  # one process per job sharing the GPU (each its memory bounded), seeds round-robin over
  # a job's lengths so a cut-short run has even cells; a rerun with the same files resumes,
  # and cases docs/pair-quality-gpu.jsonl (or $DONE's files) holds are skipped, so the new
  # lines add to it. A job is a kind, or KIND:LENGTH,LENGTH (default 4K-16K); SCORERS="draft"
  # runs fewer scorers (the random control comes with the first). Logs in /tmp.
  jobs=("${@:3}")
  [ ${#jobs[@]} -gt 0 ] || jobs=(code_return code_calls code_far passkey multikey)
  for job in "${jobs[@]}"; do
    kind="${job%%:*}" lengths=4096,8192,16384 name="${job//[:,]/-}"
    [[ "$job" != *:* ]] || lengths="${job#*:}"
    python3 benchmarks/real_models.py --models qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
      --folder "qwen2.5-coder-1.5b=$PAIR/qwen2.5-coder-1.5b" \
      "qwen2.5-coder-0.5b=$PAIR/qwen2.5-coder-0.5b" --scorers ${SCORERS:-draft self layers} \
      --draft-layers 0.5 --kinds "$kind" --lengths ${lengths//,/ } --n 100 \
      --memory-limit 20 --until "${2:-540}" --jsonl "${OUT:-/tmp}/pair-quality-$name.jsonl" \
      --done docs/pair-quality-gpu.jsonl ${DONE:-} 2> "/tmp/pair-quality-$name.log" &
  done
  wait
  tail -n 1 /tmp/pair-quality-*.log
  ;;
agent)
  python3 benchmarks/tool_agent.py --target "$PAIR/qwen2.5-coder-1.5b" \
    --draft "$PAIR/qwen2.5-coder-0.5b" --tasks "${2:-4}" --tokens 48000 --files 8 \
    --turns 10 --reply-tokens 256 --tool-seconds 0.5 --json "${OUT:-/tmp}/pair-tool-agent-gpu.json"
  ;;
loop)
  python3 benchmarks/agent.py --target "$PAIR/qwen2.5-coder-1.5b" \
    --draft "$PAIR/qwen2.5-coder-0.5b" --tokens 16000 --steps 6 --sessions 4 \
    --tool-seconds 0.5 --reply-tokens 150 --stop-at-eos --json "${OUT:-/tmp}/agent-pair-16k.json"
  ;;
short)
  (cd benchmarks && python3 short_reply.py --model "$PAIR/qwen2.5-coder-1.5b" \
    --draft "$PAIR/qwen2.5-coder-0.5b" --chat --prompt 16000 --new-tokens 150 --breakdown \
    --json "${OUT:-/tmp}/short-reply-pair-gpu.json")
  ;;
session)
  python3 benchmarks/tool_agent.py --target "$PAIR/qwen2.5-coder-1.5b" \
    --draft "$PAIR/qwen2.5-coder-0.5b" --seed "${SEED:-0}" --tasks 2 --tokens 24000 --files 8 \
    --questions 10 --scripted-reads --turns 2 --reply-tokens 160 --tool-seconds 0.5 \
    --methods dense "SpecPrefill + reuse" default mlx-lm \
    --json "${OUT:-/tmp}/tool-session-pair-gpu.json"
  ;;
*)
  echo "usage: $0 prepare|install|ttft|first|quality [seconds [job...]]|agent [tasks]|loop|short|session" >&2
  exit 2
  ;;
esac
