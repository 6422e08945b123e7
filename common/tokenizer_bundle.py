"""What a gateway needs of a model to count its tokens, as one value a worker publishes in Redis.

A gateway tokenizes every prompt before admitting it (``gateway/dispatch/prompts.py``): it needs
the model's tokenizer, its chat template, its context length (``config.json``) and the sampling
defaults it ships (``generation_config.json``), not its weights. A worker that has the model's
files packs those (``BUNDLE_FILES``, the ones present) into an uncompressed tar with every
header fixed (names sorted, no times, owners or modes of the host), so the same files give the
same bytes, and so the same digest, on every host. It stores them once under
``wire.tokenizer_key(digest)`` and names the digest in its heartbeat
(``Heartbeat.tokenizer``); a gateway started with ``--model-from-workers`` unpacks them into its
cache, keyed by the digest, and loads them as it would a local model directory (docs/operations.md).
Stdlib ``tarfile``: it is the one format with a fixed byte layout that needs no dependency.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tarfile
from pathlib import Path

#: the files a tokenizer, its chat template, the context length and the sampling defaults come
#: from (transformers reads whichever of the tokenizer's are present)
BUNDLE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


class BundleError(ValueError):
    """Not a bundle this version can unpack."""


def pack(model_dir: Path) -> tuple[str, bytes] | None:
    """(digest, bytes) of ``model_dir``'s tokenizer files, or None where it has no tokenizer
    (no ``tokenizer.json`` nor ``tokenizer.model``) or no ``config.json``."""
    present = [name for name in BUNDLE_FILES if (model_dir / name).is_file()]
    if "config.json" not in present or not {"tokenizer.json", "tokenizer.model"} & set(present):
        return None
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(present):
            data = (model_dir / name).read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    blob = out.getvalue()
    return _digest(blob), blob


def _digest(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()[:32]


def unpack(digest: str, blob: bytes, cache_dir: Path) -> Path:
    """The bundle's files in ``cache_dir / digest`` (written once; a second call finds them),
    after checking that ``blob`` is the bundle ``digest`` names and holds only its files."""
    if _digest(blob) != digest:
        raise BundleError(f"the tokenizer bundle stored under {digest} does not match its digest")
    target = cache_dir / digest
    if target.is_dir():
        return target
    staging = cache_dir / f".{digest}.{os.getpid()}"
    staging.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as tar:
            for member in tar.getmembers():
                if member.name not in BUNDLE_FILES or not member.isfile():
                    raise BundleError(f"the tokenizer bundle {digest} holds {member.name!r}, not a tokenizer file")
                data = tar.extractfile(member)
                assert data is not None  # a regular file
                (staging / member.name).write_bytes(data.read())
    except tarfile.TarError as exc:
        raise BundleError(f"the tokenizer bundle {digest} is unreadable: {exc}") from exc
    if target.is_dir():  # another gateway process unpacked it meanwhile
        shutil.rmtree(staging)
    else:
        staging.replace(target)  # whole or not at all: a reader finds the directory complete
    return target
