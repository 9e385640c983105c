"""`vllm serve`'s flags under their names and meanings: parsed into the settings, refused
where a value cannot be honoured, and accepted all together by a real `hybridkv serve`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from hybridkv.serving.cli.flags.engine import engine_args
from hybridkv.serving.cli.flags.serve import http_settings, read_chat_template
from hybridkv.serving.cli.flags.values import UsageError
from hybridkv.serving.cli.loading import checkpoint_dtype, kv_bytes
from hybridkv.serving.cli.main import build_parser

RUN_CLI = "import sys; from hybridkv.serving.cli.main import main; sys.exit(main(sys.argv[1:]))"


def serve_args(*flags: str) -> Any:
    return build_parser().parse_args(["serve", *flags])


def test_vllm_spellings_make_the_same_settings() -> None:
    args = serve_args(
        "--model", "m", "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5",
        "--dtype", "auto", "--kv-cache-dtype", "auto", "--seed", "7",
    )  # fmt: skip
    settings = engine_args(args)
    assert settings.model == "m"
    assert not settings.enable_prefix_caching
    assert settings.memory_utilization == 0.5
    assert settings.seed == 7
    assert settings.dtype == "auto"
    assert engine_args(serve_args("--enable-prefix-caching")).enable_prefix_caching
    assert engine_args(serve_args("m", "--model", "m")).model == "m"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["a", "--model", "b"], "name two models"),
        (["--kv-cache-dtype", "fp8"], "fp8 KV caches are not built"),
        (["--kv-cache-dtype", "bfloat16"], "in the model dtype"),
        (["--gpu-memory-utilization", "1.5"], r"in \(0, 1\]"),
        (["--gpu-memory-utilization", "0.5", "--kv-memory", "1GiB"], "both size the pool"),
    ],
)
def test_values_that_cannot_be_honoured_are_refused_by_name(flags: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        engine_args(serve_args(*flags))


def test_allowed_origins_take_a_json_list_or_commas() -> None:
    def origins(value: str) -> tuple[str, ...]:
        args = serve_args("--allowed-origins", value)
        return http_settings(
            args, max_body_bytes=1, default_max_tokens=None
        ).options.allowed_origins

    assert origins('["https://a.example", "https://b.example"]') == (
        "https://a.example",
        "https://b.example",
    )
    assert origins("https://a.example, https://b.example") == (
        "https://a.example",
        "https://b.example",
    )
    with pytest.raises(ValueError, match="JSON list"):
        origins('["https://a.example", 3]')


def test_dtype_auto_reads_the_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert checkpoint_dtype("auto", tmp_path) == "bfloat16"
    assert checkpoint_dtype("float16", tmp_path) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "int8"}))
    assert checkpoint_dtype("auto", tmp_path) == "float32"


def test_memory_utilization_is_a_share_of_free_memory_less_the_weights(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The free memory is read once, here pinned so the arithmetic is exact."""
    import hybridkv.serving.cli.loading as loading

    monkeypatch.setattr(loading, "device_memory", lambda: (10 << 30, "of free host memory"))
    weights = sum(p.stat().st_size for p in tiny_checkpoint.glob("*.safetensors"))
    settings = engine_args(serve_args("--gpu-memory-utilization", "0.1"))
    assert kv_bytes(settings, tiny_checkpoint) == int(0.1 * (10 << 30)) - weights
    tiny = engine_args(serve_args("--gpu-memory-utilization", "1e-9"))
    with pytest.raises(UsageError, match="leaves nothing for the KV pool"):
        kv_bytes(tiny, tiny_checkpoint)


