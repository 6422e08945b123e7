"""deploy/prometheus and deploy/grafana: every file they name is there as docker compose mounts
it, and every dashboard query asks for series the gateway's /metrics exports."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import Metrics
from tests.deploy_launches import COMPOSE, DEPLOY, LAUNCHES, OPERATOR_ENV, compose, start

SERVICES: dict[str, Any] = compose(OPERATOR_ENV)["services"]
PROMETHEUS_CONFIG = "/etc/prometheus/prometheus.yml"  # the prom/prometheus image's --config.file
GRAFANA_PROVISIONING = "/etc/grafana/provisioning"  # the grafana/grafana image's GF_PATHS_PROVISIONING
DASHBOARDS = sorted((DEPLOY / "grafana").rglob("*.json"))


def _service(image: str) -> tuple[str, dict[str, Any]]:
    found = [(name, s) for name, s in SERVICES.items() if str(s.get("image", "")).split(":")[0].endswith(image)]
    assert len(found) == 1, f"{COMPOSE.name}: one {image} service expected, found {[n for n, _ in found]}"
    return found[0]


def _binds(service: dict[str, Any]) -> Iterator[tuple[Path, str]]:
    """(path under deploy/, path in the container) of each bind mount."""
    for volume in service.get("volumes", []):
        source, target = (volume.split(":")[:2] if isinstance(volume, str) else (volume["source"], volume["target"]))
        if source.startswith((".", "/")):  # else a named volume, which holds nothing of ours
            path = (COMPOSE.parent / source).resolve()
            assert path.is_relative_to(DEPLOY.resolve()), f"{target} is mounted from {path}, outside deploy/"
            yield path, target


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def mounted(service: dict[str, Any], container_path: str) -> Path | None:
    """The file or folder under deploy/ that compose mounts at container_path (None: nothing)."""
    covering = [(source, target) for source, target in _binds(service) if _under(container_path, target)]
    if not covering:
        return None
    source, target = max(covering, key=lambda bind: len(bind[1]))  # the innermost mount wins
    return (source / os.path.relpath(container_path, target)).resolve()


def visible(service: dict[str, Any], container_folder: str, pattern: str, recursive: bool) -> list[Path]:
    """Files matching pattern that the container sees in container_folder (and below, if recursive)."""
    found: list[Path] = []
    for source, target in _binds(service):
        if _under(container_folder, target):  # a mount holds the folder
            host = mounted(service, container_folder)
        elif _under(target, container_folder) and (recursive or os.path.dirname(target) == container_folder):
            host = source  # a file or folder mounted into it
        else:
            continue
        if host is not None and host.is_dir():
            found += host.rglob(pattern) if recursive else host.glob(pattern)
        elif host is not None and host.is_file() and host.match(pattern):
            found.append(host)
    return sorted(set(found))


def _config_path(service: dict[str, Any], flag: str, default: str) -> str:
    command = service.get("command") or []
    for word in command.split() if isinstance(command, str) else command:
        if str(word).startswith(f"{flag}="):
            return str(word).split("=", 1)[1]
    return default


# -- Prometheus -------------------------------------------------------------------------------

_FILE_LISTS = ("rule_files", "scrape_config_files", "files")  # globs; "files" is file_sd_configs'


def _file_references(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _FILE_LISTS and isinstance(value, list):
                yield from (str(v) for v in value)
            elif key.endswith("_file") and isinstance(value, str):  # ca_file, bearer_token_file, password_file ...
                yield value
            else:
                yield from _file_references(value)
    elif isinstance(node, list):
        for item in node:
            yield from _file_references(item)


def unprovided(config: dict[str, Any], service: dict[str, Any], container_config: str) -> list[str]:
    """The files the config names (relative to its own folder) that no compose mount provides."""
    missing = []
    for reference in _file_references(config):
        in_container = os.path.normpath(os.path.join(os.path.dirname(container_config), reference))
        if not visible(service, os.path.dirname(in_container), os.path.basename(in_container), recursive=False):
            missing.append(reference)
    return missing


def test_prometheus_loads_the_shipped_config_and_every_file_it_names() -> None:
    _, prometheus = _service("prometheus")
    container_config = _config_path(prometheus, "--config.file", PROMETHEUS_CONFIG)
    config_file = mounted(prometheus, container_config)
    assert config_file is not None and config_file.is_file(), f"nothing of deploy/ is mounted at {container_config}"
    config = yaml.safe_load(config_file.read_text())
    assert config.get("scrape_configs"), f"{config_file.name}: no scrape_configs"
    assert unprovided(config, prometheus, container_config) == []


def test_a_file_prometheus_would_not_find_is_caught() -> None:
    _, prometheus = _service("prometheus")
    config = {
        "rule_files": ["prometheus.yml", "rules/*.yml"],
        "scrape_configs": [{"file_sd_configs": [{"files": ["/etc/prometheus/targets.json"]}],
                            "tls_config": {"ca_file": "ca.pem"}}],
    }
    assert unprovided(config, prometheus, PROMETHEUS_CONFIG) == ["rules/*.yml", "/etc/prometheus/targets.json",
                                                                 "ca.pem"]


def test_prometheus_scrapes_the_gateways_where_they_listen() -> None:
    config_file = mounted(_service("prometheus")[1], PROMETHEUS_CONFIG)
    assert config_file is not None
    config = yaml.safe_load(config_file.read_text())
    targets = [t for job in config["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]]
    assert targets
    gateways = {
        launch.where.rsplit(" ", 1)[1]: started.gateway.port
        for launch in LAUNCHES
        if launch.where.startswith(f"{COMPOSE.name} service ") and (started := start(launch)).gateway is not None
    }
    for target in targets:
        host, _, port = target.partition(":")
        assert host in SERVICES, f"scrape target {target}: no compose service {host}"
        if host in gateways:
            assert int(port) == gateways[host], f"scrape target {target}: {host} listens on {gateways[host]}"
    assert set(gateways) <= {t.partition(":")[0] for t in targets}, "a compose gateway nobody scrapes"


# -- Grafana ----------------------------------------------------------------------------------


def _provisioning(kind: str) -> list[tuple[Path, dict[str, Any]]]:
    _, grafana = _service("grafana")
    folder = mounted(grafana, GRAFANA_PROVISIONING)
    assert folder is not None and folder.is_dir(), f"nothing of deploy/ is mounted at {GRAFANA_PROVISIONING}"
    files = sorted([*(folder / kind).glob("*.yaml"), *(folder / kind).glob("*.yml")])
    loaded = [(path, yaml.safe_load(path.read_text())) for path in files]
    for path, doc in loaded:
        assert doc.get("apiVersion") == 1, f"{path.name}: apiVersion 1 expected"
    return loaded


def test_grafana_datasources_point_at_compose_services() -> None:
    sources = [s for _, doc in _provisioning("datasources") for s in doc.get("datasources", [])]
    assert sources
    for source in sources:
        host = re.match(r"\w+://([^:/]+)", source["url"])
        assert host and host[1] in SERVICES, f"datasource {source['name']}: {source['url']} is no compose service"


def test_grafana_loads_every_shipped_dashboard() -> None:
    _, grafana = _service("grafana")
    loaded: set[Path] = set()
    for path, doc in _provisioning("dashboards"):
        for provider in doc.get("providers", []):
            assert provider.get("type", "file") == "file"
            found = visible(grafana, provider["options"]["path"], "*.json", recursive=True)
            assert found, f"{path.name}: no dashboard under {provider['options']['path']}"
            loaded.update(found)
    assert loaded == set(DASHBOARDS), "every dashboard in deploy/grafana, and only those, is provisioned"


# -- dashboards against /metrics ----------------------------------------------------------------


def exported_series() -> set[str]:
    """Every sample name the gateway's /metrics can export (a labelled metric shows nothing until it
    has a child, so each gets one)."""
    metrics = Metrics()
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase):
            metric.labels(*["x"] * len(metric._labelnames))
    text = generate_latest(metrics.registry).decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def _panels(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in node.get("panels", []):  # a row holds its panels while collapsed
        yield panel
        yield from _panels(panel)


def _query(expr: str) -> promql_parser.Expr:
    """Grafana's own $__rate_interval, $__interval ... become a plain range before parsing."""
    return promql_parser.parse(re.sub(r"\$(?:\{__\w+\}|__\w+)", "1m", expr))


