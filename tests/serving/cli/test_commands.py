"""The serve, generate, demo and bench commands, run in-process on a tiny checkpoint."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from hybridkv.serving.cli.main import main

VOCAB = 64


pytestmark = pytest.mark.usefixtures("command_isolation")


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    """`hybridkv --help` names demo, serve, generate, plan and bench."""
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    assert all(name in out for name in ("demo", "serve", "generate", "plan", "bench"))


#: What ``--help`` must not import: the model and HTTP stacks take seconds to load.
HEAVY = ("torch", "transformers", "safetensors", "starlette", "uvicorn", "jinja2", "llguidance")


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["--version"]])
def test_help_and_version_import_neither_torch_nor_the_server(argv: list[str]) -> None:
    """The imports are measured, not the time: a fresh interpreter builds every parser,
    prints, exits, and none of the heavy packages was imported."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from hybridkv.serving.cli.main import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.splitlines()[-1] == "HEAVY []", done.stdout
    if argv == ["--version"]:
        assert re.match(r"hybridkv \d+\.\d+", done.stdout)


def test_serve_help_shows_the_engine_and_http_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """`hybridkv serve --help` documents the KV budget, batching, threads, host and port."""
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--kv-memory", "--block-size", "--max-num-batched-tokens", "--max-num-seqs",
                 "--no-prefix-caching", "--threads", "--host", "--port"):  # fmt: skip
        assert flag in out


