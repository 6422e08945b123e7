"""The two secrets `tokengate serve` keeps in its data directory besides Redis's AOF.

The admin token it makes up (``admin-token``) and the plaintext of the demo tenant's key
(``demo-key``; Redis keeps only the key's sha256) live in files only their owner may read
(mode 0600), so that every start prints the same two secrets instead of new ones. Files, not
Redis: a key's plaintext must never reach Redis, and the private redis-server answers any local
user, where a 0600 file is its owner's alone. A demo key belongs to one Redis's demo tenant, so
a `serve --redis-url` keeps its own file per Redis URL (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
from pathlib import Path

from gateway.settings import ADMIN_TOKEN_MIN_CHARS

log = logging.getLogger("tokengate.serve")

ADMIN_TOKEN_FILE = "admin-token"
DEMO_KEY_FILE = "demo-key"


def read_secret(path: Path) -> str | None:
    """The secret kept in ``path`` (its first line), or None where there is none."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    if path.stat().st_mode & 0o077:
        log.warning("%s may be read by other users than its owner: chmod 600 it", path)
    return text.splitlines()[0] if text else None


def _private_copy(path: Path, secret: str) -> Path:
    """A new file beside ``path`` holding ``secret``, created readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secret + "\n")
    return tmp


def write_secret(path: Path, secret: str) -> None:
    """Keeps ``secret`` in ``path`` (mode 0600), replacing what was there in one step."""
    tmp = _private_copy(path, secret)
    try:
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def admin_token(data_dir: Path) -> str:
    """The admin token kept in ``data_dir``; the first call makes one up and keeps it (if two
    processes race to, both end with the one written first)."""
    path = data_dir / ADMIN_TOKEN_FILE
    token = read_secret(path)
    if token is None:
        made = _private_copy(path, secrets.token_urlsafe(24))
        try:
            if path.exists():  # empty
                os.replace(made, path)
            else:
                with contextlib.suppress(FileExistsError):  # a token another process kept first wins
                    os.link(made, path)
        finally:
            made.unlink(missing_ok=True)
        token = read_secret(path)
        assert token is not None
    if len(token) < ADMIN_TOKEN_MIN_CHARS:
        raise ValueError(f"the admin token in {path} has fewer than {ADMIN_TOKEN_MIN_CHARS} characters: "
                         "fix the file or remove it (a new token is then made up)")
    return token


def demo_key_file(data_dir: Path, redis_url: str | None = None) -> Path:
    """Where the demo key is kept: ``demo-key`` for serve's private Redis; for another Redis
    (``redis_url``), a file named after a digest of its URL."""
    if redis_url is None:
        return data_dir / DEMO_KEY_FILE
    return data_dir / f"{DEMO_KEY_FILE}-{hashlib.sha256(redis_url.encode()).hexdigest()[:12]}"
