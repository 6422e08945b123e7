"""The HTTP floor for bench/overhead.py: Starlette on uvicorn+httptools answering a fixed body."""

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

BODY = orjson.dumps({"id": "x" * 24, "object": "chat.completion", "choices": [{"index": 0, "text": " echo" * 16}]})


async def answer(request: Request) -> Response:
    orjson.loads(await request.body())
    return Response(BODY, media_type="application/json")


app = Starlette(routes=[Route("/v1/chat/completions", answer, methods=["POST"])])
