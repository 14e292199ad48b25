"""`specprefill-engine`: ask questions about long files, chat, demo, bench, eval, serve."""

import argparse
import json
import logging
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

EXAMPLES = """examples:
  specprefill-engine demo                      # the main job on a generated document
  specprefill-engine ask notes.py --question "What is the secret passkey?"
  specprefill-engine ask a.py b.py -q "What is REGISTRY[\\"412-cobalt\\"]?" --compare
  specprefill-engine chat
  specprefill-engine bench                     # quick TTFT: dense vs SpecPrefill vs mlx-lm
  specprefill-engine eval                      # quick accuracy: dense vs SpecPrefill vs random
  specprefill-engine serve --port 8000         # OpenAI- and Anthropic-compatible HTTP server
"""


class UsageError(Exception):
    """A mistake the user can fix; printed as one line, exit status 2."""


def read_document(path: str) -> str:
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"no such file: {path}")
    data = file.read_bytes()
    if b"\0" in data:
        raise UsageError(f"{path} looks like a binary file; give text files")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text") from None


def build_messages(documents: dict, question: str) -> list:
    """All files, each under its name, then the question, in one user turn."""
    if not question or not question.strip():
        raise UsageError("the question is empty")
    body = "\n".join(f"# file: {name}\n{text}" for name, text in documents.items())
    return [{"role": "user", "content": f"{body}\n{question.strip()}"}]


