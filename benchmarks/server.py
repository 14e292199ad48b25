"""What the HTTP server costs: streams through it with the `openai` client against the
same streams from `engine.stream` directly, in one run.

Workloads: 16 concurrent streams and 1 stream (passkey chats of `--lengths`
tokens, `--new-tokens` new tokens each, greedy, EOS ignored so every stream makes all its
tokens). Each repeat runs a workload on both sides, the side that goes first
alternating: directly, `engine.stream` consumers on this process's event loop; through
the server, a uvicorn server on 127.0.0.1 in this process (its own thread and loop)
and `openai.AsyncOpenAI` streaming clients in a child process, so the client's parsing
does not take the server's GIL (as a real client would not). Every run gets prompts
of its own, so none finds another's prefix in the cache. Per run: aggregate tokens/s
(every token over the wall time from the first request to the last token) and each
stream's time to first token as its caller sees it, and its path time: that TTFT less
the engine's own from the moment the request was ready for the worker
(`timings.time_to_first_token` less `timings.prepare`), i.e. what the way in and out
adds, without the prefill's noise.
Rows: medians over the repeats; the server / direct ratio of aggregate tokens/s, the
added TTFT and the added path time (server median minus direct median, per repeat,
then their median), and CPU time per token of the thread that runs the event loop
(directly: the callers' loop; through the server: uvicorn's, which parses, translates
and writes) and of the client process: the server's own cost, which other jobs on
the machine do not stretch the way they stretch wall time (the worker's work is the
same on both sides).

    python benchmarks/server.py --repeats 10 --json server-cpu.json
    python benchmarks/server.py --shape qwen3-8b --json server-gpu.json   # GPU, random weights
"""

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import uvicorn

from specprefill_engine import Engine
from specprefill_engine.demo_tasks import make_case

from specprefill_server import ServerConfig, create_app

from common import add_model_arguments, add_run_arguments, model_folders, write_json


async def timed(prompts: list, pieces) -> dict:
    """Run one stream per prompt, all together: wall time from the first request to the
    last token, each stream's time to first token, the tokens made, and each stream's
    path time (its TTFT less the engine's own, measured on the worker from the moment
    the request was ready: what parsing, tokenizing and delivery add, free of the
    prefill's noise). `pieces(prompt)` yields (text, final timings and usage or None)."""
    async def one(prompt):
        sent, first, final = time.perf_counter(), None, None
        async for text, last in pieces(prompt):
            if text and first is None:
                first = time.perf_counter() - sent
            final = last or final
        return first, final, time.perf_counter()

    start, cpu = time.perf_counter(), time.process_time()
    results = await asyncio.gather(*[one(p) for p in prompts])
    return {"wall": max(r[2] for r in results) - start, "ttft": [r[0] for r in results],
            "path": [r[0] - r[1]["ttft"] for r in results],
            "tokens": sum(r[1]["tokens"] for r in results),
            "process_cpu": time.process_time() - cpu}


