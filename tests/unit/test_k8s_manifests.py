"""The Kubernetes manifests in configs/k8s, checked without a cluster.

Every built-in kind is validated with kubernetes-validate against Kubernetes 1.37's
schemas in strict mode (unknown fields fail). The PodMonitor is the Prometheus Operator's
custom resource, which the package has no schema for: its metadata and selector are
validated against the package's ObjectMeta and LabelSelector schemas, and its spec
against a schema of the PodMonitor fields used here (names and types as the operator's
monitoring.coreos.com/v1 CRD defines them), unknown fields refused.

Then the manifests are checked against each other and the code: the ConfigMap holds a
valid router config whose selectors pick the P and D pods, vLLM starts with our
connector and exposes its push port, the router has 2 replicas, readiness on /health,
and RBAC to get, list and watch pods, and the Service and PodMonitor reach its pods."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

from proxy.config import RouterConfig, build_config
from tests.k8s_apiserver import matches

MANIFESTS = Path(__file__).resolve().parents[2] / "configs" / "k8s"
KUBERNETES_VERSION = "1.37"
DEFINITIONS = "https://kubernetes.io/api/_definitions.json#/$defs/"


def documents() -> list[dict[str, Any]]:
    found = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        found += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def one(kind: str, name: str) -> dict[str, Any]:
    [found] = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def router_config() -> RouterConfig:
    return build_config(yaml.safe_load(one("ConfigMap", "pd-proxy")["data"]["router.yaml"]), {})


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any]
    [found] = deployment["spec"]["template"]["spec"]["containers"]
    return found


def port_number(c: dict[str, Any], name: str) -> int:
    [number] = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return int(number)


@pytest.mark.parametrize("doc", [d for d in documents() if d["kind"] != "PodMonitor"],
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_each_builtin_resource_validates_against_kubernetes_schemas(doc: dict[str, Any]) -> None:
    assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def test_a_wrong_field_is_caught() -> None:
    """The validation above can fail: a misspelt field and a wrong type are refused."""
    deployment = one("Deployment", "pd-proxy")
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    broken = json.loads(json.dumps(deployment))
    container(broken)["readinessProbe"]["periodSeconds"] = "often"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@cache
def _definitions() -> Resource[Any]:
    schema_dir = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    path = schema_dir / f"v{KUBERNETES_VERSION}.0-local-strict" / "_definitions.json"
    return Resource.from_contents(json.loads(path.read_text()))


POD_MONITOR_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {"$ref": DEFINITIONS + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": {"$ref": DEFINITIONS + "io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector"},
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "podMetricsEndpoints": {
                    "type": "array", "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        },
                    },
                },
            },
        },
    },
}


def validate_pod_monitor(doc: dict[str, Any]) -> None:
    registry: Registry[Any] = _definitions() @ Registry()
    jsonschema.Draft202012Validator(POD_MONITOR_SCHEMA, registry=registry).validate(doc)


def test_the_pod_monitor_has_no_schema_in_the_package_and_validates_against_ours() -> None:
    monitor = one("PodMonitor", "pd-proxy")
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(monitor, KUBERNETES_VERSION, strict=True)
    validate_pod_monitor(monitor)
    broken = json.loads(json.dumps(monitor))
    broken["spec"]["podMetricsEndpoints"][0]["targetPort"] = 8000  # not ours, not allowed
    with pytest.raises(jsonschema.ValidationError):
        validate_pod_monitor(broken)
    broken = json.loads(json.dumps(monitor))
    broken["metadata"]["labels"] = {"a": 1}  # ObjectMeta: label values are strings
    with pytest.raises(jsonschema.ValidationError):
        validate_pod_monitor(broken)


def test_the_router_config_picks_the_p_and_d_pods() -> None:
    config = router_config()
    discovery = config.discovery.kubernetes
    assert discovery is not None and config.prefill == [] and config.decode == []
    for name, selector in (("vllm-prefill", discovery.prefill_selector),
                           ("vllm-decode", discovery.decode_selector)):
        deployment = one("Deployment", name)
        assert deployment["metadata"]["namespace"] == discovery.namespace
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert matches(selector, labels), (name, selector)
        other = (discovery.decode_selector if selector == discovery.prefill_selector
                 else discovery.prefill_selector)
        assert not matches(other, labels), f"{name} is picked by both selectors"
        assert port_number(container(deployment), "http") == discovery.port


@pytest.mark.parametrize("name", ["vllm-prefill", "vllm-decode"])
def test_vllm_starts_with_our_connector_and_exposes_its_push_port(name: str) -> None:
    c = container(one("Deployment", name))
    args = c["args"]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "NixlDualConnector"
    assert kv["kv_connector_module_path"] == "connector"
    assert kv["kv_role"] == "kv_both"
    assert kv["kv_connector_extra_config"]["push_port"] == port_number(c, "kv-push")
    env = {e["name"]: e for e in c["env"]}
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"]) == port_number(c, "nixl-side")
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert f"--port={port_number(c, 'http')}" in args


def test_the_router_deployment_rbac_service_and_monitor_fit_together() -> None:
    config = router_config()
    router = one("Deployment", "pd-proxy")
    assert router["spec"]["replicas"] == 2
    pod = router["spec"]["template"]
    labels = pod["metadata"]["labels"]
    c = container(router)
    assert port_number(c, "http") == config.port and config.host == "0.0.0.0"
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "httpGet" not in c.get("livenessProbe", {})  # /health is readiness only
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "config")
    assert c["args"] == ["--config", f"{mount}/router.yaml"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > config.shutdown_grace

    account = pod["spec"]["serviceAccountName"]
    assert one("ServiceAccount", account)
    binding = one("RoleBinding", "pd-proxy-pod-reader")
    assert {"kind": "ServiceAccount", "name": account, "namespace": "llm"} in binding["subjects"]
    role = one("Role", binding["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]

    service = one("Service", "pd-proxy")
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    monitor = one("PodMonitor", "pd-proxy")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    assert all(d["metadata"].get("namespace", "llm") == "llm" for d in documents())
