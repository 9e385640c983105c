"""Speculative method mtp from the command line: ``hybridkv generate`` and ``serve``
with the checkpoint's own MTP layer, ``hybridkv plan`` with its memory, and what is
refused before any model loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from server_process import Server

from hybridkv.serving.cli.main import main
from hybridkv.testing import byte_tokenizer
from hybridkv.testing.tiny_mtp import save_agreeing_mtp

pytestmark = pytest.mark.usefixtures("command_isolation")

MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3.5-shaped hybrid whose MTP layer mostly agrees with it, with the byte
    tokenizer."""
    folder = save_agreeing_mtp(tmp_path_factory.mktemp("agreeing"), seed=5)
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize("method", ["mtp", "qwen3_next_mtp"])
def test_generate_prints_the_same_text_with_most_proposals_kept(
    method: str, agreeing: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's spelling and its Qwen alias: the text without speculation, and the MTP
    layer's proposals mostly accepted."""
    argv = ["generate", str(agreeing), "a prompt longer than a block", "--max-tokens", "24",
            "--ignore-eos", "--kv-memory", "4MiB", "--block-size", "16"]  # fmt: skip
    assert main(argv) == 0
    plain = capsys.readouterr().out
    flag = json.dumps({"method": method, "num_speculative_tokens": 3})
    assert main([*argv, "--speculative-config", flag]) == 0
    speculated = capsys.readouterr()
    assert speculated.out == plain
    found = re.search(r"(\d+) of (\d+) proposed tokens accepted", speculated.err)
    assert found is not None and int(found[1]) > 0.7 * int(found[2]) > 0


def test_serve_answers_with_mtp(agreeing: Path) -> None:
    """``hybridkv serve`` in its own process proposes with the MTP layer and answers."""
    import httpx

    every = json.dumps({"method": "mtp", "num_speculative_tokens": 3, "adaptive": False})
    server = Server(["serve", str(agreeing), "--port", "0", "--kv-memory", "4MiB",
                     "--speculative-config", every])  # fmt: skip
    try:
        body = {"model": agreeing.name, "prompt": "hello there", "max_tokens": 8}
        body |= {"ignore_eos": True, "temperature": 0}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
        assert answer.get("usage", {}).get("completion_tokens") == 8, answer
        metrics = httpx.get(f"{server.url}/metrics", timeout=60).text
        accepted = re.search(r"vllm:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)", metrics)
        assert accepted is not None and float(accepted[1]) > 0
    finally:
        server.stop()


def test_a_checkpoint_without_mtp_layers_is_refused_by_name(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", str(tiny_checkpoint), "w2 w3", "--max-tokens", "2", "--kv-memory",
            "1MiB", "--speculative-config", MTP]  # fmt: skip
    assert main(argv) != 0
    assert "no multi-token prediction layers" in capsys.readouterr().err


def test_mtp_beside_several_processes_is_refused_before_any_worker(
    agreeing: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", str(agreeing), "hi", "-pp", "2", "--speculative-config", MTP]
    assert main(argv) == 2
    assert "method mtp beside pipeline" in capsys.readouterr().err


def test_plan_counts_the_mtp_layers_memory(capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen3-Next's MTP layer joins its full attention group; DeepSeek V3's is its 62nd
    latent layer, V4's a 44th window; Kimi K2 ships none and is refused."""
    spec = ["--kv-memory", "8GiB", "--speculative-config", MTP]
    assert main(["plan", "qwen3-next-80b-a3b-like", *spec]) == 0
    out = capsys.readouterr().out
    assert "49 KV layers (36 mamba, 13 full; the last its MTP layer" in out
    assert main(["plan", "deepseek-v3-like", *spec]) == 0
    assert "62 KV layers (62 full;" in capsys.readouterr().out
    assert main(["plan", "deepseek-v4-like", *spec]) == 0  # its window, 44 of them now
    assert "130 KV layers (44 sliding_window(window=128)" in capsys.readouterr().out
    assert main(["plan", "kimi-k2-like", *spec]) == 2
    assert "no multi-token prediction layers" in capsys.readouterr().err


def test_plan_refuses_mtp_for_a_model_no_family_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config sized from its ``layer_types`` alone has no MTP layers we know of: a
    message, not a traceback."""
    config = {
        "model_type": "someone_elses_model", "num_hidden_layers": 2,
        "layer_types": ["full_attention", "full_attention"], "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 4096, "vocab_size": 100,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", str(tmp_path), "--kv-memory", "1GiB", "--speculative-config", MTP]) == 2
    err = capsys.readouterr().err
    assert "someone_elses_model checkpoint has no multi-token prediction layers" in err
