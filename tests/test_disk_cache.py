"""The prefix caches' disk tier: entries of every cache family written by one process
and restored by the next, exactly; restarts of the engine, `chat` and `serve` that
continue a conversation from disk; a process killed mid-write, a damaged file, two
processes sharing the folder, a full or unwritable disk, another model's files, and
the read-or-recompute decision."""

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from models import HYBRID_CASES, ROPE_CASES, build, kept_chunks, save_with_demo_tokenizer
from specprefill_engine import Engine
from specprefill_engine.demo_tasks import make_case
from specprefill_engine.engine.disk_cache import FOLDER, DiskCache, DiskTier
from prefix_pair import PrefixPair
from specprefill_engine.engine.kv_store import snapshot
from specprefill_engine.loading import DEMO_DRAFT, DEMO_TARGET
from test_prefix_cache import CASES as FAMILIES, feed, tokens
from test_server import _free_port

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).parent.parent
GB = 1 << 30
ALONE = dict(model=str(DEMO_TARGET), draft=None)  # the demo target without a draft


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    """Each test its own folder, so nothing on disk (the policy's costs included) comes
    from another test."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("SPECPREFILL_CACHE_DIR", str(folder))
    return folder


# every cache family, through the files ------------------------------------------------

@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_an_entry_read_back_restores_exactly_what_was_stored(name, sparse, tmp_path):
    if sparse and name in ("mamba", "nemotron_h"):
        pytest.skip("SpecPrefill needs attention layers to take positions from")
    model = build(FAMILIES[name])
    prompt = tokens(300, 1)
    kept = np.array(kept_chunks(prompt.size)) if sparse else np.arange(prompt.size)
    cache, checkpoints, done = make_prompt_cache(model), {}, 0
    for boundary in (90, 200):  # every kept entry before the boundary fed, none after
        upto = int(np.searchsorted(kept, boundary))
        feed(model, cache, prompt[kept[done:upto]], kept[done:upto] if sparse else None)
        checkpoints[boundary], done = snapshot(cache), upto
    feed(model, cache, prompt[kept[done:]], kept[done:] if sparse else None)
    positions = kept if sparse else None
    disk = DiskCache(tmp_path / FOLDER, GB)
    writer = PrefixPair(disk=disk.tier("model-a"))
    key = writer.store(prompt, cache, positions, checkpoints, keep=0.3 if sparse else 1.0)
    writer.persist(key)
    disk.close()  # the writes done

    reader = PrefixPair(disk=DiskCache(tmp_path / FOLDER, GB).tier("model-a"))
    ids = np.concatenate([prompt[:250], tokens(40, 3)])
    for dense_only in (True, False):
        want = writer.find(ids, dense_only)
        hit = reader.promote(ids, dense_only)
        if want is None:  # a sparse view with no checkpoint inside its dense start
            assert hit is None and reader.find(ids, dense_only) is None
            continue
        if hit is None:  # the first read brought the entry: the same one serves both
            hit = reader.find(ids, dense_only)
        assert (hit.shared, hit.cut) == (want.shared, want.cut)
        assert hit.describe().endswith("(disk)") and hit.entry.keep == want.entry.keep
        assert set(hit.entry.checkpoints) == set(want.entry.checkpoints)
        got_cache, got_positions = reader.restore(model, hit, hit.cut)
        want_cache, want_positions = writer.restore(model, want, want.cut)
        assert (got_positions is None) == (want_positions is None)
        if want_positions is not None:
            assert np.array_equal(got_positions, want_positions)
        for got, expected in zip(got_cache, want_cache):  # the same state, bit for bit
            for a, b in zip(_arrays(got.state), _arrays(expected.state)):
                assert a.dtype == b.dtype and np.array_equal(np.array(a), np.array(b))
        rest = np.arange(hit.cut, ids.size) if got_positions is not None else None
        assert np.array_equal(np.array(feed(model, got_cache, ids[hit.cut:], rest)),
                              np.array(feed(model, want_cache, ids[want.cut:], rest)))
    assert reader.disk.stats.reads == 1 and reader.disk.stats.broken == 0


def _arrays(tree) -> list:
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [a for item in tree for a in _arrays(item)]
    return []


def test_bfloat16_kv_and_quantized_kv_go_through_the_file(tmp_path):
    model = build(("qwen3", {"head_dim": 32}))  # a head as wide as a quantization group
    model.set_dtype(mx.bfloat16)
    prompt = tokens(200, 4)
    cache = make_prompt_cache(model)
    feed(model, cache, prompt)
    sizes = {}
    for bits in (0, 8, 4):
        root = tmp_path / f"bits{bits}" / FOLDER
        disk = DiskCache(root, GB, bits)
        writer = PrefixPair(disk=disk.tier("m"))
        writer.persist(writer.store(prompt, cache))
        disk.close()
        reader = PrefixPair(disk=DiskCache(root, GB).tier("m"))
        hit = reader.promote(np.concatenate([prompt, tokens(5, 5)]))
        keys = reader.held(hit.entry.key).kv[0][0]
        stored = writer.held(0).kv[0][0]
        assert keys.dtype == mx.bfloat16 and keys.shape == stored.shape
        error = float(mx.abs(keys.astype(mx.float32) - stored.astype(mx.float32)).max())
        scale = float(mx.abs(stored.astype(mx.float32)).max())
        assert error == 0 if bits == 0 else 0 < error < scale * (0.02 if bits == 8 else 0.2)
        sizes[bits] = sum(f.stat().st_size for f in root.rglob("*.safetensors"))
    assert sizes[4] < 0.6 * sizes[8] and sizes[8] < 0.7 * sizes[0]


# restarts: the engine, `chat`, `serve` -------------------------------------------------

def conversation(engine, turns: int, length: int = 1800, seed: int = 0, **kwargs) -> list:
    """`turns` turns of one chat on the demo tasks; each next prompt adds the reply and a
    question. Returns (prompt tokens, result) per turn."""
    case = make_case(engine.tokenizer, seed, "passkey", length)
    messages, out = list(case.messages), []
    for turn in range(turns):
        size = len(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        result = engine.generate_sync(messages, max_tokens=6, ignore_eos=True, **kwargs)
        out.append((size, messages, result))
        messages = next_turn(out[-1])
    return out


QUESTION = "Read the notes above again, then answer with the number alone. " * 6


def next_turn(previous: tuple) -> list:
    """The prompt after a turn: its messages, its reply and a question numbered by it
    (about 120 tokens: enough for the draft to score what a turn adds)."""
    _, messages, result = previous
    turn = sum(m["role"] == "assistant" for m in messages)
    return messages + [{"role": "assistant", "content": result.text.strip()},
                       {"role": "user", "content": f"And once more ({turn})? {QUESTION}"}]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """The demo pair, and a hybrid (GatedDeltaNet + attention) and a sliding-window
    model, each with the demo draft (their tokenizer; a draft of the target's own weights
    would share its files, and a tiny random one prefills faster than a file opens)."""
    paths = {"demo": (None, None)}
    for name, case in (("qwen3_next", HYBRID_CASES["qwen3_next"]),
                       ("gemma3", HYBRID_CASES["gemma3-small-window"])):
        path = save_with_demo_tokenizer(case, tmp_path_factory.mktemp(name))
        paths[name] = (str(path), str(DEMO_DRAFT))
    return paths


@pytest.mark.parametrize("family", ["demo", "qwen3_next", "gemma3"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_after_a_restart_the_next_turn_restores_from_disk(family, sparse, families, tmp_path):
    model, draft = families[family]
    length = 1800 if family == "demo" or sparse else 600  # past the newest message's cap
    settings = dict(model=model, draft=draft, prefix_cache_disk_bytes=GB)
    request = dict(specprefill=sparse)
    if sparse:  # the random models' importance is noise: the gate would refuse it
        settings.update(reuse_coverage=0.0, densify="off")
    with Engine(cache_dir=str(tmp_path / "reference"), **settings) as engine:
        reference = conversation(engine, 2, length, **request)
    with Engine(cache_dir=str(tmp_path / "restarted"), **settings) as engine:
        (first,) = conversation(engine, 1, length, **request)
    assert first[2].token_ids == reference[0][2].token_ids
    # the tiny models prefill a turn in milliseconds, about what opening a file costs: a
    # disk measured as fast makes the read the cost model's pick (its choice has its own test)
    fast_disk(tmp_path / "restarted")
    with Engine(cache_dir=str(tmp_path / "restarted"), **settings) as engine:
        second = engine.generate_sync(next_turn(first), max_tokens=6, ignore_eos=True,
                                      **request)
        stats = engine.stats()["disk"]
    want = reference[1][2]
    reuse = second.specprefill.reuse
    assert "(disk)" in reuse and reuse.split()[0] == want.specprefill.reuse.split()[0], reuse
    assert second.usage.cached_tokens == want.usage.cached_tokens
    # the reused prefix: every position of it (dense), or a view of it (sparse: its kept
    # entries are what `cached_tokens` counts)
    reused = int(reuse.split(" of ")[1].split()[0]) if " of " in reuse else 0
    assert reused >= 0.9 * first[0], reuse
    if not sparse:
        assert second.usage.cached_tokens >= 0.9 * first[0]
    if sparse:
        assert reuse.startswith("sparse"), reuse
    if sparse and family == "demo":  # the draft's prompt KV too (beside a random target the
        # read rate comes from its tiny file, mostly opening costs: a prefill can win)
        assert second.usage.draft_cached_tokens >= 0.9 * first[0]
        assert second.specprefill.selection_digest == want.specprefill.selection_digest
    assert second.token_ids == want.token_ids
    assert stats.reads >= 1 and stats.broken == 0 and not stats.off


def test_a_densified_turn_is_kept_on_disk_and_restored_as_densified(tmp_path):
    settings = dict(prefix_cache_disk_bytes=GB, cache_dir=str(tmp_path), densify="idle")
    with Engine(**settings) as engine:
        (first,) = conversation(engine, 1, 1800, specprefill=True)
        deadline = time.monotonic() + 300
        while engine.stats()["densify"].entries < 1:  # computed while the engine is idle
            assert time.monotonic() < deadline, engine.stats()
            time.sleep(0.2)
    with Engine(**settings) as engine:
        again = engine.generate_sync(next_turn(first), max_tokens=6, ignore_eos=True)
    reuse = again.specprefill.reuse
    assert reuse.startswith("dense prefix (densified) of") and reuse.endswith("(disk)"), reuse
    assert again.usage.cached_tokens >= first[0]


def fast_disk(cache_dir: Path) -> None:
    """The folder's measured read rate, as a fast SSD's page cache gives it."""
    (cache_dir / FOLDER / "rates.json").write_text(json.dumps({"read": 1e12}))


def _cli_env(cache: Path) -> dict:
    return dict(os.environ, SPECPREFILL_CACHE_DIR=str(cache),
                PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "integrations")]))


def _chat(session: Path, message: str, cache: Path) -> dict:
    run = subprocess.run(
        [sys.executable, "-m", "specprefill_engine.cli", "chat", "--session", str(session),
         "--json", "--max-tokens", "6", "--no-specprefill"], input=message + "\n", capture_output=True, text=True,
        timeout=300, env=_cli_env(cache))
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def test_chat_reopened_with_its_session_continues_from_disk(tmp_path, demo_pair):
    _, _, tokenizer = demo_pair
    document = make_case(tokenizer, 7, "passkey", 1500).messages[-1]["content"]
    one = tmp_path / "one-run.json"
    stdin = f"{document}\n\n\nWhat was it again?\n"
    run = subprocess.run(
        [sys.executable, "-m", "specprefill_engine.cli", "chat", "--session", str(one),
         "--json", "--max-tokens", "6", "--no-specprefill"], input=stdin, capture_output=True, text=True,
        timeout=300, env=_cli_env(tmp_path / "cache-one"))
    assert run.returncode == 0, run.stderr
    without_restart = [json.loads(line) for line in run.stdout.splitlines()]

    session, cache = tmp_path / "talk.json", tmp_path / "cache-two"
    first = _chat(session, document, cache)
    assert len(json.loads(session.read_text())) == 2  # the question and its answer
    second = _chat(session, "What was it again?", cache)  # a new process
    assert second["specprefill"]["reuse"].endswith("(disk)"), second["specprefill"]
    assert second["usage"]["cached_tokens"] >= 0.9 * first["usage"]["prompt_tokens"]
    assert second["answer"] == without_restart[1]["answer"]
    assert second["usage"]["prompt_tokens"] == without_restart[1]["usage"]["prompt_tokens"]
    assert len(json.loads(session.read_text())) == 4


def _serve_one(cache: Path, messages: list) -> dict:
    """Start `serve`, send one chat completion, stop it with SIGTERM."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "specprefill_engine.cli", "serve", "--port", str(port),
         "--log-level", "warning"], env=_cli_env(cache), stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):  # up to 2 minutes for the models to load
            assert process.poll() is None, "serve exited"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(base + "/health").status_code == 200:
                    break
            time.sleep(0.1)
        else:
            raise AssertionError("serve did not start")
        response = httpx.post(base + "/v1/chat/completions", timeout=120, json={
            "model": "m", "messages": messages, "max_tokens": 6, "temperature": 0})
        assert response.status_code == 200, response.text
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        assert "Traceback" not in stderr, stderr
        return response.json()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serve_restarted_serves_the_next_turn_from_disk(tmp_path, demo_pair):
    _, _, tokenizer = demo_pair
    # below the policy's threshold: every turn dense, whatever the policy has measured
    messages = list(make_case(tokenizer, 8, "passkey", 900).messages)
    cache = tmp_path / "cache"
    first = _serve_one(cache, messages)
    reply = first["choices"][0]["message"]["content"]
    grown = messages + [{"role": "assistant", "content": reply},
                        {"role": "user", "content": "Once more?"}]
    second = _serve_one(cache, grown)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.9 * first["usage"]["prompt_tokens"]
    with Engine(prefix_cache_disk_bytes=0) as engine:  # the same turn, nothing cached
        alone = engine.generate_sync(grown, max_tokens=6, cache_prompt=False)
    assert second["choices"][0]["message"]["content"] == alone.text


