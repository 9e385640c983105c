"""What a generation request must pass before anything of it is queued.

::

    the model it names          this server's, or a 404
    its priority                one the scheduling policy takes (fcfs: 0 only), or a 400
    its logit bias              token ids inside the vocabulary, or a 400
    its structured output       bounded, checked and compiled (grammar_check), or a 400

The checks that need no work run on the loop; the grammar's run in a worker thread.
"""

from __future__ import annotations

from hybridkv.scheduler import EngineConfig, InvalidRequestError
from hybridkv.serving.openai.errors import APIError
from hybridkv.serving.openai.grammar_check import GrammarCheck
from hybridkv.serving.openai.protocol import GenerationRequest


class Admission:
    """The checks of one server.

    Args:
        model_name: The only ``model`` value requests may name.
        config: The engine's config (its scheduling policy).
        vocab_size: Token ids a logit bias may name are below it.
        grammars: How structured output is checked and compiled.
    """

    def __init__(
        self, model_name: str, config: EngineConfig, vocab_size: int, grammars: GrammarCheck
    ) -> None:
        self.model_name = model_name
        self.config = config
        self.vocab_size = vocab_size
        self.grammars = grammars

    def check_model(self, model: str | None) -> None:
        """Refuse (404) a ``model`` this server does not serve."""
        if model is not None and model != self.model_name:
            raise APIError(
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )

    def check_scheduling(self, request: GenerationRequest) -> None:
        """Refuse (400) a priority the engine's scheduling policy does not take."""
        try:
            self.config.check_priority(request.priority)
        except InvalidRequestError as exc:
            hint = (
                "; start the server with --scheduling-policy priority to honour priorities"
                if self.config.scheduling_policy == "fcfs"
                else ""
            )
            raise APIError(f"{exc}{hint}", param="priority") from None

    async def check_sampling(self, request: GenerationRequest) -> None:
        """Refuse (400) a logit bias outside the vocabulary, and a constraint that is over
        a bound or does not compile (compiling it for the steps otherwise)."""
        outside = [t for t, _ in request.sampling.logit_bias if t >= self.vocab_size]
        if outside:
            raise APIError(
                f"'logit_bias' names token ids outside the vocabulary of {self.vocab_size}: "
                f"{outside[:5]}",
                param="logit_bias",
            )
        spec = request.sampling.structured_output
        if spec is not None:
            await self.grammars.check(spec, request.structured_param or "response_format")
