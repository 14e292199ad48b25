"""`specprefill-engine`: ask questions about long files, chat, demo, bench, eval, serve."""

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from .engine.runtime import EngineConfig, check_keep

EXAMPLES = """examples:
  specprefill-engine demo                      # the main job on a generated document
  specprefill-engine ask notes.py --question "What is the secret passkey?"
  specprefill-engine ask a.py b.py -q "What is REGISTRY[\\"412-cobalt\\"]?" --compare
  specprefill-engine chat --file notes.py --system "Answer briefly."
  specprefill-engine chat --session talk.json  # run again: the chat goes on from disk
  specprefill-engine bench                     # quick TTFT: dense vs SpecPrefill vs mlx-lm
  specprefill-engine eval                      # quick accuracy: dense vs SpecPrefill vs random
  specprefill-engine serve --port 8000         # OpenAI- and Anthropic-compatible HTTP server

ask, demo and chat send the files and the question as chat messages, through the
model's chat template. Progress (prompt tokens scored by the draft, then prefilled by
the target) goes to stderr: one line per phase on a terminal, a plain line every few
seconds otherwise; --quiet turns it off.
"""
DISK_CACHE_GB = {"chat": 10.0, "serve": 10.0}  # per command; the others keep nothing on disk
PROGRESS_INTERVAL = 5.0  # seconds between plain progress lines when stderr is not a terminal
PROGRESS_FLOOR = 1.0  # a phase done within its first report and this many seconds: not shown
DEMO_MIN_TOKENS = 100  # room for the hidden facts and the question
# an answer at the command line: room for a thinking model's reasoning and its answer,
# where a library call keeps `SamplingParams`' shorter default
ANSWER_TOKENS = 512


class UsageError(Exception):
    """A mistake the user can fix; printed as one line, exit status 2."""


def read_document(path: str) -> str:
    """A text file's contents; `-` reads stdin."""
    file = Path(path)
    if path == "-":
        data = sys.stdin.buffer.read()
    elif file.is_dir():
        raise UsageError(f"{path} is a directory; give text files")
    elif not file.is_file():
        raise UsageError(f"no such file: {path}")
    else:
        data = file.read_bytes()
    if b"\0" in data:
        raise UsageError(f"{path} looks like a binary file; give text files")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text") from None


def build_messages(documents: dict, question: str, system: Optional[str] = None) -> list:
    """All files, each under its name, then the question, in one user turn (after
    the system message, when given)."""
    if not question or not question.strip():
        raise UsageError("the question is empty")
    body = "".join(f"# file: {name}\n{text}\n" for name, text in documents.items())
    return system_messages(system) + [{"role": "user", "content": f"{body}{question.strip()}"}]


def system_messages(system: Optional[str]) -> list:
    return [{"role": "system", "content": system}] if system else []


