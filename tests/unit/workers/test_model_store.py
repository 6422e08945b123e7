"""The sampling defaults a model directory ships (its generation_config.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from workers.model_store import generation_defaults


def _model(tmp_path: Path, config: Any) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_model_without_a_generation_config_ships_no_defaults(tmp_path: Path) -> None:
    assert generation_defaults(tmp_path) == {}


def test_only_the_sampling_fields_the_file_sets_are_taken(tmp_path: Path) -> None:
    # what the converted SmolLM2 GGUF ships: no sampling field at all
    smol = {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "use_cache": True}
    assert generation_defaults(_model(tmp_path, smol)) == {}
    llama = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [1, 2]}
    assert generation_defaults(_model(tmp_path, llama)) == {"temperature": 0.6, "top_p": 0.9}
    assert generation_defaults(_model(tmp_path, {"temperature": 0})) == {"temperature": 0.0}
    assert generation_defaults(_model(tmp_path, {"top_p": 1})) == {"top_p": 1.0}


@pytest.mark.parametrize("config", [{"temperature": 3.0}, {"temperature": -1}, {"temperature": "0.7"},
                                    {"temperature": True}, {"top_p": 0}, {"top_p": 1.5}, [0.7], "x"])
def test_a_value_a_request_could_not_send_is_ignored(tmp_path: Path, config: Any) -> None:
    assert generation_defaults(_model(tmp_path, config)) == {}


def test_an_unreadable_file_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{not json")
    assert generation_defaults(tmp_path) == {}
