"""The engine on two ranks of an mlx.distributed ring on localhost: the demo target
sharded 2 ways (tensor parallel), the draft on rank 0.

Each test starts `mlx.launch --backend ring -n 2` on `tests/distributed/run_engine.py`
(or the CLI) and compares with the same program run as one process. Sharding splits
the attention output and MLP reductions into an all_sum of two float32 partial sums;
greedy tokens are compared exactly (they agree on these prompts; the logits may differ
in the last bits, which this test does not assert on). A target that cannot batch
decode (dynamic NTK RoPE) runs the same way, each request in its own SoloDecode.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specprefill_engine.loading import DEMO_TARGET, ModelLoadError, check_shardable

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "distributed" / "run_engine.py"
LAUNCH = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or shutil.which("mlx.launch")
needs_launch = pytest.mark.skipif(LAUNCH is None, reason="mlx.launch (from the mlx package) "
                                  "is not installed next to this Python")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "integrations"),
                                         env.get("PYTHONPATH", "")])
    return env


def _launch(args: list, timeout: float = 150) -> subprocess.CompletedProcess:
    command = [LAUNCH, "--backend", "ring", "-n", "2", sys.executable, *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_env(),
                          cwd=ROOT)


def _alone(args: list) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=_env(), cwd=ROOT, check=True)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # exited, not yet reaped by its (gone) parent


def _run_both(tmp_path: Path, scenario: str, *extra) -> tuple[dict, dict, Path]:
    alone, shared = tmp_path / "alone.json", tmp_path / "ranks.json"
    _alone([PROGRAM, alone, scenario, *extra])
    done = _launch([PROGRAM, shared, scenario, *extra])
    assert "exited with code" not in done.stderr, done.stderr[-3000:]
    assert shared.exists(), done.stderr[-3000:]
    return json.loads(alone.read_text()), json.loads(shared.read_text()), shared


def _check_ranks_ended(out: Path) -> None:
    pids = [int(Path(f"{out}.pid{rank}").read_text()) for rank in (0, 1)]
    assert all(_gone(pid) for pid in pids), "a rank's process is still running"
    assert Path(f"{out}.inside0").exists()
    assert not Path(f"{out}.inside1").exists(), "rank 1 ran past the engine's start"


@needs_launch
def test_two_ranks_greedy_outputs_equal_one_process(tmp_path):
    alone, shared, out = _run_both(tmp_path, "outputs")
    assert (alone.pop("ranks"), shared.pop("ranks")) == (1, 2)
    assert shared == alone  # tokens, kept counts, prefix-cache reuse, batched rows
    assert shared["a-sparse"]["engaged"] and shared["a-sparse"]["kept"] < shared["a-dense"]["kept"]
    assert shared["again"]["cached"] > 0
    _check_ranks_ended(out)


@needs_launch
def test_cancelled_requests_and_shutdown_leave_no_process(tmp_path):
    alone, shared, out = _run_both(tmp_path, "cancel")
    assert shared["ranks"] == 2
    assert shared["after"] == alone["after"] and shared["active_after"] == 0
    assert shared["auto"].startswith("policy:")  # calibrated on both ranks
    _check_ranks_ended(out)


@needs_launch
def test_a_target_that_cannot_batch_decodes_alone_on_every_rank(tmp_path):
    """Dynamic NTK RoPE (llama, rope_scaling "dynamic"): no batched decode, so every
    request decodes in its own SoloDecode, announced and replayed step by step."""
    from models import ROPE_CASES, save_with_demo_tokenizer

    model_type, overrides = ROPE_CASES["dynamic-ntk"]
    # untied embeddings: the tied random model repeats one token whatever it is given
    case = (model_type, {**overrides, "tie_word_embeddings": False})
    target = save_with_demo_tokenizer(case, tmp_path / "dynamic")  # 4 heads, 2 KV, MLP 128
    alone, shared, out = _run_both(tmp_path, "solo", target)
    assert (alone.pop("ranks"), shared.pop("ranks")) == (1, 2)
    assert shared == alone  # tokens, kept counts, prefix-cache reuse, batch reasons
    assert shared["batch_reason"]
    rows = [shared["dense"], shared["sparse"], *shared["together"], shared["again"],
            shared["again-sparse"], shared["after-abort"]]
    assert not any(r["batched"] for r in rows)
    assert shared["sparse"]["engaged"] and shared["sparse"]["kept"] < shared["dense"]["kept"]
    assert len({tuple(r["tokens"]) for r in rows}) > 2  # outputs that tell positions apart
    assert shared["again"]["cached"] > 0  # stored from a solo decode on every rank
    assert shared["again-sparse"]["cached"] > 0
    assert shared["active_after"] == 0  # the stream left early was released everywhere
    _check_ranks_ended(out)


@needs_launch
def test_cli_ask_json_reports_ranks(tmp_path):
    document = tmp_path / "notes.py"
    document.write_text("".join(f"value_{i} = {i * 7}\n" for i in range(60)) + "PASSKEY = 4821\n")
    done = _launch(["-m", "specprefill_engine.cli", "ask", document, "--question",
                    "What is PASSKEY?", "--max-tokens", "4", "--json"])
    assert "exited with code" not in done.stderr, done.stderr[-3000:]
    payload = json.loads(done.stdout[done.stdout.index("{"):])
    assert payload["ranks"] == 2 and payload["finish_reason"] in ("stop", "length")


def test_refuses_a_target_it_cannot_shard_before_loading_weights():
    from mlx_lm import load

    model, _ = load(str(DEMO_TARGET), lazy=True)
    check_shardable(model, "demo", 2)  # 6 heads, 2 KV heads, MLP 1024
    with pytest.raises(ModelLoadError, match="num_key_value_heads = 2 is not divisible by 3"):
        check_shardable(model, "demo", 3)
