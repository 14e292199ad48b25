"""The next turn after a restart: its KV read back from the prefix cache on disk, against
recomputed, with the read rate and the cost model's pick; and what 8- or 4-bit storage
of the KV does to answers.

An agent session (`demo_tasks.make_agent_session`: documents of `--lengths` tokens, then
a tool result of 200-500 tokens and a question per step) runs its first step in one
engine, which keeps that turn on disk and shuts down. Rows for the second step, each
in a new engine (the restart) that first answers a short unrelated prompt (a process's
first forward pays one-time costs, kernel compiles on a GPU):
- recompute: no cached prefix, the whole prompt prefilled (`cache_prompt=False`), in
  the first engine; "recompute (restarted)": the same in new engines without the disk
  tier, warmed up alike (a restarted process's first long prefill compiles kernels for
  its shapes on a GPU);
- restore: the file read back, from the page cache (just written) and, on Linux, cold
  (the file dropped from the page cache first: `posix_fadvise`, as after a reboot). A
  read rate far above any prefill is written to the folder's `rates.json` first, so
  the engine reads whatever its cost model says;
- auto: the engine's own pick, cold, from the read rate it measured and its cost
  model's prediction of the prefill (`Engine.stats()["disk"]`); "right" when it took
  the side measured faster, against the restarted recompute;
- no restart (memory): the first engine, still up, answering the step from memory: the
  floor a restore can reach (the new tokens' prefill after the cached prefix).
`--bits 8 4` adds the restore rows with the KV stored quantized. `--quality N` runs N
sessions per storage (exact, 8-bit, 4-bit): the second step's answer after a restart,
right or wrong, and its greedy tokens against the exact restore's.

    python benchmarks/disk_cache.py --lengths 6144 --bits 0 8 4 --repeats 3 --json disk-cpu.json
    python benchmarks/disk_cache.py --lengths 2048 --quality 20 --no-timing --json disk-quality.json
    python benchmarks/disk_cache.py --shape qwen3-8b --lengths 8192 32768 --bits 0 8   # a GPU
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx

from specprefill_engine import Engine
from specprefill_engine.demo_tasks import make_agent_session
from specprefill_engine.engine.disk_cache import FOLDER
from specprefill_engine.loading import DEMO_TARGET

from common import add_model_arguments, add_run_arguments, model_folders, write_json

NEW_TOKENS = 12
FORCE_READ = 1e15  # bytes/s: every read predicted faster than any prefill
WARM_UP = [{"role": "user", "content": "Say hello."}]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def sessions(engine, tokens: int, count: int, seed: int = 0) -> list:
    return [make_agent_session(engine.tokenizer, seed + i, tokens, steps=2) for i in range(count)]


def drop_from_page_cache(folder: Path) -> bool:
    """Evict the folder's files from the page cache (their pages are clean: the writer
    flushed them), so the next read comes from the disk; False where the OS has no way."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in folder.rglob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def set_read_rate(folder: Path, rate: float) -> None:
    path = folder / FOLDER / "rates.json"
    rates = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**rates, "read": rate}))


def step(engine, session, replies: list, **request):
    """The session's next step, as an agent sends it (its tools in the prompt); dense."""
    return engine.generate_sync(session.messages(len(replies), replies), max_tokens=NEW_TOKENS,
                                tools=list(session.tools), specprefill=False, **request)


def row(name: str, result, stats=None, **extra) -> dict:
    out = {"row": name, "prompt_tokens": result.usage.prompt_tokens,
           "cached_tokens": result.usage.cached_tokens, "reuse": result.specprefill.reuse,
           "ttft_s": result.timings.time_to_first_token, **extra}
    if stats is not None:
        out.update(read_bytes=stats.read_bytes, read_s=stats.read_seconds,
                   read_gb_per_s=stats.read_rate / 1e9 if stats.read_seconds else None,
                   predicted_read_s=stats.predicted_read_s,
                   predicted_prefill_s=stats.predicted_prefill_s)
    log(f"  {name}: TTFT {out['ttft_s']:.3f}s, cached {out['cached_tokens']}, {out['reuse']}")
    return out


def copy_of(folder: Path, name: str) -> Path:
    """A restart's own copy of what the first engine wrote (a restarted engine writes its
    own turn, which the next restart must not find)."""
    copy = folder.with_name(f"{folder.name}-{name}")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(folder, copy)
    return copy


def restarted(paths, folder: Path, bits: int, session, replies: list) -> tuple:
    """A new engine over `folder`: a warm-up, then the session's next step."""
    with Engine(model=paths[0], draft=paths[1], prefix_cache_disk_bytes=1 << 40,
                prefix_cache_disk_bits=bits, cache_dir=str(folder)) as engine:
        engine.generate_sync(WARM_UP, max_tokens=2, cache_prompt=False)
        result = step(engine, session, replies)
        return result, engine.stats()["disk"]


