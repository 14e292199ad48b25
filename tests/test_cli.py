"""The command line, run as a user runs it (a subprocess)."""

import json
import re
import subprocess
import sys

import pytest

from specprefill_engine.cli import main, parser
from specprefill_engine.demo_tasks import make_case


def cli(*args, timeout=300, input=None):
    return subprocess.run(
        [sys.executable, "-m", "specprefill_engine.cli", *args],
        capture_output=True, text=True, timeout=timeout, input=input,
    )


def test_demo_prints_the_right_answer():
    run = cli("demo", "--tokens", "3000", "--json")
    assert run.returncode == 0, run.stderr
    payload = json.loads(run.stdout)
    assert payload["answer"].strip() == payload["expected"]
    assert payload["specprefill"]["engaged"]
    assert "Traceback" not in run.stderr


def test_ask_streams_the_answer_and_a_summary(tmp_path, demo_pair):
    _, _, tokenizer = demo_pair
    case = make_case(tokenizer, 3, "assignment", 1500)
    document = tmp_path / "module.py"
    document.write_text(case.context)
    run = cli("ask", str(document), "--question", case.question, "--max-tokens", "12")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == case.answer
    assert "prompt" in run.stderr and "TTFT" in run.stderr and "\r" not in run.stderr


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda p: ["ask", str(p / "missing.txt"), "-q", "why?"], "no such file"),
        (lambda p: ["ask", str(p / "blob.bin"), "-q", "why?"], "binary"),
        (lambda p: ["ask", str(p / "doc.txt"), "-q", "  "], "question is empty"),
        (lambda p: ["ask", str(p / "doc.txt"), "-q", "why?", "--model", str(p / "nope")], "does not exist"),
        (lambda p: ["ask", str(p / "huge.txt"), "-q", "why?"], "longer than the model's context"),
        (lambda p: ["ask", str(p / "doc.txt"), "-q", "why?", "--keep", "2"], "--keep"),
        (lambda p: ["ask", str(p), "-q", "why?"], "is a directory"),
        (lambda p: ["demo", "--tokens", "-5"], "--tokens must be at least"),
    ],
)
def test_user_errors_print_one_line_and_exit_nonzero(tmp_path, capsys, make_args, message):
    """`main` as the console script calls it, in this process (an interpreter start for
    each one-line error would take most of the test's time)."""
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "doc.txt").write_text("x = 1\n")
    (tmp_path / "huge.txt").write_text("1 2 3 4 5 6 7 8 9 0\n" * 2000)
    code = main(make_args(tmp_path))
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_bench_and_eval_run_quick_versions():
    bench = cli("bench", "--lengths", "256", "--keeps", "0.3")
    assert bench.returncode == 0, bench.stderr
    assert "engine SpecPrefill keep 0.3" in bench.stdout and "mlx-lm stream_generate" in bench.stdout
    evaluate = cli("eval", "--lengths", "512", "--cases", "1", "--keeps", "0.3")
    assert evaluate.returncode == 0, evaluate.stderr
    assert "specprefill@0.3" in evaluate.stdout and "random@0.3" in evaluate.stdout
    assert re.search(r"^eval: (\d+)/\1 tokens \(", evaluate.stderr, re.M), evaluate.stderr


def test_piped_progress_in_tokens_per_phase_and_the_cut_answer():
    run = cli("demo", "--tokens", "1200", "--specprefill", "--compare", "--max-tokens", "2")
    assert run.returncode == 0, run.stderr
    err = run.stderr
    prompt, kept = map(int, re.search(r"prompt (\d+) tokens, kept (\d+)/", err).groups())
    assert re.search(rf"^scoring: {prompt}/{prompt} tokens \(", err, re.M), err  # the draft
    assert re.search(rf"^prefill: {kept}/{kept} tokens \(", err, re.M), err  # the target's
    assert re.search(rf"^dense prefill: {prompt}/{prompt} tokens \(", err, re.M), err
    assert "\r" not in err  # plain lines when stderr is not a terminal
    assert "stopped at --max-tokens 2; raise it" in err
    assert len(run.stdout.strip()) == 2  # the cut answer: two digits


def test_a_dense_prompt_with_speculation_shows_the_drafts_prefill_once(demo_pair):
    """The draft computing a dense prompt's KV for speculative decoding is its own phase,
    not "scoring", and a phase's last line is written once."""
    case = make_case(demo_pair[2], 6, "passkey", 900)  # below the threshold: dense
    run = cli("ask", "-", "-q", case.question, "--num-draft-tokens", "2", "--max-tokens", "4",
              "--json", input=case.context)
    assert run.returncode == 0, run.stderr
    payload = json.loads(run.stdout)
    prompt = payload["usage"]["prompt_tokens"]
    assert not payload["specprefill"]["engaged"] and payload["specprefill"]["speculative"]
    assert "scoring:" not in run.stderr
    assert len(re.findall(rf"^draft prefill: {prompt}/{prompt} tokens \(", run.stderr,
                          re.M)) == 1, run.stderr
    assert len(re.findall(rf"^prefill: {prompt}/{prompt} tokens \(", run.stderr, re.M)) == 1


def test_quiet_leaves_only_what_the_user_must_know(tmp_path):
    assert parser().parse_args(["ask", "f.txt", "-q", "why?"]).max_tokens == 512
    (tmp_path / "doc.txt").write_text("x = 1\n")
    run = cli("ask", str(tmp_path / "doc.txt"), "-q", "What is x?", "--max-tokens", "1",
              "--quiet")
    assert run.returncode == 0, run.stderr
    assert run.stderr.strip().splitlines() == [
        "stopped at --max-tokens 1; raise it for a longer answer"]


def test_ask_reads_stdin_and_can_force_specprefill(demo_pair):
    _, _, tokenizer = demo_pair
    case = make_case(tokenizer, 5, "passkey", 600)  # below the threshold: the policy says dense
    run = cli("ask", "-", "-q", case.question, "--specprefill", "--json", input=case.context)
    assert run.returncode == 0, run.stderr
    payload = json.loads(run.stdout)
    assert payload["specprefill"]["engaged"] and payload["specprefill"]["reason"] == "requested"
    assert payload["usage"]["prompt_tokens"] > 500  # the document came through stdin


def test_serve_takes_the_memory_budgets():
    """serve's --prefix-cache-bytes, --draft-prefix-cache-bytes and --kv-cache-gb reach
    the engine (a server under many sessions needs budgets below their KV)."""
    from specprefill_engine.cli import make_engine, serve_settings

    args = parser().parse_args(["serve", "--prefix-cache-bytes", "1000000",
                                "--draft-prefix-cache-bytes", "0", "--kv-cache-gb", "0.002",
                                "--disk-cache-gb", "0.5"])
    config = make_engine(args, **serve_settings(args)).config
    assert (config.prefix_cache_bytes, config.draft_prefix_cache_bytes,
            config.kv_cache_bytes) == (1000000, 0, 2000000)
    assert config.prefix_cache_disk_bytes == 500_000_000
    default = make_engine(parser().parse_args(["serve"]), **serve_settings(
        parser().parse_args(["serve"]))).config
    assert default.prefix_cache_bytes == 8 << 30 and default.kv_cache_bytes is None
