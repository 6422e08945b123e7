"""What deploy/'s files start: each container that runs the tokengate image as a ``Launch``
(its command line and environment), and ``start``, which does what the process does before it
touches Redis or the model. ``tests/unit/test_deploy*.py`` check them."""


from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import yaml

from gateway.cli.main import build_parser
from gateway.cli.server import settings_from_args as gateway_settings  # what `tokengate gateway` builds
from gateway.settings import GatewaySettings
from workers import cli as worker_cli
from workers.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "docker-compose.yml"
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
IMAGE = "tokengate"  # the image deploy/Dockerfile builds, by whatever tag

# What an operator supplies, as the files' comments and docs/operations.md tell them to.
OPERATOR_ENV = {"TOKENGATE_ADMIN_TOKEN": "0123456789abcdef" * 3}  # `docker compose` reads it
DOCKER_RUN_ENV = {"TOKENGATE_REDIS_URL": "redis://redis:6379/0"}  # `docker run -e` for the image's own CMD
GENERATED = "f" * 48  # stands for a documented "$(openssl rand -hex 24)"


class StartError(ValueError):
    """The process would exit at start-up (or never be started)."""


# -- the image --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Image:
    env: Mapping[str, str]  # the final stage's ENV
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    exposed: tuple[int, ...]
    copied: tuple[str, ...]  # COPY sources taken from the build context


def _instructions(text: str) -> Iterator[tuple[str, str]]:
    logical = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            logical += line.rstrip()[:-1] + " "
            continue
        logical += line
        if logical.strip():
            word, _, rest = logical.strip().partition(" ")
            yield word.upper(), rest.strip()
        logical = ""


def _exec_form(arg: str) -> tuple[str, ...]:
    return tuple(json.loads(arg)) if arg.startswith("[") else ("/bin/sh", "-c", arg)


def read_image(path: Path = DOCKERFILE) -> Image:
    env: dict[str, str] = {}
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    exposed: list[int] = []
    copied: list[str] = []
    for word, arg in _instructions(path.read_text()):
        if word == "FROM":  # only the last stage's ENV, ENTRYPOINT, CMD and EXPOSE reach the image
            env, entrypoint, cmd, exposed = {}, (), (), []
        elif word == "ENV":
            tokens = shlex.split(arg)
            if "=" in tokens[0]:
                env.update(token.partition("=")[::2] for token in tokens)
            else:  # the old `ENV KEY value with spaces` form
                env[tokens[0]] = arg.split(None, 1)[1]
        elif word == "ENTRYPOINT":
            entrypoint, cmd = _exec_form(arg), ()
        elif word == "CMD":
            cmd = _exec_form(arg)
        elif word == "EXPOSE":
            exposed += [int(port.split("/")[0]) for port in arg.split()]
        elif word in ("COPY", "ADD"):
            tokens = shlex.split(arg)
            if not any(token.startswith("--from") for token in tokens):
                copied += [token for token in tokens[:-1] if not token.startswith("--")]
    return Image(env, entrypoint, cmd, tuple(exposed), tuple(copied))


# -- launches and what they do at start-up ------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    where: str  # "tokengate.yaml Deployment tokengate/gateway container gateway"
    argv: tuple[str, ...]
    env: Mapping[str, str]
    origin: Mapping[str, str]  # variable -> what sets it: a file, a ConfigMap or Secret, a container's env
    ports: tuple[int, ...] = ()  # ports the file expects the process to listen on
    workload: tuple[str, str, str] | None = None  # Kubernetes (kind, namespace, name)
    unresolved: tuple[str, ...] = ()  # why it would never be started (a missing Secret ...)


@dataclass(frozen=True)
class Started:
    args: argparse.Namespace
    flags: frozenset[str]  # the TOKENGATE_* variable of every flag this command reads
    gateway: GatewaySettings | None
    worker: WorkerSettings | None


