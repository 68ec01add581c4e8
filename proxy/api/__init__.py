"""The HTTP surface: the OpenAI-compatible app (`app`), the admin API (`admin`), the
worker-to-worker control sockets of `--workers N` (`control`), the OpenAPI schema
(`openapi`) and the listener that cuts stalled clients (`listener`).

Imports `flow` and below; nothing below imports it."""
