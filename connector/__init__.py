"""Our vLLM KV connector: one NIXL connector that does pull and push per request.

Not built yet (its own issue). Until then, run P and D with stock vLLM connectors:
`NixlConnector` (pull) or `NixlPushConnector` (push); the router works with both.
"""
