"""Real replicas for routing.py: ``hybridkv serve`` processes of a tiny random model, and
``hybridkv route`` (or SGLang's model gateway, ``smg``) in front of them.

Every run starts its replicas afresh (empty caches), then the front end with one
policy (or several of ours, each session through one of them in turn, as the workers of
one front end would take connections), and plays the same chats against it over HTTP:
each session's turns in order,
the sessions at once, every prompt sent as text of one byte a token (the same tokens for
every policy) with a fixed reply appended for the next turn, as the simulated sessions do.
Each answer's ``usage`` gives its cached prompt tokens and its first streamed chunk its
time to first token; the prompt tokens each replica computed (its load) come from its
own ``/metrics`` after the run (``vllm:prompt_tokens`` less ``vllm:prefix_cache_hits``),
whatever the front end.

``smg`` is installed by this benchmark, never by the project, into a venv under
``~/.cache/hybridkv-peers/`` (``--smg``); it routes plain OpenAI-compatible workers with
its ``cache_aware`` policy, a tree of the prompts it has sent (no KV events).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

_START = "import sys; from hybridkv.serving.cli.main import main; sys.exit(main())"
_WAIT_S = 300.0
SMG_VENV = Path.home() / ".cache" / "hybridkv-peers" / "smg-venv"


def smg_binary() -> Path | None:
    """SGLang's model gateway, installed into its own venv on first use; None when it
    does not install here."""
    binary = SMG_VENV / "bin" / "smg"
    if binary.exists():
        return binary
    try:
        subprocess.run([sys.executable, "-m", "venv", str(SMG_VENV)], check=True)
        pip = [str(SMG_VENV / "bin" / "pip"), "install", "-q", "smg"]
        subprocess.run(pip, check=True, timeout=900)
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"smg does not install here: {exc}", file=sys.stderr)
        return None
    return binary if binary.exists() else None


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_smg(urls: list[str]) -> tuple[subprocess.Popen[str], str]:
    import httpx

    binary = smg_binary()
    if binary is None:
        raise RuntimeError("smg is not installed")
    port = _free_port()
    process = subprocess.Popen(
        [str(binary), "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
         *urls, "--policy", "cache_aware", "--disable-tokenizer-autoload",
         "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # a benchmark's wait for a process to listen
        if process.poll() is not None:
            raise RuntimeError(f"smg exited with code {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return process, url
        time.sleep(0.2)
    raise RuntimeError("smg never answered /v1/models")


def save_model(layout: str, folder: Path) -> Path:
    """A tiny random checkpoint of ``layout`` (full: Llama; gemma-3-like: Gemma 3 with
    one full layer in six; bamba-like: Bamba, Mamba2 layers and one attention layer),
    with the byte tokenizer."""
    import torch
    import transformers

    from hybridkv.testing import byte_tokenizer

    common = dict(
        vocab_size=257, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=False,
    )  # fmt: skip
    if layout == "full":
        config: Any = transformers.LlamaConfig(num_hidden_layers=2, **common)
        model: Any = transformers.LlamaForCausalLM(config)
    elif layout == "gemma-3-like":
        kinds = ["sliding_attention"] * 5 + ["full_attention"]
        config = transformers.Gemma3TextConfig(
            num_hidden_layers=6, layer_types=kinds, sliding_window=256, head_dim=16, **common
        )
        model = transformers.Gemma3ForCausalLM(config)
    else:
        config = transformers.BambaConfig(
            num_hidden_layers=4, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_state=8,
            mamba_n_groups=2, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=16, **common,
        )  # fmt: skip
        model = transformers.BambaForCausalLM(config)
    torch.manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


def _start(argv: list[str], ready: str) -> tuple[subprocess.Popen[str], str]:
    """A ``hybridkv`` command and the URL of its ``ready`` line on stderr."""
    process = subprocess.Popen(
        [sys.executable, "-c", _START, *argv],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stderr is not None
    seen = []
    for line in process.stderr:
        seen.append(line)
        if line.startswith(ready):
            url = line.split(" at ")[1].split()[0].removesuffix("/v1")
            # Keep reading its stderr, so that a chatty process never blocks on the pipe.
            stream = process.stderr
            threading_drain(stream)
            return process, url
    raise RuntimeError(f"{argv[0]} never became ready:\n" + "".join(seen[-20:]))


def threading_drain(stream: Any) -> None:
    import threading

    threading.Thread(target=lambda: [None for _ in stream], daemon=True).start()


def _stop(processes: list[subprocess.Popen[str]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def cpu_seconds(pid: int) -> float:
    """CPU time (user and system) process ``pid`` has used so far; 0.0 where ``/proc``
    does not say (not Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@attrs.define
class Served:
    """What :func:`serving` started: the URLs clients use (one per front end), the
    replicas', and the processes (the front ends' last, where there are any)."""

    urls: list[str]
    replicas: list[str]
    processes: list[subprocess.Popen[str]]
    num_front_ends: int

    def cpu(self) -> tuple[float, float]:
        """CPU seconds used so far by the front ends together and by the replicas
        together."""
        seconds = [cpu_seconds(p.pid) for p in self.processes]
        split = len(seconds) - self.num_front_ends
        return sum(seconds[split:]), sum(seconds[:split])


@contextlib.contextmanager
def serving(
    folder: Path,
    num_replicas: int,
    kv_memory: str,
    front: str | None,
    max_num_seqs: int,
    front_ends: int = 1,
) -> Iterator[Served]:
    """Replicas of ``folder`` and a front end with policy ``front`` (``smg``: SGLang's
    gateway; None: the one replica itself); ours ``front_ends`` times, each following
    every replica on its own."""
    processes: list[subprocess.Popen[str]] = []
    try:
        urls = []
        for _ in range(num_replicas):
            events = json.dumps(
                {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
                 "replay_endpoint": "tcp://127.0.0.1:*"}
            )  # fmt: skip
            process, url = _start(
                ["serve", str(folder), "--port", "0", "--threads", "1",
                 "--kv-memory", kv_memory, "--block-size", "16", "--max-num-seqs",
                 str(max_num_seqs), "--kv-events-config", events, "--log-level", "warning",
                 "--disable-log-stats"],
                "serving ",
            )  # fmt: skip
            processes.append(process)
            urls.append(url)
        if front is None:
            yield Served(urls[:1], urls, processes, num_front_ends=0)
            return
        if front == "smg":
            process, url = _start_smg(urls)
            processes.append(process)
            yield Served([url], urls, processes, num_front_ends=1)
            return
        replicas = [arg for url in urls for arg in ("--replica", url)]
        fronts = []
        for _ in range(front_ends):
            process, url = _start(
                ["route", str(folder), *replicas, "--port", "0", "--routing", front,
                 "--log-level", "warning"],
                "routing at ",
            )  # fmt: skip
            processes.append(process)
            fronts.append(url)
        yield Served(fronts, urls, processes, num_front_ends=front_ends)
    finally:
        _stop(processes)


def sessions(
    seed: int, num_sessions: int, turns: int, per_prompt: int, sizes: dict[str, int]
) -> list[list[str]]:
    """Per session, per turn, the text it adds (one byte, one token): the group's system
    prompt and a user message on the first turn, a reply and a message after. Text,
    not token ids: SGLang's gateway takes only text prompts."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz "

    def tokens(n: int) -> str:
        return "".join(rng.choice(letters) for _ in range(n))

    systems = [tokens(sizes["system"]) for _ in range(-(-num_sessions // per_prompt))]
    out = []
    for s in range(num_sessions):
        first = systems[s // per_prompt] + tokens(sizes["user"])
        later = [tokens(sizes["reply"]) + tokens(sizes["user"]) for _ in range(turns - 1)]
        out.append([first, *later])
    return out


async def _play(
    urls: list[str], replicas: list[str], chats: list[list[str]], reply_tokens: int
) -> dict[str, Any]:
    """Every chat played, session ``i`` through front end ``urls[i % len(urls)]``."""
    import httpx

    turns: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=_WAIT_S) as client:
        model = (await client.get(f"{urls[0]}/v1/models")).json()["data"][0]["id"]

        async def session(index: int, parts: list[str]) -> None:
            url = urls[index % len(urls)]
            await asyncio.sleep(0.05 * index)  # sessions start one after another
            prompt = ""
            for part in parts:
                prompt = prompt + part
                body = {
                    "model": model, "prompt": prompt, "max_tokens": reply_tokens,
                    "ignore_eos": True, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True},
                }  # fmt: skip
                sent = time.perf_counter()
                first = None
                usage: dict[str, Any] = {}
                async with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
                    answer.raise_for_status()
                    async for line in answer.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if first is None and chunk.get("choices"):
                            first = time.perf_counter()
                        usage = chunk.get("usage") or usage
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                turns.append(
                    {
                        "prompt": usage["prompt_tokens"],
                        "cached": cached,
                        "ttft_ms": 1000 * ((first or time.perf_counter()) - sent),
                        "e2e_ms": 1000 * (time.perf_counter() - sent),
                    }
                )

        await asyncio.gather(*(session(i, parts) for i, parts in enumerate(chats)))
        sums = [await _replica_sums(client, replica) for replica in replicas]
    return _measures(turns, sums)


_REPLICA_SUMS = (
    "vllm:prompt_tokens", "vllm:prefix_cache_hits",
    "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
    "vllm:e2e_request_latency_seconds_sum",
)  # fmt: skip


async def _replica_sums(client: Any, url: str) -> dict[str, float]:
    """The replica at ``url``'s counts of :data:`_REPLICA_SUMS`, from its ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(_REPLICA_SUMS, 0.0)
    text = (await client.get(f"{url}/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in totals:
                totals[name] += sample.value
    return totals


def _measures(turns: list[dict[str, Any]], replicas: list[dict[str, float]]) -> dict[str, Any]:
    """The run's hit rate, TTFT as clients saw it and as the replicas did (arrival at the
    replica to its first token: the rest is the front end's and the transport's), end
    to end likewise, and the spread of computed prompt tokens across replicas."""
    ttft = sorted(t["ttft_ms"] for t in turns)
    computed = [r["vllm:prompt_tokens"] - r["vllm:prefix_cache_hits"] for r in replicas]
    mean = statistics.fmean(computed)
    count = sum(r["vllm:time_to_first_token_seconds_count"] for r in replicas) or 1.0
    replica_ttft = sum(r["vllm:time_to_first_token_seconds_sum"] for r in replicas) / count
    replica_e2e = sum(r["vllm:e2e_request_latency_seconds_sum"] for r in replicas) / count
    return {
        "hit_rate": round(sum(t["cached"] for t in turns) / sum(t["prompt"] for t in turns), 4),
        "ttft_ms_mean": round(statistics.fmean(ttft), 1),
        "ttft_ms_p50": round(ttft[len(ttft) // 2], 1),
        "ttft_ms_p90": round(ttft[int(len(ttft) * 0.9)], 1),
        "replica_ttft_ms_mean": round(1000 * replica_ttft, 1),
        "e2e_ms_mean": round(statistics.fmean(t["e2e_ms"] for t in turns), 1),
        "replica_e2e_ms_mean": round(1000 * replica_e2e, 1),
        "imbalance": round(max(computed) / mean, 3) if mean else 1.0,
        "preemptions": 0,
    }


def run_real(
    folder: Path,
    num_replicas: int,
    policy: str | None,
    chats: list[list[str]],
    *,
    kv_memory: str,
    reply_tokens: int,
    max_num_seqs: int,
    front_ends: int = 1,
) -> dict[str, Any]:
    """One run: fresh replicas (one with ``num_replicas`` times the memory for the
    reference, ``policy`` None), the front ends, every chat played."""
    t0 = time.perf_counter()
    if policy is None:
        size = int(kv_memory.removesuffix("MiB")) * num_replicas
        started = serving(folder, 1, f"{size}MiB", None, max_num_seqs * num_replicas)
    else:
        started = serving(folder, num_replicas, kv_memory, policy, max_num_seqs, front_ends)
    with started as served:
        front_before, replicas_before = served.cpu()
        run = asyncio.run(_play(served.urls, served.replicas, chats, reply_tokens))
        front_after, replicas_after = served.cpu()
    return run | {
        "wall_s": round(time.perf_counter() - t0, 1),
        "front_end_cpu_s": round(front_after - front_before, 2),
        "replicas_cpu_s": round(replicas_after - replicas_before, 2),
    }
