"""Whether the draft is good enough for its target: a short retrieval probe.

A draft too weak for a task ranks the answer's tokens low, and the selection drops them:
the target then answers from a prompt without its answer, and nothing says so. The
probe asks what the selection depends on, in the target's own vocabulary: `QUESTIONS`
questions over one generated Python file (`PROBES`; `code_tasks`: which constant a named
function adds, among similar functions each adding one; the value a function near the
end adds through a module constant defined near the top, which needs both places; the
value of a named module constant, among others). Each question is scored twice, by the
draft and by the target as its own draft, and each scoring gives the least keep at which
the engine's selection holds the answer's tokens (`needed_keep`).

The measure: of the questions whose answer the target's own selection holds, the share
the draft's selection holds too, both at `MARGIN` of the engine's keep. It is the
selection's own outcome (chunks, the protected head and tail, the budget), not a proxy
such as a correlation of importances, and it is relative: it asks whether the draft sees
what the target itself would, so a question the target's own attention misses counts
against neither. The margin: the probe's file holds a fraction of the distractors of the
prompts the policy engages on, and a draft that finds the answer by its content keeps
its rank as they grow while one that does not falls with them (docs/how-it-works.md,
"The draft check", has the ranks measured on a real pair), so the short probe asks for
the answer at half the keep. The draft is vouched for where that share is at least
`HELD_SHARE`; where the target's own selection holds fewer than `CONCLUSIVE` answers the
probe cannot tell (no verdict: the policy goes on as without a check). The probes run
from the longest file down until one gives a verdict: a draft is judged at the longest
file its target's own attention reads (a 1.5B coder at 2,048 tokens; a tiny demo model only at
768), since the distractors are what separates a weak draft from its target.

The probe judges the draft's attention alone, without the selection's matches of the
question's words (`core/matching.py`): its questions name what they ask for, which the
matches find whatever the draft (a random draft would pass), while the prompts a user
sends ask for much that no word of theirs names.

Code is judged apart (`core/kinds.py`): a view of code can glue the ends of different
functions together, and the target can then answer otherwise than dense even where the
answer's own tokens are kept. So the probe also asks the target `ANSWER_QUESTIONS` code
questions over a 2,048-token file of similar functions, dense and with the draft's
selection at the engine's keep, and the policy
engages on code only where the target answers every one it answers dense (at least
`CONCLUSIVE` of them): the answers themselves, not the tokens held.

The probe vouches from its file's length up: at a given keep a shorter prompt's
selection keeps fewer tokens than the probe's did, and on the real pair prose of 1.5K
tokens lost answers at keep 0.3 that the 2,048-token probe's verdict did not foresee, so
the policy declines prompts shorter than the probe's file.

The questions share their file, so each model prefills it once and then only each
question. The measurement is persisted per (target, draft, scoring and selection
settings) in `cache_dir()/draft-checks`, keyed by both models' identity (their files and
dtype, `disk_cache.model_identity`), versioned; a file that cannot be read, of another
version or key, or holding implausible values is ignored (and measured anew) with a log
line.
"""

import hashlib
import json
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ..code_tasks import is_right, make_case
from ..core import run_steps, score_steps, select_chunks
from ..core.answers import dense_answer, greedy, sparse_answer
from ..core.prefill import STEP_SIZE, cache_length, chunked_prefill
from ..core.scoring import N_LOOKAHEAD, N_WINDOW, POOL_KERNEL
from ..loading import cache_dir, save_json
from .blank_lines import BlankLines

logger = logging.getLogger(__name__)
VERSION = 3  # of the probe and its file
FOLDER = "draft-checks"
# (file length in tokens, ((kind, questions), ...)): the longest first; each over one file
PROBES = ((2048, (("code_return", 4), ("code_far", 4))),
          (768, (("code_return", 4), ("code_const", 4))))
SEED = 0
QUESTIONS = 8  # of every probe
HELD_SHARE = 0.75  # of the answers the target's own selection holds, the draft's must hold
CONCLUSIVE = 3  # answers the target's own selection must hold for a verdict
MARGIN = 0.5  # the share of the engine's keep the probe judges at
KEEPS = np.round(np.arange(1, 101) / 100, 2)  # the keeps `needed_keep` tries
ANSWER_LENGTH = 2048  # the code file the target answers over, dense and sparse
ANSWER_QUESTIONS = 8


