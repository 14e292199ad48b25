"""One program for every rank (run under `mlx.launch`, or alone for reference).

Rank 0 answers a fixed set of requests and writes them as JSON to argv[1]; on a
rank > 0 the engine's start serves rank 0 and exits the process when rank 0 shuts
down, so nothing after it runs there. Each rank writes its pid to argv[1].pid<rank>.
argv[2]: "outputs" (dense, SpecPrefill, batched, prefix-cached), "cancel" (a
stream left early, a task cancelled, then requests that must still run), "solo"
(the target at argv[3], one that cannot batch decode, with the demo draft: dense,
SpecPrefill, two at once, prefix-cached, a stream left early; every request decodes
on its own), "faults" (on rank 0, one request of four fails at its join, store, output
or sampling; the others and the next request must run as on one process) or "lost"
(rank 0 streams a long request and writes argv[1].decoding once it decodes; the test
then kills or stops rank 1, and rank 0 writes what its caller got); "broken" (rank
0's target, at argv[3], cannot be loaded: each rank writes the error its start raised).
"""

import asyncio
import json
import os
import sys
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fault helper

from faults import executor_fault  # noqa: E402
from specprefill_engine import Engine  # noqa: E402
from specprefill_engine.demo_tasks import make_case  # noqa: E402
from specprefill_engine.engine.output import OutputProcessor  # noqa: E402
from specprefill_engine.loading import DEMO_DRAFT  # noqa: E402

OUT = sys.argv[1]
SCENARIO = sys.argv[2] if len(sys.argv) > 2 else "outputs"
TARGET = sys.argv[3] if len(sys.argv) > 3 else None


def prompt(tokenizer, seed: int, n_tokens: int = 740) -> list:
    """729 templated tokens for seeds 1 and 2: on a CPU the prefill chunks end at 256, 488,
    702 and 729, and the small last chunk runs in the turn before it (`chunk_plan`), so
    the ranks must follow the same plan."""
    case = make_case(tokenizer, seed, n_tokens=n_tokens)
    return case.messages


def row(result) -> dict:
    return {"tokens": result.token_ids, "engaged": result.specprefill.engaged,
            "kept": result.specprefill.kept_tokens, "cached": result.usage.cached_tokens,
            "finish": result.finish_reason}


async def outputs(engine) -> dict:
    a, b = prompt(engine.tokenizer, 1), prompt(engine.tokenizer, 2)
    out = {}
    for name, messages in (("a", a), ("b", b)):
        out[f"{name}-dense"] = row(await engine.generate(messages, max_tokens=6, specprefill=False,
                                                        cache_prompt=False))
        out[f"{name}-sparse"] = row(await engine.generate(messages, max_tokens=6, specprefill=True,
                                                         cache_prompt=False))
    both = await asyncio.gather(engine.generate(a, max_tokens=6, specprefill=True),
                                engine.generate(b, max_tokens=8, specprefill=False))
    out["batched"] = [row(r) for r in both]
    out["again"] = row(await engine.generate(b, max_tokens=6, specprefill=False))
    return out


async def cancel(engine) -> dict:
    a, b = prompt(engine.tokenizer, 1), prompt(engine.tokenizer, 2)
    chunks = []
    async for chunk in engine.stream(a, max_tokens=200, specprefill=True, ignore_eos=True):
        chunks.append(chunk)
        if len(chunks) == 3:
            break  # aborted while decoding
    task = asyncio.create_task(engine.generate(b, max_tokens=50, specprefill=False,
                                               cache_prompt=False))
    await asyncio.sleep(0.3)
    task.cancel()  # aborted while prefilling (or early in decode)
    try:
        await task
    except asyncio.CancelledError:
        pass
    after = await engine.generate(b, max_tokens=6, specprefill=False, cache_prompt=False)
    left = len(engine.active_request_ids)
    # the automatic policy decides on rank 0 (its predictions come from timings, so
    # its choice is not compared with one process)
    auto = await engine.generate(a, max_tokens=4, threshold=256, cache_prompt=False)
    return {"after": row(after), "active_after": left, "auto": auto.specprefill.reason}


async def solo(engine) -> dict:
    a, b = prompt(engine.tokenizer, 1), prompt(engine.tokenizer, 2)

    def solo_row(result) -> dict:
        return {**row(result), "batched": result.specprefill.batched}

    out = {"batch_reason": engine.info.batch_reason}
    for name, sparse in (("dense", False), ("sparse", True)):
        out[name] = solo_row(await engine.generate(a, max_tokens=6, specprefill=sparse,
                                                   cache_prompt=False))
    # two requests decoding side by side, each its own forward per step; the dense one
    # stored (had both read and filled the cache, whether the sparse one found the
    # other's template head would depend on when each arrived)
    both = await asyncio.gather(engine.generate(a, max_tokens=6, specprefill=True,
                                                cache_prompt=False),
                                engine.generate(b, max_tokens=8, specprefill=False))
    out["together"] = [solo_row(r) for r in both]
    out["again"] = solo_row(await engine.generate(b, max_tokens=6, specprefill=False))
    out["again-sparse"] = solo_row(await engine.generate(a, max_tokens=6, specprefill=True))
    chunks = 0
    async for _ in engine.stream(b, max_tokens=200, specprefill=True, ignore_eos=True,
                                 cache_prompt=False):
        chunks += 1
        if chunks == 3:
            break  # a solo decode aborted: released on every rank
    out["after-abort"] = solo_row(await engine.generate(b, max_tokens=6, specprefill=True,
                                                        cache_prompt=False))
    out["active_after"] = len(engine.active_request_ids)
    return out


