"""Each example runs offline on the demo pair and prints what it promises."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize(
    "script, expected",
    [
        ("async_app.py", ["generate:", "stream:", "timeout: request aborted", "next request:"]),
        ("langchain_chain.py", ["chain answer:", "tool calls:"]),
        ("rag_pipeline.py", ["question:", "answer:", "kept"]),
        ("streaming_agent.py", ["tool call: get_weather(", "tool result: It is sunny in",
                                "final: "]),
    ],
)
def test_example_runs(script, expected):
    run = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    for text in expected:
        assert text in run.stdout
    if "answer:" in run.stdout:
        line = next(l for l in run.stdout.splitlines() if "answer:" in l)
        got, _, rest = line.partition("(expected ")
        assert rest.rstrip(")") in got  # the right answer