def test_chat_template_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert read_chat_template(str(path)).source == path.read_text()
    assert read_chat_template("{{ messages[0]['content'] }}").is_builtin is False
    with pytest.raises(UsageError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_hybridkv_serve_accepts_the_vllm_flags_together(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """A real server started with vLLM's flags: the template from the file renders the
    chat, CORS answers a preflight for the allowed origin only, completions are served."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}w5 {{ m['content'] }} {% endfor %}w6")
    process = subprocess.Popen(
        [
            sys.executable, "-c", RUN_CLI, "serve", "--port", "0",
            "--model", str(tiny_checkpoint), "--dtype", "auto", "--kv-cache-dtype", "auto",
            "--enable-prefix-caching", "--seed", "3", "--gpu-memory-utilization", "0.05",
            "--chat-template", str(template), "--allowed-origins", '["https://app.example"]',
            "--threads", "1", "--log-level", "info", "--log-format", "json",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert process.stderr is not None
        url, seen = "", []
        for line in process.stderr:  # the line it prints once it listens
            seen.append(line)
            if line.startswith("serving "):
                url = line.split(" at ")[1].split()[0].removesuffix("/v1")
                break
        assert url, "the server never said it listens:\n" + "".join(seen)
        assert any(json.loads(line)["event"] == "model_loaded" for line in seen[1:-1])
        tokens = httpx.post(
            f"{url}/tokenize", json={"messages": [{"role": "user", "content": "w2 w3"}]}
        ).json()
        assert tokens["count"] == 4  # w5 w2 w3 w6: the file's template
        preflight = {"Access-Control-Request-Method": "POST"}
        allowed = httpx.options(
            f"{url}/v1/completions", headers={"Origin": "https://app.example", **preflight}
        )
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(
            f"{url}/v1/completions", headers={"Origin": "https://evil.example", **preflight}
        )
        assert "access-control-allow-origin" not in other.headers
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        done = httpx.post(
            f"{url}/v1/completions", json={"model": model, "prompt": "w2", "max_tokens": 3}
        )
        assert done.status_code == 200, done.text
        # Its word-level tokenizer has no decoder llguidance reads: structured output is
        # refused per request, saying why, and everything else serves.
        body = {"model": model, "prompt": "w2", "response_format": {"type": "json_object"}}
        refused = httpx.post(f"{url}/v1/completions", json=body)
        assert refused.status_code == 400
        assert "structured output is unavailable" in refused.json()["error"]["message"]
    finally:
        process.send_signal(signal.SIGINT)
        rest = process.communicate(timeout=60)[1]
    # Every line after it is one JSON object: hybridkv's events and uvicorn's access lines.
    records = [json.loads(line) for line in rest.splitlines() if line.strip()]
    access = [r["event"] for r in records if "POST /v1/completions" in r["event"]]
    assert access and all(r["level"] for r in records)


def test_a_yaml_config_gives_flags_the_command_line_overrides(tmp_path: Path) -> None:
    from hybridkv.serving.cli.flags.config_file import expand_config
    from hybridkv.serving.cli.main import _negatable

    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: some-model\n"
        "port: 8001\n"
        "max_num_seqs: 4\n"
        "enable-prefix-caching: false\n"
        "strict-fields: true\n"
        "layer-policy:\n"
        "  - full_attention=sliding_window:window=64\n"
        "  - sliding_attention=sliding_window:window=32\n"
    )
    parser = build_parser()
    argv = expand_config(["serve", "--config", str(config), "--port", "9000"], _negatable(parser))
    args = parser.parse_args(argv)
    assert args.port == 9000  # the command line wins
    settings = engine_args(args)
    assert settings.model == "some-model" and settings.max_num_seqs == 4
    assert not settings.enable_prefix_caching
    assert [kind for kind, _ in settings.layer_policies] == ["full_attention", "sliding_attention"]
    assert args.strict_fields


@pytest.mark.parametrize(
    ("text", "message"), [("[1, 2]", "must map flag names"), ("a: [b", "is not YAML")]
)
def test_a_bad_config_file_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    from hybridkv.serving.cli.main import main

    config = tmp_path / "bad.yaml"
    config.write_text(text)
    assert main(["plan", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert main(["plan", "--config", str(tmp_path / "missing.yaml")]) == 2


def test_structured_outputs_config_sets_the_json_defaults() -> None:
    def options(value: str) -> Any:
        args = serve_args("--structured-outputs-config", value)
        return http_settings(args, max_body_bytes=1, default_max_tokens=None).options

    loose = options('{"disable_any_whitespace": true, "disable_additional_properties": false}')
    assert (loose.any_whitespace, loose.additional_properties) == (False, True)
    default = http_settings(serve_args(), max_body_bytes=1, default_max_tokens=None).options
    assert (default.any_whitespace, default.additional_properties) == (True, False)
    with pytest.raises(ValueError, match="must be a JSON object"):
        options('{"backend": "xgrammar"}')
