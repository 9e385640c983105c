"""Chat messages to prompt text, with the checkpoint's own chat template when it has one.

A checkpoint folder carries its template as ``chat_template.jinja`` or as the
``chat_template`` entry of ``tokenizer_config.json``. Templates run in a sandbox with a
time and an output-size limit (``template_sandbox.py``): a template is data from a
downloaded folder, not trusted code, and the messages come from clients. Every way a
rendering can fail is a :class:`ChatTemplateError`, which the server answers with a 400.
A checkpoint without a template gets a plain ``role: content`` transcript.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from hybridkv.errors import HybridKVError

# Used when the checkpoint has none: readable by a base model, and unambiguous.
PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


class ChatTemplateError(HybridKVError, ValueError):
    """A chat template failed to load or to render the given messages."""


class ChatTemplateTooLongError(ChatTemplateError):
    """A rendering grew longer than any prompt the model can take."""


@attrs.frozen(kw_only=True)
class RenderLimits:
    """How long one rendering may run, and how many characters it may produce.

    Attributes:
        timeout_s: Seconds.
        max_chars: Characters of output (and of any value built on the way).
    """

    timeout_s: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    max_chars: int = attrs.field(default=4 * 2**20, validator=attrs.validators.ge(1))


def _token_text(value: object) -> str:
    # tokenizer_config.json stores special tokens as strings or as {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class ChatTemplate:
    """Renders a conversation into the prompt text a model was trained on.

    Attributes:
        source: The template text.
        is_builtin: Whether the checkpoint had none and :data:`PLAIN_TEMPLATE` is used.
        special_tokens: ``bos_token``/``eos_token`` strings the template may reference.
    """

    def __init__(
        self, source: str, *, special_tokens: Mapping[str, str] | None = None, is_builtin: bool
    ) -> None:
        from jinja2 import TemplateError

        from hybridkv.serving.openai.template_sandbox import LimitedSandbox

        self.source = source
        self.is_builtin = is_builtin
        self.special_tokens = dict(special_tokens or {})
        env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not parse: {exc}") from None

    @classmethod
    def plain(cls) -> ChatTemplate:
        """The ``role: content`` transcript used when a checkpoint has no template."""
        return cls(PLAIN_TEMPLATE, is_builtin=True)

    @classmethod
    def from_checkpoint(cls, folder: str | Path) -> ChatTemplate:
        """The template of a checkpoint folder, or the plain one if it has none."""
        folder = Path(folder)
        config = _read_config(folder / "tokenizer_config.json")
        tokens = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
        jinja_file = folder / "chat_template.jinja"
        source: object = (
            jinja_file.read_text(encoding="utf-8")
            if jinja_file.is_file()
            else config.get("chat_template")
        )
        if isinstance(source, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source.strip():
            return cls.plain()
        return cls(source, special_tokens=tokens, is_builtin=False)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
        limits: RenderLimits | None = None,
    ) -> str:
        """The prompt text for ``messages``, by default ending where the assistant's
        reply begins.

        Args:
            messages: The conversation.
            add_generation_prompt: End with the cue for the assistant's turn.
            variables: Extra template variables (a request's ``chat_template_kwargs``).
            limits: Time and size limits (defaults: 5 s, 4 Mi characters).

        Raises:
            ChatTemplateTooLongError: the text would be longer than ``limits.max_chars``.
            ChatTemplateError: the template failed, refused the messages, ran too long or
                tried what a chat template may not (include, huge values).
        """
        from hybridkv.serving.openai.template_sandbox import Budget, TemplateTooLongError

        limits = limits or RenderLimits()
        context = {
            **(variables or {}),
            **self.special_tokens,
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        parts: list[str] = []
        with Budget(limits.timeout_s, limits.max_chars) as budget:
            try:
                size = 0
                for chunk in self._template.generate(context):
                    size += len(chunk)
                    budget.size(size)
                    budget.tick()
                    parts.append(chunk)
            except TemplateTooLongError as exc:
                raise ChatTemplateTooLongError(str(exc)) from None
            except ChatTemplateError as exc:
                raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None
            except Exception as exc:  # any failure of checkpoint code is the request's 400
                raise ChatTemplateError(f"the chat template failed: {exc}") from None
        return "".join(parts)


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ChatTemplateError(f"cannot read {path.name}: {exc}") from None
    return data if isinstance(data, dict) else {}
