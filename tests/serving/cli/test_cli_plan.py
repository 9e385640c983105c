"""The ``hybridkv plan`` command: tables for built-in and config.json models, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.memory.sizes import SizeError, parse_size
from hybridkv.serving.cli.flags.values import UsageError
from hybridkv.serving.cli.main import main
from hybridkv.serving.cli.plan import split_stages


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_builtin_gemma3_like(capsys: pytest.CaptureFixture[str]) -> None:
    """gemma3-like in 2 GiB: 7 groups of 16 KiB pages, 32768 blocks, 3.79x uniform."""
    code, out, err = run(capsys, "plan", "gemma3-like", "--kv-memory", "2GiB")
    assert (code, err) == (0, "")
    assert "7 groups, 4 slots per device, 32768 pages" in out
    assert "K/V     page 16.00 KiB (16 tokens)" in out and "\nstate" not in out
    assert "sliding_window(window=512)  6       22      198" in out
    assert "requests of 4096 tokens  72      19       3.79x" in out
    assert "blocks                   32768   5041" in out


def test_plan_config_json_in_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder holding a Mistral config.json plans one sliding-window group."""
    cfg = {
        "model_type": "mistral",
        "num_hidden_layers": 8,
        "hidden_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "sliding_window": 1024,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, _ = run(capsys, "plan", str(tmp_path), "--kv-memory", "64MiB", "--dtype", "fp32")
    assert code == 0
    # A page: K and V, 2 heads of 64, 4 bytes, 16 tokens = 16 KiB; 8 slots per block.
    assert "1 group, 8 slots per device, 512 pages" in out
    assert "K/V     page 16.00 KiB (16 tokens)" in out
    assert f"model   {tmp_path / 'config.json'}: 8 KV layers (8 sliding_window" in out


def test_plan_with_pipeline_stages_prints_stage_slots(capsys: pytest.CaptureFixture[str]) -> None:
    """Two stages of gemma3-like each hold two slots."""
    code, out, _ = run(capsys, "plan", "gemma3-like", "--kv-memory", "1GiB", "--pp-stages", "2")
    assert code == 0
    assert "stage  layers  slots\n0      13      2\n1      13      2" in out


def test_plan_with_context_ranks_shows_the_longest_request_per_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Four context ranks, each with the same memory, hold a request about 4x as long."""
    code, out, _ = run(capsys, "plan", "llama-like", "--kv-memory", "1GiB", "-cp", "4")
    assert code == 0
    assert "context parallelism: 4 ranks, 1.00 GiB of KV each" in out
    table = out.split("context parallelism")[1].splitlines()[2:4]
    (one, bs1, long1, _), (four, bs4, long4, _) = ([int(x) for x in r.split()] for r in table)
    assert (one, four, bs4) == (1, 4, 4 * bs1)
    assert 3.9 < long4 / long1 <= 4.0


def test_plan_mamba_hybrid_shows_both_page_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    """jamba-like keeps blocks of 16 tokens. A Mamba1 state (float32, 608 KiB) would waste
    5% of 10 K/V pages; its 28 lie one after another over state pages of 17 pages in each
    of 4 slots instead, 4 state groups."""
    code, out, _ = run(capsys, "plan", "jamba-like", "--kv-memory", "2GiB")
    assert code == 0
    assert "block size 16, state pages of 17 K/V pages" in out and "raised" not in out
    assert "pool    5 groups, 4 slots" in out
    assert "K/V     page 64.00 KiB (16 tokens); requests of 4096 tokens hold 64.00 MiB" in out
    assert (
        "state   page 1.06 MiB (17 K/V pages); requests of 4096 tokens hold "
        "51.00 MiB each, 1.12 MiB (2.2%) padding"
    ) in out


def test_plan_leaves_out_layers_that_keep_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    """nemotron-h-8b-like: its 24 MLP layers keep nothing and take no group; block 16 is
    kept beside its Mamba2 states, their padding 0.2%, in one stage or two."""
    for stages in ("1", "2"):
        code, out, _ = run(capsys, "plan", "nemotron-h-8b-like", "--kv-memory", "8GiB",
                           "--pp-stages", stages)  # fmt: skip
        assert code == 0
        assert "28 KV layers (24 mamba, 4 full; 24 more keep nothing)" in out
        assert "block size 16, state pages of 66 K/V pages" in out
        assert "576.00 KiB (0.2%) padding" in out


def test_plan_minimax_keeps_block_16_beside_lightning_states(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """minimax-text-01-like: 70 lightning layers (a 4 MiB memory each, 64 K/V pages to
    the byte) beside 10 softmax attention layers at blocks of 16."""
    code, out, _ = run(capsys, "plan", "minimax-text-01-like", "--kv-memory", "8GiB")
    assert code == 0
    assert "80 KV layers (70 mamba, 10 full)" in out
    assert "block size 16, state pages of 64 K/V pages" in out
    assert "requests of 4096 tokens hold 840.00 MiB each, 0 B padding" in out


def test_plan_falcon_h1_sizes_both_memories_of_each_layer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """falcon-h1-7b-like: each of its 44 layers keeps K/V in the full group and a Mamba2
    state (3.04 MiB) in the state group; block 16 is kept, in one stage or two, on one
    rank or two (each rank a half of the heads and of the state)."""
    for extra in ([], ["--pp-stages", "2"], ["-tp", "2"]):
        code, out, _ = run(capsys, "plan", "falcon-h1-7b-like", "--kv-memory", "8GiB", *extra)
        assert code == 0
        assert "88 KV layers (44 full, 44 mamba; 44 layers hold a K/V and a state each)" in out
        assert "block size 16, state pages of 195 K/V pages" in out
    assert "state   page 1.52 MiB (195 K/V pages)" in out
    assert "0 B padding" in out.split("state   page")[1].splitlines()[0]


def test_plan_zamba2_keeps_block_16_beside_its_shared_blocks_states(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """zamba2-7b-like: 13 hybrid layers keep a K/V page of 448 KiB (heads of 224) beside
    their Mamba2 states, block 16 kept. One state of 1.83 MiB to 5 K/V pages would pad
    25% (16% in the page, empty slots of 7 state groups); the 81 states one after another
    over state pages of 9 pages in each of the 13 slots pad 3.2%, in 3 groups."""
    code, out, _ = run(capsys, "plan", "zamba2-7b-like", "--kv-memory", "8GiB")
    assert code == 0
    assert "94 KV layers (81 mamba, 13 full; 13 layers hold a K/V and a state each)" in out
    assert "block size 16, state pages of 9 K/V pages" in out
    assert "pool    4 groups, 13 slots" in out
    assert "K/V     page 448.00 KiB (16 tokens)" in out
    assert "14.79 MiB (3.2%) padding" in out


def test_plan_sizes_latent_attention(capsys: pytest.CaptureFixture[str]) -> None:
    """deepseek-v3-like: 61 layers of one 576-value latent a token, 18 KiB a page of 16
    tokens (68.6 KiB a token of context), the same on every tensor rank (replicated)."""
    code, out, _ = run(capsys, "plan", "deepseek-v3-like", "--kv-memory", "8GiB", "-tp", "2")
    assert code == 0
    assert "61 KV layers (61 full; latent attention: 576 values a token and layer)" in out
    assert "K/V     page 18.00 KiB (16 tokens)" in out
    assert "2      1              68.62 KiB" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["nope-like", "--kv-memory", "1GiB"], "neither a config.json"),
        (["gemma3-like", "--kv-memory", "2 parsecs"], "size '2 parsecs'"),
        (["gemma3-like", "--kv-memory", "64KiB"], "budget_bytes=65536"),
        (["gemma3-like", "--kv-memory", "1GiB", "--dtype", "int3"], "dtype 'int3'"),
        (["gemma3-like", "--kv-memory", "1GiB", "--pp-stages", "0"], "--pp-stages must be >= 1"),
        (["gemma3-like", "--kv-memory", "1GiB", "--block-size", "0"], "block_size must be >= 1"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """Bad values give exit status 2 and one error line naming them, no traceback."""
    code, out, err = run(capsys, "plan", *argv)
    assert (code, out) == (2, "")
    assert err.startswith("hybridkv plan: error: ") and message in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_unreadable_config_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config.json that is not JSON is named in the error."""
    path = tmp_path / "config.json"
    path.write_text("{not json")
    code, _, err = run(capsys, "plan", str(path), "--kv-memory", "1GiB")
    assert code == 2 and "as JSON" in err


@pytest.mark.parametrize(
    ("text", "size"),
    [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1e9", 10**9), ("1.5 GiB", 3 << 29),
     ("4096", 4096), ("2gb", 2 * 10**9), ("0", 0)],
)  # fmt: skip
def test_parse_size(text: str, size: int) -> None:
    """Sizes take binary and decimal units and scientific notation."""
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "-1GiB", "GiB", "2 GiBs", "1e"])
def test_parse_size_refuses_junk(text: str) -> None:
    """A size that is not a number with a known unit is refused."""
    with pytest.raises(SizeError, match="such as 2GiB"):
        parse_size(text)