async def client_main(base: str) -> None:
    """The child process: a run per line of stdin, its result a line of stdout."""
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        command = json.loads(line)

        async def pieces(prompt):
            stream = await client.chat.completions.create(
                model="m", messages=prompt, max_tokens=command["tokens"], stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            timings = None
            async for chunk in stream:
                if chunk.choices:
                    timings = (chunk.model_extra or {}).get("timings") or timings
                    yield chunk.choices[0].delta.content, None
                elif chunk.usage is not None:
                    yield None, {"tokens": chunk.usage.completion_tokens,
                                 "ttft": timings["time_to_first_token"] - timings["prepare"]}

        print(json.dumps(await timed(command["prompts"], pieces)), flush=True)
    await client.close()


async def direct_run(engine: Engine, prompts: list, tokens: int) -> dict:
    async def pieces(prompt):
        async for chunk in engine.stream(prompt, max_tokens=tokens, ignore_eos=True):
            yield chunk.text, chunk.usage and {"tokens": chunk.usage.completion_tokens,
                                               "ttft": chunk.timings.time_to_first_token
                                               - chunk.timings.prepare}

    cpu = time.thread_time()
    run = await timed(prompts, pieces)
    run["loop_cpu"] = time.thread_time() - cpu  # this thread runs the callers' event loop
    return run


def start_server(engine: Engine):
    """uvicorn on a free port of 127.0.0.1, on its own loop in a thread. The socket names
    its protocol (IPPROTO_TCP), as the sockets uvicorn binds itself do: asyncio turns
    Nagle's algorithm off only for those, and with it on every response waits ~40 ms for
    the client's delayed ACK."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, ServerConfig()),
                                           log_level="warning"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete,
                              args=(server.serve(sockets=[sock]),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the benchmark's server did not start")
        time.sleep(0.05)
    return server, thread, loop, f"http://127.0.0.1:{sock.getsockname()[1]}"


def loop_cpu(loop) -> float:
    """CPU seconds the thread running `loop` has used."""
    async def read():
        return time.thread_time()

    return asyncio.run_coroutine_threadsafe(read(), loop).result()


def summary(streams: int, runs: dict) -> dict:
    rate = {side: [r["tokens"] / r["wall"] for r in runs[side]] for side in runs}
    ttft = {side: [statistics.median(r["ttft"]) for r in runs[side]] for side in runs}
    path = {side: [statistics.median(r["path"]) for r in runs[side]] for side in runs}
    added = [s - d for s, d in zip(ttft["server"], ttft["direct"])]
    added_path = [s - d for s, d in zip(path["server"], path["direct"])]
    cpu = {side: [r["loop_cpu"] / r["tokens"] for r in runs[side]] for side in runs}
    client_cpu = [r["client_cpu"] / r["tokens"] for r in runs["server"]]
    return {
        "streams": streams,
        "direct_tok_s": statistics.median(rate["direct"]),
        "server_tok_s": statistics.median(rate["server"]),
        "ratio": statistics.median(rate["server"]) / statistics.median(rate["direct"]),
        "direct_ttft_ms": statistics.median(ttft["direct"]) * 1e3,
        "server_ttft_ms": statistics.median(ttft["server"]) * 1e3,
        "added_ttft_ms": statistics.median(added) * 1e3,
        "added_ttft_runs_ms": [a * 1e3 for a in added],
        "direct_path_ms": statistics.median(path["direct"]) * 1e3,
        "server_path_ms": statistics.median(path["server"]) * 1e3,
        "added_path_ms": statistics.median(added_path) * 1e3,
        "added_path_runs_ms": [a * 1e3 for a in added_path],
        "loop_cpu_ms_per_token": {side: statistics.median(v) * 1e3 for side, v in cpu.items()},
        "client_cpu_ms_per_token": statistics.median(client_cpu) * 1e3,
        "tok_s_runs": rate, "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--client", help=argparse.SUPPRESS)  # the child process's mode
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 1])
    add_model_arguments(parser, draft=False)
    add_run_arguments(parser, lengths=[128], repeats=6, one_length=True,
                      what="each chat's prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per stream")
    args = parser.parse_args()
    if args.client:
        asyncio.run(client_main(args.client))
        return
    engine = Engine(model_folders(args)[0])
    engine.start_sync()
    server, thread, server_loop, base = start_server(engine)
    client = subprocess.Popen([sys.executable, __file__, "--client", base], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    tokenizer, seeds = engine.tokenizer, iter(range(10**6))

    def fresh(n: int) -> list:
        return [[dict(m) for m in make_case(tokenizer, next(seeds), "passkey",
                                            args.lengths[0]).messages] for _ in range(n)]

    def through_server(prompts: list) -> dict:
        cpu = loop_cpu(server_loop)
        client.stdin.write(json.dumps({"prompts": prompts, "tokens": args.new_tokens}) + "\n")
        client.stdin.flush()
        run = json.loads(client.stdout.readline())
        run["client_cpu"] = run.pop("process_cpu")
        run["loop_cpu"] = loop_cpu(server_loop) - cpu
        return run

    through_server(fresh(2))  # warm both sides: the first requests pay one-time costs
    loop = asyncio.new_event_loop()  # one loop for every direct run, as one caller has
    loop.run_until_complete(direct_run(engine, fresh(2), args.new_tokens))
    rows = []
    for streams in args.streams:
        runs = {"direct": [], "server": []}
        for repeat in range(args.repeats):
            order = ("direct", "server") if repeat % 2 == 0 else ("server", "direct")
            for side in order:
                prompts = fresh(streams)
                run = (loop.run_until_complete(direct_run(engine, prompts, args.new_tokens))
                       if side == "direct" else through_server(prompts))
                runs[side].append(run)
                print(f"{streams} streams, repeat {repeat}, {side}: "
                      f"{run['tokens'] / run['wall']:.1f} tok/s, TTFT median "
                      f"{statistics.median(run['ttft']) * 1e3:.1f} ms", file=sys.stderr,
                      flush=True)
        rows.append(summary(streams, runs))
    client.stdin.close()
    client.wait()
    loop.close()
    server.should_exit = True
    thread.join()
    server_loop.close()
    print("| streams | direct tok/s | server tok/s | server / direct | TTFT ms direct / server "
          "| added TTFT ms | path ms direct / server | added path ms | event loop CPU "
          "ms/token direct / server | client CPU ms/token |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        cpu = row["loop_cpu_ms_per_token"]
        print(f"| {row['streams']} | {row['direct_tok_s']:.1f} | {row['server_tok_s']:.1f} | "
              f"{row['ratio']:.2f}x | {row['direct_ttft_ms']:.1f} / {row['server_ttft_ms']:.1f} "
              f"| {row['added_ttft_ms']:.1f} | {row['direct_path_ms']:.2f} / "
              f"{row['server_path_ms']:.2f} | {row['added_path_ms']:.2f} | "
              f"{cpu['direct']:.2f} / {cpu['server']:.2f} | {row['client_cpu_ms_per_token']:.2f} |")
    write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
