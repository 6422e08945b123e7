"""API keys: their format, the digest Redis stores, and parsing. Pure; no I/O.

A key reads ``tg-<prefix>-<secret>``. ``prefix`` is 8 lowercase hex characters: public, the
handle keys are listed, revoked and looked up by (and the only part ever logged).
``secret`` is 32 random bytes in URL-safe base64 (43 characters). Redis stores only
``sha256(key)`` under the prefix. The key carries 256 random bits, so a fast hash is enough:
a slow password hash protects guessable secrets, and these are not guessable. The stored
digest is compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

PREFIX_CHARS = 8
_KEY = re.compile(r"tg-([0-9a-f]{8})-[A-Za-z0-9_-]{43}")
_PREFIX = re.compile(r"[0-9a-f]{8}")


@dataclass(frozen=True, slots=True)
class NewKey:
    """A freshly issued key: ``key`` is shown once and never stored."""

    key: str
    prefix: str
    digest: str


@dataclass(frozen=True, slots=True)
class KeyRef:
    """A presented key as the rest of the gateway may hold it: its prefix and digest."""

    prefix: str
    digest: str


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> NewKey:
    prefix = secrets.token_hex(PREFIX_CHARS // 2)
    key = f"tg-{prefix}-{secrets.token_urlsafe(32)}"
    return NewKey(key, prefix, digest(key))


def prefix_of(key: str) -> str | None:
    """The lookup prefix of a well-formed key, else None (no lookup needed to refuse it)."""
    match = _KEY.fullmatch(key)
    return match.group(1) if match else None


def is_prefix(text: str) -> bool:
    return _PREFIX.fullmatch(text) is not None


def matches(key: str, stored_digest: str) -> bool:
    return hmac.compare_digest(digest(key), stored_digest)