def _variables(parser: argparse.ArgumentParser, command: str) -> frozenset[str]:
    """Every flag is also an environment variable, TOKENGATE_<FLAG> (workers/cli.py: env_default)."""
    parsers = [parser]
    for action in parser._actions:  # argparse has no public way to reach a subcommand's parser
        if isinstance(action, argparse._SubParsersAction):
            parsers.append(action.choices[command])
    return frozenset(
        "TOKENGATE_" + option[2:].upper().replace("-", "_")
        for p in parsers
        for action in p._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    )


def start(launch: Launch) -> Started:
    """What `tokengate ...` does with this command line and environment up to its first I/O."""
    if launch.unresolved:
        raise StartError("; ".join(launch.unresolved))
    if launch.argv[:1] != ("tokengate",):
        raise StartError(f"{launch.where}: {shlex.join(launch.argv)} does not run the tokengate CLI")
    command = shlex.join(launch.argv)
    with mock.patch.dict(os.environ):
        for name in [name for name in os.environ if name.startswith("TOKENGATE_")]:
            del os.environ[name]
        os.environ.update({k: v for k, v in launch.env.items() if k.startswith("TOKENGATE_")})
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                parser = build_parser()  # reads the environment: TOKENGATE_PORT=abc fails here
                args = parser.parse_args(launch.argv[1:])
            gateway = worker = None
            if args.command in ("gateway", "serve"):  # `serve` starts its own Redis when given none
                redis_url = args.redis_url or "redis://127.0.0.1:6379/0"
                gateway = gateway_settings(args, redis_url, (args.model_name or ["model"])[0], 1 << 20)
            if args.command == "worker":
                worker = worker_cli.settings_from_args(args)
            elif args.command == "serve":  # one worker per --model and pool: the first model's stands for them
                first = {name: (getattr(args, name) or [None])[0] for name in ("model", "model_name")}
                worker = worker_cli.settings_from_args(argparse.Namespace(**{**vars(args), **first}))
        except SystemExit:
            raise StartError(f"{launch.where}: the CLI refuses {command}: {stderr.getvalue().strip()}") from None
        except ValueError as exc:
            raise StartError(f"{launch.where}: {command} exits at start-up: {exc}") from None
    return Started(args, _variables(parser, args.command), gateway, worker)


def _ours(image: str | None) -> bool:
    return image is not None and image.split(":")[0] == IMAGE


def _argv(value: str | list[Any]) -> tuple[str, ...]:
    return tuple(shlex.split(value)) if isinstance(value, str) else tuple(str(v) for v in value)


def image_launch(image: Image) -> Launch:
    env = {**image.env, **DOCKER_RUN_ENV}
    origin = {name: "Dockerfile" for name in image.env}
    return Launch("Dockerfile ENTRYPOINT+CMD", image.entrypoint + image.cmd, env, origin, image.exposed)


# -- docker compose ---------------------------------------------------------------------------


class ComposeError(ValueError):
    """`docker compose` refuses the file before starting anything: a ${VAR:?message} without VAR."""


_VARIABLE = re.compile(
    r"\$(?:(?P<dollar>\$)|\{(?P<braced>\w+)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}|(?P<named>[A-Za-z_]\w*))"
)


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """docker compose's $$, $VAR, ${VAR}, ${VAR-default}, ${VAR?error}, ${VAR+other} (each also with ':',
    which treats an empty value as unset)."""

    def one(m: re.Match[str]) -> str:
        if m["dollar"]:
            return "$"
        name, op, arg = m["braced"] or m["named"], m["op"] or "", m["arg"] or ""
        value = env.get(name)
        unset = value is None or (op.startswith(":") and value == "")
        if op.endswith("-"):
            return arg if unset else str(value)
        if op.endswith("?"):
            if unset:
                raise ComposeError(f"{COMPOSE.name}: {name}: {arg}")
            return str(value)
        if op.endswith("+"):
            return "" if unset else arg
        return value or ""

    return _VARIABLE.sub(one, text)


