"""Our vLLM KV connector: one NIXL connector that does pull and push per request.

Built so far, pure logic with no vLLM or NIXL import: `connector.messages` (the push side
channel's typed wire messages and codec) and `connector.registry` (P's registry matching
D's block registrations with finished prefills). The connector class itself is its own
issue; until then, run P and D with stock vLLM connectors: `NixlConnector` (pull) or
`NixlPushConnector` (push); the router works with both.
"""
