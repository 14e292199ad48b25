"""The plots and the index of docs/results/, regenerated from the result files there.

    python benchmarks/plots.py               # every plot, then docs/results/README.md
    python benchmarks/plots.py --index       # the index alone (no matplotlib needed)
    python benchmarks/plots.py --check       # fail if the index is stale or a file is cited nowhere

Plots, by file name: `ttft-*.json` TTFT against prompt length per method (the
SpecPrefill rows' ideal dashed); `quality-*-demo.json` accuracy against keep per prompt
length; other `quality-*.jsonl` accuracy retained against keep per model and kind;
`throughput-*.json` decode tokens/s against concurrent streams; the agent loop's grid
(`agent-*-reply*-tool*-base.json` with their keep 0.1 runs) as wall-time speed-ups over
mlx-lm. The index lists every file with its size and the sections of the documents
that cite it, so a file no document cites shows.
"""

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
INDEX = RESULTS / "README.md"
GRIDS = ["agent-h200-qwen3-8b-32k"]  # the agent loop's grids: one plot per prefix


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot

    return matplotlib.pyplot


def _integer_log_ticks(axes, ticks: list) -> None:
    axes.set_xticks(ticks, [str(n) for n in ticks])
    from matplotlib.ticker import NullFormatter

    axes.xaxis.set_minor_formatter(NullFormatter())


def _save(figure, axes, path: Path, legend_size: int = 8) -> None:
    axes.grid(alpha=0.3)
    axes.legend(fontsize=legend_size)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot_ttft(rows: list, path: Path, title: str) -> None:
    """One line per method; ttft.py's component rows (N=..., scoring, draft prefill) are
    left out and its SpecPrefill rows' ideal drawn dashed."""
    figure, axes = plt.subplots(figsize=(7, 4.5))
    skip = ("N=", "scoring", "draft prefill", "(before)")
    for method in dict.fromkeys(r["method"] for r in rows):
        if any(s in method for s in skip):
            continue
        points = sorted((r["length"], r["ttft"]) for r in rows if r["method"] == method)
        line, = axes.plot(*zip(*points), marker="o", label=method)
        ideal = sorted((r["length"], r["ideal_s"]) for r in rows
                       if r["method"] == method and "ideal_s" in r)
        if ideal:
            axes.plot(*zip(*ideal), linestyle="--", color=line.get_color(), alpha=0.6,
                      label=f"ideal for {method}")
    axes.set(xlabel="prompt tokens", ylabel="time to first token (s)", title=title,
             xscale="log", yscale="log")
    _integer_log_ticks(axes, sorted({r["length"] for r in rows}))
    _save(figure, axes, path)


def plot_quality(rows: list, path: Path, title: str) -> None:
    figure, axes = plt.subplots(figsize=(7, 4.5))
    methods = [k for k in rows[0] if "@" in k]
    families = sorted({m.split("@")[0] for m in methods})
    for number, length in enumerate(sorted({r["length"] for r in rows})):
        group = [r for r in rows if r["length"] == length]
        dense = sum(r["dense"] for r in group) / len(group)
        color = plt.cm.tab10(number)
        axes.axhline(dense, linestyle=":", alpha=0.6, color=color)
        for family, style in zip(families, ("-o", "--s", "-.^", ":v")):
            keeps = sorted(float(m.split("@")[1]) for m in methods if m.startswith(family + "@"))
            accuracy = [sum(bool(r.get(f"{family}@{k}")) for r in group) / len(group) for k in keeps]
            axes.plot(keeps, accuracy, style, color=color,
                      label=f"{family}, {length} tokens (dotted: dense)")
    axes.set(xlabel="keep fraction", ylabel="exact-answer accuracy", title=title, ylim=(-0.02, 1.02))
    _save(figure, axes, path, legend_size=7)


def plot_throughput(rows: list, path: Path, title: str) -> None:
    figure, axes = plt.subplots(figsize=(7, 4.5))
    rows = [r for r in rows if "streams" in r]
    streams = [r["streams"] for r in rows]
    for key, label in (("engine", "engine (batched decode)"),
                       ("mlx_lm_batch", "mlx-lm BatchGenerator")):
        axes.plot(streams, [r[key]["tok_s"] for r in rows], marker="o", label=label)
    single = [r for r in rows if "mlx_lm_generate_step" in r]
    if single:
        axes.plot([1], [single[0]["mlx_lm_generate_step"]["tok_s"]], "k^",
                  label="mlx-lm generate_step (1 stream)")
    axes.set(xlabel="concurrent streams", ylabel="aggregate decode tokens/s", title=title,
             xscale="log", yscale="log")
    _integer_log_ticks(axes, streams)
    _save(figure, axes, path)