def test_split_stages_gives_earlier_stages_the_remainder() -> None:
    """Five layers in three stages: 2, 2, 1; more stages than layers leaves empty ones."""
    assert split_stages(list("abcde"), 3) == [["a", "b"], ["c", "d"], ["e"]]
    assert split_stages(["a"], 2) == [["a"], []]


def test_console_script_runs_plan() -> None:
    """The installed ``hybridkv`` script prints a plan."""
    script = Path(sys.executable).with_name("hybridkv")
    if not script.exists():
        pytest.skip("the hybridkv console script is not installed next to this Python")
    done = subprocess.run(
        [str(script), "plan", "llama-like", "--kv-memory", "1GiB"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "1 group, 32 slots per device, 512 pages" in done.stdout
    assert "K/V     page 64.00 KiB (16 tokens)" in done.stdout


def test_plan_with_a_layer_policy_groups_by_it(capsys: pytest.CaptureFixture[str]) -> None:
    """--layer-policy gives the full layers of gemma3-like a window of 1024 in the plan."""
    code, out, _ = run(
        capsys, "plan", "gemma3-like", "--kv-memory", "1GiB",
        "--layer-policy", "full_attention=sliding_window:window=1024",
    )  # fmt: skip
    assert code == 0
    assert "(22 sliding_window(window=512), 4 sliding_window(window=1024))" in out


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("full_attention", "is not KIND=NAME[:key=value,...]"),
        ("full_attention=sliding_window:1024", "is not KIND=NAME[:key=value,...]"),
        ("full_attention=nope", "unknown memory policy 'nope'"),
        ("sliding_attention=full", "layer kind 'sliding_attention'"),
        ("full_attention=sliding_window:size=4", "bad parameters for policy 'sliding_window'"),
    ],
)
def test_bad_layer_policy_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], flag: str, message: str
) -> None:
    """A malformed flag, an unknown policy or a kind the model lacks is named, no traceback."""
    code, out, err = run(
        capsys, "plan", "llama-like", "--kv-memory", "1GiB", "--layer-policy", flag
    )
    assert (code, out) == (2, "")
    assert message in err and err.count("\n") == 1


