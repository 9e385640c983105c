"""``hybridkv serve --data-parallel-size N``: N engine processes behind one front end.

::

    hybridkv serve MODEL -dp 2 --port 8000
      ├─ replica 0: hybridkv serve MODEL --port P0 --kv-events-config {tcp://127.0.0.1:E0}
      ├─ replica 1: hybridkv serve MODEL --port P1 --kv-events-config {tcp://127.0.0.1:E1}
      └─ this process: the front end on :8000 (serving/cli/route.py), routing by prefix

Each replica is the same ``serve`` command with every other flag as given (``-tp``,
``-pp``, ``--kv-offload redis://...`` shared by all, ...), listening on loopback. Its KV
events go to free loopback ports, unless ``--kv-events-config`` is given: then replica
``r`` publishes where that config says, with its TCP ports moved up by ``r``, as vLLM
numbers its data-parallel ranks. The front end waits until every replica serves (a
replica that exits first fails the command with its exit code; its own log says why),
takes a replica whose process exits out of rotation at once (and starts it again with
``--restart-replicas``), and stops them all when it stops, on Ctrl-C or SIGTERM
(``replica_processes.py``). Each replica ends with the front end, even a SIGKILLed one.
"""

from __future__ import annotations

import argparse
import json
import socket
from collections.abc import Sequence

from hybridkv.serving.cli.route import add_routing_arguments

#: Flags of the command line that the front end keeps to itself (with their values).
_FRONT_END_FLAGS = (
    "--data-parallel-size",
    "-dp",
    "--data-parallel-rank",
    "--host",
    "--port",
    "--api-key",  # the replicas get it in their environment
    # The front end answers to the Host names and origins; its own requests to a
    # replica name the replica's loopback address.
    "--allowed-hosts",
    "--allowed-origins",
    "--kv-events-config",
    "--routing",
    "--health-interval",
    "--load-interval",
)
#: Its flags that take no value.
_FRONT_END_SWITCHES = ("--restart-replicas",)


def add_data_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """``-dp`` / ``--data-parallel-size`` and the front end's flags, on ``serve``."""
    group = parser.add_argument_group("data parallelism")
    group.add_argument(
        "-dp",
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="run N engine processes behind this server, routed by prefix (1)",
    )
    group.add_argument(
        "--data-parallel-rank",
        type=int,
        default=0,
        metavar="R",
        help="this engine's rank among data-parallel replicas, written into its KV events (0)",
    )
    group.add_argument(
        "--restart-replicas",
        action="store_true",
        help="start a replica again when its process exits (default: serve on the others)",
    )
    add_routing_arguments(group)


def replica_command_line(argv: Sequence[str], *, port: int, kv_events: str, rank: int) -> list[str]:
    """``argv`` (a ``serve`` command line) for replica ``rank``: the front end's flags
    dropped, its own port, KV events and rank added."""
    kept: list[str] = []
    skip = False
    for item in argv:
        if skip:
            skip = False
            continue
        name = item.split("=", 1)[0]
        if name in _FRONT_END_SWITCHES:
            continue
        if name in _FRONT_END_FLAGS:
            skip = "=" not in item
            continue
        kept.append(item)
    return [
        *kept,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kv-events-config",
        kv_events,
        "--data-parallel-rank",
        str(rank),
    ]


def kv_events_of(args: argparse.Namespace, rank: int) -> str:
    """Replica ``rank``'s ``--kv-events-config``: the user's moved to its rank, or free
    loopback ports."""
    import attrs

    from hybridkv.parallel.kv_events_config import KVEventsConfig

    if args.kv_events_config is not None:
        config = KVEventsConfig.from_json(args.kv_events_config).for_data_parallel_rank(rank)
        return json.dumps({k: v for k, v in attrs.asdict(config).items() if v is not None})
    endpoint, replay = (f"tcp://127.0.0.1:{port}" for port in free_ports(2))
    return json.dumps(
        {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay}
    )


def free_ports(count: int) -> list[int]:
    """Ports free now on loopback (all held open together, so they differ)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def run_data_parallel(args: argparse.Namespace) -> int:
    """Start the replicas, serve the front end until interrupted (Ctrl-C or SIGTERM),
    stop the replicas."""
    import contextlib

    from hybridkv.serving.cli.flags.console import configure_logging
    from hybridkv.serving.cli.flags.values import UsageError
    from hybridkv.serving.cli.replica_processes import ReplicaProcesses
    from hybridkv.serving.cli.route import (
        front_end_settings,
        load_prompter,
        run_front_end,
        serve_front_end,
    )
    from hybridkv.serving.http.uvicorn_server import open_socket
    from hybridkv.serving.router.replicas import Replica

    configure_logging(args.log_level, args.log_format)
    size = args.data_parallel_size
    if args.data_parallel_rank != 0:
        raise UsageError("--data-parallel-rank is for the replicas -dp starts; drop it")
    if not args.enable_prefix_caching and args.routing.startswith("prefix"):
        args.routing = "least-loaded"  # no cache, no events: load is all there is
    settings = front_end_settings(args)  # a bad flag fails before any replica starts
    sock = open_socket(args.host, args.port)  # and so does a port in use
    with sock:
        prompter = load_prompter(
            args.model_flag or args.model, args.chat_template, getattr(args, "revision", None)
        )
        ports = free_ports(size)
        lines = [
            replica_command_line(
                args.command_line, port=port, kv_events=kv_events_of(args, rank), rank=rank
            )
            for rank, port in enumerate(ports)
        ]
        processes = ReplicaProcesses(lines, restart=args.restart_replicas, api_key=args.api_key)
        try:
            processes.start()
            replicas = [
                Replica(str(rank), f"http://127.0.0.1:{port}", pid=process.pid)
                for rank, (port, process) in enumerate(zip(ports, processes.processes, strict=True))
            ]
            watchers = [processes.watcher(rank) for rank in range(size)]
            with contextlib.suppress(KeyboardInterrupt):
                run_front_end(
                    args.loop,
                    lambda: serve_front_end(
                        args,
                        settings,
                        replicas,
                        prompter,
                        sock,
                        watchers,
                        ready=processes.until_serving,
                    ),
                )
        finally:
            processes.stop()
    return 0
