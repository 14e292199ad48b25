"""Run the app under uvicorn, with a graceful drain at SIGINT / SIGTERM.

uvicorn stops accepting connections and waits for the open ones; before that the
drain refuses new requests (503) and, after `drain_timeout` seconds, aborts those
still running, whose streams then end with an error event. The app's lifespan then
shuts the engine down, and uvicorn re-raises the signal (the usual exit status).
"""

import asyncio
import logging
from typing import Optional

import uvicorn

from specprefill_engine import Engine

from .app import ServerConfig, create_app

logger = logging.getLogger(__name__)
DEFAULT_HOST = "127.0.0.1"  # loopback unless told otherwise
DEFAULT_PORT = 8000
AFTER_DRAIN_S = 5.0  # beyond the drain: how long aborted streams get to send their last event


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.state = state  # the app's ServerState

    async def shutdown(self, sockets=None) -> None:
        state = self.state
        logger.info("draining %d request(s) for up to %.0f s", len(state.gate.active),
                    state.config.drain_timeout)
        drain = asyncio.ensure_future(state.gate.drain(state.config.drain_timeout))
        await super().shutdown(sockets)
        await drain


def server(engine: Engine, config: Optional[ServerConfig] = None, host: str = DEFAULT_HOST,
           port: int = DEFAULT_PORT, **uvicorn_options) -> DrainingServer:
    """A uvicorn server for `engine` (call `.run()`, or `await .serve(sockets)`)."""
    config = config or ServerConfig()
    app = create_app(engine, config)
    options = dict(host=host, port=port, lifespan="on",
                   timeout_graceful_shutdown=config.drain_timeout + AFTER_DRAIN_S)
    options.update(uvicorn_options)
    return DrainingServer(uvicorn.Config(app, **options), app.state.server)
