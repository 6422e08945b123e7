"""A zero-cost OpenAI backend: Starlette on uvicorn+httptools answering every chat completion at
once with one fixed, valid ``chat.completion`` body (with usage). It is the HTTP floor of
``bench.overhead``, and LiteLLM's upstream and the "direct" baseline of ``bench.peers``.
Start it with ``bench.harness.floor_server``."""

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

BODY = orjson.dumps(
    {
        "id": "chatcmpl-" + "0" * 24,
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "zero",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": " echo" * 16},
                "finish_reason": "length",
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 250, "completion_tokens": 16, "total_tokens": 266},
    }
)


async def answer(request: Request) -> Response:
    orjson.loads(await request.body())
    return Response(BODY, media_type="application/json")


async def healthz(request: Request) -> Response:
    return Response(b"ok")


app = Starlette(
    routes=[Route("/v1/chat/completions", answer, methods=["POST"]), Route("/healthz", healthz, methods=["GET"])]
)
