"""The operator console's two targets, measured in headless Chromium against a local gateway.

    python -m bench.console_browser [--loads 10] [--seconds 30] [--browsers 1,3] [--no-pin]
                            [--screenshots docs/img/console] [--json]

First paint: each view (``login``, ``live``, ``tenants``, ``request``) is loaded ``--loads``
times in a fresh browser context (the token already in its session for the signed-in views);
the table gives the page's first contentful paint (Chromium's ``first-contentful-paint``) and
the moment the view's data is on screen (its first table filled from the admin API), both from
the start of navigation. Target: first paint ≤ 300 ms.

CPU: the gateway's CPU time (user + system, /proc) over ``--seconds`` with no browser open
(the baseline: its own loops, the console's publisher among them), then with each count of
``--browsers`` open on the live view (one refresh a second), each count between two
baselines. The cost of one browser is the difference from the mean of the baselines around
it, divided by the count, as a share of one core. Target: ≤ 1 %.
The same cost read directly: ``GET /admin/cluster`` (the live view's one call a second) back
to back for a third of ``--seconds``, the gateway's CPU per call beyond the baseline.

The stack: Redis and one echo worker (2 slots, 50 ms steps, so requests queue) on core 1, the
gateway alone on core 0; this script and Chromium on core 1 (``--no-pin``: unpinned). The CPU
runs are of an idle gateway (its own loops the baseline) unless ``--rate R`` keeps R requests
a second per tenant (three tenants) flowing through them all, the baseline included.

``--screenshots DIR``: the views as the docs show them (docs/operations.md), under traffic
from three tenants (``--shots-rate`` requests a second each), one of them over its budget.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
from playwright.sync_api import Browser, Page

from bench.browser import chromium
from bench.harness import ADMIN_TOKEN, backend, console, gateway_server, json_lines, table, tree_cpu_s

VIEWS = {  # view -> what shows its data has arrived
    "login": "document.querySelector('#login-form') !== null",
    "live": "document.querySelectorAll('#workers tr').length > 1",
    "tenants": "document.querySelectorAll('#tenant-list tr').length > 1",
    "request": "document.querySelector('#request-form') !== null",
}
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def _context_page(browser: Browser, base: str, signed_in: bool) -> Page:
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, bypass_csp=True)
    if signed_in:  # as after signing in: the token in the tab's session
        context.add_init_script(f"sessionStorage.setItem('tokengate.admin', {ADMIN_TOKEN!r})")
    return context.new_page()


def first_paint(browser: Browser, base: str, view: str, loads: int) -> tuple[list[float], list[float]]:
    """(first contentful paint ms, data on screen ms) of ``loads`` fresh loads of ``view``."""
    paints, ready = [], []
    for _ in range(loads):
        page = _context_page(browser, base, view != "login")
        page.goto(f"{base}/console#{view}")
        page.wait_for_function(VIEWS[view])
        ready.append(page.evaluate("performance.now()"))
        page.wait_for_function("performance.getEntriesByName('first-contentful-paint').length > 0")
        paints.append(page.evaluate("performance.getEntriesByName('first-contentful-paint')[0].startTime"))
        page.context.close()
    return paints, ready


class Traffic:
    """A background client: ``rate`` requests a second from each of ``keys``, until stopped."""

    def __init__(self, base: str, model: str, keys: Sequence[str], rate: float) -> None:
        self.base, self.model, self.keys, self.rate = base, model, keys, rate
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in keys]

    def _run(self, key: str) -> None:
        body = {"model": self.model, "prompt": "tell me about the weather", "max_tokens": 8}
        with httpx.Client(base_url=self.base, headers={"authorization": f"Bearer {key}"}, timeout=30) as c:

            def send() -> None:
                with contextlib.suppress(httpx.HTTPError):  # the client closes under the last ones
                    c.post("/v1/completions", json=body)

            while not self.stop.is_set():  # open loop: each request in its own thread
                threading.Thread(target=send, daemon=True).start()
                self.stop.wait(1.0 / self.rate)

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()


def tenants(base: str) -> list[str]:
    """Three tenants and a key each: the first with an SLO, the last with a budget the traffic overruns."""
    keys = []
    slo = {"slo_ttft_ms": 1500, "slo_tpot_ms": 100}  # acme's requests are held to an SLO
    for name, rate, extra in (("acme", 10_000, slo), ("globex", 10_000, {}), ("initech", 5, {})):
        r = httpx.post(base + "/admin/tenants", json={"name": name, "rate": rate, "max_queue_delay_s": 0, **extra},
                       headers=ADMIN)
        r.raise_for_status()
        issued = httpx.post(f"{base}/admin/tenants/{r.json()['id']}/keys", json={"name": "bench"}, headers=ADMIN)
        keys.append(issued.json()["key"])
    return keys


def cpu_share(pid: int, seconds: float) -> float:
    """The process's CPU time over ``seconds``, as a share of one core."""
    before, started = tree_cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    return (tree_cpu_s(pid) - before) / (time.monotonic() - started)


def live_browsers(browser: Browser, base: str, n: int) -> list[Page]:
    pages = []
    for _ in range(n):
        page = _context_page(browser, base, True)
        page.goto(f"{base}/console#live")
        page.wait_for_function(VIEWS["live"])
        pages.append(page)
    return pages


