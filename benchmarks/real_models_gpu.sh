#!/usr/bin/env bash
# The real-weights grid on the GPU machine, which has no network: the two GGUF files
# (SmolLM2 98 MB, Gemma 3 253 MB: 14 parts of at most 24 MiB) travel one part per device
# call, next to MLX's CUDA build (../shared/gpu/README.md), and are converted there.
#
# Here, in the project's root (the packages installed, see benchmarks/real_models.py):
#     bash benchmarks/real_models_gpu.sh prepare     # .gpu/real/p1 .. pN, git-ignored
# There, one call per part, each carrying .gpu/real/pK:
#     mkdir -p /tmp/real && cp .gpu/real/pK/* /tmp/real/
# then, once MLX is installed (export PYTHONPATH=/tmp/site:$PWD):
#     bash benchmarks/real_models_gpu.sh install     # assemble, check, convert to /tmp/models
# then grid calls, each adding whole cases for SECONDS and returning $OUT/real-models-gpu.jsonl:
#     bash benchmarks/real_models_gpu.sh grid SECONDS
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
  python="${PYTHON:-.venv/bin/python}"
  exclude="$(git rev-parse --git-path info/exclude)"
  grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
  rm -rf .gpu/real && mkdir -p .gpu/real
  tmp="$(mktemp -d)"
  "$python" - "$tmp" <<'EOF'
import sys
from pathlib import Path
from specprefill_engine import gguf
out = Path(sys.argv[1])
for name, model in gguf.MODELS.items():
    path = model.gguf(out)
    (out / f"{name}.gguf").unlink(missing_ok=True)
    (out / f"{name}.gguf").symlink_to(path.resolve())
    folder = gguf.convert(name)  # its tokenizer files travel too (3.9 MB compressed)
    (out / "tokenizers" / name).mkdir(parents=True)
    for file in gguf.TOKENIZER_FILES:
        if (folder / file).is_file():
            (out / "tokenizers" / name / file).write_bytes((folder / file).read_bytes())
EOF
  tar cJf "$tmp/tokenizers.tar.xz" -C "$tmp" tokenizers
  (cd "$tmp" && sha256sum smollm2.gguf gemma3.gguf > gguf.sha256 \
    && tar chf - smollm2.gguf gemma3.gguf gguf.sha256 | split -b 24M - real.part-)
  "$python" -m pip download -q --no-deps -d "$tmp" gguf
  i=0
  for part in "$tmp"/*.part-*; do i=$((i + 1)); mkdir -p ".gpu/real/p$i"; mv "$part" ".gpu/real/p$i/"; done
  mv "$tmp"/gguf-*.whl "$tmp/tokenizers.tar.xz" ".gpu/real/p$i/"
  rm -rf "$tmp"
  du -sh .gpu/real/p*
  echo "$i parts: carry each .gpu/real/pK in a call of its own: mkdir -p /tmp/real && cp .gpu/real/pK/* /tmp/real/"
  ;;
install)
  cd /tmp/real
  [ -f gemma3.gguf ] || cat real.part-* | tar xf -
  sha256sum -c gguf.sha256
  mkdir -p /tmp/site && python3 -m zipfile -e gguf-*.whl /tmp/site
  cd - >/dev/null
  tar xJf /tmp/real/tokenizers.tar.xz -C /tmp/real
  export SPECPREFILL_CACHE_DIR=/tmp/models
  python3 -m specprefill_engine.gguf smollm2 gemma3 --measure \
    --gguf smollm2=/tmp/real/smollm2.gguf gemma3=/tmp/real/gemma3.gguf \
    --tokenizer smollm2=/tmp/real/tokenizers/smollm2 gemma3=/tmp/real/tokenizers/gemma3
  ;;
grid)
  # The small models leave the GPU half idle (their steps are host-bound), so slices of the
  # grid run four side by side, one process and JSONL each in /tmp/grid (kept while the
  # machine is), each resuming its file, until SECONDS from the call's start. A slice is
  # model, kinds, lengths (commas), in the order they matter.
  export SPECPREFILL_CACHE_DIR=/tmp/models end=$(( $(date +%s) + ${2:-480} ))
  mkdir -p /tmp/grid
  slice() {
    local name="$1-${2//,/-}-${3//,/-}" left=$(( end - $(date +%s) ))
    [ "$left" -gt 0 ] || return 0
    python3 benchmarks/real_models.py --models "$1" --kinds ${2//,/ } --lengths ${3//,/ } \
      --n 100 --memory-limit 28 --jsonl "/tmp/grid/$name.jsonl" --until "$left" \
      > "/tmp/grid/$name.log" 2>&1 || tail -n 3 "/tmp/grid/$name.log"
  }
  export -f slice
  xargs -P 4 -L 1 bash -c 'slice "$@"' slice <<'SLICES'
gemma3 passkey,multikey 8192,32768
gemma3 qa,two_hop 8192,32768
gemma3 passkey,multikey,qa 16384
smollm2 passkey,multikey,two_hop,qa 1024
gemma3 two_hop 16384
gemma3 passkey,multikey,qa,two_hop 4096
smollm2 passkey,multikey,two_hop,qa 2048
gemma3 summary 8192
smollm2 summary 1024
SLICES
  cat /tmp/grid/*.jsonl > "${OUT:-/tmp}/real-models-gpu.jsonl"
  wc -l /tmp/grid/*.jsonl
  ;;
*)
  echo "usage: $0 prepare|install|grid SECONDS" >&2
  exit 2
  ;;
esac