def recomputed_after_restart(paths, session, replies: list, runs: int) -> list:
    """The step in new engines without the disk tier, each warmed up as a restart is:
    what recomputing costs a restarted process (its first long prefill compiles kernels
    on a GPU), the fair side to weigh a restore against."""
    results = []
    for _ in range(runs):
        with Engine(model=paths[0], draft=paths[1], prefix_cache_disk_bytes=0) as engine:
            engine.generate_sync(WARM_UP, max_tokens=2, cache_prompt=False)
            results.append(step(engine, session, replies, cache_prompt=False))
    return results


def first_step(engine, tokens: int) -> tuple:
    """A session's first step, once its file is on disk: (session, replies)."""
    engine.generate_sync(WARM_UP, max_tokens=2, cache_prompt=False)
    (session,) = sessions(engine, tokens, 1)
    replies = [step(engine, session, []).text.strip()]
    deadline = time.monotonic() + 600
    while engine.stats()["disk"].written < 1:  # the writer thread keeps it
        assert time.monotonic() < deadline, "the first step's file was not written"
        time.sleep(0.05)
    return session, replies


def restores(paths, folder: Path, bits: int, session, replies: list, runs: int,
             common: dict) -> list:
    """The restore rows, each restart on its own copy of `folder`, the read forced."""
    rows = []
    for where in ("page cache", "cold"):
        if where == "cold" and not hasattr(os, "posix_fadvise"):
            continue
        results = []
        for run in range(runs):
            copy = copy_of(folder, f"{where}-{run}".replace(" ", "-"))
            set_read_rate(copy, FORCE_READ)
            if where == "cold":
                drop_from_page_cache(copy)
            results.append(restarted(paths, copy, bits, session, replies))
            shutil.rmtree(copy)  # 32K tokens of an 8B model: 4.8 GB a copy
        result, stats = min(results, key=lambda pair: pair[0].timings.time_to_first_token)
        rows.append(row(f"restore ({where})", result, stats, **common,
                        ttft_runs=[r.timings.time_to_first_token for r, _ in results]))
    return rows


def timing(paths, tokens: int, bits_list: list, work: Path, runs: int) -> list:
    """Per storage, the first engine stays up while the restarts run, then answers the
    same step from memory (no restart) last."""
    rows = []
    for bits in bits_list:
        folder, first = work / f"{tokens}-{bits}", bits == bits_list[0]
        with Engine(model=paths[0], draft=paths[1], prefix_cache_disk_bytes=1 << 40,
                    prefix_cache_disk_bits=bits, cache_dir=str(folder)) as engine:
            session, replies = first_step(engine, tokens)
            file_bytes = sum(p.stat().st_size for p in folder.rglob("*.safetensors"))
            log(f"{tokens} tokens, {bits or 'full'}-bit KV: {file_bytes / 1e6:.1f} MB written "
                f"in {engine.stats()['disk'].write_seconds:.2f}s")
            common = dict(tokens=tokens, bits=bits, file_bytes=file_bytes)
            if first:
                recompute = [step(engine, session, replies, cache_prompt=False)
                             for _ in range(runs)]
                best = min(recompute, key=lambda r: r.timings.time_to_first_token)
                rows.append(row("recompute", best, **common,
                                ttft_runs=[r.timings.time_to_first_token for r in recompute]))
                fresh = recomputed_after_restart(paths, session, replies, runs)
                best = min(fresh, key=lambda r: r.timings.time_to_first_token)
                rows.append(row("recompute (restarted)", best, **common,
                                ttft_runs=[r.timings.time_to_first_token for r in fresh]))
            rows += restores(paths, folder, bits, session, replies, runs, common)
            if not first:
                continue
            # the engine's own pick, cold, from the read rate the cold restarts measured
            copy = copy_of(folder, "auto")
            set_read_rate(copy, rows[-1]["read_gb_per_s"] * 1e9)
            drop_from_page_cache(copy)
            result, stats = restarted(paths, copy, bits, session, replies)
            shutil.rmtree(copy)
            picked = "restore" if stats.reads else "recompute"
            measured = {r["row"]: r["ttft_s"] for r in rows
                        if (r["tokens"], r["bits"]) == (tokens, bits)}
            # a restart weighs a cold read against a restarted process's recompute
            faster = "restore" if rows[-1]["ttft_s"] < measured["recompute (restarted)"] \
                else "recompute"
            rows.append(row("auto", result, stats, **common, picked=picked,
                            right=picked == faster))
            rows.append(row("no restart (memory)", step(engine, session, replies), **common))
        shutil.rmtree(folder)
    return rows


