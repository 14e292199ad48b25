"""An async service: concurrent requests, streaming, and cancellation by timeout."""

import asyncio

from specprefill_engine import Engine
from specprefill_engine.demo_tasks import make_case


async def main() -> None:
    async with Engine() as engine:
        case = make_case(engine.tokenizer, seed=7, kind="passkey", n_tokens=3000)

        result = await engine.generate(case.messages, max_tokens=12)
        report = result.specprefill
        print(f"generate: {result.text!r} (expected {case.answer}); "
              f"kept {report.kept_tokens}/{report.total_tokens}, "
              f"TTFT {result.timings.time_to_first_token:.2f}s")

        print("stream: ", end="")
        async for chunk in engine.stream(case.messages, max_tokens=12):
            print(chunk.text, end="", flush=True)
        print(f"  [{chunk.finish_reason}]")

        try:  # a caller that gives up: the engine aborts the request within a chunk
            await asyncio.wait_for(engine.generate(case.messages, specprefill=False), 0.5)
        except asyncio.TimeoutError:
            print("timeout: request aborted, engine still serving")
        again = await engine.generate("def main():", max_tokens=8)
        print(f"next request: {again.finish_reason}")


if __name__ == "__main__":
    asyncio.run(main())