def _selected(query: promql_parser.Expr) -> list[str | None]:
    names: list[str | None] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            by_matcher = [m.value for m in node.matchers.matchers
                          if m.name == "__name__" and m.op == promql_parser.MatchOp.Equal]
            names.append(node.name or (by_matcher[0] if by_matcher else None))

    promql_parser.walk(query, visit)
    return names


def _quantiles(query: promql_parser.Expr) -> set[float]:
    found: set[float] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.Call) and node.func.name in ("histogram_quantile", "quantile_over_time"):
            if isinstance(node.args[0], promql_parser.NumberLiteral):
                found.add(round(node.args[0].val, 6))

    promql_parser.walk(query, visit)
    return found


def claimed_quantiles(title: str) -> set[float]:
    """p50 -> 0.5, p99 -> 0.99, p999 and p99.9 -> 0.999, p5 -> 0.05."""
    found = set()
    for digits in re.findall(r"\bp(\d+(?:\.\d+)?)\b", title, re.I):
        short = "." in digits or len(digits) <= 2
        found.add(round(float(digits) / 100 if short else float("0." + digits), 6))
    return found


def test_claimed_quantiles() -> None:
    assert claimed_quantiles("Latency p50 / p99") == {0.5, 0.99}
    assert claimed_quantiles("TTFT p999, P99.9 and p5") == {0.999, 0.05}
    assert claimed_quantiles("Tokens/s up to 50") == set()


def test_exported_series_carry_their_suffixes() -> None:
    exported = exported_series()
    assert {"tokengate_requests_total", "tokengate_request_latency_seconds_bucket"} <= exported
    assert "tokengate_requests" not in exported  # a counter is exported with _total only


@pytest.mark.parametrize("dashboard", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_queries_read_exported_series(dashboard: Path) -> None:
    exported = exported_series()
    doc = json.loads(dashboard.read_text())
    panels = list(_panels(doc))
    assert panels, f"{dashboard.name}: no panels"
    problems = []
    for panel in panels:
        targets = [t for t in panel.get("targets", []) if "expr" in t]
        ref_ids = [t.get("refId") for t in targets]
        if len(set(ref_ids)) != len(ref_ids):
            problems.append(f"{panel['title']!r}: refIds repeat {ref_ids}, Grafana drops all but one")
        shown: set[float] = set()
        for target in targets:
            try:
                query = _query(target["expr"])
            except ValueError as exc:
                problems.append(f"{panel['title']!r}: {target['expr']!r} is not PromQL: {exc}")
                continue
            shown |= _quantiles(query)
            for name in _selected(query):
                if name not in exported:
                    problems.append(f"{panel['title']!r}: {name or 'a selector without a literal name'} is not in "
                                    "/metrics")
        missing = claimed_quantiles(panel.get("title", "")) - shown
        if missing:
            problems.append(f"{panel['title']!r}: the title promises quantiles {sorted(missing)} no query computes")
    assert not problems, f"{dashboard.name}: " + "; ".join(problems)
