"""The tables hostile_clients.py prints, one per case."""

from __future__ import annotations

from typing import Any

FRESH_GOAL_S = 2.0  # a fresh completion: at most this over the unloaded median
HEALTH_GOAL_S = 1.0  # /health: at most this


def log_events(stderr: str) -> list[str]:
    """The event names of the server's log lines ("12:00:00 [warning ] name key=...")."""
    names = []
    for line in stderr.splitlines():
        _, bracket, rest = line.partition("] ")
        names.append(rest.split(" ", 1)[0] if bracket else line[:80])
    return names


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _yes(value: bool) -> str:
    return "yes" if value else "NO"


def print_case(r: dict[str, Any]) -> None:
    print(f"\ncase {r['case']}: {r['hostile']} ({r['seconds']:g} s)\n")
    print("| probe | unloaded median / max ms | loaded median / max ms | median diff ms | goal |")
    print("| --- | --- | --- | --- | --- |")
    for name, goal, limit in (
        ("fresh", "fresh_goal", f"max within {FRESH_GOAL_S:g} s of unloaded median"),
        ("health", "health_goal", f"max within {HEALTH_GOAL_S:g} s"),
    ):
        u, lo = r[name]["unloaded"], r[name]["loaded"]
        diff = (
            None
            if u["median_ms"] is None or lo["median_ms"] is None
            else lo["median_ms"] - u["median_ms"]
        )
        label = "fresh completion" if name == "fresh" else "GET /health"
        bad = "" if lo["all_200"] else f", statuses {lo['statuses']}"
        print(
            f"| {label} | {_ms(u['median_ms'])} / {_ms(u['max_ms'])} "
            f"| {_ms(lo['median_ms'])} / {_ms(lo['max_ms'])} | {diff:+.1f} "
            f"| {'holds' if r[goal] else 'FAILS'} ({limit}{bad}) |"
            if diff is not None
            else f"| {label} | - | - | - | FAILS{bad} |"
        )
    outcomes = "; ".join(
        f"{label}: " + ", ".join(f"{code} x {n}" for code, n in sorted(counts.items()))
        for label, counts in r["hostile_outcomes"].items()
    )
    print(f"\nhostile client: {outcomes}")
    for note, value in r["hostile_notes"].items():
        if value < 100_000:  # only the large answers (case 7) are worth a line
            continue
        print(f"  {note}: {value:,.0f}")
    e, before, after = r["engine_after"], r["resources_before"], r["resources_after"]
    print(
        f"5xx: {'none' if r['no_5xx'] else 'SOME'} (server counted {e['5xx counted']:.0f}); "
        f"hostile active through the probes: {_yes(r['hostile_active_through_probes'])}"
    )
    print(
        f"server: {'alive, /health 200' if r['server_alive_after'] else 'DEAD or unhealthy'} "
        f"after the case; exit code {r['server_exit_code']} when told to stop; "
        f"stderr {r['server_stderr_lines']} lines ({r['server_stderr_bytes']:,} bytes), "
        f"{r['server_tracebacks']} tracebacks"
        + (
            f" (events: {', '.join(r['server_stderr_events'])})"
            if r["server_stderr_events"]
            else ""
        )
    )
    print(
        f"after: running {e['running']:.0f}, waiting {e['waiting']:.0f}, pages held "
        f"{e['pages held']:.0f}; descriptors {before['descriptors']} -> {after['descriptors']}, "
        f"threads {before['threads']} -> {after['threads']}; "
        f"{'LEAK' if r['leaked'] else 'no leak'}"
    )
