"""What `serve` prints once it is ready: where to send requests, the models and their workers
(the path each took and what it measured of itself), the demo key and the admin token."""

from __future__ import annotations

from pathlib import Path

from common import protocol as p
from gateway.settings import GatewaySettings

DEMO_TENANT = "demo"


def worker_line(hb: p.Heartbeat) -> str:
    """One worker as the banner shows it: the path it took (AMX bf16, bf16, fp32, a GPU) and
    why, and what it measured of itself at start."""
    path = "AMX bf16" if hb.profile_part("facts").get("amx_used") else hb.dtype
    line = f"  {hb.pool} worker {hb.worker}: {hb.engine} on {hb.device}, {path} ({hb.choice})"
    summary = hb.profile_part("summary")
    if summary:
        line += (f"; measured at start ({hb.profile.get('how', '?')}, {hb.profile.get('cost_s', 0.0):.1f} s): "
                 f"prefill {summary.get('prefill_tokens_per_s', 0.0):.0f} tokens/s, "
                 f"decode step {summary.get('decode_step_ms', 0.0):.1f} ms")
        starved = hb.profile.get("starved", 0.0)
        if isinstance(starved, float) and starved >= p.STARVED_SHARE:
            line += (f" (starved of CPU: {starved * 100:.0f}% of its time waiting for one, another program is "
                     "running; the gateway follows the live steps)")
    return line


def banner(settings: GatewaySettings, models: list[str], pools: list[str], key: str, key_file: Path,
           token_from: str, workers: dict[str, p.Heartbeat]) -> str:
    """What `serve` prints once it is ready; ``token_from``: where the admin token came from (its
    file, or the flag). The example request asks for the first model."""
    base = f"http://{settings.host}:{settings.port}"
    model = models[0]
    body = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Say hello in five words."}}]}}'
    served = f"model {model}" if len(models) == 1 else f"models {', '.join(models)}"
    return (
        f"\ntokengate is ready at {base}  ({served}; workers: {', '.join(pools)}; redis {settings.redis_url})\n"
        + "".join((f"  model {hb.model}:\n" if len(models) > 1 and hb.model != last else "") + worker_line(hb) + "\n"
                  for last, hb in _by_model(workers)) +
        f"Tenant '{DEMO_TENANT}', API key: {key}  (kept in {key_file})\n"
        f"Admin token (for /admin and `tokengate tenants|keys`): {settings.admin_token}  ({token_from})\n"
        f"Console: {base}/console  (sign in with the admin token)\n"
        f"Try:\n  curl {base}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-H 'Authorization: Bearer {key}' -d '{body}'\n"
        "Ctrl-C stops everything.\n"
    )


def _by_model(workers: dict[str, p.Heartbeat]) -> list[tuple[str, p.Heartbeat]]:
    """The workers by model, then id, each with the model of the one before it ("" first)."""
    ordered = [hb for _, hb in sorted(workers.items(), key=lambda kv: (kv[1].model, kv[0]))]
    return list(zip(["", *(hb.model for hb in ordered)], ordered, strict=False))
