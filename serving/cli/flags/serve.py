"""The access and limit flags of ``hybridkv serve``, and the settings they make.

::

    --api-key KEY             clients send "Authorization: Bearer KEY" (env HYBRIDKV_API_KEY)
    --allowed-hosts A,B       Host header names answered (default: any)
    --strict-fields           refuse unknown request fields (default: ignore them, warned)
    --tool-call-parser P      hermes or json: tool calls read from the text (tool_choice auto)
    --enable-auto-tool-choice let the model decide whether to call a tool
    --allowed-origins LIST    CORS: browser origins allowed ('["*"]'; default: none)
    --structured-outputs-config JSON
                              disable_any_whitespace, disable_additional_properties
    --max-connections N       open connections at once (1000; one more closes the oldest
                              that has not sent a full request; fitted to the process's
                              open-file limit at start)
    --max-connections-per-client N
                              open connections from one IP address (default: no limit)
    --timeout-first-byte S    connection to the first byte of a request (5)
    --timeout-keep-alive S    silence between requests of a kept-alive connection (5)
    --timeout-header S        connection to a complete request head (10)
    --timeout-body S          a request body to arrive (30)
    --timeout-write S         a response left unread before the client is cut (30)
    --template-timeout S      one chat-template rendering (5)
    --step-timeout S          one engine step before the executor counts as hung (60,
                              vLLM's default; 0 disables the watchdog)
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:  # imported when the flags are read: `hybridkv --help` stays fast
    from hybridkv.serving.http.app import ServerOptions
    from hybridkv.serving.http.connection import ConnectionLimits

API_KEY_ENV = "HYBRIDKV_API_KEY"

#: Flag, default seconds, what it bounds (all must be > 0).
_TIMEOUTS = (
    ("--timeout-first-byte", 5.0, "seconds from connecting to the first byte of a request"),
    ("--timeout-keep-alive", 5.0, "idle seconds between requests of a connection"),
    ("--timeout-header", 10.0, "seconds from connecting to a complete request head"),
    ("--timeout-body", 30.0, "seconds for a request body to arrive"),
    ("--timeout-write", 30.0, "seconds a client may leave a response unread"),
)


@attrs.frozen(kw_only=True)
class HTTPSettings:
    """What the flags set: the app's options, the connections' limits, the step timeout
    (None: no watchdog)."""

    options: ServerOptions
    limits: ConnectionLimits
    step_timeout_s: float | None


def add_access_and_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of the module's table."""
    access, limits = add_transport_arguments(parser)
    access.add_argument(
        "--structured-outputs-config",
        metavar="JSON",
        default=None,
        help='as vLLM: \'{"disable_any_whitespace": true, "disable_additional_properties": '
        "false}' for JSON output (defaults: any whitespace, no unlisted properties)",
    )
    access.add_argument(
        "--tool-call-parser",
        choices=("hermes", "json"),
        default=None,
        help="how tool calls are read from the text for tool_choice auto: hermes "
        "(<tool_call>{...}</tool_call>, Hermes and Qwen) or json",
    )
    access.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let the model decide whether to call a tool (needs --tool-call-parser)",
    )
    access.add_argument(
        "--strict-fields",
        action="store_true",
        help="refuse a request field this server does not know (400), as OpenAI's API "
        "does (default: ignore it, named in one warning per request, as vLLM does)",
    )
    limits.add_argument(
        "--template-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds one chat-template rendering may take (5)",
    )


