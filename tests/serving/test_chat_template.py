"""Chat templates: read from a checkpoint folder, rendered in a sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv.serving.builtin_models import BUILTIN_MODELS
from hybridkv.serving.chat import ChatTemplate, ChatTemplateError

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
