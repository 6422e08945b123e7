"""PNG plots of a `tokengate simulate` sweep (matplotlib, Agg backend, small files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sched_core.simulate.engine import Result

STYLE = {"fcfs": "C0", "fixed": "C1", "window": "C2", "gpu-only": "C3",
         "three-regime": "C4", "tokengate": "C5", "tokengate-seq": "C9"}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'tokengate[bench]' "
                           "(or pass --no-plots)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _subtitle(info: dict[str, Any]) -> str:
    parts = []
    for path, p in info["profiles"].items():
        parts.append(f"{path} {p['workers']}x{p['slots']} {p['name']}"
                     + (" [DERIVED, not measured]" if p["derived"] else ""))
    return "; ".join(parts) + f"\nSLO: {info['slo']}"


def write_all(out: Path, rows: list[dict[str, Any]], service: dict[str, Result],
              info: dict[str, Any], top_rate: float) -> list[Path]:
    plt = _pyplot()
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    written = []

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=80)
    for p in policies:
        pts = sorted((r["rate_rps"], r["p99_ms"], r["p50_ms"]) for r in rows if r["policy"] == p)
        xs = [x for x, _, _ in pts]
        ax.plot(xs, [y / 1000 for _, y, _ in pts], "-o", ms=3, color=STYLE.get(p), label=f"{p} p99")
        ax.plot(xs, [y / 1000 for _, _, y in pts], ":", color=STYLE.get(p))
    ax.set_yscale("log")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("end-to-end latency (s): p99 solid, p50 dotted")
    ax.set_title("Latency vs load\n" + _subtitle(info), fontsize=7)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    written.append(_save(fig, plt, out / "latency_vs_load.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=80)
    for p in policies:
        att = sorted((r["rate_rps"], r["slo_attainment"]) for r in rows if r["policy"] == p)
        ax.plot([x for x, _ in att], [y * 100 for _, y in att], "-o", ms=3, color=STYLE.get(p),
                label=p)
    ax.axhline(90, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 101)
    ax.set_title("SLO attainment vs load\n" + _subtitle(info), fontsize=7)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    written.append(_save(fig, plt, out / "slo_vs_load.png"))

    if service:

        fig, axes = plt.subplots(1, len(service), figsize=(4.0 * len(service), 3.6), dpi=80,
                                 sharey=True, squeeze=False)
        for ax, (policy, result) in zip(axes[0], service.items(), strict=True):
            for tenant, (xs, ys) in service_series(result).items():
                ax.plot(xs, ys, label=f"{tenant} (budget {result.budgets[tenant]:g})")
            ax.set_title(f"{policy} at {top_rate:g} req/s", fontsize=8)
            ax.set_xlabel("simulated time (s)")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("served (prompt + 2 x output tokens) / budget")
        axes[0][0].legend(fontsize=6)
        fig.suptitle("Per-tenant service over time; " + _subtitle(info).replace("\n", "; "),
                     fontsize=6)
        written.append(_save(fig, plt, out / "tenant_service.png"))
    return written


def _save(fig: Any, plt: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def service_series(result: Result, weights: tuple[float, float] = (1.0, 2.0)
                   ) -> dict[str, tuple[list[float], list[float]]]:
    """Per tenant: times and cumulative weighted service divided by the tenant's budget."""
    out = {}
    for tenant, entries in result.service.items():
        total, xs, ys = 0.0, [], []
        for t, p, o in sorted(entries):
            total += (weights[0] * p + weights[1] * o) / result.budgets[tenant]
            xs.append(t)
            ys.append(total)
        out[tenant] = (xs, ys)
    return out
