"""`specprefill-engine chat` as a user runs it, with stdin piped in: multi-line messages,
--file / --system, --json, --compare, and a summary whose numbers agree."""

import json
import re

from specprefill_engine.demo_tasks import make_case
from test_cli import cli


def test_multi_line_messages_are_one_turn_each(demo_pair):
    _, _, tokenizer = demo_pair
    first = "line one\nline two\n\nline four after a blank line"  # pasted, a blank inside
    stdin = f"\n{first}\n\n\nsecond message\n"  # two empty lines send; the end of input too
    run = cli("chat", "--json", "--max-tokens", "4", input=stdin)
    assert run.returncode == 0, run.stderr
    answers = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(answers) == 2  # --json: one JSON line per answer
    turn = [{"role": "user", "content": first}]
    assert answers[0]["usage"]["prompt_tokens"] == len(
        tokenizer.apply_chat_template(turn, add_generation_prompt=True))
    turn += [{"role": "assistant", "content": answers[0]["answer"]},
             {"role": "user", "content": "second message"}]
    assert answers[1]["usage"]["prompt_tokens"] == len(
        tokenizer.apply_chat_template(turn, add_generation_prompt=True))
    assert answers[1]["usage"]["cached_tokens"] > 0  # the first turn's prefix was reused


def test_file_system_and_compare(tmp_path, demo_pair):
    _, _, tokenizer = demo_pair
    case = make_case(tokenizer, 3, "assignment", 1500)
    document = tmp_path / "module.py"
    document.write_text(case.context)
    run = cli("chat", "--file", str(document), "--system", "Answer with the value.",
              "--json", "--compare", input=case.question + "\n")
    assert run.returncode == 0, run.stderr
    (answer,) = [json.loads(line) for line in run.stdout.splitlines()]
    assert answer["answer"].strip() == case.answer
    messages = [{"role": "system", "content": "Answer with the value."},
                {"role": "user", "content": f"# file: {document}\n{case.context}\n{case.question}"}]
    assert answer["usage"]["prompt_tokens"] == len(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    assert answer["dense_time_to_first_token"] > 0  # --compare ran, not ignored


def test_the_summary_counts_the_cached_prefix_it_names():
    run = cli("chat", "--max-tokens", "4",
              input="What is the secret passkey?\n\n\nTell me the passkey again, please.\n")
    assert run.returncode == 0, run.stderr
    second = [line for line in run.stderr.splitlines() if line.startswith("prompt ")][1]
    named = re.search(r"after a cached prefix of (\d+)", second)
    counted = re.search(r"(\d+) from the prefix cache", second)
    assert named and counted and named.group(1) == counted.group(1), second
