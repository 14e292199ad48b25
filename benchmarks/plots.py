"""PNG plots from the benchmarks' JSON: TTFT against prompt length per method,
accuracy against keep per prompt length, decode throughput against concurrent
streams, an agent loop's TTFT per step, and a grid of agent loops' wall time against
mlx-lm's (`agent_grid.sh`'s folder).

    .venv/bin/python benchmarks/plots.py --ttft docs/ttft.json --quality docs/quality.json \
        --throughput docs/throughput-cpu.json --agent docs/agent-cpu.json --out docs
"""

import argparse
import json
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _integer_log_ticks(axes, ticks: list) -> None:
    axes.set_xticks(ticks, [str(n) for n in ticks])
    axes.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def _save(figure, axes, path: Path, legend_size: int = 8) -> None:
    axes.grid(alpha=0.3)
    axes.legend(fontsize=legend_size)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot_ttft(rows: list, path: Path, title: str) -> None:
    """One line per method; gpu_ttft.py's component rows (N=..., scoring, draft, before)
    are left out and its SpecPrefill rows' ideal drawn dashed."""
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


def plot_agent(summary: dict, path: Path, title: str) -> None:
    summary = summary["steps"]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    steps = [line["step"] for line in summary]
    methods = [k for k in summary[0] if k != "step"]
    for method in methods:
        axes.plot(steps, [line[method]["ttft"] for line in summary], marker="o", label=method)
    axes.set(xlabel="agent step", ylabel="time to first token (s, median)", title=title,
             yscale="log")
    axes.set_xticks(steps)
    _save(figure, axes, path)


def plot_agent_grid(folder: Path, path: Path) -> None:
    """Per cell (reply tokens, tool seconds): each row's wall time as a speed-up over
    mlx-lm's in the same run (the sparse rows: keep 0.1, their own run)."""
    def walls(name):
        rows = json.loads((folder / name).read_text())["rows"]
        return {m: sum(r["wall"] for r in rows if r["method"] == m)
                for m in dict.fromkeys(r["method"] for r in rows)}

    cells, bars = [], {}
    for base in sorted(folder.glob("r*-t*-base.json"),
                       key=lambda p: [-int(p.stem.split("-")[0][1:]), float(p.stem.split("-")[1][1:])]):
        reply, tool, _ = base.stem.split("-")
        found = walls(base.name)
        sparse = folder / f"{reply}-k0.1-{tool}-sparse.json"
        if sparse.exists():
            found.update({f"{m}, keep 0.1": w for m, w in walls(sparse.name).items()})
        mlx_lm = found.pop("mlx-lm + prompt cache")
        cells.append(f"{reply[1:]} tokens\n{tool[1:]} s tools")
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
             title=f"{folder.name}: agent loops, wall time against mlx-lm's")
    _save(figure, axes, path, legend_size=7)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ttft", nargs="*", default=[], help="ttft JSON files")
    parser.add_argument("--quality", nargs="*", default=[], help="quality JSON files")
    parser.add_argument("--throughput", nargs="*", default=[], help="throughput JSON files")
    parser.add_argument("--agent", nargs="*", default=[], help="agent JSON files")
    parser.add_argument("--agent-grid", help="a folder of agent_grid.sh's JSON files")
    parser.add_argument("--out", default="docs")
    args = parser.parse_args(argv)
    for name in args.ttft:
        source = Path(name)
        plot_ttft(json.loads(source.read_text())["rows"], Path(args.out) / f"{source.stem}.png", source.stem)
    for name in args.quality:
        source = Path(name)
        plot_quality(json.loads(source.read_text())["rows"], Path(args.out) / f"{source.stem}.png", source.stem)
    for name in args.throughput:
        source = Path(name)
        plot_throughput(json.loads(source.read_text()), Path(args.out) / f"{source.stem}.png", source.stem)
    for name in args.agent:
        source = Path(name)
        plot_agent(json.loads(source.read_text())["summary"], Path(args.out) / f"{source.stem}.png", source.stem)
    if args.agent_grid:
        folder = Path(args.agent_grid)
        plot_agent_grid(folder, Path(args.out) / f"{folder.name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
