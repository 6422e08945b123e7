"""The HTTP API's vocabulary, below every other part of the gateway: OpenAI requests in
(``openai_protocol``: JSON to internal dataclasses), every response body and header out
(``shapes``), declared once for the handlers and the OpenAPI document alike."""
