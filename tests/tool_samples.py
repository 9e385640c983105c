"""Tools and a scripted executor the tool-call tests share (the server's own and the
clients')."""

from __future__ import annotations

from hybridkv.scheduler import FakeExecutor, StepBatch, StepResult
from hybridkv.testing import BYTE_EOS, byte_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class ScriptedExecutor(FakeExecutor):
    """The fake, writing a fixed text (byte tokens), then ``<eos>``."""

    script = ""

    def execute(self, batch: StepBatch) -> StepResult:
        result = super().execute(batch)
        ids = [*byte_tokenizer().encode(self.script).ids, BYTE_EOS]
        tokens = [
            None if t is None else ids[min(r.output_index, len(ids) - 1)]
            for r, t in zip(batch.requests, result.token_ids, strict=True)
        ]
        return StepResult(token_ids=tuple(tokens), prompt_logprobs=result.prompt_logprobs)


HERMES = (
    'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
)