def add_transport_arguments(parser: argparse.ArgumentParser) -> tuple[Any, Any]:
    """The flags a front end honours as a server does (``serve`` and ``route``): the key,
    the hosts and origins, the body size, the connections and their timeouts; the
    ``access`` and ``limits`` groups they are in."""
    access = parser.add_argument_group("access")
    access.add_argument(
        "--api-key",
        metavar="KEY",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on /v1/* and the tokenizer routes "
        f"(default: ${API_KEY_ENV}, else none)",
    )
    access.add_argument(
        "--allowed-hosts",
        metavar="NAMES",
        default="",
        help="comma-separated Host names to answer, '*.example.com' allowed (default: any)",
    )
    access.add_argument(
        "--allowed-origins",
        metavar="ORIGINS",
        default=None,
        help="browser origins allowed by CORS: a JSON list as vLLM takes it "
        "('[\"https://app.example\"]', '[\"*\"]') or comma-separated (default: none)",
    )
    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--max-body-size", default="4MiB", metavar="SIZE", help="largest request body (4MiB)"
    )
    limits.add_argument(
        "--max-connections",
        type=int,
        default=1000,
        metavar="N",
        help="open connections at once; one more closes the oldest that has not sent a "
        "full request, and a few more are kept for /health and /metrics; lowered at start "
        "to fit the open-file limit (1000)",
    )
    limits.add_argument(
        "--max-connections-per-client",
        type=int,
        default=None,
        metavar="N",
        help="open connections from one IP address at once; more are closed (default: no "
        "limit; behind a proxy every client has the proxy's address)",
    )
    for flag, default, what in _TIMEOUTS:
        limits.add_argument(
            flag, type=float, default=default, metavar="S", help=f"{what} ({default:g})"
        )
    limits.add_argument(
        "--step-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds one engine step may take before the server reports itself broken; "
        "a front end waits this long for a replica's first byte and between two bytes of "
        "a stream (60; 0 disables)",
    )
    return access, limits


def http_settings(
    args: argparse.Namespace, *, max_body_bytes: int, default_max_tokens: int | None
) -> HTTPSettings:
    """The settings the flags ask for, the connection cap fitted to the process's
    open-file limit (:meth:`ConnectionLimits.fit_descriptor_limit`).

    Raises:
        ValueError: a value out of range (the message names the flag).
    """
    from hybridkv.serving.http.app import ServerOptions

    limits = connection_limits(args)
    if not args.template_timeout > 0:
        raise ValueError(f"--template-timeout must be > 0, got {args.template_timeout}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    hosts = host_names(args)
    options = ServerOptions(
        max_body_bytes=max_body_bytes,
        default_max_tokens=default_max_tokens,
        api_key=args.api_key,
        allowed_hosts=hosts,
        body_timeout_s=args.timeout_body,
        template_timeout_s=args.template_timeout,
        strict_fields=args.strict_fields,
        allowed_origins=allowed_origins(args),
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        **_json_output(args.structured_outputs_config),
    )
    return HTTPSettings(options=options, limits=limits, step_timeout_s=args.step_timeout or None)


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """The connection limits of the transport flags (any server's, a front end's too),
    the cap fitted to the process's open-file limit.

    Raises:
        ValueError: a value out of range (the message names the flag).
    """
    from hybridkv.serving.http.connection import ConnectionLimits

    for flag, _, _ in _TIMEOUTS:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    if args.max_connections < 1:
        raise ValueError(f"--max-connections must be >= 1, got {args.max_connections}")
    per_client = args.max_connections_per_client
    if per_client is not None and per_client < 1:
        raise ValueError(f"--max-connections-per-client must be >= 1, got {per_client}")
    if args.step_timeout < 0:
        raise ValueError(f"--step-timeout must be >= 0 (0 disables it), got {args.step_timeout}")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key must not be empty")
    return ConnectionLimits(
        max_connections=args.max_connections,
        max_connections_per_client=per_client,
        first_byte_timeout_s=args.timeout_first_byte,
        idle_timeout_s=args.timeout_keep_alive,
        head_timeout_s=args.timeout_header,
        write_timeout_s=args.timeout_write,
    ).fit_descriptor_limit()  # logs what it changed


def byte_size(args: argparse.Namespace, flag: str) -> int:
    """A size flag's bytes, at least one.

    Raises:
        UsageError: not a size, or 0 bytes (naming the flag).
    """
    from hybridkv.memory.sizes import parse_size
    from hybridkv.serving.cli.flags.values import UsageError

    text = getattr(args, flag.removeprefix("--").replace("-", "_"))
    size = parse_size(text)
    if size < 1:
        raise UsageError(f"{flag} must be at least 1 byte, got {text!r}")
    return size


def host_names(args: argparse.Namespace) -> tuple[str, ...]:
    """``--allowed-hosts`` as names."""
    return tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())


def allowed_origins(args: argparse.Namespace) -> tuple[str, ...]:
    """``--allowed-origins`` as origins (ValueError: not a list of strings)."""
    return _origins(args.allowed_origins)


def _origins(text: str | None) -> tuple[str, ...]:
    """``--allowed-origins``: a JSON list of strings, or names separated by commas."""
    import json

    if not text:
        return ()
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"--allowed-origins {text!r} is not a JSON list of strings")
        return tuple(value)
    return tuple(o.strip() for o in text.split(",") if o.strip())


def _json_output(text: str | None) -> dict[str, Any]:
    """``--structured-outputs-config``: vLLM's switches as ServerOptions' fields."""
    import json

    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    keys = {"disable_any_whitespace": "any_whitespace",
            "disable_additional_properties": "additional_properties"}  # fmt: skip
    if not isinstance(value, dict) or not all(
        k in keys and isinstance(v, bool) for k, v in value.items()
    ):
        raise ValueError(
            f"--structured-outputs-config {text!r} must be a JSON object of "
            f"{' and '.join(keys)} set to true or false"
        )
    return {keys[k]: not v for k, v in value.items()}


def read_chat_template(value: str | None) -> Any:
    """``--chat-template``: a file's text, or (as vLLM) the template itself.

    Raises:
        UsageError: neither a file nor a template.
        ChatTemplateError: the template does not parse.
    """
    from pathlib import Path

    from hybridkv.serving.cli.flags.values import UsageError
    from hybridkv.serving.openai.chat_template import ChatTemplate

    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return ChatTemplate(path.read_text(encoding="utf-8"), is_builtin=False)
    if "{{" not in value and "{%" not in value:
        raise UsageError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return ChatTemplate(value, is_builtin=False)


def written_over(written: Any, checkpoint: Any) -> Any:
    """A ``--chat-template`` (``read_chat_template``'s) in place of the checkpoint's
    template, keeping the checkpoint's bos/eos strings available to it."""
    from hybridkv.serving.openai.chat_template import ChatTemplate

    return ChatTemplate(written.source, special_tokens=checkpoint.special_tokens, is_builtin=False)