def screenshots(browser: Browser, base: str, out: Path, keys: Sequence[str], model: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    page = _context_page(browser, base, False)
    page.goto(f"{base}/console")
    page.fill("#token", "not-the-admin-token")
    page.click("#login-form button")
    page.wait_for_function("document.getElementById('login-error').textContent.length > 0")
    page.screenshot(path=str(out / "login.png"))
    page.context.close()
    page = _context_page(browser, base, True)
    page.goto(f"{base}/console#live")
    time.sleep(45)  # two refreshes a chart point, and 30 s of contracts in the window
    page.screenshot(path=str(out / "live.png"), full_page=True)
    page.click("a[data-view=tenants]")
    page.wait_for_function(VIEWS["tenants"])
    page.click("#tenant-list tr:nth-child(2)")
    page.click("#key-form button")
    page.wait_for_selector("#new-key-box:not([hidden])")
    page.screenshot(path=str(out / "tenants.png"), full_page=True)
    with httpx.stream("POST", base + "/v1/completions", headers={"authorization": f"Bearer {keys[0]}"},
                      json={"model": model, "prompt": "why is the sky blue", "max_tokens": 8, "stream": True}) as r:
        page.click("a[data-view=request]")
        page.fill("#rid", r.headers["x-request-id"])
        page.click("#request-form button")
        page.wait_for_function("document.querySelector('#record').innerText.includes('tenant')")
        page.screenshot(path=str(out / "request.png"), full_page=True)
        for _ in r.iter_bytes():
            pass
    page.context.close()
    print(f"screenshots in {out}")


@contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """This process (and the Chromium it starts) on ``cpus``."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--browsers", default="1,3")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="requests a second per tenant during the CPU runs (0: an idle gateway)")
    ap.add_argument("--shots-rate", type=float, default=2.0, help="requests a second per tenant for the screenshots")
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--screenshots", type=Path)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    gateway_cpus, other_cpus = ([0], [1]) if pin else ([], [])
    extra_worker = ["--echo-step-ms", "50", "--echo-tokens", "8"]
    rows: list[dict[str, object]] = []
    with backend("echo", slots=2, cpus=other_cpus, extra_worker=extra_worker) as (redis_url, procs), \
            gateway_server(redis_url, ["--policy", "smdp"], backend_procs=procs, cpus=gateway_cpus) as (base, gw), \
            pinned(set(other_cpus) if pin else None), chromium() as browser:
        keys = tenants(base)
        models = httpx.get(base + "/v1/models", headers={"authorization": f"Bearer {keys[0]}"}).json()
        model_name = models["data"][0]["id"]
        for view in VIEWS:
            paints, ready = first_paint(browser, base, view, args.loads)
            rows.append({"view": view, "loads": args.loads, "fcp_ms_median": statistics.median(paints),
                         "fcp_ms_max": max(paints), "data_ms_median": statistics.median(ready),
                         "data_ms_max": max(ready)})
        table("First paint of each view (ms from navigation start)",
              ["view", "loads", "first paint median", "first paint max", "data median", "data max"],
              [[r["view"], r["loads"], r["fcp_ms_median"], r["fcp_ms_max"], r["data_ms_median"], r["data_ms_max"]]
               for r in rows])
        counts = [int(x) for x in args.browsers.split(",")]
        cpu_rows = []
        with Traffic(base, model_name, keys, args.rate) if args.rate > 0 else contextlib.nullcontext():
            time.sleep(10)  # what the first-paint loads left behind settles
            baselines = [cpu_share(gw.pid, args.seconds)]
            cpu_rows.append({"browsers": 0, "gateway_cpu": baselines[0], "per_browser": None})
            for n in counts:  # each count between two baselines, against their mean
                pages = live_browsers(browser, base, n)
                share = cpu_share(gw.pid, args.seconds)
                for page in pages:
                    page.context.close()
                baselines.append(cpu_share(gw.pid, args.seconds))
                around = (baselines[-2] + baselines[-1]) / 2
                cpu_rows.append({"browsers": n, "gateway_cpu": share, "per_browser": (share - around) / n})
                cpu_rows.append({"browsers": 0, "gateway_cpu": baselines[-1], "per_browser": None})
            base_share = statistics.mean(baselines)
            # the same cost read another way: CPU per answer of the live view's one call
            calls, started, before = 0, time.monotonic(), tree_cpu_s(gw.pid)
            with httpx.Client(base_url=base, headers=ADMIN) as client:
                while time.monotonic() - started < args.seconds / 3:
                    client.get("/admin/cluster").raise_for_status()
                    calls += 1
            spent = tree_cpu_s(gw.pid) - before - base_share * (time.monotonic() - started)
            cpu_rows.append({"browsers": None, "cluster_calls": calls, "cpu_ms_per_call": 1000 * spent / calls})
        where = ", gateway pinned to core 0" if pin else ", unpinned"
        load = f"{len(keys) * args.rate:g} requests/s" if args.rate > 0 else "no traffic"
        table(f"Gateway CPU (share of one core) with the live view open, {args.seconds:g} s each, {load}{where}",
              ["browsers", "gateway CPU", "per browser"],
              [[r["browsers"], f"{100 * r['gateway_cpu']:.2f} %",  # type: ignore[operator]
                "–" if r["per_browser"] is None else f"{100 * r['per_browser']:.2f} %"]  # type: ignore[operator]
               for r in cpu_rows if r["browsers"] is not None])
        console.print(f"GET /admin/cluster: {calls} calls back to back, {1000 * spent / calls:.2f} ms of gateway "
                      f"CPU each beyond the baseline: {100 * spent / calls:.2f} % of a core at one a second")
        if args.screenshots:
            with Traffic(base, model_name, keys, args.shots_rate):
                screenshots(browser, base, args.screenshots, keys, model_name)
    if args.json:
        json_lines([*rows, *cpu_rows])


if __name__ == "__main__":
    main()
