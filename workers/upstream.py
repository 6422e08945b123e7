"""An engine that fronts an OpenAI-compatible server: llama.cpp's, vLLM, TGI, SGLang, Ollama.

The worker stays what it is (jobs from its pool's stream, fenced replies, re-delivery); only
the engine changes. Each sequence becomes one streaming request to the upstream, run by an
asyncio loop in a thread of its own with one ``aiohttp`` connection pool of ``slots``
connections; ``step`` collects what the streams delivered since the last call and turns it
into tokengate's events:

- a chat request goes to ``/v1/chat/completions`` with its messages, so the upstream applies
  its own chat template and answers exactly as it would a direct call; a completion goes to
  ``/v1/completions`` with its text (or its token ids);
- every upstream chunk that carries text is one token (llama.cpp and vLLM send one per
  token); the usage the upstream reports, when it does, replaces the counts at the end;
- a sequence resumed after a peer died (``resume_chars``) is asked again from the start and
  its first ``resume_chars`` characters are not sent twice: exact for greedy or seeded
  sampling on an upstream that honours the seed;
- cancelling closes the upstream stream (the connection), which stops its generation.

Failures. A 400, 413 or 422 answer is the request's fault: an ``upstream_rejected`` error
event (the client gets a 400). A transport error, a time-out or a 408/429/502/503/504 answer
passes: the sequence is reported ``failed`` and its batch goes back to the stream for
re-delivery (``Worker._abandon``, ``Fence.release``), and a transport error or time-out marks
the upstream down. Any other answer (a 500: llama-cpp-python's answer to a body it cannot
read), an unreadable chunk or a stream that ends with no finish reason is an
``upstream_error`` event (a 502): the upstream answered, and would answer the same again. While it is
down the engine has no free slot (the worker reads no job), ``down`` says why (heartbeat,
``/admin/workers``), and a probe of ``/v1/models`` every ``probe_s`` brings it back.

Context. Whenever the upstream comes up, the engine asks it the context it serves (vLLM's
``/v1/models``, llama-server's ``/props``; llama-cpp-python's server says none: the one given,
``--context-tokens``): ``context_tokens``, in the heartbeat; gateways refuse longer requests.

Telemetry. The upstream is a black box, so its steps are inferred from what the streams
show: a sequence's first token closes a prefill step (its prompt tokens, the sequences
decoding beside it, the time from request to first token), and each ``step`` call in which
tokens arrived is one decode step (the sequences decoding, their KV tokens, the mean gap
between consecutive tokens of a sequence). An upstream that says in its usage the prompt
tokens it found in its prefix cache (llama-server, vLLM: ``prompt_tokens_details``) has a
sequence's prefill step recorded at the sequence's end, on the tokens it really prefilled, so
a cached conversation does not teach the scheduler that prefill is cheap. Where the upstream
exports Prometheus metrics (vLLM's and llama-server's ``/metrics``: ``UPSTREAM_METRICS``),
running and waiting requests, KV-cache use and llama-server's prompt tokens prefilled and found cached go
into the heartbeat, and the running count sizes the inferred decode steps (others may share
the upstream).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from common.protocol import Delta, Failed, Finished, SeqJob, StepRecord
from workers.engine import Prefill, StepResult
from workers.upstream_api import cached_tokens, listed_context, parse_metrics, props_context, request_body

log = logging.getLogger("tokengate.upstream")

POLL_S = 0.002  # a step waits this long for tokens while a job could still be read
FULL_WAIT_S = 0.05  # and this long when no slot is free (no job to read meanwhile)
PROBE_S = 1.0  # how often the upstream is probed (``/v1/models``, and ``/metrics`` where served)
CONNECT_TIMEOUT_S = 5.0
_RETRY_STATUS = frozenset({408, 429, 502, 503, 504})  # busy, slow or restarting: another try may succeed
_JSON = {"content-type": "application/json"}
_REJECT_STATUS = frozenset({400, 413, 422})  # the request's own fault: the client gets a 400

class UpstreamError(Exception):
    """The upstream failed a sequence. ``retry``: a passing fault (re-deliver it); else the
    error event's ``code``: ``upstream_rejected`` (the request's fault) or ``upstream_error``."""

    def __init__(self, message: str, retry: bool, down: bool = False, code: str = "upstream_error") -> None:
        super().__init__(message)
        self.retry = retry
        self.down = down
        self.code = code


class _Stale(Exception):
    """The request failed before the upstream answered it, on a connection it had closed."""


@dataclass(slots=True)
class _Seq:
    job: SeqJob
    sent_at: float
    future: concurrent.futures.Future[None] | None = None
    first_at: float | None = None
    last_at: float = 0.0
    tokens: int = 0  # chunks with text so far (a replay counts its skipped ones too)
    chars: int = 0  # characters received so far
    sent: int = 0  # characters delivered to the client (resume_chars at first)
    text: list[str] = field(default_factory=list)  # a non-streaming sequence's completion
    prefill: StepRecord | None = None  # its prefill step, held until its usage says what was cached


class UpstreamEngine:
    name = "upstream"
    device = "remote"
    dtype = "upstream"
    step_tokens = 0
    max_threads = 0  # the upstream server runs its own

    def __init__(self, url: str, model: str | None = None, slots: int = 32, timeout_s: float = 60.0,
                 probe_s: float = PROBE_S, context_tokens: int = 0) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")  # the server root; a URL ending in /v1 is taken too
        self.slots = slots
        self.model = model or ""
        self.given_context = context_tokens  # --context-tokens: where the upstream does not say its own
        self.context_tokens = context_tokens  # what it serves, as it said when it came up (0: unknown)
        self.timeout_s = timeout_s
        self.probe_s = probe_s
        self.metrics: dict[str, float] = {}  # the upstream's own figures (vLLM's, llama-server's), if it exports them
        self._has_metrics: bool | None = None  # unknown until /metrics answers once
        # its usage says the prompt tokens it found cached: a sequence's prefill step is then
        # recorded at its end, priced on the tokens it really prefilled
        self.says_cached = False
        self._streams = 0  # upstream requests in flight (the loop's thread)
        self._alive_at = 0.0  # when one was last sent or last received a chunk
        self.down = "not probed yet"  # why no job should come here now; empty while the upstream answers
        self.choice = f"upstream {self.url}"
        self._seqs: dict[str, _Seq] = {}
        self._cancelled: list[_Seq] = []
        self._inbox: queue.SimpleQueue[tuple[str, str, Any, float]] = queue.SimpleQueue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="upstream", daemon=True)
        self._thread.start()
        self._client: aiohttp.ClientSession = self._call(self._make_client())
        self._probe_task = asyncio.run_coroutine_threadsafe(self._probe_loop(), self._loop)
        self._call(self._probe())  # down or up, and the model's name, before the first job

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _make_client(self) -> aiohttp.ClientSession:
        """aiohttp rather than httpx: its C parser costs about a quarter of httpx's CPU per
        streamed request (0.36 against 1.3 ms measured here), on a core the worker shares."""
        timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_read=self.timeout_s)
        return aiohttp.ClientSession(self.url, connector=aiohttp.TCPConnector(limit=self.slots), timeout=timeout)

    def close(self) -> None:
        self.reset()
        self._probe_task.cancel()
        self._call(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # -- health -----------------------------------------------------------------------------

    async def _probe(self) -> None:
        try:
            # as patient as with a stream: a server that runs one sequence at a time can be slow to
            # answer while it generates, and a dead one refuses the connection at once
            async with self._client.get("/v1/models") as reply:
                reply.raise_for_status()
                listed = await reply.json(content_type=None)
            models = [m.get("id") for m in listed.get("data", []) if isinstance(m, dict)]
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
            self._mark_down(f"upstream {self.url} does not answer: {_describe(exc)}")
            return
        if not self.model and models:
            self.model = str(models[0])
        self.choice = f"upstream {self.url} (model {self.model or 'unknown'})"
        if self.down:  # up now, or again (perhaps restarted with another context)
            await self._learn_context(listed)
            log.info("upstream %s is up (model %s, context %s)", self.url, self.model or "unknown",
                     self.context_tokens or "the model's own")
        self.down = ""
        if self._has_metrics is not False:
            await self._read_metrics()

    async def _learn_context(self, listed: object) -> None:
        """The context the upstream serves: as it says, else the one given."""
        said = listed_context(listed, self.model)
        if not said:
            try:
                async with self._client.get("/props") as reply:
                    said = props_context(await reply.json(content_type=None)) if reply.status == 200 else 0
            except (aiohttp.ClientError, TimeoutError, ValueError):
                said = 0
        if said and self.given_context and said != self.given_context:
            log.warning("upstream %s says its context is %d tokens, not %d (given)", self.url, said, self.given_context)
        self.context_tokens = said or self.given_context

    async def _read_metrics(self) -> None:
        try:
            async with self._client.get("/metrics") as reply:
                self._has_metrics = reply.status == 200
                self.metrics = parse_metrics(await reply.text()) if self._has_metrics else {}
        except (aiohttp.ClientError, TimeoutError, ValueError):
            self.metrics = {}

    def _mark_down(self, why: str) -> None:
        if self.down != why:
            log.warning("%s: taking no jobs until it answers again", why)
        self.down = why

    async def _probe_loop(self) -> None:
        """Probe while down (to see it back) or idle (to see it go before a job is sent);
        not while a stream has shown life within the time-out: a server that runs one
        sequence at a time answers ``/v1/models`` only after the sequences queued before it
        (llama-cpp-python's takes its model lock), so a probe then says nothing a stream
        does not. Gauges (``/metrics``), where served, are read every time."""
        while True:
            await asyncio.sleep(self.probe_s)
            try:
                if self.down or not self._streams or time.monotonic() - self._alive_at > self.timeout_s:
                    await self._probe()
                elif self._has_metrics:  # vLLM serves its gauges beside the engine: kept fresh
                    await self._read_metrics()
            except Exception as exc:  # an answer no one foresaw must not end the probing
                log.exception("probing upstream %s failed", self.url)
                self._mark_down(f"upstream {self.url} answers its probe oddly: {_describe(exc)}")

    # -- the engine interface -----------------------------------------------------------------

    def add(self, seq: SeqJob, kv: dict[str, Any] | None = None) -> None:
        """Start the sequence's upstream request. A handed-over KV cache cannot travel to an
        upstream: the prompt is prefilled there again (same answer), and a handoff asked of
        this sequence is not made (it decodes here)."""
        s = _Seq(seq, time.monotonic(), sent=seq.resume_chars)
        self._seqs[seq.rid] = s
        s.future = asyncio.run_coroutine_threadsafe(self._run(s), self._loop)

    def cancel(self, rid: str) -> bool:
        s = self._seqs.pop(rid, None)
        if s is None:
            return False
        if s.future is not None:
            s.future.cancel()  # the task is cancelled in the loop: its stream and connection close
        self._cancelled.append(s)
        return True

    def set_threads(self, n: int) -> None:
        """The upstream server's threads are its own."""

    def reset(self) -> None:
        for s in self._seqs.values():
            if s.future is not None:
                s.future.cancel()
        self._seqs.clear()
        self._cancelled.clear()
        while not self._inbox.empty():
            self._inbox.get_nowait()

    @property
    def prefix_cache_tokens(self) -> int:
        """What placement may expect it to keep: each slot's last prompt (llama-server keeps
        one per slot; vLLM's prefix cache holds more), where the upstream said its context."""
        return self.slots * self.context_tokens

    @property
    def busy(self) -> bool:
        return bool(self._seqs or self._cancelled)

    @property
    def free_slots(self) -> int:
        return 0 if self.down else max(0, self.slots - len(self._seqs))

    @property
    def running(self) -> int:
        return sum(1 for s in self._seqs.values() if s.first_at is not None)

    @property
    def queued_prefill(self) -> int:
        return sum(len(s.job.prompt_ids) for s in self._seqs.values() if s.first_at is None)

    def _batch(self) -> tuple[int, int]:
        """The sequences decoding upstream and their KV tokens, as far as the worker can tell:
        its own, or, where the upstream counts more running requests (vLLM's gauge: other
        clients share it), that count, each holding as many KV tokens as this worker's hold
        on average."""
        own = [len(s.job.prompt_ids) + s.tokens for s in self._seqs.values() if s.first_at is not None]
        running = int(self.metrics.get("running", 0))
        if running <= len(own):
            return len(own), sum(own)
        return running, round(running * sum(own) / len(own)) if own else 0

    def step(self) -> StepResult:
        started = time.perf_counter()
        observed: list[StepRecord] = []
        result = StepResult(observed=observed)
        for gone in self._cancelled:
            result.events.append(Finished(gone.job.rid, "", "cancelled", len(gone.job.prompt_ids), gone.tokens))
        self._cancelled.clear()
        items = self._collect(0.0 if result.events else POLL_S if self.free_slots else FULL_WAIT_S)
        decoding, kv = self._batch()
        gaps: list[float] = []
        decoded: set[str] = set()
        for kind, rid, payload, at in items:
            s = self._seqs.get(rid)
            if s is None:  # cancelled or reset meanwhile
                continue
            if kind == "piece":
                self._piece(s, payload, at, result, observed, gaps, decoded, decoding, kv)
            elif kind == "end":
                del self._seqs[rid]
                self._end(s, payload, result, observed)
            else:  # "error"
                del self._seqs[rid]
                if payload.retry:
                    result.failed.append(rid)
                else:
                    result.events.append(Failed(rid, payload.code, str(payload)))
        if gaps:
            mean_gap = sum(gaps) / len(gaps)
            observed.append(StepRecord(0, decoding, kv, mean_gap * 1000))
            result.decode_rids = tuple(decoded)
            result.decode_s = mean_gap
            result.decode_seqs = decoding
            result.kv_tokens = kv
        for rid, live in self._seqs.items():
            if live.job.stream and live.first_at is not None:
                result.progress[rid] = (tuple(range(live.tokens)), live.sent)
        result.step_s = time.perf_counter() - started
        return result

    def _collect(self, wait_s: float) -> list[tuple[str, str, Any, float]]:
        items: list[tuple[str, str, Any, float]] = []
        if self._seqs and wait_s > 0:
            try:
                items.append(self._inbox.get(timeout=wait_s))
            except queue.Empty:
                return items
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    def _piece(self, s: _Seq, text: str, at: float, result: StepResult, observed: list[StepRecord],
               gaps: list[float], decoded: set[str], decoding: int, kv: int) -> None:
        rid, prompt = s.job.rid, len(s.job.prompt_ids)
        if s.first_at is None:
            s.first_at = at
            ttft = at - s.sent_at
            result.prefills.append(Prefill((rid,), prompt, ttft))
            result.prefill_tokens += prompt
            record = StepRecord(prompt, decoding, kv, ttft * 1000)
            if self.says_cached:  # the prompt tokens it found cached come with its usage, at the end
                s.prefill = record
            else:
                observed.append(record)
        else:
            gaps.append(at - s.last_at)
            decoded.add(rid)
        s.last_at = at
        s.tokens += 1
        start = s.chars
        s.chars += len(text)
        if s.chars <= s.sent:  # a replay: the client has these characters already
            return
        fresh = text[max(0, s.sent - start):]
        s.sent = s.chars
        if s.job.stream:
            result.events.append(Delta(rid, fresh, s.tokens))
        else:
            s.text.append(fresh)

    def _end(self, s: _Seq, payload: tuple[str, dict[str, Any] | None], result: StepResult,
             observed: list[StepRecord]) -> None:
        reason, usage = payload
        prompt = len(s.job.prompt_ids)
        tokens = s.tokens
        if usage:  # the upstream's own counts, where it reports them
            prompt = int(usage.get("prompt_tokens", prompt))
            tokens = int(usage.get("completion_tokens", tokens))
        cached = cached_tokens(usage)
        if cached is not None:
            self.says_cached = True
        if s.prefill is not None:  # it prefilled only what it did not find cached
            observed.append(dataclasses.replace(s.prefill, prefill_tokens=max(
                1, s.prefill.prefill_tokens - (cached or 0))))
        text = "" if s.job.stream else "".join(s.text)
        result.events.append(Finished(s.job.rid, text, reason if reason in ("stop", "length") else "stop",
                                      prompt, tokens))

    # -- the upstream requests (in the loop's thread) ------------------------------------------

    async def _run(self, s: _Seq) -> None:
        self._streams += 1
        self._alive_at = time.monotonic()
        try:
            self._inbox.put(await self._outcome(s))
        finally:
            self._streams -= 1

    async def _outcome(self, s: _Seq) -> tuple[str, str, Any, float]:
        """The sequence's last inbox item: its end, or its error."""
        rid = s.job.rid
        try:
            try:
                reason, usage = await self._stream(s, retry_stale=True)
            except _Stale:
                # a kept-alive connection the upstream had closed (after an error answer or a
                # cancelled stream): nothing was answered, so once more on a fresh one
                reason, usage = await self._stream(s, retry_stale=False)
        except UpstreamError as exc:
            if exc.down:
                self._mark_down(str(exc))
            return ("error", rid, exc, time.monotonic())
        except Exception as exc:  # a bug here must still end the sequence, not hang it (a cancel passes)
            log.exception("upstream request of %s failed", rid)
            return ("error", rid, UpstreamError(_describe(exc), retry=True), time.monotonic())
        return ("end", rid, (reason, usage), time.monotonic())

    async def _stream(self, s: _Seq, retry_stale: bool) -> tuple[str, dict[str, Any] | None]:
        path, body = request_body(s.job, self.model)
        chat = "messages" in body
        reason: str | None = None
        usage = None
        answered = False
        try:
            async with self._client.post(path, data=orjson.dumps(body), headers=_JSON) as reply:
                answered = True
                self._alive_at = time.monotonic()
                if reply.status != 200:
                    detail = (await reply.read()).decode(errors="replace")[:500]
                    code = "upstream_rejected" if reply.status in _REJECT_STATUS else "upstream_error"
                    raise UpstreamError(f"upstream answered {reply.status}: {detail}",
                                        retry=reply.status in _RETRY_STATUS, code=code)
                async for line in reply.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = orjson.loads(data)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                        if text:
                            self._alive_at = time.monotonic()
                            self._inbox.put(("piece", s.job.rid, text, self._alive_at))
                        if choice.get("finish_reason"):
                            reason = choice["finish_reason"]
        except TimeoutError as exc:  # aiohttp's read and connect time-outs are TimeoutErrors
            raise UpstreamError(f"upstream {self.url} timed out: {_describe(exc)}", retry=True, down=True) from exc
        except aiohttp.ClientConnectorError as exc:  # refused, unreachable: not a stale connection
            raise UpstreamError(f"upstream {self.url} failed: {_describe(exc)}", retry=True, down=True) from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError) as exc:
            if retry_stale and not answered:
                raise _Stale from exc
            raise UpstreamError(f"upstream {self.url} failed: {_describe(exc)}", retry=True, down=True) from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"upstream {self.url} failed: {_describe(exc)}", retry=True, down=True) from exc
        except orjson.JSONDecodeError as exc:
            raise UpstreamError(f"upstream sent an unreadable chunk: {exc}", retry=False) from exc
        if reason is None:  # llama-cpp-python's answer to a prompt over its context, among others
            raise UpstreamError("the upstream ended its stream without a finish reason", retry=False)
        return reason, usage


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