class ProgressLine:
    """The engine's progress on stderr, one line per phase, in prompt tokens: redrawn
    in place on a terminal; otherwise a plain line every `interval` seconds and when
    the phase ends. `label` names whose work it is; a phase over at once is not shown."""

    def __init__(self, enabled: bool, label: str = "", interval: float = PROGRESS_INTERVAL):
        self.enabled, self.label, self.interval = enabled, label, interval
        self.terminal = sys.stderr.isatty()
        self.phase: Optional[str] = None
        self.last = self.started = self.written = time.monotonic()
        self.shown = self.complete = False  # complete: the phase's last line is out

    def __call__(self, progress) -> None:
        if not self.enabled:
            return
        phase, now = f"{self.label}{progress.phase}", time.monotonic()
        first = phase != self.phase
        if first:  # it started when the last phase's work ended
            self.end()
            self.phase, self.started, self.written = phase, self.last, now
        self.last = now
        done, total, elapsed = progress.done, progress.total, now - self.started
        was_complete, self.complete = self.complete, done >= total
        if first and done >= total and elapsed < PROGRESS_FLOOR:
            return
        counts = f"{done}/{total} tokens ({elapsed:.1f}s)"
        if self.terminal:
            bar = "#" * (30 * done // max(total, 1))
            sys.stderr.write(f"\r{phase:>14} [{bar:-<30}] {counts}")
            self.shown = True
        elif (done >= total and not was_complete) or (
                done < total and now - self.written >= self.interval):
            sys.stderr.write(f"{phase}: {counts}\n")
            self.written, self.shown = now, True
        sys.stderr.flush()

    def end(self) -> None:
        """A phase is over: on a terminal its line stays, and the next starts below."""
        if self.enabled and self.terminal and self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
        self.phase, self.shown, self.complete = None, False, False


def make_engine(args, **config):
    """The Engine the command's --model, --draft, --keep, --threshold,
    --num-draft-tokens, --kv-bits, --kv-group-size, --quantized-kv-start, --kv-cache-gb
    and --disk-cache-gb describe."""
    from .engine import Engine

    settings = {name: getattr(args, name) for name in (
        "keep", "threshold", "num_draft_tokens", "kv_bits", "kv_group_size", "quantized_kv_start")
        if getattr(args, name, None) is not None}
    memory = getattr(args, "kv_cache_gb", None)
    if memory is not None:
        if not (math.isfinite(memory) and memory > 0):
            raise UsageError(f"--kv-cache-gb must be > 0, got {memory}")
        settings["kv_cache_bytes"] = int(memory * 1e9)
    gb = args.disk_cache_gb
    if gb is None:
        gb = DISK_CACHE_GB.get(args.command, 0.0)
    if not (math.isfinite(gb) and gb >= 0):
        raise UsageError(f"--disk-cache-gb must be >= 0 (0: off), got {gb}")
    return Engine(model=args.model, draft=args.draft, prefix_cache_disk_bytes=int(gb * 1e9),
                  **settings, **config)


def summary(result, dense_ttft=None) -> str:
    report, timings, usage = result.specprefill, result.timings, result.usage
    kept = f"kept {report.kept_tokens}/{report.total_tokens}" if report.engaged else f"dense ({report.reason})"
    disk = " on disk" if report.reuse.endswith("(disk)") or "(disk)," in report.reuse else ""
    cached = f", {usage.cached_tokens} from the prefix cache{disk}" if usage.cached_tokens else ""
    line = (
        f"prompt {usage.prompt_tokens} tokens{cached}, {kept}, "
        f"TTFT {timings.time_to_first_token:.2f}s, decode {timings.decode_tokens_per_s:.1f} tok/s"
    )
    if report.drafted_tokens:
        line += f" ({report.accepted_tokens} of {report.drafted_tokens} drafted tokens taken)"
    if dense_ttft is not None:
        line += f", dense TTFT {dense_ttft:.2f}s ({dense_ttft / timings.time_to_first_token:.1f}x)"
    return line


def notes(final, max_tokens: int) -> list:
    """What the user must know about an answer: the engine's warnings, and a cut."""
    lines = [f"warning: {warning}" for warning in final.warnings]
    if final.finish_reason == "length":
        if final.usage.completion_tokens >= max_tokens:
            lines.append(f"stopped at --max-tokens {max_tokens}; raise it for a longer answer")
        else:
            lines.append(f"stopped after {final.usage.completion_tokens} tokens: the model's "
                         "context is full")
    return lines


def answer(engine, messages, args) -> tuple:
    """Stream one answer (to stdout unless --json); return (text, final chunk)."""
    progress = ProgressLine(not args.quiet)
    specprefill = True if args.specprefill else False if args.no_specprefill else None
    parts, final = [], None
    for chunk in engine.stream_sync(messages, max_tokens=args.max_tokens,
                                    specprefill=specprefill, on_progress=progress):
        if not parts:
            progress.end()
        parts.append(chunk.text)
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        final = chunk
    return "".join(parts), final


def dense_run(engine, messages, args):
    """--compare: a dense prefill of the same prompt, cold (the answer's own prefill
    may sit in the prefix cache), with its own progress."""
    progress = ProgressLine(not args.quiet, label="dense ")
    dense = engine.generate_sync(messages, max_tokens=1, specprefill=False, cache_prompt=False,
                                 on_progress=progress)
    progress.end()
    return dense


def ask(engine, messages, args, expected=None, indent: Optional[int] = 2) -> str:
    """Answer, then print a one-line summary and notes on stderr (or JSON on stdout);
    return the answer's text."""
    try:
        text, final = answer(engine, messages, args)
        if not args.json:
            print(flush=True)  # the answer's line ends before anything else is written
        dense = dense_run(engine, messages, args) if args.compare else None
    except (ValueError, TypeError) as error:  # the request was refused before it ran
        raise UsageError(str(error)) from None
    if args.json:
        payload = {
            "answer": text,
            "finish_reason": final.finish_reason,
            "warnings": final.warnings,
            "usage": asdict(final.usage),
            "timings": asdict(final.timings),
            "specprefill": asdict(final.specprefill),
            "dense_time_to_first_token": dense and dense.timings.time_to_first_token,
            "dense_cached_tokens": dense and dense.usage.cached_tokens,
            "ranks": engine.info.ranks,
        }
        if expected is not None:
            payload["expected"] = expected
        print(json.dumps(payload, indent=indent), flush=True)
        return text
    for line in notes(final, args.max_tokens):
        print(line, file=sys.stderr)
    if not args.quiet:
        print(summary(final, dense and dense.timings.time_to_first_token), file=sys.stderr)
    if expected is not None:
        verdict = "correct" if text.strip() == expected else "WRONG"
        print(f"expected {expected}: {verdict}", file=sys.stderr)
    return text


def cmd_ask(args) -> int:
    documents = {path: read_document(path) for path in args.files}
    messages = build_messages(documents, args.question, args.system)
    with make_engine(args) as engine:
        ask(engine, messages, args)
    return 0


def cmd_demo(args) -> int:
    """Generate a long document with facts hidden in it, then ask for one of them."""
    from .demo_tasks import make_case

    with make_engine(args) as engine:
        case = make_case(engine.tokenizer, args.seed, "registry", args.tokens)
        path = Path(args.output or Path(tempfile.gettempdir()) / "specprefill-demo.py")
        path.write_text(case.context)
        if not (args.json or args.quiet):
            print(f"document: {path} (about {args.tokens} tokens of Python source with "
                  f"facts hidden in it)\nquestion: {case.question}", file=sys.stderr)
        ask(engine, build_messages({path.name: case.context}, case.question), args,
            expected=case.answer)
    return 0


def read_message(terminal: bool) -> Optional[str]:
    """One chat message from stdin: lines up to two empty lines in a row or the end
    of input (Ctrl-D on a terminal), so pasted text with blank lines stays one
    message. None at the end of input with nothing typed."""
    lines, empty = [], 0
    while True:
        try:
            line = input(("... " if lines else "> ") if terminal else "")
        except EOFError:
            break
        if line.strip():
            lines.extend([""] * empty + [line])
            empty = 0
        elif lines:
            empty += 1
            if empty == 2:
                break
    return "\n".join(lines) if lines else None


ROLES = ("system", "developer", "user", "assistant")


def load_session(path: str) -> list:
    """The messages a --session file holds ([] when it does not exist yet)."""
    file = Path(path)
    if not file.exists():
        return []
    try:
        messages = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UsageError(f"--session {path}: cannot read it as a chat ({error})") from None
    if not (isinstance(messages, list) and all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
            for m in messages)):
        raise UsageError(f"--session {path}: not a chat (a JSON list of messages, each a "
                         f"role among {', '.join(ROLES)} and a content string)")
    return messages