@dataclass(frozen=True)
class Probe:
    """What the probe measured: per question, the least keep at which each scoring's
    selection holds the answer (1.0: only the whole prompt), and its seconds."""

    target: tuple
    draft: tuple
    target_s: float = 0.0
    draft_s: float = 0.0
    length: int = PROBES[-1][0]  # the probe's file, of `PROBES`
    # per code question: (the target answers it dense, and from the draft's selection)
    code_answers: tuple = ()


@dataclass(frozen=True)
class DraftVerdict:
    """Whether the automatic policy may engage the draft: True (vouched for), False (not:
    the policy prefills densely), None (no verdict: the policy goes on as without a
    check); `reason` says why, with the probe's numbers when it ran."""

    vouched: Optional[bool]
    reason: str
    probe: Optional[Probe] = None


def needed_keep(importance, spans, must_keep=None, **selection) -> float:
    """The least keep (in steps of 0.01) whose selection (`select_chunks` with
    `selection`'s settings) holds every token of the (start, end) `spans`."""
    values = np.asarray(importance, dtype=np.float32)
    wanted = np.concatenate([np.arange(a, b) for a, b in spans])
    for keep in KEEPS:
        kept = np.asarray(select_chunks(values, float(keep), must_keep=must_keep, **selection))
        if np.isin(wanted, kept).all():
            return float(keep)
    return 1.0


def measure(target, draft, tokenizer, length: int, n_lookahead: int = N_LOOKAHEAD,
            pool_kernel: int = POOL_KERNEL, n_window: int = N_WINDOW, **selection) -> Probe:
    """Score the questions of `PROBES`' probe of `length` with both models; `selection`:
    `select_chunks`' chunk_size, tail_tokens, backbone_pct and spread as the engine
    selects."""
    kinds = dict(PROBES)[length]
    cases = [make_case(tokenizer, kind, length, SEED, ask)
             for kind, count in kinds for ask in range(count)]
    blank_lines = BlankLines(tokenizer)
    shared = len(os.path.commonprefix([case.ids for case in cases]))
    found, seconds = {}, {}
    for which, model in (("target", target), ("draft", draft)):
        started, keeps, cache = time.perf_counter(), [], make_prompt_cache(model)
        for case in cases:
            if not can_trim_prompt_cache(cache):  # continued, not cut back: a fresh one
                cache = make_prompt_cache(model)
            # one chunk of the shared file, then the question: a later question's scoring
            # cuts the cache back to the file and feeds only its own question
            importance = run_steps(score_steps(model, case.ids, n_lookahead, pool_kernel,
                                               step_size=shared, n_window=n_window,
                                               cache=cache))
            protected = np.arange(len(case.ids)) < case.head
            keeps.append(needed_keep(np.array(importance), case.answer_spans, protected,
                                     starts=blank_lines(case.ids), **selection))
        del cache
        found[which], seconds[which] = tuple(keeps), time.perf_counter() - started
    mx.clear_cache()
    return Probe(found["target"], found["draft"], round(seconds["target"], 3),
                 round(seconds["draft"], 3), length)


def code_answers(target, draft, tokenizer, keep: float, n_lookahead: int = N_LOOKAHEAD,
                 pool_kernel: int = POOL_KERNEL, n_window: int = N_WINDOW,
                 **selection) -> tuple:
    """Per code question of the answer probe: (the target answers it right dense, and
    right from the draft's selection at `keep`, as the engine selects). The questions
    share their file: each model prefills it once, then only each question."""
    cases = [make_case(tokenizer, "code_return", ANSWER_LENGTH, SEED, ask)
             for ask in range(ANSWER_QUESTIONS)]
    shared = len(os.path.commonprefix([case.ids for case in cases]))
    eos, found = set(tokenizer.eos_token_ids), []
    scoring, dense = make_prompt_cache(draft), make_prompt_cache(target)
    for case in cases:
        if not can_trim_prompt_cache(scoring):
            scoring = make_prompt_cache(draft)
        importance = run_steps(score_steps(draft, case.ids, n_lookahead, pool_kernel,
                                           step_size=shared, n_window=n_window,
                                           cache=scoring))
        kept = select_chunks(np.array(importance), keep,
                             must_keep=np.arange(len(case.ids)) < case.head,
                             starts=BlankLines(tokenizer)(case.ids), **selection)
        sparse = sparse_answer(target, case.ids, kept, case.max_tokens, eos)
        found.append((is_right(case, tokenizer.decode(
            continued_answer(target, dense, case.ids, shared, case.max_tokens, eos))),
            is_right(case, tokenizer.decode(sparse))))
    mx.clear_cache()
    return tuple(found)


