"""Long-context RAG: gather many files into one prompt, answer with SpecPrefill."""

import asyncio
import sys
import tempfile
from pathlib import Path

from specprefill_engine import Engine
from specprefill_engine.demo_tasks import make_case


def gather(folder: Path, limit_chars: int = 40_000) -> str:
    """Concatenate a folder's text files, each under its name, up to a size."""
    parts, size = [], 0
    for path in sorted(folder.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if size + len(text) > limit_chars:
            break
        parts.append(f"# file: {path.name}\n{text}")
        size += len(text)
    return "\n".join(parts)


async def main(folder: Path) -> None:
    async with Engine(keep=0.2) as engine:
        # a corpus of three files; one holds the fact we ask about
        for seed, kind in enumerate(["passkey", "assignment", "registry"]):
            case = make_case(engine.tokenizer, seed, kind, 1500)
            (folder / f"module_{seed}.py").write_text(case.context)
        context = gather(folder)
        result = await engine.generate(
            [{"role": "user", "content": f"{context}\n{case.question}"}], max_tokens=12
        )
        report = result.specprefill
        print(f"question: {case.question}\nanswer: {result.text.strip()} (expected {case.answer})")
        print(f"prompt {report.total_tokens} tokens, kept {report.kept_tokens}, "
              f"TTFT {result.timings.time_to_first_token:.2f}s")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp)))