def save_session(path: str, messages: list) -> None:
    """Written whole or not at all (a new file renamed over the old)."""
    file = Path(path)
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(messages, ensure_ascii=False, indent=1), encoding="utf-8")
    os.replace(tmp, file)


def cmd_chat(args) -> int:
    """Turns from stdin; the files (--file) open the first user message. With
    --session the chat is read from and saved to a file, so a later run goes on with
    it (and the prefix cache on disk has its KV)."""
    if "-" in (args.file or []):
        raise UsageError("chat reads its messages from stdin: --file - cannot be stdin too")
    documents = {path: read_document(path) for path in args.file or []}
    messages = load_session(args.session) if args.session else []
    if messages and (args.system or documents):
        print(f"warning: --system and --file are ignored: {args.session} already holds the "
              "chat's first messages", file=sys.stderr)
    if not messages:
        messages = system_messages(args.system)
    terminal = sys.stdin.isatty()
    with make_engine(args) as engine:
        if terminal and not args.quiet:
            print("chat with the model: type or paste a message, then two empty lines (or "
                  "Ctrl-D) send it; Ctrl-D on an empty message ends", file=sys.stderr)
        if messages and not args.quiet:
            print(f"continuing the chat in {args.session} ({len(messages)} messages)",
                  file=sys.stderr)
        while True:
            text = read_message(terminal)
            if text is None:
                break
            if not any(message["role"] == "user" for message in messages):
                text = build_messages(documents, text)[-1]["content"]
            messages.append({"role": "user", "content": text})
            try:
                reply = ask(engine, messages, args, indent=None)
            except UsageError as error:  # this message was refused: the chat goes on
                print(f"error: {error}", file=sys.stderr)
                messages.pop()
                continue
            messages.append({"role": "assistant", "content": reply})
            if args.session:
                save_session(args.session, messages)
    return 0


