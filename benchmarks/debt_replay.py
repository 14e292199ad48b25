"""Replay the automatic policy's conversation debt over a measured agent grid: the turns
each cell's engine reported and the cost folder it left (`benchmarks/agent_grid.sh`'s
files), no model run.

For each base cell, in the order the cells ran, it rebuilds what the cost model had
seen when the default decided the session's first turn (the cells before it, this
cell's dense row and the default's warm-up), and shows the debt that decision was
given (from its report), the debt the cost model here predicts from the same history,
and what the later turns really cost beyond dense continuations and beyond mlx-lm's.

What it rebuilds, from the files:
- follow-ups: the cost folder's own (`followup`: turns that continued a sparse view),
  each at its recorded time; a later turn that ran dense on a densified view is none
  (the debt does not count on idle time);
- turns: each engine row's warm-up (two turns, as `agent.py` runs it) and its six
  steps, a step counted as continuing the turn before unless the engine, by its
  report, took it for a new conversation (a SpecPrefill turn recorded as starting a
  chain);
- the target's and the draft's fits from the cost folder's last points (the earliest
  cells' own are gone from it), so the dense and SpecPrefill times differ from the
  reported ones by a few percent.

    python benchmarks/agent.py --replay-debt ../shared/measurements/h100-agent-grid
"""

import json
import re
from pathlib import Path

import numpy as np

from specprefill_engine.engine.policy import CostModel, Shape, predict

CELLS = ("12-t0", "150-t0", "150-t0.5", "150-t2", "12-t0.5", "12-t2")  # the order they ran
DEFAULT, DENSE, MLX_LM = "engine default", "dense + prefix cache", "mlx-lm + prompt cache"
WARM_UP = 32346  # agent.py's warm-up session: its first prompt, two turns, no tool time
MARGIN = 0.1  # the engine's default specprefill_margin
WINDOW_S = 8.0  # a default row's warm-up starts this long before its first step at most


def steps(cell: dict, method: str) -> list:
    return sorted((r for r in cell["rows"] if r["method"] == method), key=lambda r: r["step"])


def reported_debt(row: dict) -> float:
    found = re.search(r"later turns' debt ([0-9.]+)s", row["reason"])
    return float(found.group(1)) if found else 0.0


def old_debt(model: CostModel, followup: list, sparse: list, tokens: int) -> tuple:
    """The debt as main computed it before (the median extra per token times the
    follow-ups per chain start): (debt, median extra for `tokens`, chain)."""
    extra = [max(s - model.predict("target", n, c), 0.0) / c for n, c, s, _ in followup if c > 0]
    if not extra:
        return 0.0, 0.0, 0.0
    chain = len(followup) / max(sum(follows == 0 for _, follows, _, _ in sparse), 1)
    return tokens * float(np.median(extra)) * chain, tokens * float(np.median(extra)), chain


