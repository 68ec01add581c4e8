"""pd-proxy: an OpenAI-compatible router for vLLM prefill/decode disaggregation."""

from proxy.api.app import create_app
from proxy.config import Mode, RouterConfig

__all__ = ["Mode", "RouterConfig", "create_app"]