def continued_answer(model, cache: list, ids: list, shared: int, n: int, eos: set) -> list:
    """`dense_answer` of `ids`, continuing `cache` where it holds their first `shared`
    tokens (cut back to them after; a cache that cannot be cut starts anew)."""
    if not can_trim_prompt_cache(cache):
        return dense_answer(model, ids, n, eos)
    held = cache_length(cache)
    if held == 0:
        run_steps(chunked_prefill(model, mx.array(ids[:shared]), cache, STEP_SIZE))
    elif held > shared:
        trim_prompt_cache(cache, held - shared)
    logits = run_steps(chunked_prefill(model, mx.array(ids[shared:]), cache, STEP_SIZE))
    return greedy(model, logits[:, -1], cache, n, eos)


def judge_code(probe: Probe, verdict: DraftVerdict) -> DraftVerdict:
    """The verdict for code prompts: `verdict` (the draft's), unless the target lost an
    answer it gives dense, or the probe could not show it keeps them."""
    if verdict.vouched is False:
        return verdict
    right = sum(dense for dense, _ in probe.code_answers)
    kept = sum(dense and sparse for dense, sparse in probe.code_answers)
    count = len(probe.code_answers)
    if right < CONCLUSIVE:
        return DraftVerdict(False, f"code: dense answers only {right} of the {count} code "
                                   f"probe questions, too few to show SpecPrefill keeps them",
                            probe)
    if kept < right:
        return DraftVerdict(False, f"code: from the draft's selection the target answers "
                                   f"{kept} of the {right} code probe questions it answers "
                                   f"dense", probe)
    return DraftVerdict(verdict.vouched, f"{verdict.reason}; code: the target answers all "
                                         f"{right} code probe questions it answers dense",
                        probe)


def probe_pair(target, draft, tokenizer, keep: float, **settings) -> Probe:
    """The probes of `PROBES` from the longest, until one gives a verdict at `keep` (the
    target's own selection holds enough answers there): the draft is judged at the
    longest file its target itself reads, and a weak target falls back to shorter ones."""
    for length, _ in PROBES:
        probe = measure(target, draft, tokenizer, length, **settings)
        if judge(probe, keep).vouched is not None:
            break
    if judge(probe, keep).vouched is False:
        return probe
    return replace(probe, code_answers=code_answers(target, draft, tokenizer, keep, **settings))


def judge(probe: Probe, keep: float) -> DraftVerdict:
    """The verdict for the engine's `keep`, judged at `MARGIN` of it (the module
    docstring says why)."""
    at = round(keep * MARGIN, 2)
    target = [t <= at for t in probe.target]
    both = sum(t and d <= at for t, d in zip(target, probe.draft))
    held, count = sum(target), len(target)
    numbers = (f"the least keep holding it over {probe.length} tokens, median of {count}: draft "
               f"{statistics.median(probe.draft):.2f}, target {statistics.median(probe.target):.2f}")
    if held < CONCLUSIVE:
        return DraftVerdict(None, f"the probe cannot tell: at keep {at} (of the engine's {keep}) "
                                  f"the target's own selection holds the answer in {held} of "
                                  f"{count} questions; {numbers}", probe)
    vouched = both >= HELD_SHARE * held
    return DraftVerdict(vouched, f"at keep {at} (of the engine's {keep}) the draft's selection "
                                 f"holds the answer in {both} of the {held} probe questions the "
                                 f"target's own holds ({'at least' if vouched else 'below'} "
                                 f"{HELD_SHARE:.0%}); {numbers}", probe)


def _plausible(saved, key: dict) -> Optional[Probe]:
    """The saved probe, if it is one this key's probe could have measured."""
    if not isinstance(saved, dict) or saved.get("key") != key:
        return None
    probe = saved.get("probe")
    if not isinstance(probe, dict):
        return None
    keeps = [probe.get("target"), probe.get("draft")]
    if not all(isinstance(k, list) and len(k) == QUESTIONS and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1
            for v in k) for k in keeps):
        return None
    times = [probe.get("target_s"), probe.get("draft_s")]
    if not all(isinstance(t, (int, float)) and math.isfinite(t) and t >= 0 for t in times):
        return None
    if probe.get("length") not in dict(PROBES):
        return None
    answers = probe.get("code_answers", [])
    if not isinstance(answers, list) or len(answers) > ANSWER_QUESTIONS or not all(
            isinstance(a, list) and len(a) == 2 and all(isinstance(v, bool) for v in a)
            for a in answers):
        return None
    return Probe(tuple(keeps[0]), tuple(keeps[1]), *times, probe["length"],
                 tuple(tuple(a) for a in answers))


