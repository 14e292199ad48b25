"""A logging proxy: forwards every request to a server and saves each request body.

    python tests/clients/capture.py --upstream http://127.0.0.1:8000 --port 8001 --out DIR

Each request is written as DIR/NNN-<path>.json: `{"method", "path", "headers",
"body", "status"}`, credentials left out (`authorization`, `x-api-key`). Responses,
streams included, pass through unchanged. This is how `tests/fixtures/` was captured
from the real CLIs (see docs/server.md, "Which client, which model").
"""

import argparse
import itertools
import json
import re
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

SECRET = {"authorization", "x-api-key", "cookie"}
HOP = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


def make_app(upstream: str, out: Path) -> Starlette:
    out.mkdir(parents=True, exist_ok=True)
    numbers = itertools.count(len(list(out.glob("*.json"))))
    client = httpx.AsyncClient(base_url=upstream, timeout=None)

    async def forward(request: Request):
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        headers = {k: v for k, v in request.headers.items() if k not in HOP}
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        sent = client.build_request(request.method, path, content=raw, headers=headers)
        answer = await client.send(sent, stream=True)
        name = re.sub(r"[^a-z0-9]+", "-", request.url.path.lower()).strip("-")
        record = {"method": request.method, "path": path,
                  "headers": {k: v for k, v in headers.items() if k not in SECRET},
                  "body": body, "status": answer.status_code}
        (out / f"{next(numbers):03d}-{name}.json").write_text(json.dumps(record, indent=1))
        kept = {k: v for k, v in answer.headers.items() if k not in HOP | {"content-encoding"}}
        return StreamingResponse(answer.aiter_raw(), answer.status_code, kept,
                                 background=BackgroundTask(answer.aclose))

    return Starlette(routes=[Route("/{path:path}", forward, methods=[
        "GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    uvicorn.run(make_app(args.upstream, args.out), host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
