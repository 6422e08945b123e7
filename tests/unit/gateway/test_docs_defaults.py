"""The docs say what the code does: every default a doc gives for a gateway flag, in a flag
table (`| --flag | 10 s |`) or beside the flag (`--flag` (1 h)), is the one in
``GatewaySettings``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.cli.flags import GATEWAY_FLAGS, setting_default

ROOT = Path(__file__).resolve().parents[3]
FIELDS = {flag: name for flag, name, _help in GATEWAY_FLAGS}
UNITS = {"": 1.0, "s": 1.0, "ms": 1.0, "h": 3600.0, "min": 60.0, "mib": float(1 << 20), "kib": 1024.0}
QUANTITY = r"([0-9][0-9,]*(?:\.[0-9]+)?)\s*(s|ms|h|min|MiB|KiB)?"
STATED = (
    re.compile(r"^\| `--([a-z-]+)` \| " + QUANTITY + r" \|", re.MULTILINE),
    re.compile(r"`--([a-z-]+)`,? \((?:default )?" + QUANTITY + r"\)"),
)


def _stated() -> list[tuple[str, str, float]]:
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for pattern in STATED:
            for flag, number, unit in pattern.findall(text):
                if flag in FIELDS:
                    found.append((doc.name, flag, float(number.replace(",", "")) * UNITS[(unit or "").lower()]))
    return found


def test_the_docs_state_defaults() -> None:
    assert len(_stated()) >= 5  # the patterns still find the tables


@pytest.mark.parametrize(("doc", "flag", "value"), _stated())
def test_a_default_in_the_docs_is_the_codes(doc: str, flag: str, value: float) -> None:
    assert value == pytest.approx(float(setting_default(FIELDS[flag]))), f"{doc} gives --{flag} as {value:g}"
