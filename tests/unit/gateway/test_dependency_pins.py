"""Libraries whose internals we extend are pinned to the versions we test, and no other
library's private modules are imported: an upgrade that breaks an extension fails here, naming
the file to re-check, instead of misbehaving quietly in production."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from gateway.http.protocol import TESTED_UVICORN, untested_uvicorn

ROOT = Path(__file__).resolve().parents[3]
OUR_PACKAGES = ("gateway", "workers", "sched_core")


def test_the_installed_uvicorn_is_a_tested_one() -> None:
    assert untested_uvicorn() is None, (
        f"{untested_uvicorn()}; then add its series to TESTED_UVICORN in gateway/http/protocol.py "
        "and to uvicorn's pin in pyproject.toml"
    )


def test_an_untested_uvicorn_is_named_with_the_files_to_re_check() -> None:
    series = TESTED_UVICORN[-1]
    assert untested_uvicorn(f"{series}.7") is None
    major, minor = series.split(".")
    why = untested_uvicorn(f"{major}.{int(minor) + 1}.0")
    assert why is not None and "gateway/http/protocol.py" in why and "gateway/cli/shutdown.py" in why


def test_pyproject_pins_uvicorn_to_the_tested_series() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [uvicorn_req] = [Requirement(d) for d in deps if Requirement(d).name == "uvicorn"]
    allowed = uvicorn_req.specifier
    for series in TESTED_UVICORN:
        assert allowed.contains(f"{series}.0") and allowed.contains(f"{series}.99"), (uvicorn_req, series)
    tested = sorted(tuple(int(n) for n in series.split(".")) for series in TESTED_UVICORN)
    (major, lowest), (_major, highest) = tested[0], tested[-1]
    for outside in (f"{major}.{lowest - 1}.99", f"{major}.{highest + 1}.0"):
        assert not allowed.contains(outside), f"pyproject.toml's {uvicorn_req} allows untested uvicorn {outside}"


def test_no_private_module_of_another_library_is_imported() -> None:
    """redis-py's, hiredis's, uvicorn's, ...: ``x._y`` is theirs to change in any release."""
    found = []
    for package in OUR_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                elif isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                else:
                    continue
                for module in modules:
                    parts = module.split(".")
                    private = any(p.startswith("_") and not p.startswith("__") for p in parts)
                    if private and parts[0] not in OUR_PACKAGES:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {module}")
    assert not found, "private modules of other libraries imported:\n" + "\n".join(found)
