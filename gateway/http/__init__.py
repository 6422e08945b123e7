"""The HTTP side, the top of the gateway below its commands: the ASGI app and its routes (the
OpenAI API, the admin API), one request's life from admission to settlement (``lifecycle``),
the services a process shares (``services.Gateway``), uvicorn's protocol class and the
OpenAPI document."""