class Fault(RuntimeError):
    """The injected failure."""


async def faults(engine) -> dict:
    a, b = prompt(engine.tokenizer, 1, 300), prompt(engine.tokenizer, 2, 300)
    accept = OutputProcessor.accept
    out = {}
    for stage in ("join", "store", "output", "sample"):
        victim, fired, handles = f"victim-{stage}", [], []  # handles: seen at its prefill

        def is_victim(handle, victim=victim):
            state = engine._worker.find(victim)
            return state is not None and state.handle == handle

        def fault(handle, stage=stage, fired=fired, handles=handles):
            if is_victim(handle) or handle in handles:
                fired.append(stage)
                raise Fault(stage)

        def faulty(self, token, logprob=None, victim=victim):
            if self.request_id == victim and len(self.tokens) >= 2:
                raise Fault("output")
            return accept(self, token, logprob)

        def processor(generated, logits):
            if generated.size >= 2:
                raise Fault("sample")
            return logits

        extra, injected = {"request_id": victim}, ExitStack()
        if stage in ("join", "store"):
            injected.enter_context(executor_fault(stage, fault))
        if stage == "store":  # stored as the request ends: its handle is noted before
            injected.enter_context(executor_fault(
                "prefill", lambda handle, handles=handles: handles.extend(
                    [handle] if is_victim(handle) else [])))
        elif stage == "output":
            OutputProcessor.accept = faulty
        else:
            extra["logits_processors"] = [processor]
        requests = [dict(prompt=a, max_tokens=6, specprefill=False),
                    dict(prompt=b, max_tokens=8, specprefill=True, **extra),
                    dict(prompt=a, max_tokens=7, specprefill=True, cache_prompt=False),
                    dict(prompt=b, max_tokens=5, specprefill=False, cache_prompt=False)]
        with injected:
            results = await asyncio.gather(*(engine.generate(**r) for r in requests),
                                           return_exceptions=True)
            if stage == "store":  # the store runs in a turn after its request's result:
                for _ in range(500):  # wait for it (at most 5 s) before the hook is removed
                    if fired:
                        break
                    await asyncio.sleep(0.01)
        OutputProcessor.accept = accept
        out[stage] = [type(r).__name__ if isinstance(r, BaseException) else row(r)
                      for r in results]
        out[f"{stage} faults"] = len(fired)
    out["after"] = row(await engine.generate(b, max_tokens=6, specprefill=False))
    out["active_after"] = len(engine.active_request_ids)
    return out


async def lost(engine) -> dict:
    chunks = 0
    try:
        async for _ in engine.stream(prompt(engine.tokenizer, 1), max_tokens=100000,
                                     ignore_eos=True, specprefill=False):
            chunks += 1
            if chunks == 2:
                with open(f"{OUT}.decoding", "w") as f:
                    f.write("")
        error = "none"
    except Exception as failure:
        error = f"{type(failure).__name__}: {failure}"
    try:
        await engine.generate("def f():", max_tokens=2)
        later = "served"
    except Exception as failure:
        later = type(failure).__name__
    return {"error": error, "later": later}


IDLE_SECONDS = 2.0


def follower_cpu_seconds() -> float:
    """Rank 1's process's CPU time so far (user and system, from /proc)."""
    pid = Path(f"{OUT}.pid1").read_text()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


SCENARIOS = {"outputs": outputs, "cancel": cancel, "solo": solo, "faults": faults, "lost": lost}


async def main():
    if SCENARIO == "broken":
        rank = int(os.environ.get("MLX_RANK", "0"))
        engine = Engine(model=TARGET if rank == 0 else None, draft=str(DEMO_DRAFT))
        try:
            await engine.start()
            error = "none"
        except BaseException as failure:
            error = f"{type(failure).__name__}: {failure}"
        with open(f"{OUT}.error{rank}", "w") as f:
            f.write(error)
        return
    if SCENARIO == "solo":
        engine = Engine(model=TARGET, draft=str(DEMO_DRAFT), max_batch_size=4, step_size=256)
    else:
        # a short watchdog only where a rank is made to stop answering; elsewhere a slow
        # turn on a loaded machine must not read as a lost rank
        engine = Engine(max_batch_size=4, step_size=256,
                        rank_timeout=5 if SCENARIO == "lost" else 120)
    with open(f"{OUT}.pid{engine.rank}", "w") as f:
        f.write(str(os.getpid()))
    await engine.start()
    with open(f"{OUT}.inside{engine.rank}", "w") as f:  # rank 0 only gets here
        f.write("")
    payload = {"ranks": engine.ranks}
    payload.update(await SCENARIOS[SCENARIO](engine))
    if SCENARIO == "outputs" and engine.ranks > 1:  # the engine idle: what rank 1 spends
        for _ in range(300):  # after what idle time is for (densify)
            if not engine.stats()["densify"].pending:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # its last unit ends
        used = follower_cpu_seconds()
        await asyncio.sleep(IDLE_SECONDS)
        payload["idle_cpu_s"] = follower_cpu_seconds() - used
    with open(OUT, "w") as f:
        json.dump(payload, f)
    await engine.shutdown(timeout=5)


asyncio.run(main())