def quality(paths, tokens: int, count: int, work: Path) -> list:
    """The second step's answer after a restart, per storage of the first step's KV."""
    rows, exact = [], None
    for bits in (0, 8, 4):
        folder = work / f"quality-{bits}"
        settings = dict(model=paths[0], draft=paths[1], prefix_cache_disk_bytes=1 << 40,
                        prefix_cache_disk_bits=bits, cache_dir=str(folder))
        with Engine(**settings) as engine:
            cases = sessions(engine, tokens, count, seed=100)
            replies = [[step(engine, s, []).text.strip()] for s in cases]
        set_read_rate(folder, FORCE_READ)
        with Engine(**settings) as engine:
            results = [step(engine, s, r) for s, r in zip(cases, replies)]
        right = [r.text.strip() == s.answers[1] for r, s in zip(results, cases)]
        restored = sum("(disk)" in r.specprefill.reuse for r in results)
        if bits == 0:
            exact = results
        same = [r.token_ids == e.token_ids for r, e in zip(results, exact)]
        first = [r.token_ids[0] == e.token_ids[0] for r, e in zip(results, exact)]
        rows.append({"row": "quality", "bits": bits, "tokens": tokens, "sessions": count,
                     "restored": restored, "accuracy": sum(right) / count,
                     "same_tokens": sum(same) / count, "same_first_token": sum(first) / count})
        log(f"quality, {bits or 'full'}-bit KV: accuracy {sum(right)}/{count}, greedy tokens "
            f"as the exact restore's {sum(same)}/{count} ({restored} restored from disk)")
    return rows


def storage(bits: int) -> str:
    return f"{bits}-bit" if bits else "as computed"


def table(rows: list) -> str:
    """Markdown: the timing rows, then the quality rows."""
    lines = []
    timed = [r for r in rows if r["row"] != "quality"]
    recompute = {r["tokens"]: r["ttft_s"] for r in timed if r["row"] == "recompute"}
    if timed:
        lines += ["| tokens | KV on disk | row | TTFT (s) | vs recompute | cached | file (MB) | "
                  "read (s) | read (GB/s) | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in timed:
        note = ""
        if r["row"] == "auto":
            verdict = "right" if r["right"] else "wrong"
            note = (f"picked {r['picked']} ({verdict}): read {r['predicted_read_s']:.3f}s vs "
                    f"prefill {r['predicted_prefill_s']:.3f}s predicted")
        read = f"{r['read_s']:.3f} | {r['read_gb_per_s']:.2f}" if r.get("read_s") else " | "
        speedup = recompute[r["tokens"]] / r["ttft_s"]
        lines.append(f"| {r['tokens']} | {storage(r['bits'])} | {r['row']} | {r['ttft_s']:.3f} | "
                     f"{speedup:.1f}x | {r['cached_tokens']} | {r['file_bytes'] / 1e6:.1f} | "
                     f"{read} | {note} |")
    quality_rows = [r for r in rows if r["row"] == "quality"]
    if quality_rows:
        if lines:
            lines.append("")
        lines += ["| KV on disk | tokens | sessions | restored | accuracy | greedy tokens as "
                  "exact | first token as exact |", "|---|---|---|---|---|---|---|"]
        for r in quality_rows:
            lines.append(f"| {storage(r['bits'])} | {r['tokens']} | {r['sessions']} | "
                         f"{r['restored']} | {r['accuracy']:.2f} | {r['same_tokens']:.2f} | "
                         f"{r['same_first_token']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, draft=False)
    add_run_arguments(parser, lengths=[6144], repeats=1,
                      what="the conversation's tokens before the next turn",
                      repeats_what="restarts per row (the best counts)")
    parser.add_argument("--bits", type=int, nargs="+", default=[0], choices=[0, 4, 8],
                        help="KV storage for the restore rows (0: as computed)")
    parser.add_argument("--quality", type=int, default=0, help="sessions per storage")
    parser.add_argument("--no-timing", action="store_true", help="only --quality")
    parser.add_argument("--table", nargs="+", metavar="JSON", help="print saved runs' tables")
    args = parser.parse_args(argv)
    if args.table:
        for path in args.table:
            print(table(json.loads(Path(path).read_text())["rows"]) + "\n")
        return 0
    target, _ = model_folders(args)
    paths = (target or str(DEMO_TARGET), None)  # every row is dense: no draft to load
    work = Path(tempfile.mkdtemp(prefix="specprefill-disk-"))
    os.environ["SPECPREFILL_CACHE_DIR"] = str(work / "home")  # the cost model starts empty
    log(f"files under {work} (removed at the end); device {mx.default_device()}")
    rows = []
    for tokens in [] if args.no_timing else args.lengths:
        rows += timing(paths, tokens, args.bits, work, args.repeats)
    if args.quality:
        rows += quality(paths, args.lengths[0], args.quality, work)
    shutil.rmtree(work, ignore_errors=True)  # its files: hundreds of MB, GBs on a GPU
    print(table(rows), flush=True)
    write_json(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
