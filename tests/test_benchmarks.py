"""The benchmark suite stays runnable: `benchmarks/smoke.py` runs every entry point's
`--help` and a tiny CPU run of each (and `plots.py --check`: the results' index is
current and every result file is cited by a document)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
BENCHMARKS = ROOT / "benchmarks"


def test_the_suite_has_at_most_twelve_entry_points_and_no_path_edits():
    entry_points = {p.name for p in BENCHMARKS.glob("*.py")
                    if 'if __name__ == "__main__"' in p.read_text()}
    assert len(entry_points) <= 12, sorted(entry_points)
    edits = [p.name for p in BENCHMARKS.glob("*.py") if "sys.path" in p.read_text()]
    assert not edits, f"sys.path edits in {edits}: run from the root as python benchmarks/x.py"


def test_every_entry_point_runs_at_tiny_sizes():
    paths = [str(ROOT), str(ROOT / "integrations"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    run = subprocess.run([sys.executable, str(BENCHMARKS / "smoke.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