def cmd_bench(args) -> int:
    """A quick TTFT comparison; benchmarks/ttft.py runs the full one."""
    from .benchmarking import ttft_rows, ttft_table

    rows = ttft_rows(args.lengths, args.keeps, args.runs,
                     report=lambda m: print(m, file=sys.stderr, flush=True))
    print(ttft_table(rows))
    return 0


def cmd_eval(args) -> int:
    """A quick accuracy check; benchmarks/quality.py runs the full grid and the peers."""
    from .benchmarking import KINDS, quality_cases, quality_rows, quality_table
    from .loading import load_model

    _, tokenizer = load_model()
    cases = quality_cases(tokenizer, KINDS, args.lengths, args.cases)
    progress = ProgressLine(not args.quiet)
    rows = quality_rows(cases, args.keeps, on_progress=progress)
    progress.end()
    print(quality_table(rows))
    return 0


def cmd_serve(args) -> int:
    """The HTTP server (`integrations/specprefill_server`); runs until SIGINT / SIGTERM."""
    try:
        from specprefill_server import ServerConfig, server
    except ImportError as error:
        raise UsageError(f"serve needs the server extra: pip install "
                         f"'specprefill-engine[server]' ({error})") from None
    def given(*names) -> dict:  # the rest: the settings' own defaults
        return {name: getattr(args, name) for name in names if getattr(args, name) is not None}

    try:
        config = ServerConfig(model_name=args.served_model_name, api_key=args.api_key or None,
                              **given("keepalive", "max_queued", "drain_timeout",
                                      "max_body_bytes", "metadata_lines"))
        engine = make_engine(args, **serve_settings(args))
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        print(f"warning: serving on {args.host} without an API key: anyone who can reach "
              "the port can use the model (set --api-key or SPECPREFILL_API_KEY)",
              file=sys.stderr)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    for name in ("specprefill_server", "specprefill_engine"):  # the engine's warnings too
        served = logging.getLogger(name)
        served.addHandler(handler)
        served.setLevel(args.log_level.upper())
    # a model that fails to load or a port in use: uvicorn logs why and exits with 3
    server(engine, config, args.host, args.port, log_level=args.log_level).run()
    return 0


def serve_settings(args) -> dict:
    """The engine settings serve's own flags give (the rest: the engine's defaults). A
    server probes its draft as it starts, before its port accepts: the probe runs on the
    worker, and lazily every session's first request would wait behind it."""
    return {"draft_check": "load", **{name: getattr(args, name) for name in
            ("max_batch_size", "prefix_cache_bytes", "draft_prefix_cache_bytes")
            if getattr(args, name, None) is not None}}