def test_layer_policy_flags_parse_to_policies() -> None:
    """KIND=NAME:key=value pairs build registered policies, numbers as numbers."""
    from hybridkv.policies import FullAttention, SlidingWindow
    from hybridkv.serving.cli.flags.engine import parse_layer_policies

    parsed = parse_layer_policies(["full_attention=sliding_window:window=64", "x=full"])
    assert parsed == (("full_attention", SlidingWindow(64)), ("x", FullAttention()))
    with pytest.raises(UsageError, match="twice"):
        parse_layer_policies(["x=full", "x=full"])


@pytest.mark.parametrize("model", ["bamba-like", "granite-4.0-h-like"])
def test_plan_shows_a_mamba2_hybrid_layout(capsys: pytest.CaptureFixture[str], model: str) -> None:
    """A Bamba or Granite 4.0-H layout: attention keeps blocks of 16 tokens, and a float32
    Mamba2 state takes a span of K/V pages (no block raised to hold it)."""
    code, out, _ = run(capsys, "plan", model, "--kv-memory", "8GiB")
    assert code == 0
    assert "block size 16, state pages of" in out and "raised" not in out
    assert "\nK/V     page" in out and "\nstate   page" in out
    assert "\nmamba  " in out and "\nfull  " in out and "padding" in out


def test_plan_takes_a_state_policy_for_the_mamba_kind(capsys: pytest.CaptureFixture[str]) -> None:
    """--layer-policy mamba=mamba:checkpoint_every=4 keeps a state every 4 blocks."""
    argv = ["plan", "bamba-like", "--kv-memory", "8GiB"]
    code, out, _ = run(capsys, *argv, "--layer-policy", "mamba=mamba:checkpoint_every=4")
    assert code == 0
    assert "29 mamba(checkpoint_every=4), 3 full" in out
