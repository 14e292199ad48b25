"""The README and docs/ say what runs: every Python block runs as written on the demo
pair, and every relative link points at a file (and heading) that exists."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = "# not run by tests/test_readme.py:"  # a block's first line, then the reason
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+)$", re.M)


def python_blocks() -> list:
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) == "python":
                line = text.count("\n", 0, match.start()) + 1
                blocks.append(pytest.param(match.group(2), id=f"{page.name}:{line}"))
    return blocks


def prose(text: str) -> str:
    """The page without its fenced blocks (a `#` comment there is no heading)."""
    return FENCE.sub("", text)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set:
    return {anchor(h) for h in HEADING.findall(prose(page.read_text()))}


@pytest.mark.parametrize("code", python_blocks())
def test_python_block_runs(code, tmp_path):
    if code.startswith(NOT_RUN):
        reason = code.splitlines()[0][len(NOT_RUN):].strip()
        assert reason, "a block left out of the run says why"
        pytest.skip(reason)
    paths = [str(ROOT), str(ROOT / "integrations"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p),
           "HF_HUB_OFFLINE": "1",  # a block that would download fails at once
           "SPECPREFILL_CACHE_DIR": str(tmp_path)}  # as a new user: nothing observed before
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]


def test_pages_have_python_blocks_and_the_marker_is_rare():
    blocks = [p.values[0] for p in python_blocks()]
    assert sum(not b.startswith(NOT_RUN) for b in blocks) >= 4
    assert sum(b.startswith(NOT_RUN) for b in blocks) <= 1


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_point_at_existing_files_and_headings(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no heading #{fragment} in {file.name}")
    assert not broken, "\n".join(broken)


def test_model_card_names_only_files_that_ship():
    assets = ROOT / "specprefill_engine" / "assets"
    card = (assets / "MODEL_CARD.md").read_text()
    named = set(re.findall(r"`([\w.-]+\.(?:py|txt|json|safetensors))`", card))
    shipped = {file.name for file in assets.rglob("*") if file.is_file()}
    assert named and not named - shipped, f"named but not shipped: {sorted(named - shipped)}"
