"""The text model of a multimodal checkpoint (Gemma 3, Llama 4, Gemma 4): refused without
``--text-only``, served with it, with the multimodal model's own logits on text."""

from __future__ import annotations

from typing import Any

import pytest
from model_fixtures import TinyModel

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.models.checkpoint import Checkpoint
from hybridkv.models.errors import ModelConfigError
from hybridkv.testing.tiny_multimodal import MULTIMODAL_BUILDERS


@pytest.fixture(params=sorted(MULTIMODAL_BUILDERS))
def multimodal(request: pytest.FixtureRequest, tiny_multimodal: Any) -> TinyModel:
    model: TinyModel = tiny_multimodal[request.param]
    return model


def test_a_multimodal_checkpoint_is_refused_without_text_only(multimodal: TinyModel) -> None:
    with pytest.raises(ModelConfigError, match=r"vision tower.*--text-only"):
        Checkpoint.open(multimodal.path)


def test_its_text_model_gives_the_multimodal_models_logits(
    multimodal: TinyModel, drive: Any, prompt_of: Any, check_reference: Any
) -> None:
    """Prompts past the window or chunk, batched, then decode steps: transformers' logits
    of the whole multimodal model on text, and its greedy tokens."""
    options = LoadOptions(kv_cache_bytes=1 << 20, block_size=4, text_only=True)
    driver = drive(ModelExecutor.from_pretrained(multimodal.path, options))
    driver.add("a", prompt_of(23, 1))
    driver.add("b", prompt_of(9, 2))
    driver.run(5)
    check_reference(multimodal, driver, "a")
    check_reference(multimodal, driver, "b")
