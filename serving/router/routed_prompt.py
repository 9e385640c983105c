"""The prompt a request routes by: its tokens as a replica will see them, and its cache
salt, read leniently (a body the front end cannot read is routed by load, and the
replica it reaches answers the error)."""

from __future__ import annotations

import json
from collections.abc import Hashable
from typing import Any

from hybridkv.serving.openai.errors import APIError
from hybridkv.serving.openai.json_text import decode_json
from hybridkv.serving.openai.prompts import Prompter
from hybridkv.serving.openai.protocol import parse_chat, parse_completion


async def lenient_json(raw: bytes, prompter: Prompter | None) -> dict[str, Any]:
    """The body's JSON object, or an empty one if it is not one (large bodies decoded in
    the prompter's threads)."""
    try:
        if prompter is None:
            body = json.loads(raw)
        else:
            body = await decode_json(raw, prompter.limiter)
    except (APIError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


async def routed_prompt(
    prompter: Prompter | None, path: str, body: dict[str, Any]
) -> tuple[list[int] | None, tuple[Hashable, ...]]:
    """The prompt's tokens and extra keys (its cache salt) for a generation ``body`` of
    ``path``; None for the tokens where there is no one prefix to follow (no prompter,
    a batch of prompts, a body the replicas will refuse)."""
    if prompter is None:
        return None, ()
    try:
        if path.endswith("/chat/completions"):
            parsed = parse_chat(body, auto_tools=True)
        else:
            parsed = parse_completion(body)
        prompt = parsed.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return None, ()  # a batch of prompts
        token_ids = await prompter.token_ids(parsed)
    except (APIError, TypeError, ValueError):
        return None, ()
    salt = parsed.cache_salt
    return token_ids, (() if salt is None else (salt,))