def _interpolated(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, dict):
        return {k: _interpolated(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolated(v, env) for v in node]
    return interpolate(node, env) if isinstance(node, str) else node


def compose(env: Mapping[str, str]) -> dict[str, Any]:
    """The compose file as `docker compose` sees it with this shell environment."""
    loaded: dict[str, Any] = _interpolated(yaml.safe_load(COMPOSE.read_text()), env)
    return loaded


def _container_port(spec: str | int | dict[str, Any]) -> int:
    if isinstance(spec, dict):
        return int(spec["target"])
    return int(str(spec).split("/")[0].rsplit(":", 1)[-1])


def _runs_image(service: dict[str, Any]) -> bool:
    build = service.get("build")
    if isinstance(build, str):
        build = {"context": build}
    if build is not None:
        context = COMPOSE.parent / build.get("context", ".")
        return (context / build.get("dockerfile", "Dockerfile")).resolve() == DOCKERFILE.resolve()
    return _ours(service.get("image"))


def compose_launches(env: Mapping[str, str], image: Image) -> list[Launch]:
    launches = []
    for name, service in compose(env)["services"].items():
        if not _runs_image(service):
            continue
        where = f"{COMPOSE.name} service {name}"
        assert "env_file" not in service, f"{where}: env_file is not modelled by this test yet"
        environment = service.get("environment") or {}
        if isinstance(environment, list):
            environment = dict(item.split("=", 1) if "=" in item else (item, None) for item in environment)
        shell = {k: env.get(k) if v is None else str(v) for k, v in environment.items()}  # a bare KEY: from the shell
        own = {k: v for k, v in shell.items() if v is not None}
        entrypoint = _argv(service["entrypoint"]) if "entrypoint" in service else image.entrypoint
        cmd = _argv(service["command"]) if "command" in service else () if "entrypoint" in service else image.cmd
        origin = {**{k: "Dockerfile" for k in image.env}, **{k: COMPOSE.name for k in own}}
        ports = tuple(_container_port(p) for p in service.get("ports", []))
        launches.append(Launch(where, entrypoint + cmd, {**image.env, **own}, origin, ports))
    return launches


# -- Kubernetes -------------------------------------------------------------------------------


def k8s_documents() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in K8S for doc in yaml.safe_load_all(path.read_text()) if doc]


def documented_secrets() -> dict[tuple[str, str, str], dict[str, str]]:
    """The Secrets the manifests' comments tell the operator to create with
    `kubectl create secret generic NAME --from-literal=KEY=VALUE`, by (kind, namespace, name)."""
    found = {}
    for path in K8S:
        for line in path.read_text().splitlines():
            comment = line.partition("#")[2]
            if "create secret generic" not in comment:
                continue
            words = shlex.split(comment)
            namespace = "default"
            for i, word in enumerate(words):
                if word in ("-n", "--namespace"):
                    namespace = words[i + 1]
                elif word.startswith("--namespace="):
                    namespace = word.split("=", 1)[1]
            name = words[words.index("generic") + 1]
            data = {}
            for word in words:
                if word.startswith("--from-literal="):
                    key, _, value = word.removeprefix("--from-literal=").partition("=")
                    data[key] = GENERATED if value.startswith("$(") else value
            found["Secret", namespace, name] = data
    return found


def _config_objects() -> dict[tuple[str, str, str], dict[str, str]]:
    objects = documented_secrets()
    for _, doc in k8s_documents():
        kind, meta = str(doc.get("kind")), doc.get("metadata", {})
        key = (kind, str(meta.get("namespace", "default")), str(meta.get("name")))
        if kind == "ConfigMap":
            objects[key] = {k: str(v) for k, v in (doc.get("data") or {}).items()}
        elif kind == "Secret":
            data = {k: base64.b64decode(v).decode() for k, v in (doc.get("data") or {}).items()}
            objects[key] = {**data, **{k: str(v) for k, v in (doc.get("stringData") or {}).items()}}
    return objects


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    spec = doc.get("spec") or {}
    kind = doc.get("kind")
    if kind == "Pod":
        return spec
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        return dict(spec["template"]["spec"])
    if kind == "CronJob":
        return dict(spec["jobTemplate"]["spec"]["template"]["spec"])
    return None