def replay(folder: Path) -> list:
    costs = next(json.loads(p.read_text()) for p in sorted((folder / "costs").glob("*.json"))
                 if "draft" in json.loads(p.read_text()))
    target, draft = Shape(*costs["target"]["shape"]), Shape(*costs["draft"]["shape"])
    recorded = {k: [tuple(p) for p in costs[k]["points"]] for k in ("followup", "sparse", "target")}
    cells = {name: json.loads((folder / f"r{name}-base.json").read_text()) for name in CELLS}
    # each default row's first SpecPrefill turn, when it engaged (all six did)
    starts = {}
    for name in CELLS:
        first = steps(cells[name], DEFAULT)[0]
        starts[name] = min(at for tokens, follows, _, at in recorded["sparse"]
                           if tokens == first["prompt_tokens"] and follows == 0 and
                           all(at > t + 60 for t in starts.values()))
    bounds = [starts[name] - WINDOW_S for name in CELLS] + [float("inf")]
    followup, turns, out = [], [], []
    for index, name in enumerate(CELLS):
        cell, begin, end = cells[name], bounds[index], bounds[index + 1]
        reply = cell["args"]["reply_tokens"]
        dense, default, mlx = steps(cell, DENSE), steps(cell, DEFAULT), steps(cell, MLX_LM)
        warm_next = WARM_UP + reply + 365  # the warm-up's second prompt
        # the dense row: its warm-up and its session, each a conversation
        turns += [(WARM_UP, 0), (warm_next, WARM_UP + reply)]
        turns += [(r["prompt_tokens"], r["target_cached"] if r["step"] > 1 else 0) for r in dense]
        # the default's warm-up: a SpecPrefill turn and its follow-up where it engaged
        warm = [p for p in recorded["followup"] if begin <= p[3] < starts[name]]
        followup += warm
        turns += [(WARM_UP, 0), (warm_next, WARM_UP + reply)]
        model = CostModel(target, draft, warm={"target", "draft"})
        model.target.extend(recorded["target"])
        model.draft.extend(tuple(p) for p in costs["draft"]["points"])
        model.followup.extend(followup)
        model.turns.extend((t, c, 1.0, 0.0) for t, c in turns)
        first = default[0]
        prediction = predict(model, first["prompt_tokens"], first["target_cached"],
                             first["draft_cached"], first["kept_tokens"])
        before = [p for p in recorded["followup"] if p[3] < starts[name]]
        sparse_before = [p for p in recorded["sparse"] if p[3] < starts[name]]
        old, old_extra, old_chain = old_debt(model, before, sparse_before, first["prompt_tokens"])
        out.append(dict(
            cell=name, reply_tokens=reply, tool_seconds=cell["args"]["tool_seconds"],
            turns="".join("S" if r["engaged"] else "d" for r in default),
            reported=dict(debt=reported_debt(first), decision=first["reason"]),
            old=dict(debt=old, per_followup=old_extra, chain=old_chain),
            new=dict(debt=prediction.debt_s, per_followup=model.extra() * first["prompt_tokens"],
                     later_turns=model.later_turns(), dense=prediction.dense_s,
                     specprefill=prediction.specprefill_s, engages=prediction.pays(MARGIN)),
            truth=dict(
                saving=dense[0]["ttft"] - default[0]["ttft"],
                later_over_dense=sum(d["ttft"] - r["ttft"] for d, r in zip(default[1:], dense[1:])),
                later_over_mlx_lm=sum(d["ttft"] - r["ttft"] for d, r in zip(default[1:], mlx[1:])),
                wall=dict(mlx_lm=sum(r["wall"] for r in mlx), dense=sum(r["wall"] for r in dense),
                          default=sum(r["wall"] for r in default)))))
        # the default's session, as the engine would count it now
        session = [p for p in recorded["followup"] if starts[name] <= p[3] < end]
        followup += session
        measured = {n + c: c for n, c, _, _ in session}  # by the prompt they measured
        for previous, row in zip([None, *default], default):
            tokens = row["prompt_tokens"]
            if previous is None:
                turns.append((tokens, 0))
            elif tokens in measured:
                turns.append((tokens, measured[tokens]))
            elif row["engaged"]:
                turns.append((tokens, 0))  # taken for a new conversation
            else:  # a dense turn on a densified view: a turn, no follow-up
                turns.append((tokens, previous["prompt_tokens"] + reply))
    return out


def markdown(rows: list) -> str:
    """The replay as a table: per cell, the debt reported and replayed, the decision
    replayed, and what the later turns really cost (times to first token, seconds)."""
    lines = ["| reply tokens, tool s | default's turns | debt reported (per follow-up x chain) "
             "| debt replayed (per later turn x later turns) | engages (saving predicted) "
             "| first turn saved | later turns over dense | over mlx-lm "
             "| wall mlx-lm / dense / default |", "| --- " * 9 + "|"]
    for r in rows:
        old, new, truth = r["old"], r["new"], r["truth"]
        wall = truth["wall"]
        lines.append(
            f"| {r['reply_tokens']}, {r['tool_seconds']:g} | {r['turns']} "
            f"| {r['reported']['debt']:.3f} ({old['per_followup']:.3f} x {old['chain']:.2f}) "
            f"| {new['debt']:.3f} ({new['per_followup']:.3f} x {new['later_turns']:.2f}) "
            f"| {'yes' if new['engages'] else 'no'} ({new['dense'] - new['specprefill']:.3f}) "
            f"| {truth['saving']:.3f} | {truth['later_over_dense']:.3f} "
            f"| {truth['later_over_mlx_lm']:.3f} "
            f"| {wall['mlx_lm']:.2f} / {wall['dense']:.2f} / {wall['default']:.2f} |")
    return "\n".join(lines)
