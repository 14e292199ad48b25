"""What the policy's conversation debt would decide on a measured agent loop: the cost
points an engine persisted (`--costs`, a file of `~/.cache/specprefill-engine/costs`),
and the turns of `agent.py` runs (`--loops`) replayed as the engines' records: each
SpecPrefill row's turn that continued a stored SpecPrefill turn (not from a dense prefix
covering it) as a follow-up, each engaged turn as a SpecPrefill turn, the TTFT as the
cost. Prints, per run, the prediction for the loop's first turn (`--prompt` tokens,
`--cached` of them in both prefix caches, `--kept` kept) and whether it engages.

    .venv/bin/python benchmarks/debt_replay.py --costs docs/costs-gpu-8b.json \\
        --loops docs/agent-gpu-r150-k0.1-t0.5-6df470c.json ...
"""

import argparse
import json
import re

from specprefill_engine.engine.policy import CostModel, Shape, predict

ROWS = ("SpecPrefill + reuse", "SpecPrefill + densify", "engine default")


def cost_model(path: str) -> CostModel:
    saved = json.loads(open(path).read())
    costs = CostModel(Shape(*saved["target"]["shape"]), Shape(*saved["draft"]["shape"]),
                      warm={"target", "draft"})
    for which in ("target", "draft", "repair"):
        getattr(costs, which).extend(tuple(p) for p in saved.get(which, {}).get("points", []))
    return costs


def replay(costs: CostModel, rows: list) -> None:
    for method in ROWS:
        previous = None
        for row in (row for row in rows if row["method"] == method):
            follows = 0
            if previous is not None and previous.get("engaged"):
                stored = previous["prompt_tokens"] + previous["reply_tokens"]
                dense = re.search(r"dense prefix \(densified\) of (\d+)", row["reuse"])
                if (int(dense.group(1)) if dense else 0) < stored - 64:
                    follows = stored
            if follows:
                costs.observe_followup(row["prompt_tokens"] - follows, follows, row["ttft"])
            if row.get("engaged"):
                costs.observe_sparse(row["prompt_tokens"], follows, row["ttft"])
            previous = row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--costs", required=True)
    parser.add_argument("--loops", nargs="+", required=True)
    parser.add_argument("--prompt", type=int, default=32459)
    parser.add_argument("--cached", type=int, default=283)
    parser.add_argument("--kept", type=int, default=9952)
    args = parser.parse_args()
    for path in args.loops:
        costs = cost_model(args.costs)
        replay(costs, json.loads(open(path).read())["rows"])
        prediction = predict(costs, args.prompt, args.cached, args.cached, args.kept)
        print(f"{path}: {len(costs.followup)} follow-ups, {costs.chain():.1f} a chain; "
              f"{prediction.describe()}; engages: {prediction.pays(0.1)}")


if __name__ == "__main__":
    main()
