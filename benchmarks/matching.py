"""The question's matches (`core/matching.py`) on and off, side by side in one run.

- `engine`: the demo target with a random-weight draft (`random_models.py`'s "tiny"
  shape: its attention ranks nothing), SpecPrefill forced at `--keep`, the demo tasks'
  passkey, registry and assignment cases: the answers right with `match_weight=1` and
  with 0.
- `draft` (with `--draft`, a real draft's folder, e.g. the converted Qwen2.5-Coder-0.5B):
  over `code_tasks`' cases, one scoring each, the share of cases whose selection holds
  the answer's tokens whole at each keep, with the matches and without.

    .venv/bin/python benchmarks/matching.py engine --cases 4 --json docs/matching-cpu.json
    .venv/bin/python benchmarks/matching.py draft --draft ~/.cache/specprefill-engine/\
qwen2.5-coder-0.5b-instruct-q4_k_m --length 2048 --cases 8 --json docs/matching-draft-cpu.json
"""

import argparse
import json

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import numpy as np

from random_models import random_model_dir
from specprefill_engine import Engine, code_tasks, demo_tasks
from specprefill_engine.core import score_tokens, select_chunks
from specprefill_engine.core.matching import question_match, with_matches
from specprefill_engine.core.scoring import N_WINDOW
from specprefill_engine.engine.words import TokenWords
from specprefill_engine.loading import DEMO_TARGET, load_model

WEIGHTS = (1.0, 0.0)  # the matches on, as `match_weight=1`, and off


def engine_rows(args) -> list:
    draft, rows = random_model_dir("tiny"), []
    for weight in WEIGHTS:
        with Engine(model=str(DEMO_TARGET), draft=draft, match_weight=weight) as engine:
            for kind in ("passkey", "registry", "assignment"):
                for seed in range(args.cases):
                    case = demo_tasks.make_case(engine.tokenizer, seed, kind, args.length)
                    result = engine.generate_sync(case.messages, specprefill=True,
                                                  keep=args.keep, max_tokens=8,
                                                  cache_prompt=False)
                    rows.append({"match_weight": weight, "kind": kind, "seed": seed,
                                 "right": result.text.strip().startswith(case.answer),
                                 "kept": result.specprefill.kept_tokens,
                                 "tokens": result.usage.prompt_tokens})
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def draft_rows(args) -> list:
    draft, tokenizer = load_model(args.draft)
    words, rows = TokenWords(tokenizer), []
    for kind in args.kinds:
        for seed in range(args.cases):
            case = code_tasks.make_case(tokenizer, kind, args.length, seed)
            importance = np.array(score_tokens(draft, case.ids, step_size=512))
            match = question_match(*words(case.ids), min(N_WINDOW, len(case.ids)))
            protected = np.arange(len(case.ids)) < case.head
            wanted = np.concatenate([np.arange(a, b) for a, b in case.answer_spans])
            for weight in WEIGHTS:
                values = with_matches(importance, match, weight)
                held = {str(keep): bool(np.isin(wanted, np.asarray(select_chunks(
                    values, keep, must_keep=protected))).all()) for keep in args.keeps}
                rows.append({"match_weight": weight, "kind": kind, "seed": seed,
                             "tokens": len(case.ids), "held": held})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def summary(rows: list) -> dict:
    out = {}
    for weight in WEIGHTS:
        picked = [r for r in rows if r["match_weight"] == weight]
        for kind in dict.fromkeys(r["kind"] for r in picked):
            cell = [r for r in picked if r["kind"] == kind]
            key = f"{kind}, match_weight {weight}"
            if "right" in cell[0]:
                out[key] = f"{sum(r['right'] for r in cell)}/{len(cell)} right"
            else:
                out[key] = {keep: f"{sum(r['held'][keep] for r in cell)}/{len(cell)} held"
                            for keep in cell[0]["held"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("engine", "draft"))
    parser.add_argument("--draft", help="the draft's folder (part `draft`)")
    parser.add_argument("--kinds", nargs="+", default=["code_return", "code_calls"],
                        choices=code_tasks.KINDS)
    parser.add_argument("--length", type=int, default=1500, help="prompt tokens")
    parser.add_argument("--cases", type=int, default=4, help="per kind")
    parser.add_argument("--keep", type=float, default=0.1, help="part `engine`")
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3],
                        help="part `draft`")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.part == "draft" and not args.draft:
        parser.error("part `draft` needs --draft")
    rows = engine_rows(args) if args.part == "engine" else draft_rows(args)
    result = {"args": vars(args), "summary": summary(rows), "rows": rows}
    print(json.dumps(result["summary"], indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
