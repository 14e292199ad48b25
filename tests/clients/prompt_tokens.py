"""How many prompt tokens each agent CLI's captured requests take in a model's tokenizer
(`tests/fixtures/clients/`): which model's context fits which client.

    python tests/clients/prompt_tokens.py                 # the demo pair's tokenizer
    python tests/clients/prompt_tokens.py --model PATH    # any model the engine loads

Each body is rendered exactly as the server renders it (the same translation of
messages, tools and template settings), without generating.
"""

import argparse
import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

from specprefill_engine import Engine
from specprefill_server.anthropic_api import MessagesRequest, messages_call
from specprefill_server.openai_api import ChatRequest, chat_call
from specprefill_server.responses_api import ResponsesRequest, chat_request

FIXTURES = Path(__file__).parent.parent / "fixtures" / "clients"


async def prompt_tokens(state, path: str, body: dict) -> int:
    if path == "/v1/messages":
        call = await messages_call(state, MessagesRequest.model_validate(body))
    elif path == "/v1/responses":
        call = await chat_call(state, chat_request(ResponsesRequest.model_validate(body))[0])
    else:
        call = await chat_call(state, ChatRequest.model_validate(body))
    return int(call.prompt.tokens.size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled demo target")
    args = parser.parse_args()
    engine = Engine(model=args.model, draft=None)
    engine.start_sync()
    state = SimpleNamespace(engine=engine)
    print(f"context: {engine.info.context_length} tokens")
    for folder in sorted(p for p in FIXTURES.iterdir() if p.is_dir()):
        for file in sorted(folder.glob("*.json")):
            record = json.loads(file.read_text())
            path = record["path"].split("?")[0]
            if path not in ("/v1/messages", "/v1/responses", "/v1/chat/completions"):
                continue
            body = record["body"]
            tokens = asyncio.run(prompt_tokens(state, path, body))
            print(f"{folder.name:18} {file.name:28} {tokens:6d} prompt tokens, "
                  f"{len(body.get('tools') or []):2d} tools")
    engine.shutdown_sync()


if __name__ == "__main__":
    main()
