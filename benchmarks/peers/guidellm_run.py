"""guidellm with its defaults against ``hybridkv serve``: every request answered.

A vLLM user benchmarks a server with guidellm as it comes, and its defaults ask for what
vLLM has: streamed chat completions with ``stream_options.continuous_usage_stats`` (usage
in every chunk), ``max_tokens`` with ``ignore_eos``, the served name from ``/v1/models``.
This starts the server, then runs guidellm with nothing set but what a run must name here:
the target, synthetic prompts of fixed lengths, the tokenizer's folder (guidellm would
fetch it from a hub), the concurrency and a request count. It runs the chat endpoint
(guidellm's default) and ``/v1/completions``, and reads the server's log for every
response that was not a 200 and every ``request_fields_ignored`` warning.

Goal: no request errored or cut short, no 4xx or 5xx, no field ignored.

The peer comes from ``llama_peers.py --only guidellm`` (a venv in the peers' cache).

    python -m benchmarks.peers.guidellm_run [--model gemma-3-270m] [--streams 1 4] [--json FILE]
    python -m benchmarks.peers.guidellm_run --serve-args=--strict-fields   # no field ignored

The last line printed is one JSON object; ``--json FILE`` writes it to FILE too, with the
command. Results: docs/benchmarks.md, section "guidellm with its defaults".
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import benchmarks.peers.llama_peers as llama_peers
from benchmarks.common.results import add_json_argument, write_json
from benchmarks.peers.vs_llama_cpp import METRICS, running

PORT = 18313
FORMATS = ("/v1/chat/completions", "/v1/completions")
_STATUS = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+" (?P<status>\d{3})')


def drive(args: argparse.Namespace, folder: Path, request_format: str, streams: int) -> Any:
    """One guidellm run; its request totals and the metrics of :data:`METRICS`."""
    guidellm = llama_peers.guidellm()
    assert guidellm is not None
    backend = f"kind=openai_http,target=http://127.0.0.1:{PORT}"
    if request_format != FORMATS[0]:
        backend += f",request_format={request_format}"
    out = folder / f"guidellm-{request_format.strip('/').replace('/', '-')}-{streams}.json"
    data = (
        f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}"
    )
    subprocess.run(
        [str(guidellm), "run", "--backend", backend, "--data", data,
         "--tokenizer", f"kind=huggingface_auto,model={args.folder}",
         "--profile", f"kind=concurrent,streams={streams}",
         "--constraint", f"kind=max_requests,count={max(args.requests, streams)}",
         "--output", f"kind=json,path={out}", "--disable-console"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    numbers = {
        name: metrics[key]["successful"][stat] if metrics["request_totals"]["successful"] else 0.0
        for name, (key, stat) in METRICS.items()
    }
    return {"requests": metrics["request_totals"], **numbers}


def read_log(log: Path) -> dict[str, Any]:
    """The responses that were not a 200, by path and status, and the ignored fields."""
    failures: dict[str, int] = {}
    ignored: set[str] = set()
    answered = 0
    for line in log.read_text(errors="replace").splitlines():
        if "request_fields_ignored" in line:
            ignored.update(re.findall(r"'([^']+)'", line.split("fields=", 1)[-1]))
        match = _STATUS.search(line)
        if match and match["path"].startswith("/v1/"):
            answered += 1
            if match["status"] != "200":
                key = f"{match['method']} {match['path']} {match['status']}"
                failures[key] = failures.get(key, 0) + 1
    return {"v1_responses": answered, "not_200": failures, "ignored_fields": sorted(ignored)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m", help="a built-in name or folder")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests", type=int, default=8, help="per run")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--serve-args", default="", help="more flags of hybridkv serve, one string")
    add_json_argument(parser)
    args = parser.parse_args()
    if llama_peers.guidellm() is None:
        sys.exit(
            "guidellm is not installed: run python -m benchmarks.peers.llama_peers --only guidellm"
        )
    from hybridkv.serving.cli.builtin_models import resolve_model

    args.folder = resolve_model(args.model)[1]
    hybridkv = Path(sys.executable).with_name("hybridkv")
    command = [str(hybridkv), "serve", args.model, "--port", str(PORT),
               "--threads", str(args.threads), *args.serve_args.split()]  # fmt: skip
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        log = folder / "serve.log"
        with running(command, PORT, log):
            for request_format in FORMATS:
                for streams in args.streams:
                    key = f"{request_format}, {streams} at a time"
                    runs[key] = drive(args, folder, request_format, streams)
                    print(f"{key}: {runs[key]}", flush=True)
        server = read_log(log)
    columns = "successful | errored | incomplete | out tok/s | TTFT ms | ITL ms"
    print(f"\n| endpoint, concurrency | {columns} |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for key, run in runs.items():
        totals = run["requests"]
        print(
            f"| {key} | {totals['successful']} / {totals['total']} | {totals['errored']} "
            f"| {totals['incomplete']} | {run['out_tok_s']:.1f} | {run['ttft_ms']:.0f} "
            f"| {run['itl_ms']:.1f} |"
        )
    print(f"\nserver: {server['v1_responses']} /v1 responses, "
          f"not 200: {server['not_200'] or 'none'}, "
          f"fields ignored: {server['ignored_fields'] or 'none'}")  # fmt: skip
    errored = sum(r["requests"]["errored"] + r["requests"]["incomplete"] for r in runs.values())
    results = {"model": args.model, "runs": runs, "server": server, "goal_met": not errored
               and not server["not_200"] and not server["ignored_fields"]}  # fmt: skip
    print(json.dumps(results))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