def test_generate_streams_a_completion(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hybridkv generate MODEL PROMPT` prints the text and the counts."""
    code = main(["generate", str(tiny_checkpoint), "w2 w3 w4", "--max-tokens", "5",
                 "--ignore-eos", "--kv-memory", "1MiB", "--block-size", "4"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0
    assert len(captured.out.split()) == 5
    assert "3 prompt tokens, 5 generated (length)" in captured.err


def test_generate_with_a_layer_policy(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--layer-policy` loads the model with that policy for a kind of layer, and runs it."""
    code = main(["generate", str(tiny_checkpoint), "w2 w3 w4 " * 6, "--max-tokens", "5",
                 "--ignore-eos", "--kv-memory", "1MiB", "--block-size", "4",
                 "--layer-policy", "full_attention=chunked_local:chunk=6"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0
    assert "18 prompt tokens, 5 generated (length)" in captured.err


def test_demo_prints_the_summary(tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`hybridkv demo` on a checkpoint ends with the summary table."""
    code = main(["demo", str(tiny_checkpoint), "--requests", "4", "--rate", "1000",
                 "--max-tokens", "4", "--kv-memory", "4MiB", "--block-size", "4"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    for row in ("requests", "prefix-cache hit rate", "pages per group at peak", "tokens/s"):
        assert row in out
    assert re.search(r"with a uniform allocator: \d+\.\d\dx", out)


def test_bench_compares_layouts(tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`hybridkv bench --compare-uniform` prints one row per layout."""
    code = main(["bench", str(tiny_checkpoint), "--requests", "3", "--prompt-len", "20",
                 "--output-len", "3", "--compare-uniform", "--kv-memory", "1MiB",
                 "--block-size", "4"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()] == ["layout", "hybrid", "uniform"]


def test_serve_refuses_a_port_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    """A port in use is a one-line error and exit status 2, before any model loads."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", "no-such-model", "--port", str(port)])
    assert code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_unknown_model_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    """A model that is neither a folder nor built in exits 2 naming the built-in models."""
    code = main(["generate", "no-such-model", "w2"])
    assert code == 2
    assert "gemma-3-270m" in capsys.readouterr().err


def test_serve_refuses_a_port_out_of_range(capsys: pytest.CaptureFixture[str]) -> None:
    """A port above 65535 is a one-line error, not a silent bind to the port modulo 65536."""
    code = main(["serve", "no-such-model", "--port", "70000"])
    assert code == 2
    assert "port 70000" in capsys.readouterr().err


def test_serve_refuses_a_non_positive_default_max_tokens(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--default-max-tokens 0 exits 2 at start instead of failing every chat request with 500."""
    code = main(["serve", "no-such-model", "--port", "0", "--default-max-tokens", "0"])
    assert code == 2
    assert "--default-max-tokens must be >= 1, got 0" in capsys.readouterr().err


def test_generate_prompt_over_the_limit_is_a_one_line_error(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A prompt filling --max-model-len exits 2 with the engine's message, not a traceback."""
    code = main(["generate", str(tiny_checkpoint), "w2 w3", "--max-model-len", "2",
                 "--kv-memory", "1MiB", "--block-size", "4"])  # fmt: skip
    assert code == 2
    assert "leaves no room to generate within max_model_len=2" in capsys.readouterr().err


def test_bench_refuses_a_non_positive_rate(capsys: pytest.CaptureFixture[str]) -> None:
    """`bench --rate 0` exits 2 naming the flag instead of dividing by zero."""
    code = main(["bench", "no-such-model", "--rate", "0"])
    assert code == 2
    assert "--rate must be > 0, got 0.0" in capsys.readouterr().err


def test_bench_prompt_over_the_limit_is_reported_once(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every bench request failing the same way prints the error once and exits 2."""
    code = main(["bench", str(tiny_checkpoint), "--requests", "2", "--prompt-len", "20",
                 "--output-len", "2", "--max-model-len", "10", "--kv-memory", "1MiB",
                 "--block-size", "4"])  # fmt: skip
    assert code == 2
    assert capsys.readouterr().err.count("leaves no room to generate") == 1


def test_serve_refuses_a_zero_max_body_size(capsys: pytest.CaptureFixture[str]) -> None:
    """`serve --max-body-size 0` is a one-line error and exit status 2, not a traceback."""
    code = main(["serve", "no-such-model", "--port", "0", "--max-body-size", "0"])
    assert code == 2
    assert "--max-body-size must be at least 1 byte, got '0'" in capsys.readouterr().err


def test_serve_access_and_limit_flags_make_the_settings() -> None:
    """The serve flags become the app's options, the connection limits and the watchdog."""
    import argparse

    from hybridkv.serving.cli.flags.serve import add_access_and_limit_arguments, http_settings

    parser = argparse.ArgumentParser()
    add_access_and_limit_arguments(parser)
    args = parser.parse_args(
        ["--api-key", "k", "--allowed-hosts", "localhost, *.lan", "--timeout-body", "2",
         "--max-connections", "7", "--step-timeout", "0", "--strict-fields"]
    )  # fmt: skip
    settings = http_settings(args, max_body_bytes=100, default_max_tokens=None)
    assert settings.options.strict_fields
    default = http_settings(parser.parse_args([]), max_body_bytes=1, default_max_tokens=None)
    assert not default.options.strict_fields
    assert settings.options.api_key == "k"
    assert settings.options.allowed_hosts == ("localhost", "*.lan")
    assert settings.options.body_timeout_s == 2.0
    assert settings.limits.max_connections == 7
    assert settings.step_timeout_s is None  # 0 disables the watchdog


@pytest.mark.parametrize(
    "flags", [["--timeout-header", "0"], ["--max-connections", "0"], ["--step-timeout", "-1"]]
)
def test_serve_refuses_bad_limits(capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    """A limit out of range is a one-line error naming the flag, exit status 2."""
    code = main(["serve", "no-such-model", "--port", "0", *flags])
    assert code == 2
    assert flags[0] in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "inf", "soon"])
def test_route_intervals_must_be_positive_seconds(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An interval of 0 would poll the replicas without pause: `route` refuses it."""
    for flag in ("--load-interval", "--health-interval"):
        with pytest.raises(SystemExit) as info:
            main(["route", "m", "--replica", "http://127.0.0.1:1", flag, value])
        assert info.value.code == 2
        assert f"{value!r} is not a positive number of seconds" in capsys.readouterr().err
