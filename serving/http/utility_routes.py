"""The routes around generation: models, tokenize, detokenize, version (vLLM's shapes).

::

    GET  /v1/models             {"object": "list", "data": [card]}
    GET  /v1/models/{model}     card, or 404 model_not_found
    POST /tokenize              {"prompt": ...} or {"messages": [...]} ->
                                {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize            {"tokens": [...]} -> {"prompt": text}
    GET  /version               {"version": "0.1.0"}
    GET  /kv_events             where this engine publishes its KV events and how its
                                blocks hash: {"endpoint", "replay_endpoint", "topic",
                                "block_size", "hash_algorithm", "shared_tiers"}; 404
                                when it does not
    GET  /load                  the engine's queues and free pages, for a router:
                                {"num_waiting", "num_running", "num_free_blocks",
                                 "num_blocks", "kv_usage", "free_tokens"}; every
                                generation's answer carries free_tokens in its
                                x-hybridkv-free-tokens header too

Tokenizing and rendering go through the same prompter as generation (worker threads,
the template's limits); ``/tokenize`` counts a text longer than the context rather than
refusing it, as vLLM's does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hybridkv.memory.headroom import token_headroom
from hybridkv.parallel.kv_event_wire import MEDIUM
from hybridkv.serving.openai.errors import APIError
from hybridkv.serving.openai.fields import Fields
from hybridkv.serving.openai.messages import parse_messages
from hybridkv.serving.openai.protocol import GenerationRequest, parse_template_kwargs
from hybridkv.serving.openai.service import GenerationService

if TYPE_CHECKING:
    from hybridkv.parallel.kv_events import KVEventPublisher

#: Detokenizing this many ids or fewer runs on the loop.
_INLINE_IDS = 4096


def free_tokens(service: GenerationService) -> int:
    """The longest prompt ``service``'s free pages hold now, up to its context length."""
    kv = service.engine.core.kv
    return token_headroom(kv, kv.num_free_blocks, service.max_model_len)


class UtilityRoutes:
    """Handlers of the non-generation routes.

    Args:
        service: The generation service (model name, prompter, tokenizer).
        read_json: Reads a request's JSON body through the server's body checks.
        kv_events: The engine's KV event publisher, if it has one.
    """

    def __init__(
        self,
        service: GenerationService,
        read_json: Callable[[Request], Awaitable[dict[str, Any]]],
        kv_events: KVEventPublisher | None = None,
    ) -> None:
        self.service = service
        self.read_json = read_json
        self.kv_events = kv_events

    def card(self) -> dict[str, Any]:
        """The served model, as OpenAI's model object (with vLLM's max_model_len)."""
        service = self.service
        return {
            "id": service.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "hybridkv",
            "root": service.model_name,
            "max_model_len": service.max_model_len,
        }

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.card()]})

    async def model(self, request: Request) -> Response:
        try:
            self.service.check_model(request.path_params["model"])
        except APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        return JSONResponse(self.card())

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": metadata.version("hybridkv")})

    async def kv_events_info(self, request: Request) -> Response:
        """What a router needs to follow this engine's KV events (``hybridkv route``)."""
        publisher = self.kv_events
        if publisher is None:
            body = {
                "error": {
                    "message": "this server publishes no KV events "
                    "(serve it with --kv-events-config)",
                    "type": "NotFoundError",
                }
            }
            return JSONResponse(body, status_code=404)
        core = self.service.engine.core
        kv = core.kv
        # The tiers other engines read, by medium: replicas naming one store load one
        # another's blocks there (a round trip to Redis, once, off the loop).
        stores = (
            {} if core.offload is None else await anyio.to_thread.run_sync(
                core.offload.connector.shared_stores
            )
        )  # fmt: skip
        return JSONResponse(
            {
                "endpoint": publisher.endpoint,
                "replay_endpoint": publisher.replay_endpoint,
                "topic": publisher.config.topic,
                "block_size": kv.block_size,
                "hash_algorithm": kv.hash_name,
                "data_parallel_rank": publisher.data_parallel_rank,
                "shared_tiers": {MEDIUM[name]: store for name, store in stores.items()},
            }
        )

    async def load(self, request: Request) -> Response:
        """The queues and free pages a router weighs (``serving/router/replicas.py`` polls it,
        as SGLang's router polls ``/get_load``): ``free_tokens`` is the longest prompt the
        free pages hold now (``memory/headroom.py``), up to the context length."""
        stats = self.service.engine.stats()
        return JSONResponse(
            {
                "num_waiting": stats.num_waiting,
                "num_running": stats.num_running,
                "num_free_blocks": stats.num_free_blocks,
                "num_blocks": stats.num_blocks,
                "kv_usage": round(stats.kv_usage, 4),
                "free_tokens": free_tokens(self.service),
            }
        )

    async def tokenize(self, request: Request) -> Response:
        fields = Fields(await self.read_json(request))
        self.service.check_model(fields.string("model"))
        is_chat = fields.has("messages")
        add_special = fields.boolean("add_special_tokens", not is_chat)
        return_strs = fields.boolean("return_token_strs", False)
        prompter = self.service.prompter
        if is_chat:
            parsed = GenerationRequest(
                model=self.service.model_name,
                messages=parse_messages(fields),
                add_generation_prompt=fields.boolean("add_generation_prompt", True),
                template_kwargs=parse_template_kwargs(fields.nested("chat_template_kwargs")),
            )
            fields.refuse("continue_final_message", allowed=(None, False))
            fields.check_all_read()
            text = await prompter.render(parsed)
        else:
            prompt = fields.string("prompt")
            if prompt is None:
                raise fields.error("prompt", "is required (or 'messages')")
            fields.check_all_read()
            text = prompt
        param = "messages" if is_chat else "prompt"
        ids = await prompter.encode(text, add_special, param=param, check_fits=False)
        strs = [self.service.token_texts(i) for i in ids] if return_strs else None
        body = {
            "count": len(ids),
            "max_model_len": self.service.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }
        return JSONResponse(body)

    async def detokenize(self, request: Request) -> Response:
        fields = Fields(await self.read_json(request))
        self.service.check_model(fields.string("model"))
        ids = list(fields.token_ids("tokens"))
        fields.check_all_read()
        vocab = self.service.vocab_size
        outside = [i for i in ids if i >= vocab]
        if outside:
            raise fields.error(
                "tokens", f"holds ids outside the vocabulary of {vocab}: {outside[:5]}"
            )
        tokenizer = self.service.tokenizer
        if len(ids) <= _INLINE_IDS:
            text = tokenizer.decode(ids)
        else:  # decode_batch releases the GIL while it works
            (text,) = await anyio.to_thread.run_sync(
                tokenizer.decode_batch, [ids], limiter=self.service.prompter.limiter
            )
        return JSONResponse({"prompt": text})