# safety -------------------------------------------------------------------------------

KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    from specprefill_engine import Engine
    from specprefill_engine.engine import disk_cache

    write = disk_cache.DiskCache._write_file

    def killed_halfway(job, tmp):  # what a process killed mid-write leaves: half a file
        write(job, tmp)
        with open(tmp, "r+b") as f:
            f.truncate(os.path.getsize(tmp) // 2)
        os.kill(os.getpid(), signal.SIGKILL)

    disk_cache.DiskCache._write_file = staticmethod(killed_halfway)
    messages = [{"role": "user", "content": sys.stdin.read()}]
    with Engine(prefix_cache_disk_bytes=1 << 30) as engine:
        engine.generate_sync(messages, max_tokens=4, specprefill=False)
""")


def test_a_process_killed_mid_write_leaves_nothing_the_next_one_uses(tmp_path, demo_pair):
    _, _, tokenizer = demo_pair
    cache = tmp_path / "cache"
    text = make_case(tokenizer, 9, "passkey", 1200).messages[-1]["content"]
    run = subprocess.run([sys.executable, "-c", KILLED_WRITER], input=text, text=True,
                         capture_output=True, timeout=300, env=_cli_env(cache))
    assert run.returncode == -signal.SIGKILL, run.stderr
    folder = cache / FOLDER
    assert [p.name for p in folder.rglob("*") if p.is_file() and p.suffix == ".tmp"]
    assert not list(folder.rglob("*.safetensors"))
    messages = [{"role": "user", "content": text}]
    with Engine(prefix_cache_disk_bytes=GB) as engine:
        again = engine.generate_sync(messages, max_tokens=4, specprefill=False)
        stats = engine.stats()["disk"]
    with Engine(prefix_cache_disk_bytes=0) as engine:
        alone = engine.generate_sync(messages, max_tokens=4, specprefill=False)
    assert again.usage.cached_tokens == 0 and again.specprefill.reuse == "none"
    assert again.token_ids == alone.token_ids and stats.broken == 0


@pytest.fixture(scope="module")
def written_turn(tmp_path_factory):
    """A turn of the demo target alone written to a disk tier's folder, the next turn's
    prompt, and that prompt's reply on an engine without a disk tier."""
    folder = tmp_path_factory.mktemp("written")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECPREFILL_CACHE_DIR", str(folder / "cache"))
        with Engine(prefix_cache_disk_bytes=GB, cache_dir=str(folder / "tier"), **ALONE) as engine:
            (first,) = conversation(engine, 1, 1200, seed=3)
        grown = next_turn(first)
        with Engine(prefix_cache_disk_bytes=0, **ALONE) as engine:
            alone = engine.generate_sync(grown, max_tokens=6, ignore_eos=True, cache_prompt=False)
    return folder / "tier", grown, alone


@pytest.mark.parametrize("damage", ["flipped byte", "cut short", "header"])
def test_a_damaged_file_is_ignored_and_removed(damage, written_turn, tmp_path, caplog):
    written, grown, alone = written_turn
    shutil.copytree(written, tmp_path / "tier")  # each damage on its own copy of the folder
    settings = dict(prefix_cache_disk_bytes=GB, cache_dir=str(tmp_path / "tier"), **ALONE)
    (path,) = (tmp_path / "tier" / FOLDER).rglob("*.safetensors")
    data = bytearray(path.read_bytes())
    if damage == "flipped byte":
        data[len(data) * 2 // 3] ^= 0x10
    elif damage == "cut short":
        data = data[: len(data) - 100]
    else:
        data[20:24] = b"\xff\xfe\x00\x01"
    path.write_bytes(bytes(data))
    with Engine(**settings) as engine:
        again = engine.generate_sync(grown, max_tokens=6, ignore_eos=True)
        stats = engine.stats()["disk"]
    assert "(disk)" not in again.specprefill.reuse and again.usage.cached_tokens == 0
    assert again.token_ids == alone.token_ids
    assert stats.broken == 1 and not path.exists()
    assert any("is broken" in r.getMessage() for r in caplog.records)


TWO_WRITERS = textwrap.dedent("""
    import json, sys
    from specprefill_engine import Engine
    from specprefill_engine.demo_tasks import make_case

    seeds, budget = json.loads(sys.argv[1]), int(sys.argv[2])
    with Engine(prefix_cache_disk_bytes=budget, prefix_cache_bytes=24 << 20) as engine:
        for turn in range(2):
            for seed in seeds:
                case = make_case(engine.tokenizer, seed, "passkey", 900)
                messages = list(case.messages) + [
                    {"role": "assistant", "content": "I see."},
                    {"role": "user", "content": "Again?"}][: 2 * turn]
                engine.generate_sync(messages, max_tokens=4, specprefill=False)
    print(json.dumps(engine.stats()["disk"].__dict__))  # after shutdown: every write done
""")


def test_two_processes_writing_one_folder_neither_fails_nor_restores_wrong(tmp_path,
                                                                           demo_pair):
    _, _, tokenizer = demo_pair
    cache = tmp_path / "cache"
    budget = 40 << 20  # a few entries: both evict while the other writes
    runs = [subprocess.Popen([sys.executable, "-c", TWO_WRITERS, json.dumps(seeds), str(budget)],
                             env=_cli_env(cache), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for seeds in ([10, 11, 12], [12, 13, 10])]
    outputs = [run.communicate(timeout=600) for run in runs]
    for run, (stdout, stderr) in zip(runs, outputs):
        assert run.returncode == 0, stderr
        assert "Traceback" not in stderr and "broken" not in stderr, stderr
        assert json.loads(stdout.splitlines()[-1])["written"] >= 3
    files = list((cache / FOLDER).rglob("*.safetensors"))
    assert files and sum(f.stat().st_size for f in files) <= budget
    with Engine(prefix_cache_disk_bytes=budget) as engine, \
            Engine(prefix_cache_disk_bytes=0) as fresh:
        restored = 0
        for seed in (10, 11, 12, 13):
            case = make_case(tokenizer, seed, "passkey", 900)
            messages = list(case.messages) + [
                {"role": "assistant", "content": "I see."}, {"role": "user", "content": "Again?"},
                {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Now?"}]
            result = engine.generate_sync(messages, max_tokens=6, ignore_eos=True)
            alone = fresh.generate_sync(messages, max_tokens=6, ignore_eos=True,
                                        cache_prompt=False)
            assert result.token_ids == alone.token_ids, (seed, result.specprefill.reuse)
            restored += "(disk)" in result.specprefill.reuse
        assert restored >= 1 and engine.stats()["disk"].broken == 0


def _two_turns(**settings) -> list:
    with Engine(**ALONE, **settings) as engine:
        turns = conversation(engine, 2, 1000, seed=5)
        stats = engine.stats().get("disk")
    return [result for _, _, result in turns], stats


def test_a_budget_smaller_than_an_entry_warns_once_and_answers_as_without(tmp_path, caplog):
    without, _ = _two_turns(prefix_cache_disk_bytes=0)
    tiny, stats = _two_turns(prefix_cache_disk_bytes=4096, cache_dir=str(tmp_path))
    assert [r.token_ids for r in tiny] == [r.token_ids for r in without]
    assert tiny[1].usage.cached_tokens == without[1].usage.cached_tokens > 0  # memory serves
    warnings = [r for r in caplog.records if "larger than the budget" in r.getMessage()]
    assert len(warnings) == 1 and stats.written == 0
    assert not list(tmp_path.rglob("*.safetensors"))


def test_a_full_disk_turns_the_tier_off_with_one_warning(tmp_path, caplog):
    full = tmp_path / "full"
    full.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("mounting a small filesystem needs root")
    try:
        without, _ = _two_turns(prefix_cache_disk_bytes=0)
        turns, stats = _two_turns(prefix_cache_disk_bytes=GB, cache_dir=str(full))
    finally:
        subprocess.run(["umount", str(full)], check=True)
    assert [r.token_ids for r in turns] == [r.token_ids for r in without]
    assert turns[1].usage.cached_tokens == without[1].usage.cached_tokens > 0
    assert "No space left" in stats.off
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1


def test_a_folder_that_cannot_be_made_turns_the_tier_off_with_one_warning(tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    without, _ = _two_turns(prefix_cache_disk_bytes=0)
    turns, stats = _two_turns(prefix_cache_disk_bytes=GB, cache_dir=str(blocked))
    assert [r.token_ids for r in turns] == [r.token_ids for r in without]
    assert stats.off and stats.written == 0
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1


def test_bad_settings_are_refused_by_name():
    for settings, name in ((dict(prefix_cache_disk_bytes=-1), "prefix_cache_disk_bytes"),
                           (dict(prefix_cache_disk_bytes=1.5), "prefix_cache_disk_bytes"),
                           (dict(prefix_cache_disk_bits=3), "prefix_cache_disk_bits"),
                           (dict(cache_dir=3), "cache_dir")):
        with pytest.raises((ValueError, TypeError), match=name):
            Engine(**settings)
    run = subprocess.run([sys.executable, "-m", "specprefill_engine.cli", "demo",
                          "--disk-cache-gb", "-1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--disk-cache-gb must be >= 0" in run.stderr


# keys and the decision -----------------------------------------------------------------

def test_another_model_or_dtype_never_reads_the_files(tmp_path):
    settings = dict(prefix_cache_disk_bytes=GB, cache_dir=str(tmp_path), draft=None)
    with Engine(model=str(DEMO_TARGET), **settings) as engine:
        (first,) = conversation(engine, 1, 1000, seed=6)
    grown = next_turn(first)
    other = save_with_demo_tokenizer(ROPE_CASES["qwen3"], tmp_path / "other-model")
    for name, config in (("another model", dict(model=str(other))),
                         ("another dtype", dict(model=str(DEMO_TARGET), dtype="bfloat16"))):
        with Engine(**config, **settings) as engine:
            result = engine.generate_sync(grown, max_tokens=4, specprefill=False)
            assert "(disk)" not in result.specprefill.reuse, name
            assert engine.stats()["disk"].reads == 0, name
    folders = [p for p in (tmp_path / FOLDER).iterdir() if p.is_dir()]
    assert len(folders) == 3  # one per identity: the demo target, the other model, bfloat16
    with Engine(model=str(DEMO_TARGET), **settings) as engine:  # the first still reads its own
        assert "(disk)" in engine.generate_sync(grown, max_tokens=4).specprefill.reuse


@pytest.mark.parametrize("rate, read", [(1.0, False), (1e12, True)])
def test_a_file_is_read_only_when_the_read_is_predicted_faster(rate, read, tmp_path):
    settings = dict(prefix_cache_disk_bytes=GB, cache_dir=str(tmp_path), **ALONE)
    with Engine(**settings) as engine:
        turns = conversation(engine, 2, 1200, seed=7)
        # a long prefill measured (a process's first counts only when fast): the cost
        # model's rates are this machine's, not its prior
        engine.generate_sync(turns[0][1], max_tokens=1, cache_prompt=False)
    (tmp_path / FOLDER / "rates.json").write_text(json.dumps({"read": rate}))
    grown = next_turn(turns[-1])
    with Engine(**settings) as engine:
        result = engine.generate_sync(grown, max_tokens=6, ignore_eos=True)
        stats = engine.stats()["disk"]
    with Engine(prefix_cache_disk_bytes=0, **ALONE) as engine:
        alone = engine.generate_sync(grown, max_tokens=6, ignore_eos=True, cache_prompt=False)
    assert ("(disk)" in result.specprefill.reuse) == read
    assert (stats.reads, stats.recomputed) == ((1, 0) if read else (0, 1))
    assert result.token_ids == alone.token_ids


async def test_an_entry_evicted_while_its_write_is_queued_is_written_once(tmp_path,
                                                                          monkeypatch):
    """Two turns that end in one step are both kept and queued for the disk; the next
    plan evicts one of them (the budget holds one): each file is handed to the writer
    once, not again by the eviction."""
    names, write = [], DiskTier.write

    def recorded(self, entry, held):
        name = write(self, entry, held)
        names.append(name)
        return name

    monkeypatch.setattr(DiskTier, "write", recorded)
    settings = dict(prefix_cache_disk_bytes=GB, cache_dir=str(tmp_path), **ALONE)
    async with Engine(prefix_cache_bytes=3 << 19, **settings) as engine:
        prompts = [f"Note {seed}: " + " ".join(["cedar"] * 40) for seed in range(2)]
        await asyncio.gather(*(engine.generate(p, max_tokens=6, ignore_eos=True,
                                               specprefill=False) for p in prompts))
        await engine.generate("x", max_tokens=1, cache_prompt=False)  # the next plan
    assert len(names) >= 3 and len(set(names)) == len(names)