def plot_agent_grid(prefix: str, path: Path) -> None:
    """Per cell (reply tokens, tool seconds) of the agent loop's grid (files
    PREFIX-replyR-toolT-base.json and PREFIX-replyR-toolT-keep0.1-sparse.json): each
    row's wall time as a speed-up over mlx-lm's in the same run (the sparse rows: keep
    0.1, their own run)."""
    def walls(file):
        rows = json.loads(file.read_text())["rows"]
        return {m: sum(r["wall"] for r in rows if r["method"] == m)
                for m in dict.fromkeys(r["method"] for r in rows)}

    def cell(file):
        reply, tool = file.stem[len(prefix) + 1:].split("-")[:2]
        return int(reply[len("reply"):]), float(tool[len("tool"):])

    cells, bars = [], {}
    for base in sorted(RESULTS.glob(f"{prefix}-reply*-tool*-base.json"),
                       key=lambda p: (-cell(p)[0], cell(p)[1])):
        found = walls(base)
        sparse = base.with_name(base.name.replace("-base.json", "-keep0.1-sparse.json"))
        if sparse.exists():
            found.update({f"{m}, keep 0.1": w for m, w in walls(sparse).items()})
        mlx_lm = found.pop("mlx-lm + prompt cache")
        reply, tool = cell(base)
        cells.append(f"{reply} tokens\n{tool:g} s tools")
        for method, wall in found.items():
            bars.setdefault(method, {})[len(cells) - 1] = mlx_lm / wall
    figure, axes = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(bars)
    for i, (method, values) in enumerate(bars.items()):
        axes.bar([c + i * width for c in values], list(values.values()), width, label=method)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks([c + 0.4 - width / 2 for c in range(len(cells))], cells)
    top = max(v for values in bars.values() for v in values.values())
    axes.set(ylabel="wall-time speed-up over mlx-lm (x)", ylim=(0, 1.3 * top),
             title=f"{prefix}: agent loops, wall time against mlx-lm's")
    _save(figure, axes, path, legend_size=7)


def plot_all() -> list:
    """Every plot the result files make; returns the paths written."""
    global plt
    plt = _pyplot()
    written = []
    for source in sorted(RESULTS.iterdir()):
        target = source.with_suffix(".png")
        if source.suffix == ".json":
            data = json.loads(source.read_text())
            if source.name.startswith("ttft-"):
                plot_ttft(data["rows"], target, source.stem)
            elif source.name.startswith("quality-") and source.stem.endswith("-demo"):
                plot_quality(data["rows"], target, source.stem)
            elif source.name.startswith("throughput-") and isinstance(data, list) \
                    and not source.stem.endswith("-1stream") \
                    and any("mlx_lm_batch" in r for r in data):
                plot_throughput(data, target, source.stem)
            else:
                continue
        elif source.suffix == ".jsonl" and source.name.startswith("quality-"):
            from quality import plot as plot_retained

            cases = {}  # a case in several lines (runs of other keeps) is one case
            for line in source.read_text().splitlines():
                r = json.loads(line)
                cases.setdefault((r["model"], r["kind"], r["length"], r["seed"]), {}).update(r)
            plot_retained(list(cases.values()), target)
        else:
            continue
        plt.close("all")
        written.append(target)
    for prefix in GRIDS:
        target = RESULTS / f"{prefix}.png"
        plot_agent_grid(prefix, target)
        plt.close("all")
        written.append(target)
    return written


def citations() -> dict:
    """File name -> the document sections (page, heading) that name it."""
    cited = {}
    for page in DOCUMENTS:
        heading = page.name
        in_fence = False
        for line in page.read_text().splitlines():
            if line.startswith("```"):
                in_fence = not in_fence
            elif not in_fence and re.match(r"#{1,6} ", line):
                heading = line.lstrip("#").strip()
            for pattern in re.findall(r"results/([\w.+*-]+\.(?:jsonl|json|png))", line):
                where = f"{page.relative_to(ROOT)}: {heading}"
                for file in RESULTS.glob(pattern):  # a name, or a pattern citing several
                    cited.setdefault(file.name, [])
                    if where not in cited[file.name]:
                        cited[file.name].append(where)
    return cited


def index_text() -> str:
    cited = citations()
    lines = ["# Results", "",
             "The files behind the figures in [docs/benchmarks.md](../benchmarks.md), each named by",
             "what it measures: the benchmark, the machine (`cpu`: the project's 2-core x86-64",
             "Linux host; `h200`: one NVIDIA H200), the model or shape, the prompt length and the",
             "setting. Each JSON file holds its rows (and, for newer runs, the command that made",
             "them); the PNGs are drawn from them. This page is written by",
             "`python benchmarks/plots.py`; do not edit it by hand.", "",
             "| file | size | cited in |", "| --- | --- | --- |"]
    for file in sorted(RESULTS.iterdir()):
        if file == INDEX:
            continue
        where = "; ".join(cited.get(file.name, [])) or "**nowhere**"
        size = file.stat().st_size
        shown = f"{size / 1024:.0f} KB" if size < 2**20 else f"{size / 2**20:.1f} MB"
        lines.append(f"| [{file.name}]({file.name}) | {shown} | {where} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", action="store_true", help="write the index alone")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; fail if the index is stale or a file is cited nowhere")
    args = parser.parse_args(argv)
    text = index_text()
    if args.check:
        stale = not INDEX.exists() or INDEX.read_text() != text
        nowhere = [line.split("]")[0][3:] for line in text.splitlines() if "**nowhere**" in line]
        if stale:
            print(f"{INDEX.relative_to(ROOT)} is stale: run python benchmarks/plots.py --index")
        if nowhere:
            print("cited by no document: " + ", ".join(nowhere))
        return 1 if stale or nowhere else 0
    if not args.index:
        for path in plot_all():
            print(f"wrote {path.relative_to(ROOT)}")
        text = index_text()  # the new plots' sizes
    INDEX.write_text(text)
    print(f"wrote {INDEX.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
