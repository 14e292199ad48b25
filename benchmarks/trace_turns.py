"""Where an agent loop's time goes: `agent.py` with every engine turn timed.

Runs `agent.py` with the same arguments and writes one JSON line per event to
`--trace`: each executor turn (synchronized, so a line's seconds are its own work: the
plan's restores, chunks with their token counts, decode, stores, joins), each scoring
unit of the draft, and each agent step's TTFT and reuse. The synchronization costs a
little overlap, so use it to find which turn is slow, and `agent.py` for the totals.

    python benchmarks/trace_turns.py --trace trace.jsonl --target-shape qwen3-8b \\
        --tokens 32000 --sessions 1 --tool-seconds 2 --methods "SpecPrefill + densify"
"""

import json
import sys
import time

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx

import agent
from specprefill_engine.engine.executor import Executor


def traced(events: list) -> None:
    """Time the executor's turns (the draft's scoring units among them) and each agent
    step."""
    run, session = Executor.run, agent.engine_session

    def timed_run(self, plan):
        started = time.perf_counter()
        outcome = run(self, plan)
        mx.synchronize()
        events.append({"turn_s": time.perf_counter() - started, "decode": plan.decode,
                       "restores": [(r.key, r.cut) for r in plan.restores],
                       "chunks": [(c.handle, int(c.tokens.size), c.positions is not None)
                                  for c in plan.chunks],
                       "stores": len(plan.stores), "drops": len(plan.drops),
                       "joins": len(plan.joins), "scoring_units": len(plan.scoring)})
        return outcome

    def steps(engine, settings, agent_session, args):
        events.append({"session": agent_session.questions[0], "steps": args.steps})
        rows = session(engine, settings, agent_session, args)
        events.extend({"step_ttft_s": r["ttft"], "target_tokens": r["target_tokens"],
                       "reuse": r["reuse"]} for r in rows)
        return rows

    Executor.run, agent.engine_session = timed_run, steps


def main():
    args = sys.argv[1:]
    if "--trace" not in args:
        sys.exit("usage: trace_turns.py --trace FILE [agent.py's arguments]")
    at = args.index("--trace")
    path, args = args[at + 1], args[:at] + args[at + 2:]
    events = []
    traced(events)
    sys.argv = ["agent.py", *args]
    try:
        agent.main()
    finally:
        with open(path, "w") as file:
            file.writelines(json.dumps(event) + "\n" for event in events)


if __name__ == "__main__":
    main()
