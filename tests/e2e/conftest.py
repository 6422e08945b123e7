"""`tokengate serve` (or `tokengate gateway`) as a real subprocess, driven over HTTP."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from gateway.cli.embedded_redis import free_port
from workers.model_store import ModelSpec

ADMIN_TOKEN = "e2e-admin-token-0123456789"


@dataclass
class Served:
    proc: subprocess.Popen[str]
    base_url: str
    model: str
    log: Path
    key: str = ""  # the demo tenant's key, from `serve`'s banner

    def stop(self, timeout_s: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=timeout_s)

    def auth(self, token: str | None = None) -> dict[str, str]:
        return {"authorization": f"Bearer {token or self.key}"}


def launch(args: list[str], tmp: Path, new_session: bool = False) -> Served:
    """``new_session``: its own process group, like a command run from a terminal (so that
    ``os.killpg(proc.pid, SIGINT)`` is what Ctrl-C does)."""
    port = free_port()
    log = tmp / f"tokengate-{port}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    env.setdefault("TOKENGATE_DATA_DIR", str(tmp / f"data-{port}"))  # `serve` persists here, not in ~
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", *args, "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=new_session,
        )
    return Served(proc, f"http://127.0.0.1:{port}", "SmolLM2-135M-Instruct", log)


def wait_ready(served: Served, ready_path: str = "/readyz", timeout_s: float = 180) -> Served:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if served.proc.poll() is not None:
            raise AssertionError(f"tokengate exited early:\n{served.log.read_text()[-4000:]}")
        try:
            if httpx.get(served.base_url + ready_path, timeout=1).status_code == 200:
                return served
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    served.proc.kill()
    raise AssertionError(f"tokengate not ready in {timeout_s} s:\n{served.log.read_text()[-4000:]}")


def start(
    args: list[str], tmp: Path, ready_path: str = "/readyz", timeout_s: float = 180, new_session: bool = False
) -> Served:
    return wait_ready(launch(args, tmp, new_session), ready_path, timeout_s)


@contextmanager
def serving(args: list[str], tmp: Path) -> Iterator[Served]:
    """``start``ed, then stopped at the end, which must be a clean exit (0, or 130: Ctrl-C's)."""
    served = start(args, tmp)
    try:
        yield served
    finally:
        code = served.stop()
        assert code in (0, 130), f"tokengate exited with {code}:\n{served.log.read_text()[-4000:]}"


def banner_match(served: Served, pattern: str, timeout_s: float = 10) -> re.Match[str]:
    """``pattern`` (multi-line) in what `serve` printed, once it is there: the banner goes out
    after /readyz can already answer (a loop polls for the first worker every 0.1 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(pattern, served.log.read_text(), re.MULTILINE)
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} in the banner:\n{served.log.read_text()[-4000:]}")


def banner_key(served: Served, timeout_s: float = 10) -> str:
    """The demo tenant's key as `serve` prints it."""
    return banner_match(served, r"Bearer (tg-[0-9a-f]{8}-[A-Za-z0-9_-]{43})'", timeout_s).group(1)


def banner_admin_token(served: Served, timeout_s: float = 10) -> str:
    """The admin token as `serve` prints it."""
    return banner_match(served, r"^Admin token \(.*?\): (\S+)", timeout_s).group(1)


@pytest.fixture(scope="session")
def served(model_spec: ModelSpec, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The whole product from one command, with its private Redis and the real model."""
    s = start(
        ["serve", "--slots", "8", "--max-body-bytes", "65536", "--admin-token", ADMIN_TOKEN],
        tmp_path_factory.mktemp("serve"),
    )
    s.key = banner_key(s)
    yield s
    s.stop()


def same_greedy_answers(tg: openai.OpenAI, direct: openai.OpenAI, model: str) -> None:
    """Greedy answers through tokengate (``tg``) are the upstream's own (``direct``): a chat, the
    same chat streamed token by token, a completion and the completion streamed."""
    kw = {"messages": [{"role": "user", "content": "Write a haiku about the sea."}], "max_tokens": 40,
          "temperature": 0}
    via = tg.chat.completions.create(model=model, **kw)  # type: ignore[call-overload]
    own = direct.chat.completions.create(model="any", **kw)  # type: ignore[call-overload]
    assert via.choices[0].message.content and via.choices[0].message.content == own.choices[0].message.content
    assert via.choices[0].finish_reason == own.choices[0].finish_reason
    assert via.usage is not None and own.usage is not None
    assert (via.usage.prompt_tokens, via.usage.completion_tokens) == (own.usage.prompt_tokens,
                                                                      own.usage.completion_tokens)
    stream = tg.chat.completions.create(model=model, stream=True, **kw)  # type: ignore[call-overload]
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(chunks) > 5 and "".join(chunks) == own.choices[0].message.content  # token by token

    prompt = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
    via_text = tg.completions.create(model=model, **prompt)  # type: ignore[call-overload]
    own_text = direct.completions.create(model="any", **prompt)  # type: ignore[call-overload]
    assert via_text.choices[0].text and via_text.choices[0].text == own_text.choices[0].text
    streamed = tg.completions.create(model=model, stream=True, **prompt)  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in streamed if c.choices) == own_text.choices[0].text


def upstream_clients(fronted: Served, upstream_url: str) -> tuple[openai.OpenAI, openai.OpenAI]:
    """The official client through tokengate (the demo key), and straight to the upstream."""
    tg = openai.OpenAI(base_url=fronted.base_url + "/v1", api_key=fronted.key, max_retries=0, timeout=60)
    direct = openai.OpenAI(base_url=upstream_url + "/v1", api_key="none", max_retries=0, timeout=60)
    return tg, direct


def admin_workers(fronted: Served) -> list[dict[str, object]]:
    """``GET /admin/workers``' workers."""
    reply = httpx.get(fronted.base_url + "/admin/workers", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert reply.status_code == 200
    return list(reply.json()["data"])
