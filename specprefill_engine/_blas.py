"""Load an optimized BLAS before MLX on Linux.

MLX's Linux CPU wheel links the reference BLAS (about 6 GFLOP/s for a 2048x2048
fp32 matmul here, against about 180 with OpenBLAS). Loading OpenBLAS into the
process's global symbol scope before `mlx.core` is imported makes MLX's `cblas_*`
calls resolve to it. It must run before anything imports `mlx.core`; when that has
already happened, nothing changes and `blas_status()` says so.

OpenBLAS's idle threads spin on `sched_yield` for about 2**28 cycles after each
call. During decode its threads sit idle between steps, so on a small CPU they take
the cores the engine's worker and event loop need (a single stream falls behind
mlx-lm's `generate_step`, the prefill no faster: docs/how-it-works.md, "Faster CPU
matmuls"). Unless the caller set it,
OPENBLAS_THREAD_TIMEOUT is set to its minimum (2**4 cycles) before the library loads,
so idle threads sleep at once; it stays in `os.environ`, so child processes and other
OpenBLAS copies loaded later (numpy's) read it too.

Set SPECPREFILL_BLAS=off to skip it, or SPECPREFILL_BLAS=/path/to/libblas.so to
choose the library.
"""

import ctypes
import os
import sys

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

_status = "not attempted"


def preload_blas() -> str:
    """Load the first optimized BLAS found; return a one-line status."""
    global _status
    choice = os.environ.get("SPECPREFILL_BLAS", "")
    if not sys.platform.startswith("linux") or choice.lower() == "off":
        _status = "skipped"
    elif "mlx.core" in sys.modules:
        _status = "mlx.core was imported first: reference BLAS in use"
    else:
        paths = [choice] if choice else [p for p in CANDIDATES if os.path.exists(p)]
        if paths:  # read when the library loads; it stays in the process's environment
            os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
        _status = "no optimized BLAS found (apt-get install libopenblas0-pthread)"
        for path in paths:
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as error:
                _status = f"could not load {path}: {error}"
                continue
            _status = f"loaded {path}"
            break
    return _status


def blas_status() -> str:
    return _status
