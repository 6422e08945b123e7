"""The operator console of a gateway serving two models (issue 39), in a real browser (Debian's
Chromium, headless, through Playwright) against `tokengate serve --engine echo` with two
models: the page offers a model picker, and picking a model shows that model's domain (its
workers, its counters) as `/admin/cluster?model=` gives it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import Page

from bench.browser import chromium
from tests.e2e.conftest import ADMIN_TOKEN, Served, serving
from workers.model_store import ModelSpec

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODELS = ("small", "large")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, model_spec: ModelSpec) -> Iterator[Served]:
    # the echo workers stand in for the two names, both counting tokens with the packaged tokenizer
    packaged = str(model_spec.path)
    with serving(["serve", "--engine", "echo", "--echo-tokens", "4", "--admin-token", ADMIN_TOKEN,
                  "--model", packaged, "--model-name", MODELS[0], "--model", packaged, "--model-name", MODELS[1]],
                 tmp_path_factory.mktemp("console-models")) as served:
        yield served


@pytest.fixture
def page(gateway: Served) -> Iterator[Page]:
    with chromium() as browser:
        context = browser.new_context(viewport={"width": 1400, "height": 1000}, bypass_csp=True)
        page = context.new_page()
        failures: list[str] = []
        page.on("pageerror", lambda exc: failures.append(str(exc)))
        page.goto(gateway.base_url + "/console")
        yield page
        context.close()
        assert not failures


def test_the_console_shows_one_model_s_domain_at_a_time(gateway: Served, page: Page) -> None:
    admin = gateway.auth(ADMIN_TOKEN)
    assert httpx.post(gateway.base_url + "/admin/tenants", json={"name": "t", "rate": 1e6, "burst": 10**8},
                      headers=admin).status_code == 201
    key = httpx.post(gateway.base_url + "/admin/tenants/t/keys", headers=admin).json()["key"]
    for _ in range(3):  # traffic on the second model only
        r = httpx.post(gateway.base_url + "/v1/completions", headers=gateway.auth(key), timeout=60,
                       json={"model": MODELS[1], "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200, r.text

    page.fill("#token", ADMIN_TOKEN)
    page.click("#login-form button")
    page.wait_for_selector("#live:not([hidden])")
    page.wait_for_selector("#model:not([hidden])")  # two models: the picker shows
    assert page.eval_on_selector_all("#model option", "os => os.map(o => o.value)") == list(MODELS)
    page.wait_for_function(f"document.getElementById('where').innerText.includes('model {MODELS[0]}')")

    page.select_option("#model", MODELS[1])
    page.wait_for_function(f"document.getElementById('where').innerText.includes('model {MODELS[1]}')")
    page.wait_for_function("document.querySelector('#workers').innerText.includes('echo')")
    # the counters are the gateways' published parts, rewritten every second (status.PUBLISH_S)
    deadline = time.monotonic() + 10
    while True:
        view = httpx.get(gateway.base_url + "/admin/cluster", params={"model": MODELS[1]}, headers=admin).json()
        if view["counters"]["admitted"] == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert view["model"] == MODELS[1] and [w["model"] for w in view["workers"]] == [MODELS[1]]
    assert view["counters"]["admitted"] == 3  # the second model's own counters
    first = httpx.get(gateway.base_url + "/admin/cluster", headers=admin).json()
    assert first["model"] == MODELS[0] and first["counters"]["admitted"] == 0
