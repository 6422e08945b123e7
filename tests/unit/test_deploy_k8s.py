"""deploy/k8s: every document matches the Kubernetes schema (offline, from kubernetes-validate's
bundle), and each KEDA object, which the bundle does not know, scales a worker Deployment on the
stream and consumer group that the Deployment's workers read (common/wire.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import promql_parser
import pytest

from common import wire
from tests.deploy_launches import LAUNCHES, k8s_documents, start
from tests.unit.test_deploy_monitoring import exported_series
from workers.model_store import DEFAULT_MODEL_NAME

VERSION = kubernetes_validate.latest_version()  # the newest Kubernetes the installed bundle describes
KEDA = "keda.sh/v1alpha1"
DOCUMENTS = k8s_documents()


def _id(document: tuple[Path, dict[str, Any]]) -> str:
    path, doc = document
    return f"{path.name} {doc.get('kind')} {doc.get('metadata', {}).get('name')}"


def _defined(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    for _, doc in DOCUMENTS:
        meta = doc.get("metadata", {})
        if (doc.get("kind"), meta.get("namespace", "default"), meta.get("name")) == (kind, namespace, name):
            return doc
    return None


def test_there_are_manifests() -> None:
    kinds = {doc["kind"] for _, doc in DOCUMENTS}
    assert {"Deployment", "ScaledObject"} <= kinds


@pytest.mark.parametrize("document", [d for d in DOCUMENTS if d[1].get("apiVersion") != KEDA], ids=_id)
def test_document_matches_the_kubernetes_schema(document: tuple[Path, dict[str, Any]]) -> None:
    _, doc = document
    problem = None
    try:
        kubernetes_validate.validate(doc, VERSION, strict=True)  # strict: an unknown field is an error
    except kubernetes_validate.ValidationError as exc:
        problem = f"{'.'.join(str(part) for part in exc.path)}: {exc.message} (Kubernetes {VERSION})"
    except kubernetes_validate.SchemaNotFoundError as exc:
        problem = f"{exc.message}; a custom resource needs its own checks here"
    assert problem is None, f"{_id(document)}: {problem}"


def _names(doc: dict[str, Any]) -> tuple[str, str]:
    meta = doc.get("metadata")
    assert isinstance(meta, dict) and isinstance(meta.get("name"), str) and meta["name"], "metadata.name"
    return meta.get("namespace", "default"), meta["name"]


@pytest.mark.parametrize("document", [d for d in DOCUMENTS if d[1].get("apiVersion") == KEDA], ids=_id)
def test_keda_object_is_one_keda_accepts(document: tuple[Path, dict[str, Any]]) -> None:
    _, doc = document
    namespace, name = _names(doc)
    assert doc["kind"] in ("ScaledObject", "TriggerAuthentication"), f"{_id(document)}: unknown KEDA kind"
    spec = doc["spec"]
    if doc["kind"] == "TriggerAuthentication":
        for ref in spec.get("secretTargetRef", []):
            assert {"parameter", "name", "key"} <= ref.keys(), f"{_id(document)}: secretTargetRef {ref}"
        return
    target = spec["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment" and target.get("apiVersion", "apps/v1") == "apps/v1"
    assert _defined("Deployment", namespace, target["name"]), f"{name}: no Deployment {namespace}/{target['name']}"
    low, high = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    assert isinstance(low, int) and isinstance(high, int) and 0 <= low <= high
    if "authenticationRef" in spec:
        assert _defined("TriggerAuthentication", namespace, spec["authenticationRef"]["name"])
    triggers = spec["triggers"]
    assert isinstance(triggers, list) and triggers, f"{name}: no triggers"
    for trigger in triggers:
        assert isinstance(trigger.get("type"), str)
        metadata = trigger["metadata"]
        strings = all(isinstance(v, str) for v in metadata.values())
        assert strings, f"{name}: KEDA's trigger metadata is a map of strings (quote numbers): {metadata}"


def _scaled_objects() -> list[tuple[Path, dict[str, Any]]]:
    return [d for d in DOCUMENTS if d[1].get("apiVersion") == KEDA and d[1].get("kind") == "ScaledObject"]


@pytest.mark.parametrize("document", _scaled_objects(), ids=_id)
def test_keda_watches_the_stream_its_target_reads(document: tuple[Path, dict[str, Any]]) -> None:
    """The trigger names the pool's jobs stream and the workers' group on the Redis the target's
    workers use."""
    _, doc = document
    namespace, name = _names(doc)
    workload = ("Deployment", namespace, doc["spec"]["scaleTargetRef"]["name"])
    workers = [started.worker for launch in LAUNCHES if launch.workload == workload
               if (started := start(launch)).worker is not None]
    assert len(workers) == 1, f"{name}: {workload} should run exactly one tokengate worker, runs {len(workers)}"
    worker = workers[0]
    redis = urlsplit(worker.redis_url)
    streams = [t for t in doc["spec"]["triggers"] if t["type"] == "redis-streams"]
    assert streams, f"{name}: no redis-streams trigger"
    for trigger in streams:
        metadata = trigger["metadata"]
        model = worker.model_name or DEFAULT_MODEL_NAME  # (the packaged model's name, where it names none)
        assert metadata.get("stream") == wire.jobs_stream(model, worker.pool), f"{name}: {model}'s {worker.pool} stream"
        assert metadata.get("consumerGroup") == wire.GROUP, f"{name}: the workers' consumer group"
        address = metadata.get("address") or f"{metadata.get('host')}:{metadata.get('port', '6379')}"
        assert address == f"{redis.hostname}:{redis.port or 6379}", f"{name}: not the workers' Redis {redis.netloc}"
        assert metadata.get("databaseIndex", "0") == (redis.path.strip("/") or "0"), f"{name}: another database"



@pytest.mark.parametrize("document", _scaled_objects(), ids=_id)
def test_keda_scales_each_pool_on_its_backlog(document: tuple[Path, dict[str, Any]]) -> None:
    """A Prometheus trigger sums the gateways' exported backlog of the target's model and pool (the queue
    lives in the gateways, so the stream's lag alone stays near zero); a pool that may scale to
    zero wakes on any of it (a pool with no worker still shows the work it would take)."""
    _, doc = document
    namespace, name = _names(doc)
    workload = ("Deployment", namespace, doc["spec"]["scaleTargetRef"]["name"])
    ((pool, model),) = {(started.worker.pool, started.worker.model_name or DEFAULT_MODEL_NAME)
                        for launch in LAUNCHES if launch.workload == workload
                        if (started := start(launch)).worker is not None}
    exported = exported_series()
    triggers = [t["metadata"] for t in doc["spec"]["triggers"] if t["type"] == "prometheus"]
    assert len(triggers) == 1, f"{name}: one prometheus trigger on the backlog"
    metadata = triggers[0]
    query = promql_parser.parse(metadata["query"])
    selectors: list[promql_parser.VectorSelector] = []
    promql_parser.walk(query, lambda node: selectors.append(node)
                       if isinstance(node, promql_parser.VectorSelector) else None)
    assert [s.name for s in selectors] == ["tokengate_backlog_tokens"], f"{name}: {metadata['query']}"
    assert selectors[0].name in exported
    pools = [m.value for m in selectors[0].matchers.matchers if m.name == "pool"]
    assert pools == [pool], f"{name}: the query reads pool {pools}, its workers serve {pool}"
    models = [m.value for m in selectors[0].matchers.matchers if m.name == "model"]
    assert models == [model], f"{name}: the query reads model {models}, its workers serve {model}"
    assert float(metadata["threshold"]) > 0 and metadata["serverAddress"].startswith("http")
    if doc["spec"].get("minReplicaCount", 0) == 0:
        assert float(metadata.get("activationThreshold", "1")) == 0.0, f"{name}: must wake on any backlog"
