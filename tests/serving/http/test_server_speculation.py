"""The server with speculative decoding: the same text, vLLM's spec_decode series, the
per-request opt-out, and ``--speculative-config`` read as vLLM reads it."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_samples import scrape

from hybridkv.scheduler.speculation import SpeculativeConfig
from hybridkv.serving.cli.flags.engine import add_engine_arguments, engine_args
from hybridkv.serving.cli.flags.values import UsageError
from hybridkv.testing import LiveServer, ReferenceProposer

MODEL = "fake-model"
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False)


def test_speculated_text_is_the_text_and_the_series_count_it(
    make_server: Callable[..., LiveServer], client: Any
) -> None:
    proposer = ReferenceProposer(64, miss=0.3, seed=2)
    server = make_server(speculative_config=NGRAM, proposer=proposer)
    import openai

    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as spec:
        body = {"ignore_eos": True}
        plain = client.completions.create(
            model=MODEL, prompt="w2 w3 w4", max_tokens=24, extra_body=body
        )
        fast = spec.completions.create(
            model=MODEL, prompt="w2 w3 w4", max_tokens=24, extra_body=body
        )
        opted_out = spec.completions.create(
            model=MODEL, prompt="w2 w3 w4", max_tokens=24, extra_body=body | {"speculative": False}
        )
    assert fast.choices[0].text == plain.choices[0].text == opted_out.choices[0].text
    samples = scrape(server)
    label = (("model_name", MODEL),)
    drafts = samples[("vllm:spec_decode_num_drafts_total", label)]
    proposed = samples[("vllm:spec_decode_num_draft_tokens_total", label)]
    accepted = samples[("vllm:spec_decode_num_accepted_tokens_total", label)]
    assert 0 < drafts <= proposed and 0 < accepted < proposed
    first = samples[
        ("vllm:spec_decode_num_accepted_tokens_per_pos_total", (*label, ("position", "0")))
    ]
    assert 0 < first <= drafts
    assert proposed == proposer.num_proposed  # the opted-out request proposed nothing


def _flags(*argv: str) -> Any:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?")
    add_engine_arguments(parser)
    return engine_args(parser.parse_args(list(argv)))


def test_the_flag_reads_vllm_json() -> None:
    args = _flags(
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}',
    )
    assert args.speculative_config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_min=3, prompt_lookup_max=3
    )
    assert _flags().speculative_config is None


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"num_speculative_tokens": 2, "drop_eagle_block": true}', "drop_eagle_block"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "eagle"),
    ],
)
def test_a_bad_flag_is_refused_by_name(text: str, names: str) -> None:
    with pytest.raises(UsageError, match=names):
        _flags("--speculative-config", text)


def test_context_parallelism_beside_it_is_refused_before_any_worker() -> None:
    with pytest.raises(UsageError, match="context-parallel"):
        _flags("-cp", "2", "--speculative-config", '{"num_speculative_tokens": 2}')
    with pytest.raises(UsageError, match="draft model beside pipeline"):
        _flags("-pp", "2", "--speculative-config", '{"model": "x", "num_speculative_tokens": 2}')


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("command", ["generate", "demo", "bench"])
def test_every_model_command_takes_the_flag(
    command: str, method: str, tiny_checkpoint: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """generate prints the text it prints without speculation; demo and bench run. The
    draft model is the checkpoint itself (a folder is what a user names)."""
    import json

    from hybridkv.serving.cli.main import main

    spec: dict[str, Any] = {"num_speculative_tokens": 3, "prompt_lookup_max": 2}
    if method == "draft_model":
        spec = {"model": str(tiny_checkpoint), "num_speculative_tokens": 3}
    flag = ["--speculative-config", json.dumps(spec)]
    common = ["--kv-memory", "4MiB", "--block-size", "4"]
    argv = {
        "generate": ["w2 w3 w4 w2 w3 w4 w2 w3", "--max-tokens", "12", "--ignore-eos"],
        "demo": ["--requests", "3", "--rate", "1000", "--max-tokens", "6"],
        "bench": ["--requests", "2", "--prompt-len", "12", "--output-len", "6"],
    }[command]
    assert main([command, str(tiny_checkpoint), *argv, *common]) == 0
    plain = capsys.readouterr().out
    assert main([command, str(tiny_checkpoint), *argv, *common, *flag]) == 0
    speculated = capsys.readouterr()
    if command == "generate":
        assert speculated.out == plain
        found = re.search(r"(\d+) of (\d+) proposed tokens accepted", speculated.err)
        assert found is not None and int(found[2]) > 0
        if method == "draft_model":  # the checkpoint as its own draft: all kept
            assert found[1] == found[2]
