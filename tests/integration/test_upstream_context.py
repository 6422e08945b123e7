"""The context an upstream says it serves, asked whenever it comes up: vLLM's ``/v1/models``,
llama-server's ``/props``, else the one given (``--context-tokens``). A small aiohttp server
plays each upstream."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from gateway.cli.embedded_redis import free_port
from workers.upstream import UpstreamEngine


class FakeUpstream:
    """``/v1/models`` answering ``models``, ``/props`` answering ``props`` (404 when None)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.models: dict[str, Any] = {"object": "list", "data": [{"id": "m", "object": "model"}]}
        self.props: dict[str, Any] | None = None
        self.loop = asyncio.new_event_loop()
        self.runner: web.AppRunner | None = None
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response(self.models)

    async def _props(self, _request: web.Request) -> web.Response:
        return web.json_response(self.props) if self.props is not None else web.json_response({}, status=404)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/props", self._props)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def _stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def start(self) -> None:
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result()


@pytest.fixture
def upstream() -> Iterator[FakeUpstream]:
    u = FakeUpstream()
    u.start()
    yield u
    u.stop()
    u.loop.call_soon_threadsafe(u.loop.stop)


def test_vllms_max_model_len_is_the_context_and_beats_the_one_given(upstream: FakeUpstream) -> None:
    upstream.models["data"] = [{"id": "m", "object": "model", "max_model_len": 4096}]
    engine = UpstreamEngine(upstream.url, slots=1, context_tokens=2048)
    try:
        assert engine.down == "" and engine.context_tokens == 4096
    finally:
        engine.close()


def test_llama_servers_props_say_the_context_and_a_restart_is_asked_again(upstream: FakeUpstream) -> None:
    upstream.props = {"default_generation_settings": {"n_ctx": 4096}, "total_slots": 1}
    engine = UpstreamEngine(upstream.url, slots=1, probe_s=0.1)
    try:
        assert engine.context_tokens == 4096
        upstream.stop()  # restarted with another context: asked again once it is back
        upstream.props = {"default_generation_settings": {"n_ctx": 1024}, "total_slots": 1}
        deadline = time.monotonic() + 5
        while not engine.down:
            assert time.monotonic() < deadline, "the engine never saw its upstream go"
            time.sleep(0.05)
        upstream.start()
        while engine.down or engine.context_tokens != 1024:
            assert time.monotonic() < deadline, (engine.down, engine.context_tokens)
            time.sleep(0.05)
    finally:
        engine.close()


def test_an_upstream_that_says_nothing_serves_the_context_given_else_the_models(upstream: FakeUpstream) -> None:
    for given in (512, 0):  # llama-cpp-python's server: neither /v1/models nor /props says
        engine = UpstreamEngine(upstream.url, slots=1, context_tokens=given)
        try:
            assert engine.down == "" and engine.context_tokens == given
        finally:
            engine.close()
