"""The headers a replica adds to its answers for a front end: light, so that the front
end's flags (``hybridkv route --help``) import nothing of the server to read them."""

#: A generation's answer carries the longest prompt the replica's free pages hold when it
#: starts (``utility_routes.free_tokens``), so that a front end hears a busy replica's load
#: without polling its ``/load``.
FREE_TOKENS_HEADER = "x-hybridkv-free-tokens"

__all__ = ["FREE_TOKENS_HEADER"]
