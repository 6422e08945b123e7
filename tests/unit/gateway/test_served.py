"""Which worker's tokenizer a gateway started with ``--model-from-workers`` takes."""

from __future__ import annotations

from common import protocol as p
from gateway.cli.served import announced


def _hb(worker: str, model: str, tokenizer: str, started: float, down: str = "") -> p.Heartbeat:
    return p.Heartbeat(worker, "cpu", "cpu", "none", "echo", model, 1, 1, 0.0, started, down=down,
                       tokenizer=tokenizer)


def test_every_gateway_takes_the_tokenizer_of_the_same_worker() -> None:
    fleet = [_hb("b", "small", "d2", 20.0), _hb("a", "small", "d1", 10.0), _hb("c", "large", "d3", 5.0),
             _hb("d", "large", "", 1.0), _hb("e", "small", "d9", 1.0, down="draining")]
    assert announced(fleet, None) is fleet[2]  # the longest running live one that published one
    assert announced(fleet, "small") is fleet[1]
    assert announced(list(reversed(fleet)), "small") is fleet[1]
    assert announced(fleet, "missing") is None
