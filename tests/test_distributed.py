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
import signal
import socket
import subprocess
import sys
import time
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
    """`args` under mlx.launch, as a user runs them."""
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
    """The scenario as one process and on two ranks started by hand (mlx.launch's
    output threads poll without pause, a core and more taken from the ranks: it runs
    the CLI's test only)."""
    alone = tmp_path / "alone.json"
    _alone([PROGRAM, alone, scenario, *extra])
    ranks, shared = _start_ranks(tmp_path, scenario, *extra)
    errors = _ended(ranks)
    assert [p.returncode for p in ranks] == [0, 0] and shared.exists(), errors[-3000:]
    return json.loads(alone.read_text()), json.loads(shared.read_text()), shared


def _ended(ranks: list, timeout: float = 150) -> str:
    """Both ranks run to their end (a rank 0 that fails takes rank 1 down, as
    mlx.launch does); their error output."""
    deadline = time.monotonic() + timeout
    errors = []
    try:
        for process in ranks:
            _, err = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            errors.append(err)
            if process.returncode:
                break
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                errors.append(process.communicate()[1])
    return "\n".join(errors)


def _check_ranks_ended(out: Path) -> None:
    pids = [int(Path(f"{out}.pid{rank}").read_text()) for rank in (0, 1)]
    assert all(_gone(pid) for pid in pids), "a rank's process is still running"
    assert Path(f"{out}.inside0").exists()
    assert not Path(f"{out}.inside1").exists(), "rank 1 ran past the engine's start"


def test_two_ranks_greedy_outputs_equal_one_process(tmp_path):
    """Greedy outputs on two ranks equal one process's; with the engine idle for 2 s
    (densify done), rank 1 waits on the doorbell, not polling the ring (which kept most
    of a core busy)."""
    alone, shared, out = _run_both(tmp_path, "outputs")
    assert shared.pop("idle_cpu_s") < 0.3
    assert (alone.pop("ranks"), shared.pop("ranks")) == (1, 2)
    for rows in (alone["batched"], shared["batched"]):
        for row in rows:  # whether one finds the other's template head stored: timing
            row.pop("cached")
    assert shared == alone  # tokens, kept counts, prefix-cache reuse, batched rows
    assert shared["a-sparse"]["engaged"] and shared["a-sparse"]["kept"] < shared["a-dense"]["kept"]
    assert shared["again"]["cached"] > 0
    _check_ranks_ended(out)


def test_cancelled_requests_and_shutdown_leave_no_process(tmp_path):
    alone, shared, out = _run_both(tmp_path, "cancel")
    assert shared["ranks"] == 2
    assert shared["after"] == alone["after"] and shared["active_after"] == 0
    assert shared["auto"].startswith("policy:")  # calibrated on both ranks
    _check_ranks_ended(out)


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


def test_a_request_failing_on_rank_0_fails_alone_on_every_rank(tmp_path):
    """One request of four fails at its join, its prefix-cache store, its output or its
    sampling on rank 0: it alone fails (a store fault only leaves it uncached), the
    others and the next request give what one process gives, and no rank hangs."""
    alone, shared, out = _run_both(tmp_path, "faults")
    assert (alone.pop("ranks"), shared.pop("ranks")) == (1, 2)
    # a join or store failing on one rank empties every rank's prefix cache (one process
    # keeps its own), at a turn that depends on timing: what the requests of the stages
    # from then on find cached differs, nothing else
    for result in (alone, shared):
        for rows in (result["store"], result["output"], result["sample"], [result["after"]]):
            for row in rows:
                if isinstance(row, dict):
                    row.pop("cached")
    assert shared == alone
    for stage in ("join", "output", "sample"):
        assert shared[stage][1] == "RequestFailedError", (stage, shared[stage])
    assert isinstance(shared["store"][1], dict) and shared["store faults"] >= 1
    assert shared["active_after"] == 0
    _check_ranks_ended(out)


def _free_ports(count: int) -> list:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _start_ranks(tmp_path: Path, scenario: str, *extra) -> tuple[list, Path]:
    """The two ranks of a localhost ring started by hand (as mlx.launch does), so a test
    can stop one and watch the other."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in _free_ports(2)]))
    out = tmp_path / f"{scenario}.json"
    ranks = []
    for rank in (0, 1):
        env = {**_env(), "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        ranks.append(subprocess.Popen([sys.executable, str(PROGRAM), str(out), scenario,
                                       *map(str, extra)], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return ranks, out


def _wait_for(path: Path, processes: list, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, [p.poll() for p in processes]
        assert processes[0].poll() is None, processes[0].communicate()
        time.sleep(0.1)


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_lost_follower_fails_every_caller_within_the_bound(tmp_path, how):
    """Rank 1 killed (its ring connection breaks: rank 0's next collective raises) or
    stopped (it never answers: rank 0's watchdog fires after `rank_timeout`, 5 s here)
    while rank 0 streams: the caller gets EngineFailedError, later calls too, and rank
    0 exits on its own."""
    ranks, out = _start_ranks(tmp_path, "lost")
    try:
        _wait_for(Path(f"{out}.decoding"), ranks)
        ranks[1].send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        ranks[0].wait(timeout=60)
        result = json.loads(out.read_text())
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.communicate()
    assert result["error"].startswith("EngineFailedError"), result
    # a killed rank breaks the ring (or, on a loaded machine, the watchdog fires first)
    causes = ("connection", "5 s") if how == "killed" else ("5 s",)
    assert any(cause in result["error"] for cause in causes), result["error"]
    assert result["later"] == "EngineFailedError"


def test_a_target_rank_0_cannot_load_releases_every_rank(tmp_path):
    """Rank 0 fails to load its target while rank 1 loads its own: the ranks agree
    before any probe forward, so both starts raise and both processes exit."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    ranks, out = _start_ranks(tmp_path, "broken", broken)
    try:
        for process in ranks:
            process.wait(timeout=120)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.communicate()
    assert Path(f"{out}.error0").read_text().startswith("ModelLoadError")
    assert "1 of 2 ranks failed to load" in Path(f"{out}.error1").read_text()


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
