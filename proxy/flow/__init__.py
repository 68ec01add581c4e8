"""One request's way: the `Router` picks P and D and the mode, and an `Exchange` runs
the pull, push or local flow (`pull`, `push`, `local`) and relays D's answer to the
client (`relay`); `modes` and `learn` decide the mode.

Flows see the router's parts through a narrow `FlowContext` (`context`), never the
whole `Router`. Imports `pool` and below."""