class ProgressLine:
    """A one-line progress bar on a terminal's stderr; silent when piped."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __call__(self, progress) -> None:
        if not self.enabled:
            return
        width = 30
        filled = int(width * progress.done / max(progress.total, 1))
        bar = "#" * filled + "-" * (width - filled)
        sys.stderr.write(f"\r{progress.phase:>8} [{bar}] {progress.done}/{progress.total}")
        sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 70 + "\r")
            sys.stderr.flush()


def make_engine(args):
    from .engine import Engine

    return Engine(model=args.model, draft=args.draft, keep=args.keep, threshold=args.threshold)


def summary(result, dense_ttft=None) -> str:
    report, timings, usage = result.specprefill, result.timings, result.usage
    kept = f"kept {report.kept_tokens}/{report.total_tokens}" if report.engaged else f"dense ({report.reason})"
    line = (
        f"prompt {usage.prompt_tokens} tokens, {kept}, TTFT {timings.time_to_first_token:.2f}s, "
        f"decode {timings.decode_tokens_per_s:.1f} tok/s"
    )
    if dense_ttft is not None:
        line += f", dense TTFT {dense_ttft:.2f}s ({dense_ttft / timings.time_to_first_token:.1f}x)"
    return line


def answer(engine, messages, args) -> tuple:
    """Stream one answer to stdout; return (text, final chunk)."""
    progress = ProgressLine(sys.stderr.isatty() and not args.json)
    parts, final = [], None
    for chunk in engine.stream_sync(
        messages, max_tokens=args.max_tokens,
        specprefill=False if args.no_specprefill else None, on_progress=progress,
    ):
        if not parts:
            progress.clear()
        parts.append(chunk.text)
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        final = chunk
    return "".join(parts), final


def ask(engine, messages, args, expected=None) -> int:
    """Answer, then print a one-line summary (or JSON)."""
    try:
        text, final = answer(engine, messages, args)
        dense_ttft, dense_cached = None, None
        if args.compare:  # cold: the answer's own prefill may sit in the prefix cache
            dense = engine.generate_sync(messages, max_tokens=1, specprefill=False,
                                         cache_prompt=False)
            dense_ttft = dense.timings.time_to_first_token
            dense_cached = dense.usage.cached_tokens
    except (ValueError, TypeError) as error:  # the request was refused before it ran
        raise UsageError(str(error)) from None
    if args.json:
        payload = {
            "answer": text,
            "finish_reason": final.finish_reason,
            "usage": asdict(final.usage),
            "timings": asdict(final.timings),
            "specprefill": asdict(final.specprefill),
            "dense_time_to_first_token": dense_ttft,
            "dense_cached_tokens": dense_cached,
            "ranks": engine.info.ranks,
        }
        if expected is not None:
            payload["expected"] = expected
        print(json.dumps(payload, indent=2))
    else:
        print()
        print(summary(final, dense_ttft), file=sys.stderr)
        if expected is not None:
            verdict = "correct" if text.strip() == expected else "WRONG"
            print(f"expected {expected}: {verdict}", file=sys.stderr)
    return 0


def cmd_ask(args) -> int:
    documents = {path: read_document(path) for path in args.files}
    messages = build_messages(documents, args.question)
    with make_engine(args) as engine:
        return ask(engine, messages, args)


def cmd_demo(args) -> int:
    """Generate a long document with facts hidden in it, then ask for one of them."""
    from .demo_tasks import make_case

    with make_engine(args) as engine:
        case = make_case(engine.tokenizer, args.seed, "registry", args.tokens)
        path = Path(args.output or Path(tempfile.gettempdir()) / "specprefill-demo.py")
        path.write_text(case.context)
        if not args.json:
            print(f"document: {path} (about {args.tokens} tokens of Python source with "
                  f"facts hidden in it)\nquestion: {case.question}", file=sys.stderr)
        return ask(engine, build_messages({path.name: case.context}, case.question), args,
                   expected=case.answer)


def cmd_chat(args) -> int:
    messages = []
    with make_engine(args) as engine:
        print("chat with the model; an empty line or Ctrl-D ends", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            text, final = answer(engine, messages, args)
            print()
            print(f"{summary(final)}, cached {final.usage.cached_tokens}", file=sys.stderr)
            messages.append({"role": "assistant", "content": text})
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
    rows = quality_rows(cases, args.keeps, report=lambda m: print(m, file=sys.stderr, flush=True))
    print(quality_table(rows))
    return 0


def cmd_serve(args) -> int:
    """The HTTP server (`integrations/specprefill_server`); runs until SIGINT / SIGTERM."""
    try:
        from specprefill_server import ServerConfig, server
    except ImportError as error:
        raise UsageError(f"serve needs the server extra: pip install "
                         f"'specprefill-engine[server]' ({error})") from None
    from .engine import Engine

    given = {name: getattr(args, name) for name in ("keepalive", "max_queued", "drain_timeout",
                                                    "max_body_bytes", "max_batch_size")
             if getattr(args, name) is not None}  # the rest: the settings' own defaults
    batch = {"max_batch_size": given.pop("max_batch_size")} if "max_batch_size" in given else {}
    try:
        config = ServerConfig(model_name=args.served_model_name, api_key=args.api_key or None,
                              **given)
        engine = Engine(model=args.model, draft=args.draft, keep=args.keep,
                        threshold=args.threshold, **batch)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        print(f"warning: serving on {args.host} without an API key: anyone who can reach "
              "the port can use the model (set --api-key or SPECPREFILL_API_KEY)",
              file=sys.stderr)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    served = logging.getLogger("specprefill_server")
    served.addHandler(handler)
    served.setLevel(args.log_level.upper())
    # a model that fails to load or a port in use: uvicorn logs why and exits with 3
    server(engine, config, args.host, args.port, log_level=args.log_level).run()
    return 0


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", help="target model: local path or Hugging Face id (default: bundled demo)")
    common.add_argument("--draft", help="draft model sharing the target's tokenizer (default: bundled demo)")
    common.add_argument("--keep", type=float, default=0.3, help="share of prompt tokens to prefill (default 0.3)")
    common.add_argument("--threshold", type=int, default=1024, help="use SpecPrefill from this many prompt tokens")
    common.add_argument("--no-specprefill", action="store_true", help="prefill the whole prompt")
    common.add_argument("--max-tokens", type=int, default=64)
    common.add_argument("--json", action="store_true", help="print the result as JSON")
    common.add_argument("--compare", action="store_true", help="also time a dense prefill")

    top = argparse.ArgumentParser(
        prog="specprefill-engine",
        description="Answer questions about long prompts sooner: a small draft model picks the "
        "tokens that matter and the target prefills only those.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = top.add_subparsers(dest="command", required=True)
    ask = commands.add_parser("ask", parents=[common], help="answer a question about files")
    ask.add_argument("files", nargs="+", help="text files to read")
    ask.add_argument("-q", "--question", required=True)
    ask.set_defaults(run=cmd_ask)
    demo = commands.add_parser("demo", parents=[common], help="the main job on a generated document")
    demo.add_argument("--tokens", type=int, default=6000, help="document length (default 6000)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--output", help="where to write the document")
    demo.set_defaults(run=cmd_demo)
    chat = commands.add_parser("chat", parents=[common], help="interactive chat (reuses the prefix cache)")
    chat.set_defaults(run=cmd_chat)
    bench = commands.add_parser("bench", help="quick time-to-first-token comparison on the demo pair")
    bench.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    bench.add_argument("--keeps", type=float, nargs="+", default=[0.3])
    bench.add_argument("--runs", type=int, default=1)
    bench.set_defaults(run=cmd_bench)
    evaluate = commands.add_parser("eval", help="quick answer-accuracy check on the demo pair")
    evaluate.add_argument("--lengths", type=int, nargs="+", default=[1024])
    evaluate.add_argument("--cases", type=int, default=5, help="cases per task kind and length")
    evaluate.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.3])
    evaluate.set_defaults(run=cmd_eval)
    serve = commands.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server")
    for name in ("--model", "--draft", "--keep", "--threshold"):
        serve._add_action(next(a for a in common._actions if name in a.option_strings))
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("SPECPREFILL_API_KEY"),
                       help="require this key (Authorization: Bearer or x-api-key); default: "
                       "$SPECPREFILL_API_KEY")
    serve.add_argument("--served-model-name", help="the model id clients see (default: the "
                       "model's folder name)")
    serve.add_argument("--max-batch-size", type=int, help="streams decoded together (default 32)")
    serve.add_argument("--max-queued", type=int, help="requests allowed to wait beyond the "
                       "batch; more get 429 (default: no bound, they wait)")
    serve.add_argument("--keepalive", type=float,
                       help="seconds between keep-alives while a stream prefills (default 5)")
    serve.add_argument("--drain-timeout", type=float, help="at SIGINT/SIGTERM, seconds running "
                       "requests may finish in before they are aborted (default 30)")
    serve.add_argument("--max-body-bytes", type=int, help="request body limit (default 32 MiB)")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(run=cmd_serve)
    return top


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    keeps = getattr(args, "keeps", None) or [getattr(args, "keep", 0.3)]
    if not all(0 < keep <= 1 for keep in keeps):
        print("error: --keep must be in (0, 1]", file=sys.stderr)
        return 2
    if getattr(args, "max_tokens", 1) < 1:
        print("error: --max-tokens must be at least 1", file=sys.stderr)
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