def _lookup(objects: Mapping[tuple[str, str, str], dict[str, str]], kind: str, namespace: str,
            ref: dict[str, Any], where: str, unresolved: list[str]) -> dict[str, str] | None:
    found = objects.get((kind, namespace, ref["name"]))
    if found is None and not ref.get("optional"):
        unresolved.append(f"{where}: {kind} {namespace}/{ref['name']} is neither in deploy/k8s nor created by a "
                          "documented command: the pod would wait in CreateContainerConfigError")
    return found


def _container_env(container: dict[str, Any], namespace: str, where: str,
                   objects: Mapping[tuple[str, str, str], dict[str, str]],
                   unresolved: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    env: dict[str, str] = {}
    origin: dict[str, str] = {}
    refs = (("ConfigMap", "configMapRef", "configMapKeyRef"), ("Secret", "secretRef", "secretKeyRef"))
    for source in container.get("envFrom", []):
        for kind, whole, _ in refs:
            data = _lookup(objects, kind, namespace, source[whole], where, unresolved) if whole in source else None
            if data is not None:
                named = {source.get("prefix", "") + k: v for k, v in data.items()}
                env.update(named)
                origin.update({k: f"{kind} {namespace}/{source[whole]['name']}" for k in named})
    for var in container.get("env", []):
        name, value_from = var["name"], var.get("valueFrom", {})
        origin[name] = where
        if "value" in var:
            env[name] = _expand(str(var["value"]), env)
        for kind, _, one in refs:
            data = _lookup(objects, kind, namespace, value_from[one], where, unresolved) if one in value_from else None
            if data is not None:
                if value_from[one]["key"] not in data and not value_from[one].get("optional"):
                    unresolved.append(f"{where}: {kind} {value_from[one]['name']} has no {value_from[one]['key']}")
                env[name] = data.get(value_from[one]["key"], "")
        if "fieldRef" in value_from or "resourceFieldRef" in value_from:
            env[name] = "from-the-pod"
    return env, origin


def _expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) in command, args and env values ($$ escapes; an unknown name stays)."""
    return re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text)


def _ports(container: dict[str, Any], annotations: Mapping[str, str]) -> tuple[int, ...]:
    named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    ports = list(named.values())
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        action = container.get(probe, {})
        for how in ("httpGet", "tcpSocket", "grpc"):
            if how in action:
                port = action[how]["port"]
                ports.append(named[port] if isinstance(port, str) else int(port))
    if "prometheus.io/port" in annotations:
        ports.append(int(annotations["prometheus.io/port"]))
    return tuple(ports)


def k8s_launches(image: Image) -> list[Launch]:
    objects = _config_objects()
    launches = []
    for path, doc in k8s_documents():
        spec = pod_spec(doc)
        if spec is None:
            continue
        meta = doc["metadata"]
        namespace = meta.get("namespace", "default")
        template = doc.get("spec", {}).get("template", {}).get("metadata", {})
        for container in spec.get("initContainers", []) + spec["containers"]:
            if not _ours(container.get("image")):
                continue
            where = f"{path.name} {doc['kind']} {namespace}/{meta['name']} container {container['name']}"
            unresolved: list[str] = []
            own, own_origin = _container_env(container, namespace, where, objects, unresolved)
            env = {**image.env, **own}
            entrypoint = _argv(container["command"]) if "command" in container else image.entrypoint
            cmd = _argv(container["args"]) if "args" in container else () if "command" in container else image.cmd
            argv = tuple(_expand(word, env) for word in entrypoint + cmd)
            origin = {**{k: "Dockerfile" for k in image.env}, **own_origin}
            ports = _ports(container, template.get("annotations", {}))
            workload = (doc["kind"], namespace, meta["name"])
            launches.append(Launch(where, argv, env, origin, ports, workload, tuple(unresolved)))
    return launches


def launches() -> list[Launch]:
    """Every tokengate process the deploy files start, as an operator following them would start it."""
    image = read_image()
    try:
        composed = compose_launches(OPERATOR_ENV, image)
    except ComposeError as exc:  # fails the launch tests, not the collection
        composed = [Launch(COMPOSE.name, (), {}, {}, unresolved=(str(exc),))]
    return [image_launch(image), *composed, *k8s_launches(image)]


LAUNCHES = launches()
