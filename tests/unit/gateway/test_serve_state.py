"""The admin token and the demo key `serve` keeps in its data directory: kept, owner-only, reused."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from gateway.cli import serve_state


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_admin_token_is_made_once_kept_owner_only_and_reused(tmp_path: Path) -> None:
    data = tmp_path / "data"  # not there yet
    token = serve_state.admin_token(data)
    assert len(token) >= 16
    path = data / serve_state.ADMIN_TOKEN_FILE
    assert _mode(path) == 0o600 and path.read_text() == token + "\n"
    assert serve_state.admin_token(data) == token
    assert [p.name for p in data.iterdir()] == [serve_state.ADMIN_TOKEN_FILE]  # no temporary file left


def test_an_empty_token_file_gets_a_new_token_and_a_short_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / serve_state.ADMIN_TOKEN_FILE
    path.write_text("\n")
    assert len(serve_state.admin_token(tmp_path)) >= 16
    path.write_text("short\n")
    with pytest.raises(ValueError, match="admin-token"):
        serve_state.admin_token(tmp_path)


def test_a_hand_written_token_is_used_as_it_is(tmp_path: Path) -> None:
    (tmp_path / serve_state.ADMIN_TOKEN_FILE).write_text("my-own-admin-token-0123\n")
    assert serve_state.admin_token(tmp_path) == "my-own-admin-token-0123"


def test_a_secret_is_replaced_in_one_step_and_stays_owner_only(tmp_path: Path) -> None:
    path = serve_state.demo_key_file(tmp_path)
    assert serve_state.read_secret(path) is None
    serve_state.write_secret(path, "tg-00000000-first")
    serve_state.write_secret(path, "tg-00000000-second")
    assert serve_state.read_secret(path) == "tg-00000000-second" and _mode(path) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [serve_state.DEMO_KEY_FILE]


def test_a_demo_key_is_kept_per_redis(tmp_path: Path) -> None:
    private = serve_state.demo_key_file(tmp_path)
    a = serve_state.demo_key_file(tmp_path, "redis://a:6379/0")
    b = serve_state.demo_key_file(tmp_path, "redis://b:6379/0")
    assert private.name == "demo-key" and len({private, a, b}) == 3
    assert a == serve_state.demo_key_file(tmp_path, "redis://a:6379/0")
    assert "6379" not in a.name  # a digest: a URL's password never lands in a file name