class DraftCheck:
    """One engine's knowledge of its draft, on the worker: a `fixed` verdict that needs
    no probe, or the probe's measurement once loaded or measured (until then there is no
    verdict). `settings`: `measure`'s, as the engine scores and selects; `keep`: the
    engine's, the one its warning speaks of. Holds no model: `run` is given them."""

    def __init__(self, key: dict, settings: dict, keep: float,
                 fixed: Optional[DraftVerdict] = None, names: tuple = ("", "")):
        self.key, self.settings, self.keep, self.fixed, self.names = key, settings, keep, fixed, names
        self.probe, self.failed, self.warned = None, "", False
        name = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.path = cache_dir() / FOLDER / f"{name}.json"
        if fixed is None:
            self.probe = self.load()
            if self.probe is not None:
                self._announce()

    @property
    def pending(self) -> bool:
        """The probe has yet to run."""
        return self.fixed is None and self.probe is None and not self.failed

    def verdict(self, keep: float, kind: str = "prose", tokens: Optional[int] = None) -> DraftVerdict:
        """The verdict at `keep` for prompts of `kind` (`core/kinds.py`) and, given, of
        `tokens`: the probe vouches from its file's length up (code: from the answers'
        file's too), and a shorter prompt, whose selection keeps fewer tokens than the
        probe's did, is not vouched for."""
        if self.fixed is not None:
            return self.fixed
        if self.failed:
            return DraftVerdict(None, f"the probe failed: {self.failed}")
        if self.probe is None:
            return DraftVerdict(None, "not probed yet: the probe runs on the first prompt "
                                      "the automatic policy would engage on")
        verdict = judge(self.probe, keep)
        if kind == "code":
            verdict = judge_code(self.probe, verdict)
        length = max(self.probe.length, ANSWER_LENGTH) if kind == "code" else self.probe.length
        if verdict.vouched and tokens is not None and tokens < length:
            return DraftVerdict(False, f"a prompt of {tokens} tokens, shorter than the probe's "
                                       f"{length} from which it vouches", self.probe)
        return verdict

    def run(self, target, draft, tokenizer) -> None:
        """Measure (on the worker), persist, and say what it found; a failure leaves no
        verdict, said once."""
        try:
            self.probe = probe_pair(target, draft, tokenizer, self.keep, **self.settings)
        except Exception as error:
            self.failed = repr(error)
            logger.warning("the draft check could not run: %r; no verdict", error)
            return
        logger.info("draft check of %s for %s: %s (target %.2f s, draft %.2f s)", *self.names,
                    self.verdict(self.keep).reason, self.probe.target_s, self.probe.draft_s)
        self.save()
        self._announce()

    def _announce(self) -> None:
        verdict = self.verdict(self.keep)
        if verdict.vouched is False:
            logger.warning("the draft %s is not vouched for the target %s: %s. The automatic "
                           "policy prefills densely; a keep given or specprefill=True still "
                           "runs SpecPrefill", *self.names, verdict.reason)

    def warn_given(self, keep: float) -> None:
        """A request's own keep runs SpecPrefill whatever the verdict: said once."""
        verdict = self.verdict(keep)
        if verdict.vouched is False and not self.warned:
            self.warned = True
            logger.warning("SpecPrefill runs as asked (keep %s) with a draft not vouched for: "
                           "%s", keep, verdict.reason)

    def load(self) -> Optional[Probe]:
        try:
            saved = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            logger.warning("ignoring an unreadable draft check in %s: %r", self.path, error)
            return None
        if not isinstance(saved, dict) or saved.get("version") != VERSION:
            version = saved.get("version") if isinstance(saved, dict) else None
            logger.warning("ignoring the draft check in %s: version %r, not %d", self.path,
                           version, VERSION)
            return None
        probe = _plausible(saved, self.key)
        if probe is None:
            logger.warning("ignoring the draft check in %s: not this pair's, or implausible "
                           "values", self.path)
        return probe

    def save(self) -> None:
        saved = {"version": VERSION, "key": self.key, "measured_at": time.time(),
                 "probe": {"target": list(self.probe.target), "draft": list(self.probe.draft),
                           "target_s": self.probe.target_s, "draft_s": self.probe.draft_s,
                           "length": self.probe.length,
                           "code_answers": [list(a) for a in self.probe.code_answers]}}
        save_json(self.path, saved, "the draft check")
