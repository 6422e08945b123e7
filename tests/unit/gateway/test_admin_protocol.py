"""Tenant validation: what the admin API accepts, and the 400 (with param) it gives otherwise."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.tenancy import admin_protocol as ap
from gateway.tenancy.tenants import Limits, from_doc, is_id, to_doc


def test_defaults_of_a_new_tenant() -> None:
    t = ap.parse_create({"name": "acme", "rate": 100}, now=1_700_000_000)
    assert is_id(t.id) and t.name == "acme" and t.rate == 100.0
    assert t.burst == 1000 and t.weight == 100.0 and t.priority == 0
    assert t.max_queue_delay_s == 2.0 and t.limits == Limits() and t.created == 1_700_000_000
    assert t.slo_ttft_ms is None and t.slo_tpot_ms is None


def test_the_document_round_trips() -> None:
    body = {
        "name": "a.b-c",
        "rate": 2.5,
        "burst": 15,
        "priority": 3,
        "weight": 9.0,
        "max_queue_delay_s": 0,
        "slo_ttft_ms": 750,
        "slo_tpot_ms": 42.5,
        "limits": {
            "max_prompt_tokens": 10,
            "max_output_tokens": 5,
            "max_concurrent": 2,
            "allowed_models": ["m", "m"],
        },
    }
    t = ap.parse_create(body)
    assert t.limits.allowed_models == ("m",)
    assert (t.slo_ttft_ms, t.slo_tpot_ms) == (750.0, 42.5)
    assert from_doc(to_doc(t)) == t


def test_a_document_stored_before_tenants_had_an_slo_still_loads() -> None:
    t = ap.parse_create({"name": "old", "rate": 1, "slo_ttft_ms": 500})
    doc = to_doc(t)
    del doc["slo_ttft_ms"], doc["slo_tpot_ms"]
    old = from_doc(doc)
    assert old.slo_ttft_ms is None and old.slo_tpot_ms is None and old.name == "old"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"rate": 1}, "name"),
        ({"name": "tn_x", "rate": 1}, "name"),  # '_' is reserved for ids
        ({"name": "", "rate": 1}, "name"),
        ({"name": "x" * 65, "rate": 1}, "name"),
        ({"name": "a", "rate": 0}, "rate"),
        ({"name": "a", "rate": "5"}, "rate"),
        ({"name": "a", "rate": True}, "rate"),
        ({"name": "a", "rate": 1, "burst": 0}, "burst"),
        ({"name": "a", "rate": 1, "burst": 2.5}, "burst"),
        ({"name": "a", "rate": 1, "priority": 10}, "priority"),
        ({"name": "a", "rate": 1, "max_queue_delay_s": -1}, "max_queue_delay_s"),
        ({"name": "a", "rate": 1, "slo_ttft_ms": 0}, "slo_ttft_ms"),
        ({"name": "a", "rate": 1, "slo_ttft_ms": 5e-324}, "slo_ttft_ms"),  # rounds to 0 s
        ({"name": "a", "rate": 1, "slo_ttft_ms": 600_001}, "slo_ttft_ms"),
        ({"name": "a", "rate": 1, "slo_ttft_ms": "500"}, "slo_ttft_ms"),
        ({"name": "a", "rate": 1, "slo_tpot_ms": -5}, "slo_tpot_ms"),
        ({"name": "a", "rate": 1, "slo_tpot_ms": 60_001}, "slo_tpot_ms"),
        ({"name": "a", "rate": 1, "slo_tpot_ms": float("inf")}, "slo_tpot_ms"),
        ({"name": "a", "rate": 1, "slo_tpot_ms": True}, "slo_tpot_ms"),
        ({"name": "a", "rate": 1, "limits": {"max_concurrent": 0}}, "limits.max_concurrent"),
        ({"name": "a", "rate": 1, "limits": {"max_concurent": 1}}, "limits.max_concurent"),
        ({"name": "a", "rate": 1, "limits": {"allowed_models": "m"}}, "limits.allowed_models"),
        ({"name": "a", "rate": 1, "colour": "red"}, "colour"),
    ],
)
def test_invalid_tenants_are_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        ap.parse_create(body)
    assert info.value.param == param and info.value.status == 400


def test_updates_change_only_what_is_given_and_null_clears_a_limit() -> None:
    t = ap.parse_create(
        {"name": "a", "rate": 10, "limits": {"max_concurrent": 3, "max_output_tokens": 9}}
    )
    u = ap.apply_update(t, ap.parse_update({"burst": 50, "limits": {"max_concurrent": None}}))
    assert u.burst == 50 and u.rate == 10.0 and u.name == "a"
    assert u.limits.max_concurrent is None and u.limits.max_output_tokens == 9


def test_an_update_sets_an_slo_absent_keeps_it_and_null_removes_it() -> None:
    t = ap.parse_create({"name": "a", "rate": 10, "slo_ttft_ms": 800})
    assert t.slo_ttft_ms == 800.0 and t.slo_tpot_ms is None
    u = ap.apply_update(t, ap.parse_update({"slo_tpot_ms": 30}))
    assert (u.slo_ttft_ms, u.slo_tpot_ms) == (800.0, 30.0)
    assert ap.apply_update(u, ap.parse_update({"burst": 5})) == replace(u, burst=5)
    cleared = ap.apply_update(u, ap.parse_update({"slo_ttft_ms": None}))
    assert (cleared.slo_ttft_ms, cleared.slo_tpot_ms) == (None, 30.0)
    with pytest.raises(InvalidRequest) as info:
        ap.parse_update({"slo_tpot_ms": 0})
    assert info.value.param == "slo_tpot_ms"


def test_a_weight_that_followed_the_rate_keeps_following_it() -> None:
    t = ap.parse_create({"name": "a", "rate": 10})
    assert ap.apply_update(t, ap.parse_update({"rate": 20})).weight == 20.0
    pinned = ap.apply_update(t, ap.parse_update({"weight": 5}))
    assert ap.apply_update(pinned, ap.parse_update({"rate": 40})).weight == 5.0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"name": None}, "name"),
        ({"rate": None}, "rate"),
        ({"id": "tn_0"}, "id"),
        ({"created": 1}, "created"),
    ],
)
def test_updates_refuse_nulls_and_fixed_fields(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        ap.parse_update(body)
    assert info.value.param == param


def test_key_labels() -> None:
    assert ap.parse_key_create({}) == "" and ap.parse_key_create({"name": "ci"}) == "ci"
    with pytest.raises(InvalidRequest):
        ap.parse_key_create({"name": "x" * 129})
