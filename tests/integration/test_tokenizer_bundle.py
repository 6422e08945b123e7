"""A model's tokenizer files as one value in Redis: the same files give the same bytes on any
host, they unpack to a directory the gateway loads as the model's, and nothing else unpacks."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import time
from pathlib import Path

import pytest

from common.tokenizer_bundle import BundleError, pack, unpack
from gateway.dispatch.prompts import PromptBuilder
from workers.model_store import ModelSpec

pytestmark = pytest.mark.model  # the default model's files


def test_the_same_files_pack_to_the_same_digest_whatever_their_times(model_spec: ModelSpec, tmp_path: Path) -> None:
    packed = pack(model_spec.path)
    assert packed is not None
    digest, blob = packed
    copy = tmp_path / "copy"
    copy.mkdir()
    for member in tarfile.open(fileobj=io.BytesIO(blob)).getmembers():
        (copy / member.name).write_bytes((model_spec.path / member.name).read_bytes())
        os.utime(copy / member.name, (time.time() - 3600, time.time() - 3600))
    (copy / "model.safetensors").write_bytes(b"weights are not a tokenizer's")
    assert pack(copy) == packed
    assert "model.safetensors" not in tarfile.open(fileobj=io.BytesIO(blob)).getnames()
    assert len(blob) < 8 << 20  # SmolLM2's tokenizer, config and chat template, no weights


def test_an_unpacked_bundle_tokenizes_as_the_model_directory_does(model_spec: ModelSpec, tmp_path: Path) -> None:
    packed = pack(model_spec.path)
    assert packed is not None
    where = unpack(*packed, tmp_path / "tokenizers")
    assert where == tmp_path / "tokenizers" / packed[0] and unpack(*packed, tmp_path / "tokenizers") == where
    local, published = PromptBuilder.load(model_spec.path), PromptBuilder.load(where)
    assert published.context_tokens == local.context_tokens
    chat = (("system", "Be brief."), ("user", "Name three colours, then count to five."))
    assert published._ids(chat) == local._ids(chat)


def test_a_bundle_that_is_not_what_its_digest_names_or_holds_other_files_is_refused(
        model_spec: ModelSpec, tmp_path: Path) -> None:
    packed = pack(model_spec.path)
    assert packed is not None
    with pytest.raises(BundleError, match="does not match its digest"):
        unpack(packed[0], packed[1] + b"\0", tmp_path)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo("../escape.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    blob = out.getvalue()
    with pytest.raises(BundleError, match="not a tokenizer file"):
        unpack(hashlib.sha256(blob).hexdigest()[:32], blob, tmp_path)
    assert not (tmp_path.parent / "escape.json").exists()


def test_a_directory_without_a_tokenizer_has_no_bundle(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert pack(tmp_path) is None
