"""vLLM's benchmark client, guidellm, against ``tokengate serve``, as its README runs it.

    python -m bench.guidellm [--guidellm PATH] [--seconds 20] [--json]

guidellm is not a dependency: it pins its own torch and transformers, so it lives in its own
virtual environment (``python3 -m venv /tmp/gl && /tmp/gl/bin/pip install guidellm``) and
``--guidellm`` names its executable (default: ``guidellm`` on the PATH). The run is
guidellm's quick start, unchanged: a sweep (synchronous, throughput, then constant rates
between the two) of synthetic 256-token prompts asking for 128 tokens, each benchmark
``--seconds`` long, over its OpenAI HTTP backend (chat completions, streamed; it first probes
``GET /health``). Two things are this machine's, not guidellm's defaults: the API key (serve's
demo tenant's) and the tokenizer guidellm builds its prompts with, the default model's own
from the local model cache (guidellm would fetch the served model's name from the Hugging Face
hub, which nothing here may reach). It prints guidellm's figures per benchmark (from its log:
its JSON report is written only when every benchmark compiles) and the errored and incomplete
requests; the target is 0 errors.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.harness import ADMIN_TOKEN, OUT, console, spawn, stop, table, wait_ready
from gateway.cli.embedded_redis import free_port
from gateway.cli.serve_state import demo_key_file
from workers import model_store

# guidellm's progress line at the end of each benchmark (its JSON report is written only when the
# whole sweep compiles, and guidellm 0.8.1 raises on a benchmark that saw no request end)
_DONE = re.compile(r"Benchmark \d+ \((?P<strategy>[^)]+)\): completed \| elapsed=(?P<elapsed>[\d.]+)s \| "
                   r"successful=(?P<successful>\d+) errored=(?P<errored>\d+) incomplete=(?P<incomplete>\d+) \| "
                   r"requests/s=(?P<rps>[\d.]+) output_tokens/s=(?P<tps>[\d.]+)")


def rows(log: str) -> list[dict[str, Any]]:
    """One row per benchmark guidellm completed, from its log."""
    return [{"strategy": m["strategy"], "elapsed_s": float(m["elapsed"]), "successful": int(m["successful"]),
             "errored": int(m["errored"]), "incomplete": int(m["incomplete"]), "requests_per_s": float(m["rps"]),
             "output_tokens_per_s": float(m["tps"])} for m in _DONE.finditer(log)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--guidellm", default="guidellm", help="guidellm's executable")
    parser.add_argument("--seconds", type=float, default=20.0, help="each benchmark's length")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = parser.parse_args()
    guidellm = shutil.which(args.guidellm)
    if guidellm is None:
        raise SystemExit(f"{args.guidellm!r} not found: install guidellm in its own venv and pass --guidellm")
    tokenizer = model_store.resolve(None, model_store.default_cache_dir()).path
    port = free_port()
    with tempfile.TemporaryDirectory() as data_dir:
        serve = spawn(["-m", "gateway.cli", "--log-level", "WARNING", "serve", "--data-dir", data_dir,
                       "--port", str(port), "--admin-token", ADMIN_TOKEN], OUT / "guidellm-serve.log")
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base, [serve], timeout_s=300)
            key = demo_key_file(Path(data_dir)).read_text().strip()
            argv = [guidellm, "run", "--backend", f"kind=openai_http,target={base},api_key={key}",
                    "--profile", "kind=sweep", "--data", "kind=synthetic_text,prompt_tokens=256,output_tokens=128",
                    "--tokenizer", f"kind=hf_auto,model={tokenizer}",
                    "--constraint", f"kind=max_duration,seconds={args.seconds:g}",
                    "--disable-console-interactive"]
            console.print("$ " + " ".join(argv).replace(key, "<demo key>"))
            env = {**os.environ, "HF_HUB_OFFLINE": "1"}
            done = subprocess.run(argv, env=env, cwd=OUT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            (OUT / "guidellm.log").write_text(done.stdout)
        finally:
            stop([serve])
    got = rows(done.stdout)
    table(f"guidellm's sweep against tokengate serve (256-token prompts, 128 tokens, {args.seconds:g} s each)",
          ["benchmark", "elapsed s", "successful", "errored", "incomplete", "req/s", "output tok/s"],
          [(r["strategy"], r["elapsed_s"], r["successful"], r["errored"], r["incomplete"], r["requests_per_s"],
            r["output_tokens_per_s"]) for r in got])
    errored = sum(r["errored"] for r in got)
    console.print(f"guidellm exited {done.returncode}; errors: {errored} of "
                  f"{sum(r['successful'] + r['errored'] for r in got)} ended requests (target 0); its log: "
                  f"{OUT / 'guidellm.log'}")
    if args.json:
        console.print(json.dumps(got, indent=1))


if __name__ == "__main__":
    main()
