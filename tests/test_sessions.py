"""Many agent sessions on one server (#62), the CPU smoke: `benchmarks/sessions.py`
replays three concurrent agent sessions (Claude Code over the Anthropic API, Codex over
Responses, OpenCode over chat completions: their captured system prompts and tools cut
short) against a `specprefill-engine serve` it starts (dense: greedy answers must not
depend on the load), with a retried request, a cancelled stream, a client that leaves
mid-stream, parallel tool calls in the history, a required tool call on each last turn
and a changing header line at the end of one session's system prompt; then replays
every session alone on a fresh server. Every request must end in a well-formed reply or
a clear 4xx, every tool call parse, no reply after a tool result be a stray template
token, every answer equal the same request's alone, and the server's log hold no
traceback. The generator's own checks are tested on replies that break them."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import sessions  # noqa: E402

SMOKE = ["--small", "--sessions", "3", "--servers", "serve-dense", "--check-solo",
         "--system-tokens", "400", "--tool-result-tokens", "40", "160", "--reply-tokens",
         "16", "24", "--tool-seconds", "0.1", "--stagger", "0.2",
         "--prefix-cache-bytes", "40000000", "--disk-cache-gb", "0.05"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sessions")
    result = sessions.main(SMOKE + ["--workdir", str(folder), "--json", str(folder / "r.json")])
    (run,) = result["runs"]
    return run, result["solo"]["serve-dense"], json.loads((folder / "r.json").read_text())


def test_every_request_ends_well(smoke):
    run, _, _ = smoke
    records = run["records"]
    attempts = {r["attempt"] for r in records}
    assert {"full", "retry", "cancel", "disconnect"} <= attempts  # the events happened
    assert {r["api"] for r in records} == {"openai", "anthropic", "responses"}
    for r in records:
        assert r["status"] == 200 or r.get("clear_4xx"), r
        assert not r["failures"], r
        if r["attempt"] in ("full", "retry"):
            assert r["completion_tokens"] and r["prompt_tokens"] == r["served_ids"], r
            assert r["cached_tokens"] is not None, r  # every API reports its cache reads
    assert run["summary"]["failures"] == 0 and run["summary"]["retry_differs"] == 0
    opened = {r.get("first_kind") for r in records if r["attempt"] == "full"}
    assert opened <= {"text", "call"} and run["summary"]["text_ttft_p99"] is not None
    timed = {r["api"] for r in records if r.get("server_timings")}
    assert timed == {"openai", "anthropic", "responses"}  # serve's timings, on every API


def test_saved_runs_summarize_again_as_they_were(smoke, tmp_path):
    run, _, saved = smoke
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(saved))
    (again,) = sessions.main(["--summarize", str(path)])["runs"]
    assert again["summary"] == run["summary"]


def test_paired_ttft_counts_only_requests_both_answered_with_text(smoke):
    run, solo, _ = smoke
    loaded, alone = sessions.clean_text_ttft(run["records"]), sessions.clean_text_ttft(
        solo["records"])
    both = loaded.keys() & alone.keys()
    assert both  # the same sessions, the same (session, turn, attempt) keys
    other = dict(solo, sessions=run["sessions"], repeat=run.get("repeat", 0), server="alone")
    line = sessions.paired([run, other]).splitlines()[-1]
    assert f"| {len(both)} |" in line
    # a request the other server answered with a call, or failed, is not compared
    first = sorted(both)[0]
    changed = [dict(r, first_kind="call") if (r["session"], r["turn"], r["attempt"]) == first
               else r for r in solo["records"]]
    line = sessions.paired([run, dict(other, records=changed)]).splitlines()[-1]
    assert f"| {len(both) - 1} |" in line


def test_tool_calls_parse_and_no_stray_token_after_a_tool_result(smoke):
    run, _, _ = smoke
    done = [r for r in run["records"] if r["attempt"] in ("full", "retry")]
    calls = [c for r in done for c in r["tool_calls"]]
    assert len(calls) >= 3  # each session's last turn requires one, on each API
    tools = {s: set() for s in range(3)}
    for session in sessions.build_sessions(sessions.parse(SMOKE), 3):
        tools[session["index"]] = {t["function"]["name"] for t in session["tools"]}
    for r in done:
        for call in r["tool_calls"]:
            assert isinstance(json.loads(call["arguments"]), dict)
            assert call["name"] in tools[r["session"]]
        if r["after_tool"]:
            text = r["text"].strip()
            assert not (text and sessions.MARKERS.match(text)), r
    assert sum(r["after_tool"] for r in done) >= 6


def test_dense_sessions_answer_as_alone(smoke):
    run, solo, _ = smoke
    assert solo["summary"]["failures"] == 0 and solo["tracebacks"] == 0
    full = sum(r["attempt"] == "full" for r in run["records"])
    assert run["solo"]["checked"] == full >= 9
    assert run["solo"]["differ"] == 0, run["solo"]["cases"]


def test_the_servers_log_has_no_traceback(smoke):
    run, _, saved = smoke
    assert run["tracebacks"] == 0, run["log_tail"]
    assert run["peak_rss"] > 0 and saved["runs"][0]["summary"] == run["summary"]


def test_later_turns_read_what_they_share_from_the_cache(smoke):
    """Each later request reads from the cache at least 90% of the prompt it shares with
    the session's previous request, and in the session whose system prompt ends with a
    line that changes on every request, 90% of the previous prompt itself (serve leaves
    such `x-name: value` lines out; on b8dc896 the shared prefix ended at that line)."""
    run, _, _ = smoke
    summary = run["summary"]
    assert summary["later_turn_cached_share_min"] >= 0.9, summary
    assert summary["header_later_turn_cached_share_min"] >= 0.9, summary
    assert summary["header_later_turn_cached_of_previous_median"] >= 0.9, summary


@pytest.mark.parametrize("text, calls, done, expected", [
    ("</tool_response>", {}, True, "stray template token after a tool result"),
    ("<|im_end|>", {}, True, "stray template token after a tool result"),
    ("ok <|end|> more", {}, True, "special token in the text"),
    ('<tool_call>\n{"name": "read"}', {}, True, "tool call left in the text"),
    ("", {0: {"name": "read", "arguments": "{path: x"}}, True, "unparseable tool call"),
    ("", {0: {"name": "nope", "arguments": "{}"}}, True, "tool call of an undeclared tool"),
    ("fine", {}, False, "malformed: the stream ended without its final event"),
])
def test_the_checks_catch_broken_replies(text, calls, done, expected):
    reply = sessions.Reply("openai")
    reply.text, reply.calls, reply.done = [text], calls, done
    reply.usage = {"completion": 3}
    found = sessions.problems(reply, {"read"}, after_tool=True)
    assert any(f.startswith(expected) for f in found), found
    fine = sessions.Reply("openai")
    fine.text, fine.done, fine.usage = ["Let me read it."], True, {"completion": 4}
    fine.calls = {0: {"name": "read", "arguments": '{"path": "a.py"}'}}
    assert sessions.problems(fine, {"read"}, after_tool=True) == []


def test_a_4xx_is_clear_only_where_the_request_exceeds_a_budget():
    """The replay sends valid requests: a 400 from an internal error (an llguidance that
    took one end token answered every tool request so) is a failure, not a clear 4xx."""
    budget = json.dumps({"error": {"message": "this request needs 3.100 GB of KV memory",
                                   "code": "memory_budget_exceeded"}})
    anthropic = json.dumps({"type": "error", "error": {
        "type": "invalid_request_error", "message": "this request needs 3.100 GB of KV memory"}})
    context = json.dumps({"error": {"message": "2048 + max_tokens must fit the context of 2048"}})
    internal = json.dumps({"error": {"message": "argument 'eos_token': 'list' object "
                                     "cannot be interpreted as an integer"}})
    assert sessions.is_clear_4xx(400, budget) and sessions.is_clear_4xx(400, anthropic)
    assert sessions.is_clear_4xx(400, context)
    assert not sessions.is_clear_4xx(400, internal)
    assert not sessions.is_clear_4xx(500, budget) and not sessions.is_clear_4xx(400, "oops")
    assert not sessions.is_clear_4xx(400, "null")
