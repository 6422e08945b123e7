"""The operator console in a real browser (Debian's Chromium, headless, through Playwright)
against a real `tokengate serve` with the echo engine and two gateway processes sharing its
port (each of the page's calls reaches either; the page shows the cluster, the scheduler's
queue and explanations through whichever answers): a wrong token is refused; an operator
signs in, creates a tenant (the admin API's own errors shown), issues a key, sends traffic
with it, watches the live queue move and the tenant's usage, reads one request explained,
revokes the key and the next request with it is refused. Opened after traffic, the live
view's chart shows it."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page

from bench.browser import chromium
from tests.e2e.conftest import ADMIN_TOKEN, Served, banner_match, serving

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEP_MS = 100  # the echo engine's step: 8 tokens take 0.8 s, and with one slot the others queue
TENANT = "console-shop"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(["serve", "--engine", "echo", "--echo-tokens", "8", "--echo-step-ms", str(STEP_MS),
                  "--slots", "1", "--policy", "smdp", "--gateways", "2", "--admin-token", ADMIN_TOKEN],
                 tmp_path_factory.mktemp("console")) as served:
        yield served


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as b:
        yield b


@pytest.fixture
def page(browser: Browser, gateway: Served) -> Iterator[Page]:
    # the page forbids eval (its CSP); Playwright's waits evaluate their conditions, so they bypass it
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, bypass_csp=True)
    page = context.new_page()
    failures: list[str] = []
    page.on("pageerror", lambda exc: failures.append(str(exc)))  # an uncaught error in the page's script
    page.goto(gateway.base_url + "/console")
    yield page
    context.close()
    assert not failures


def _sign_in(page: Page, token: str) -> None:
    page.fill("#token", token)
    page.click("#login-form button")


def _text(page: Page, selector: str) -> str:
    return page.inner_text(selector).strip()


def test_the_page_runs_only_its_own_code(gateway: Served) -> None:
    shown = banner_match(gateway, r"^Console: (\S+)  \(sign in with the admin token\)").group(1)
    assert shown == gateway.base_url + "/console"  # serve's banner names the page
    page = httpx.get(shown)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert ADMIN_TOKEN not in page.text
    for asset in re.findall(r'(?:src|href)="(/console/static/[^"]+)"', page.text):
        got = httpx.get(gateway.base_url + asset)
        assert got.status_code == 200 and got.headers["content-security-policy"] == policy, asset
    assert not re.search(r'(?:src|href)="(?:https?:)?//', page.text)  # nothing from elsewhere


def test_a_wrong_token_is_refused_with_the_admin_api_s_message(page: Page, gateway: Served) -> None:
    _sign_in(page, "not-the-admin-token-at-all")
    page.wait_for_function("document.getElementById('login-error').textContent.length > 0")
    expected = httpx.get(gateway.base_url + "/admin/cluster", headers={"authorization": "Bearer x"}).json()
    assert _text(page, "#login-error") == expected["error"]["message"]
    assert page.is_visible("#login") and not page.is_visible("#live")
    assert page.evaluate("sessionStorage.length") == 0
    page.goto(gateway.base_url + "/console#tenants")  # a view's address without a token shows the sign-in
    assert page.is_visible("#login") and not page.is_visible("#tenants")


def _stream(served: Served, key: str, rids: list[str], statuses: list[int]) -> None:
    """One streamed request; its id is known once its headers arrive (at admission)."""
    body = {"model": served.model, "prompt": "hello there", "max_tokens": 8, "stream": True}
    with httpx.stream("POST", served.base_url + "/v1/completions", json=body, headers=served.auth(key),
                      timeout=60) as r:
        rids.append(r.headers.get("x-request-id", ""))
        for _ in r.iter_bytes():
            pass
        statuses.append(r.status_code)


def test_an_operator_runs_a_tenant_from_sign_in_to_revoked_key(page: Page, gateway: Served, tmp_path: Path) -> None:
    _sign_in(page, ADMIN_TOKEN)
    page.wait_for_selector("#live:not([hidden])")
    page.wait_for_function("document.querySelector('#workers').innerText.includes('echo')")
    page.wait_for_function("document.querySelectorAll('#gateways tr').length === 3")  # both, whichever answers
    assert re.search(r"model \S+ · gateway \S+ \((scheduler|follower)\) · 2 gateway\(s\) · 1 worker\(s\)",
                     _text(page, "#where"))
    roles = sorted(row.split("\t")[1] for row in _text(page, "#gateways").splitlines()[1:])
    assert roles == ["follower", "scheduler"]
    page.wait_for_function("document.querySelector('#policy').innerText.includes('macro-state')")
    assert "policy smdp" in _text(page, "#policy")  # the SMDP table in force, and its state now
    assert page.query_selector("#policy .state-now") is not None
    # re-solved on the traffic it serves every 15 minutes; nothing re-solved yet in a fresh deployment
    assert "self-tuning: every 15 min · the packaged table is in force" in _text(page, "#policy")

    # a tenant: first with a rate the admin API refuses, in its own words, then right
    page.click("a[data-view=tenants]")
    page.fill("#create-form [name=name]", TENANT)
    page.fill("#create-form [name=rate]", "fast")
    page.click("#create-form button")
    page.wait_for_function("document.getElementById('create-error').textContent.length > 0")
    refused = httpx.post(gateway.base_url + "/admin/tenants", json={"name": TENANT, "rate": "fast"},
                         headers=gateway.auth(ADMIN_TOKEN))
    assert refused.status_code == 400 and _text(page, "#create-error") == refused.json()["error"]["message"]
    page.fill("#create-form [name=rate]", "100000")
    page.click("#create-form button")
    page.wait_for_selector("#tenant-panel:not([hidden])")
    assert _text(page, "#tenant-name") == TENANT
    tenants = httpx.get(gateway.base_url + "/admin/tenants", headers=gateway.auth(ADMIN_TOKEN)).json()["data"]
    tenant = next(t for t in tenants if t["name"] == TENANT)
    assert tenant["rate"] == 100000

    # an edit with a value the API refuses keeps the tenant as it was; a good one is saved
    page.fill("#edit-form [name='limits.max_concurrent']", "0")
    page.click("#edit-form button")
    page.wait_for_function("document.getElementById('edit-error').textContent.includes('max_concurrent')")
    page.fill("#edit-form [name='limits.max_concurrent']", "16")
    page.click("#edit-form button")
    page.wait_for_function("document.getElementById('edit-error').textContent === 'Saved.'")
    got = httpx.get(gateway.base_url + f"/admin/tenants/{tenant['id']}", headers=gateway.auth(ADMIN_TOKEN)).json()
    assert got["limits"]["max_concurrent"] == 16

    # a key, shown once
    page.click("#key-form button")
    page.wait_for_selector("#new-key-box:not([hidden])")
    key = _text(page, "#new-key")
    assert re.fullmatch(r"tg-[0-9a-f]{8}-[A-Za-z0-9_-]{43}", key)
    assert page.query_selector(f"#keys button[data-prefix='{key[3:11]}']") is not None
    page.screenshot(path=str(tmp_path / "tenants.png"), full_page=True)

    # traffic with that key: one slot, so the live queue grows and drains
    page.click("a[data-view=live]")
    rids: list[str] = []
    statuses: list[int] = []
    senders = [threading.Thread(target=_stream, args=(gateway, key, rids, statuses)) for _ in range(6)]
    for t in senders:
        t.start()
    page.wait_for_function("Number(document.getElementById('queued').textContent) >= 3", timeout=10_000)
    page.wait_for_function("Number(document.getElementById('rate-admitted').textContent) > 0", timeout=10_000)
    # the echo worker's pool only: not the other path the scheduler keeps without workers
    column = "(cells) => cells.map((td) => td.textContent)"
    paths = page.eval_on_selector_all("#paths tr td:first-child", column)
    pools = sorted(set(page.eval_on_selector_all("#workers tr td:nth-child(2)", column)))
    assert paths == pools and len(pools) == 1, (paths, pools)
    page.screenshot(path=str(tmp_path / "live.png"), full_page=True)

    # one request explained while the scheduler holds it: the last to arrive waits behind the others
    page.click("a[data-view=request]")
    while len(rids) < 6:
        threading.Event().wait(0.02)
    last = rids[-1]
    page.fill("#rid", last)
    page.click("#request-form button")
    page.wait_for_function("document.querySelector('#schedule').innerText.includes('request_id')")
    assert last in _text(page, "#schedule")
    assert f"tenant\t{TENANT} ({tenant['id']})" in _text(page, "#record")  # its name, beside its id
    assert "– / –" not in _text(page, "#record")  # its promise, from the scheduler before the record has it
    page.screenshot(path=str(tmp_path / "request.png"), full_page=True)

    for t in senders:
        t.join(timeout=30)
    assert statuses == [200] * 6
    page.click("a[data-view=live]")
    page.wait_for_function("document.getElementById('queued').textContent === '0'", timeout=10_000)
    # after it ended: its record holds what it took, the scheduler no longer holds it
    page.click("a[data-view=request]")
    page.click("#request-form button")
    page.wait_for_function("document.querySelector('#record').innerText.includes('done')")
    assert "not held by the scheduler" in _text(page, "#schedule")

    # the tenant's usage, from the admin API's usage
    page.click("a[data-view=tenants]")
    page.wait_for_function(
        f"[...document.querySelectorAll('#tenant-list tr')].some(r => r.dataset.id === '{tenant['id']}' "
        "&& r.children[10].textContent === '6')", timeout=10_000)

    # revoke the key: the next request with it is refused
    page.click(f"#tenant-list tr[data-id='{tenant['id']}']")
    page.wait_for_selector(f"#keys button[data-prefix='{key[3:11]}']")
    page.click(f"#keys button[data-prefix='{key[3:11]}']")
    page.wait_for_function(f"!document.querySelector(\"#keys button[data-prefix='{key[3:11]}']\")")
    refused = httpx.post(gateway.base_url + "/v1/completions", headers=gateway.auth(key),
                         json={"model": gateway.model, "prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert ADMIN_TOKEN not in page.url and key not in page.url  # never in an address

    # signing out forgets the token
    page.click("#logout")
    assert page.is_visible("#login") and page.evaluate("sessionStorage.length") == 0


def test_the_traffic_chart_shows_the_last_minutes_as_soon_as_the_page_opens(browser: Browser, gateway: Served
                                                                            ) -> None:
    """Traffic first, the page after: its first refresh draws the admissions already past
    (the gateways keep their recent samples), where it used to start from an empty chart."""
    admin = gateway.auth(ADMIN_TOKEN)
    tenant = httpx.post(gateway.base_url + "/admin/tenants", json={"name": "console-history", "rate": 100000},
                        headers=admin).json()
    key = httpx.post(gateway.base_url + f"/admin/tenants/{tenant['id']}/keys", json={}, headers=admin).json()["key"]
    rids: list[str] = []
    statuses: list[int] = []
    senders = [threading.Thread(target=_stream, args=(gateway, key, rids, statuses)) for _ in range(3)]
    for t in senders:
        t.start()
    for t in senders:
        t.join(timeout=30)
    assert statuses == [200] * 3
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, bypass_csp=True)
    try:
        page = context.new_page()
        page.goto(gateway.base_url + "/console")
        _sign_in(page, ADMIN_TOKEN)
        page.wait_for_selector("#chart-traffic polyline.c0", state="attached")
        points = page.get_attribute("#chart-traffic polyline.c0", "points") or ""  # the first refresh's
        heights = [float(xy.split(",")[1]) for xy in points.split()]
        assert len(heights) > 1 and min(heights) < 90, points  # admissions above the chart's floor (y 98)
        assert float(points.split()[-1].split(",")[0]) == 400.0  # its last point is now, at the right edge
    finally:
        context.close()
