"""The HTTP side: the ASGI app and its routes, uvicorn's protocol class, the OpenAI wire format and
the OpenAPI document."""