def server_default(name: str):
    """A server setting's default, for --help: its `ServerConfig`'s (the server extra may
    not be installed)."""
    try:
        from specprefill_server.app import ServerConfig
    except ImportError:
        return "the server's"
    return getattr(ServerConfig, name)


def parser() -> argparse.ArgumentParser:
    models = argparse.ArgumentParser(add_help=False)  # every command that loads an engine
    models.add_argument("--model", help="target model: local path or Hugging Face id (default: bundled demo)")
    models.add_argument("--draft", help="draft model sharing the target's tokenizer (default: bundled demo)")
    models.add_argument("--keep", type=float, help="share of prompt tokens to prefill "
                        f"(default {EngineConfig.keep})")
    models.add_argument("--threshold", type=int, help="use SpecPrefill from this many prompt "
                        f"tokens (default {EngineConfig.threshold})")
    models.add_argument("--num-draft-tokens", type=int, metavar="N",
                        help="speculative decoding: tokens the draft proposes a round for a "
                        "greedy reply decoded alone (the same reply, fewer target forwards; "
                        f"default {EngineConfig.num_draft_tokens}: off)")
    models.add_argument("--kv-bits", type=int, choices=[4, 8],
                        help="quantize the target's KV (running requests' and the prefix "
                        "cache's) to this many bits, as mlx-lm's --kv-bits (default: the "
                        "model's dtype)")
    models.add_argument("--kv-group-size", type=int, help="group size of quantized KV "
                        f"(default {EngineConfig.kv_group_size})")
    models.add_argument("--quantized-kv-start", type=int, metavar="N",
                        help="quantize a request's KV once it holds N entries "
                        f"(default {EngineConfig.quantized_kv_start})")
    models.add_argument("--kv-cache-gb", type=float, metavar="GB",
                        help="memory for running requests' KV and the prefix caches (default: "
                        "what the device can hold, less the weights); a request that cannot "
                        "fit is refused")
    models.add_argument("--disk-cache-gb", type=float, metavar="GB",
                        help="keep prefix caches on disk within this many GB, for later runs "
                        "(default 10 for chat and serve, 0 (off) for the others)")
    common = argparse.ArgumentParser(add_help=False, parents=[models])
    choice = common.add_mutually_exclusive_group()
    choice.add_argument("--specprefill", action="store_true",
                        help="always use SpecPrefill (default: when it is predicted to pay)")
    choice.add_argument("--no-specprefill", action="store_true", help="prefill the whole prompt")
    common.add_argument("--max-tokens", type=int, default=ANSWER_TOKENS,
                        help=f"most tokens in an answer (default {ANSWER_TOKENS})")
    common.add_argument("--json", action="store_true",
                        help="print the result as JSON (chat: one JSON line per answer)")
    common.add_argument("--compare", action="store_true",
                        help="also time a dense prefill of the same prompt")
    common.add_argument("--quiet", action="store_true",
                        help="no progress or summary on stderr (warnings still)")

    top = argparse.ArgumentParser(
        prog="specprefill-engine",
        description="Answer questions about long prompts sooner: a small draft model picks the "
        "tokens that matter and the target prefills only those.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = top.add_subparsers(dest="command", required=True)
    ask = commands.add_parser("ask", parents=[common], help="answer a question about files")
    ask.add_argument("files", nargs="+", help="text files to read (- reads stdin)")
    ask.add_argument("-q", "--question", required=True)
    ask.add_argument("--system", help="a system message before the files and question")
    ask.set_defaults(run=cmd_ask)
    demo = commands.add_parser("demo", parents=[common], help="the main job on a generated document")
    demo.add_argument("--tokens", type=int, default=6000, help="document length (default 6000)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--output", help="where to write the document")
    demo.set_defaults(run=cmd_demo)
    chat = commands.add_parser(
        "chat", parents=[common], help="interactive chat (reuses the prefix cache)",
        description="Chat with the model. A message may span lines (paste freely): two "
        "empty lines in a row, or Ctrl-D, send it; Ctrl-D on an empty message ends. Piped "
        "stdin works the same way.")
    chat.add_argument("--file", action="append", metavar="PATH",
                      help="a text file to open the first message with (repeatable)")
    chat.add_argument("--system", help="a system message")
    chat.add_argument("--session", metavar="PATH", help="a JSON file the chat is saved to "
                      "after every answer; run again with it to go on (its KV comes back from "
                      "the prefix cache on disk)")
    chat.set_defaults(run=cmd_chat)
    bench = commands.add_parser("bench", help="quick time-to-first-token comparison on the demo pair")
    bench.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    bench.add_argument("--keeps", type=float, nargs="+", default=[EngineConfig.keep])
    bench.add_argument("--runs", type=int, default=1)
    bench.set_defaults(run=cmd_bench)
    evaluate = commands.add_parser("eval", help="quick answer-accuracy check on the demo pair")
    evaluate.add_argument("--lengths", type=int, nargs="+", default=[1024])
    evaluate.add_argument("--cases", type=int, default=5, help="cases per task kind and length")
    evaluate.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.3])
    evaluate.add_argument("--quiet", action="store_true", help="no progress on stderr")
    evaluate.set_defaults(run=cmd_eval)
    serve = commands.add_parser("serve", parents=[models],
                                help="OpenAI- and Anthropic-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("SPECPREFILL_API_KEY"),
                       help="require this key (Authorization: Bearer or x-api-key); default: "
                       "$SPECPREFILL_API_KEY")
    serve.add_argument("--served-model-name", help="the model id clients see (default: the "
                       "model's folder name)")
    serve.add_argument("--max-batch-size", type=int, help="streams decoded together "
                       f"(default {EngineConfig.max_batch_size})")
    serve.add_argument("--prefix-cache-bytes", type=int, metavar="BYTES",
                       help="the target's prefix cache in memory, least recently used out "
                       f"(default {EngineConfig.prefix_cache_bytes}; 0: off)")
    serve.add_argument("--draft-prefix-cache-bytes", type=int, metavar="BYTES",
                       help="the draft's prefix cache in memory "
                       f"(default {EngineConfig.draft_prefix_cache_bytes}; 0: off)")
    serve.add_argument("--max-queued", type=int, help="requests allowed to wait beyond the "
                       "batch; more get 429 (default: no bound, they wait)")
    serve.add_argument("--keepalive", type=float, help="seconds between keep-alives while a "
                       f"stream prefills (default {server_default('keepalive')})")
    serve.add_argument("--drain-timeout", type=float, help="at SIGINT/SIGTERM, seconds running "
                       "requests may finish in before they are aborted "
                       f"(default {server_default('drain_timeout')})")
    serve.add_argument("--max-body-bytes", type=int, help="request body limit in bytes "
                       f"(default {server_default('max_body_bytes')})")
    serve.add_argument("--metadata-lines", metavar="REGEX", help="system-prompt lines left "
                       "out of the prompt, as clients' per-request metadata ('' keeps every "
                       f"line; default {server_default('metadata_lines')!r})")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(run=cmd_serve)
    return top


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    keeps = getattr(args, "keeps", None) or [getattr(args, "keep", None)]
    try:
        for keep in keeps:
            if keep is not None:
                check_keep(keep, "--keep")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if getattr(args, "max_tokens", 1) < 1:
        print("error: --max-tokens must be at least 1", file=sys.stderr)
        return 2
    if getattr(args, "tokens", DEMO_MIN_TOKENS) < DEMO_MIN_TOKENS:
        print(f"error: --tokens must be at least {DEMO_MIN_TOKENS}", file=sys.stderr)
        return 2
    from .loading import ModelLoadError

    try:
        return args.run(args)
    except (UsageError, ModelLoadError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # not the user's mistake: say what failed, exit 1
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
