"""Chat templates: read from a checkpoint folder, rendered in a sandbox."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hybridkv.serving.cli.builtin_models import BUILTIN_MODELS
from hybridkv.serving.openai.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    ChatTemplateTooLongError,
    RenderLimits,
)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_folder_without_template_gets_the_plain_transcript(tmp_path: Path) -> None:
    """A checkpoint with no template renders role: content lines and an Assistant cue."""
    template = ChatTemplate.from_checkpoint(tmp_path)
    assert template.is_builtin
    assert template.render(MESSAGES) == "System: Be brief.\nUser: Hi\nAssistant:"


def test_template_file_is_preferred(tmp_path: Path) -> None:
    """chat_template.jinja is read, with bos_token from tokenizer_config.json."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    )
    assert ChatTemplate.from_checkpoint(tmp_path).render(MESSAGES) == "<s>[system]Be brief.[user]Hi"


def test_template_in_tokenizer_config_is_read(tmp_path: Path) -> None:
    """A template stored in tokenizer_config.json is used when there is no .jinja file."""
    config = {"chat_template": "{% for m in messages %}{{ m.content }};{% endfor %}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.from_checkpoint(tmp_path)
    assert (template.is_builtin, template.render(MESSAGES)) == (False, "Be brief.;Hi;")


def test_raise_exception_becomes_a_chat_template_error() -> None:
    """A template refusing the messages raises ChatTemplateError with its message."""
    template = ChatTemplate("{{ raise_exception('no system role') }}", is_builtin=False)
    with pytest.raises(ChatTemplateError, match="no system role"):
        template.render(MESSAGES)


def test_template_cannot_reach_python_internals() -> None:
    """The sandbox refuses attribute access to Python internals."""
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", is_builtin=False)
    with pytest.raises(ChatTemplateError):
        template.render(MESSAGES)


def test_gemma_template_writes_turns() -> None:
    """The template written for the built-in Gemma uses its turn markers."""
    source = BUILTIN_MODELS["gemma-3-270m"].chat_template
    assert source is not None
    text = ChatTemplate(source, special_tokens={"bos_token": "<bos>"}, is_builtin=False).render(
        [{"role": "user", "content": "Hi"}]
    )
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def limited(source: str, **limits: Any) -> str:
    """Render ``source`` over MESSAGES with tight limits."""
    template = ChatTemplate(source, is_builtin=False)
    return template.render(
        MESSAGES, limits=RenderLimits(**{"timeout_s": 0.5, "max_chars": 1000, **limits})
    )


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}"
         "{% endfor %}{% endfor %}{% endfor %}", "ran longer than 0.5 s"),
        ("{% for i in range(999) %}{{ 'xy' }}{% endfor %}", "at most 1000"),
        ("{{ 'x' * 5000 }}", "at most 1000"),
        ("{{ [1] * 5000 }}", "at most 1000"),
        ("{{ 2 ** 100000 }}", "power"),
        ("{{ '%99999999s' % 'x' }}", "format width"),
        ("{{ '{:99999999}'.format('x') }}", "format width"),
        ("{{ '%99999999s' | format('x') }}", "format width"),
        ("{{ 'x' | center(10 ** 6) }}", "at most 1000"),
        ("{{ 'x'.ljust(10 ** 6) }}", "at most 1000"),
        ("{% include 'x.jinja' %}", "may not include"),
        ("{% extends 'base.jinja' %}", "may not include"),
    ],
)  # fmt: skip
def test_sandbox_limits_stop_runaway_templates(source: str, match: str) -> None:
    """Loops past the deadline, oversized values and includes are ChatTemplateErrors."""
    with pytest.raises(ChatTemplateError, match=match):
        limited(source)


def test_oversized_output_is_its_own_error() -> None:
    """Output longer than the limit raises ChatTemplateTooLongError (a context error)."""
    with pytest.raises(ChatTemplateTooLongError):
        limited("{% for i in range(900) %}ab{% endfor %}")


def test_ordinary_templates_render_within_limits() -> None:
    """Loops, filters, formatting and variables work as in plain Jinja."""
    source = (
        "{% for m in messages %}{{ '%-6s' % m.role }}|{{ m.content | upper }}"
        "{{ '{:>3}'.format(loop.index) }};{% endfor %}{{ flavour }}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    template = ChatTemplate(source, is_builtin=False)
    text = template.render(MESSAGES, variables={"flavour": "!"}, add_generation_prompt=False)
    assert text == "system|BE BRIEF.  1;user  |HI  2;!"


def test_content_with_percent_and_long_numbers_is_fine() -> None:
    """Message text that looks like a format string passes through filters untouched."""
    messages = [{"role": "user", "content": "50% of 123456789012 units"}]
    template = ChatTemplate("{{ messages[0].content | trim }}", is_builtin=False)
    assert template.render(messages) == "50% of 123456789012 units"
