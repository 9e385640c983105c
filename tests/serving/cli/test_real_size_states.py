"""Prefix hits at 16 tokens on real-sized Gated DeltaNet states, through ``hybridkv serve``.

A 3-layer model with Qwen3.5's DeltaNet shapes (32 value heads of a 128 x 128 memory, 2 MiB
of state a layer and request) beside one attention layer, served with ``--block-size 16``:
a repeated 300-token prompt resumes at 288 tokens, the third of three prompts sharing 200
tokens at 192, and the tokens equal those of a server with ``--no-prefix-caching``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from server_process import Server

from hybridkv.testing import byte_tokenizer
from hybridkv.testing.sample_tokenizers import BYTE_EOS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deltanet_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=BYTE_EOS + 1, hidden_size=1024, intermediate_size=512, num_hidden_layers=3,
        layer_types=["linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, max_position_embeddings=2048, eos_token_id=BYTE_EOS,
        bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("qwen3_5_real_states")
    Qwen3_5ForCausalLM(config).save_pretrained(folder)
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


def _complete(url: str, model: str, prompt: list[int]) -> tuple[str, int]:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip
    answer: dict[str, Any] = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()
    assert "usage" in answer, answer
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return answer["choices"][0]["text"], cached


def _prompts() -> list[list[int]]:
    repeat = [(7 * i + 3) % 250 for i in range(300)]
    shared = [(11 * i + 5) % 250 for i in range(200)]
    sharers = [shared + [(13 * i + j) % 250 for i in range(30)] for j in range(3)]
    return [repeat, repeat, *sharers]


def test_repeats_and_sharers_hit_at_block_16_with_the_tokens_of_no_caching(
    deltanet_model: Path,
) -> None:
    results = {}
    for flags in ([], ["--no-prefix-caching"]):
        argv = ["serve", str(deltanet_model), "--port", "0", "--block-size", "16",
                "--kv-memory", "256MiB", *flags]  # fmt: skip
        server = Server(argv)
        try:
            name = deltanet_model.name
            results[bool(flags)] = [_complete(server.url, name, p) for p in _prompts()]
        finally:
            server.stop()
    cached, uncached = results[False], results[True]
    assert cached[1][1] >= 288, cached
    assert cached[4][1] >= 192, cached
    assert all(hits == 0 for _, hits in uncached)
    assert [tokens for tokens, _ in cached] == [tokens for tokens, _ in uncached]
