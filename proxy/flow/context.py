"""What a request's flow may use of the router, and nothing more.

The `Router` owns the long-lived parts and builds one `FlowContext` of them; every
`Exchange` (and through it the pull, push and local flows) sees only this: the two
clusters to pick from, the upstream client, metrics, the retry budget, P's coordinates
(`prober`), health (a lost connection counts against it), auto mode's learner and the
push side channel. Membership, discovery, the model catalog and the load scraper stay
the router's own.

Compiled with the request path (`pyproject.toml`): a flow reads it a dozen times per
request, each a C field read, where an interpreted dataclass's slot was an attribute
lookup through its type.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.config import RouterConfig
from proxy.flow.learn import ModeLearner
from proxy.metrics import RouterMetrics
from proxy.pool.endpoints import Cluster, ClusterName
from proxy.pool.health import HealthChecker
from proxy.pool.probe import CoordinateProber
from proxy.pool.retry import RetryBudget
from proxy.upstream.client import UpstreamClient
from proxy.upstream.sidechannel import SideChannel


@dataclass(frozen=True, slots=True)
class FlowContext:
    config: RouterConfig
    prefill: Cluster
    decode: Cluster
    client: UpstreamClient
    metrics: RouterMetrics
    retry_budget: RetryBudget
    prober: CoordinateProber
    health: HealthChecker
    learner: ModeLearner | None  # auto mode's, when it learns (auto.learn)
    push_channel: SideChannel | None  # abandons go to P's push port (push_channel.abandon)

    def cluster(self, name: ClusterName) -> Cluster:
        return self.prefill if name is ClusterName.PREFILL else self.decode
