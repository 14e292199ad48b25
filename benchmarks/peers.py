"""The peers we compare against, each in the environment it needs.

vllm-mlx 0.6.0 pins mlx-lm < 0.32, so it gets its own virtual environment
(`.bench-venv/vllm-mlx`, made on first use with pip: MLX, mlx-lm 0.31.3, and the
vllm-mlx wheel without its server dependencies, which its SpecPrefill module does
not import). Where pip cannot reach an index (the GPU machine), pass a folder that
already holds vllm_mlx and mlx_lm 0.31 (`site`): it goes first on PYTHONPATH.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
VLLM_MLX_ENV = ROOT / ".bench-venv" / "vllm-mlx"
RUNNER = Path(__file__).resolve().parent / "vllm_mlx_runner.py"


def _vllm_mlx_python() -> str:
    python = VLLM_MLX_ENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VLLM_MLX_ENV)], check=True)
        mlx = "mlx[cpu]" if sys.platform.startswith("linux") else "mlx"
        pip = [str(python), "-m", "pip", "install", "-q"]
        for packages in ([f"{mlx}=={mx.__version__}", "mlx-lm==0.31.3"],
                         ["--no-deps", "vllm-mlx==0.6.0"]):
            install = subprocess.run(pip + packages, capture_output=True, text=True)
            if install.returncode != 0:
                raise OSError(f"installing {packages[-1]} failed: {install.stderr.strip()[-300:]}")
    return str(python)


def run_vllm_mlx(job: dict, site: Optional[str] = None) -> dict:
    """Run a job through vllm-mlx; returns its results or {"error": why}."""
    env = dict(os.environ)
    try:
        if site:
            python = sys.executable
            env["PYTHONPATH"] = os.pathsep.join([site, env.get("PYTHONPATH", "")])
        else:
            python = _vllm_mlx_python()
            env.pop("PYTHONPATH", None)
        blas = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
        if sys.platform.startswith("linux") and os.path.exists(blas) and not site:
            env["LD_PRELOAD"] = blas  # the same BLAS our side uses, for a fair timing
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(job, f)
        run = subprocess.run([python, str(RUNNER), f.name], capture_output=True, text=True, env=env)
        os.unlink(f.name)
        if run.returncode != 0:
            return {"error": run.stderr.strip().splitlines()[-1] if run.stderr.strip() else
                    f"exit status {run.returncode}"}
        return json.loads(run.stdout)
    except (subprocess.CalledProcessError, OSError, json.JSONDecodeError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
