"""A CPU smoke run of every entry point: each one's `--help` (all in one process), then
each at tiny sizes on the demo pair or random-weight "tiny" shapes, its `--json` written
to a temporary folder. It checks that the suite runs, not what it measures: take no
number from it.

    python benchmarks/smoke.py              # every entry point, about a minute on 2 cores
    python benchmarks/smoke.py ttft agent   # some of them

`tests/test_benchmarks.py` runs it, so the suite stays runnable.
"""

import argparse
import concurrent.futures
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEMO_TARGET = str(ROOT / "specprefill_engine" / "assets" / "demo-target")
DEMO_DRAFT = str(ROOT / "specprefill_engine" / "assets" / "demo-draft")
TINY = ["--shape", "tiny", "--draft-shape", "tiny"]

# entry point -> its tiny runs (each a list of arguments; "{json}" is a file to write)
RUNS = {
    "ttft.py": [
        ["--lengths", "256", "--keeps", "0.3", "--repeats", "1", "--no-peer", "--json", "{json}"],
        [*TINY, "--vocab", "4096", "--lengths", "256", "--keeps", "0.3", "--repeats", "1",
         "--mac", "--json", "{json}"],
    ],
    "quality.py": [
        ["--lengths", "256", "--kinds", "passkey", "--repeats", "1", "--keeps", "0.3",
         "--no-peer", "--json", "{json}"],
        ["--model", DEMO_TARGET, "--scorers", "self", "--kinds", "passkey", "code_return",
         "--lengths", "384", "--repeats", "1", "--keeps", "0.3", "--json", "{json}"],
        ["--engine", "--model", DEMO_TARGET, "--draft", DEMO_DRAFT, "--kinds", "passkey",
         "--placements", "user", "tool", "agent", "--lengths", "384", "--repeats", "1", "--json",
         "{json}"],
        ["--engine", "--model", DEMO_TARGET, "--draft", DEMO_DRAFT, "--kinds", "code_return",
         "--placements", "tool", "--lengths", "300", "--seeds", "1", "--rows", "forced",
         "--match-weight", "0", "--json", "{json}"],
        ["--repeat-check", "--model", DEMO_TARGET, "--kinds", "code_return", "--placements",
         "agent", "--lengths", "300", "--seeds", "1", "--json", "{json}"],
    ],
    "throughput.py": [
        ["--shape", "tiny", "--streams", "2", "--lengths", "64", "--new-tokens", "8",
         "--repeats", "1", "--long-prompt", "768", "--json", "{json}"],
        ["--speculative", "2", "--prompts", "1", "--kinds", "code", "--new-tokens", "8",
         "--json", "{json}"],
        ["--speculative", "2", "--engine", "--prompts", "1", "--kinds", "tool",
         "--new-tokens", "4", "--json", "{json}"],
    ],
    "agent.py": [
        ["--lengths", "300", "--steps", "2", "--repeats", "1", "--reply-tokens", "2",
         "--methods", "mlx-lm + prompt cache", "SpecPrefill + densify", "engine default",
         "--json", "{json}"],
    ],
    "tool_agent.py": [
        ["--lengths", "300", "--files", "2", "--repeats", "1", "--turns", "1",
         "--reply-tokens", "4", "--json", "{json}"],
    ],
    "server.py": [
        ["--streams", "2", "--repeats", "1", "--lengths", "64", "--new-tokens", "4",
         "--json", "{json}"],
    ],
    "disk_cache.py": [
        ["--lengths", "256", "--bits", "8", "--repeats", "1", "--json", "{json}"],
    ],
    "distributed.py": [
        [*TINY, "--lengths", "256", "--keeps", "0.3", "--repeats", "1", "--streams", "1",
         "--new-tokens", "4", "--decode-prompt", "64", "--json", "{json}"],
    ],
    "plots.py": [["--check"]],
    "sessions.py": [],  # --help only: tests/test_sessions.py replays three sessions
    "memory.py": [
        ["--target-shape", "qwen3-narrow", "--draft-shape", "tiny", "--lengths", "256",
         "--max-tokens", "2", "--quality-lengths", "--json", "{json}"],
    ],
}


# each entry point's `--help`, run as `python benchmarks/NAME --help` would, in one process
# (an interpreter and MLX started once): the names whose help did not exit 0 are printed
HELP = """import runpy, sys
failed = []
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    try:
        runpy.run_path(path, run_name="__main__")
        failed.append(path)
    except SystemExit as stop:
        if stop.code not in (0, None):
            failed.append(path)
sys.exit(f"--help failed: {failed}" if failed else 0)
"""


def run(name: str, arguments: list, folder: Path, number: int) -> tuple:
    json_path = folder / f"{name}-{number}.json"
    if name == "--help":
        command = [sys.executable, "-c", HELP, *(str(HERE / n) for n in arguments)]
    else:
        command = [sys.executable, str(HERE / name),
                   *[str(json_path) if a == "{json}" else a for a in arguments]]
    env = {**os.environ, "SPECPREFILL_CACHE_DIR": str(folder / f"cache-{number}"),
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
               p for p in (str(ROOT), str(ROOT / "integrations"), str(HERE),
                           os.environ.get("PYTHONPATH")) if p)}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    return done, time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="entry points (default: all), e.g. ttft")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    args = parser.parse_args(argv)
    names = [n if n.endswith(".py") else f"{n}.py" for n in args.names] or list(RUNS)
    jobs, helps = [], []
    for name in names:
        if not (HERE / name).exists():
            print(f"skip {name}: not written yet (benchmarks/smoke.py runs it once it is)")
            continue
        if name in RUNS and not RUNS[name]:
            print(f"note {name}: --help only here")
        helps.append(name)
        jobs += [(name, arguments) for arguments in RUNS.get(name, [])]
    jobs.insert(0, ("--help", helps))
    failed = 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="specprefill-smoke-") as folder, \
            concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run, name, arguments, Path(folder), number)
                   for number, (name, arguments) in enumerate(jobs)]
        for (name, arguments), future in zip(jobs, futures):
            done, seconds = future.result()
            status = "ok" if done.returncode == 0 else f"FAILED ({done.returncode})"
            print(f"{status:>10} {seconds:5.1f} s  {name} {' '.join(arguments)}", flush=True)
            if done.returncode != 0:
                failed += 1
                print(done.stdout[-2000:] + done.stderr[-4000:], flush=True)
    print(f"{len(jobs) - failed} of {len(jobs)} runs ok in {time.perf_counter() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
