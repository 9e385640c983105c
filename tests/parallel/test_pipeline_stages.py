"""Pipeline stages in one process: each loads its layers and pages, and chained they give
the model's outputs. (The same stages over processes: test_pipeline_processes.py.)"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch
from model_fixtures import ATTENTION

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.memory.layout import AttentionSpec
from hybridkv.models.errors import ParallelConfigError
from hybridkv.models.stages import check_stage_cuts, split_layers
from hybridkv.models.transformer import MissingLayer
from hybridkv.policies import make_policy

KV_BYTES = 1 << 20


def _stages(path: Path, num_stages: int) -> list[ModelExecutor]:
    return [
        ModelExecutor.from_pretrained(
            path,
            LoadOptions(kv_cache_bytes=KV_BYTES, block_size=4),
            pipeline_stage=i,
            pipeline_parallel_size=num_stages,
        )
        for i in range(num_stages)
    ]


def _slot_tensors(executor: ModelExecutor) -> int:
    return len({cache.untyped_storage().data_ptr() for cache in executor.kv_caches})


def test_split_gives_earlier_stages_the_remainder() -> None:
    """10 layers in 3 stages: 4, 3, 3, contiguous; the first embeds, the last samples."""
    stages = split_layers(10, 3)
    assert [s.layers for s in stages] == [range(0, 4), range(4, 7), range(7, 10)]
    assert [s.is_first for s in stages] == [True, False, False]
    assert [s.is_last for s in stages] == [False, False, True]


def test_more_stages_than_layers_is_refused(tiny_models) -> None:
    """Seven stages of a six-layer model: refused, naming both counts."""
    with pytest.raises(ParallelConfigError, match="pipeline_parallel_size=7 exceeds the model's 6"):
        ModelExecutor.from_pretrained(
            tiny_models["gemma3"].path,
            LoadOptions(kv_cache_bytes=KV_BYTES),
            pipeline_parallel_size=7,
        )


#: Gemma 4's small shape has per-layer inputs, which only the first stage computes.
STAGED = [name for name in ATTENTION if name != "gemma4"]


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("name", STAGED)
def test_chained_stages_match_one_process(
    name, num_stages, tiny_models, make_driver, drive, run_scenario, check_same_outputs, chain
) -> None:
    """Stages run in turn give one process's tokens and logits, through chunked prefill, a
    prefix hit and a preemption."""
    expected = run_scenario(make_driver(name))
    chained = chain(_stages(tiny_models[name].path, num_stages))
    check_same_outputs(run_scenario(drive(chained)), expected)


@pytest.mark.parametrize(
    ("name", "reason"),
    [("gemma4", r"per-layer input.*first stage"), ("zamba2", r"shared attention.*first stage")],
)
def test_layers_reading_the_embeddings_refuse_stages_before_loading(
    tiny_models, name, reason
) -> None:
    """Gemma 4 with per-layer inputs and Zamba2 (its shared blocks read the embeddings) in
    two stages: refused, naming why."""
    with pytest.raises(ParallelConfigError, match=reason):
        ModelExecutor.from_pretrained(
            tiny_models[name].path,
            LoadOptions(kv_cache_bytes=KV_BYTES),
            pipeline_stage=1,
            pipeline_parallel_size=2,
        )


def test_a_cut_between_a_layer_and_the_cache_it_reads_is_refused() -> None:
    """Four layers, the last reading layer 1's cache: two stages of two cut them apart;
    four stages too; one stage does not."""
    full = make_policy("full")
    specs = [
        AttentionSpec(name=f"l{i}", policy=full, num_kv_heads=1, head_dim=8, dtype_bytes=2)
        for i in range(4)
    ]
    specs[3] = attrs.evolve(specs[3], reads="l1")
    for num_stages in (2, 4):
        with pytest.raises(ParallelConfigError, match=r"'l3' in stage .* 'l1', whose KV cache"):
            check_stage_cuts(specs, num_stages)
    assert len(check_stage_cuts(specs, 1)) == 1


def test_each_stage_holds_only_its_layers_and_pages(tiny_models) -> None:
    """Gemma 3 (s s f s s f) in 3 stages: two layers each, their weights, one slot
    each of the same page count; embedding first, norm and head last."""
    stages = _stages(tiny_models["gemma3"].path, 3)
    assert len({s.pool for s in stages}) == 1
    for i, stage in enumerate(stages):
        layers = stage.model.model.layers
        held = [j for j, layer in enumerate(layers) if not isinstance(layer, MissingLayer)]
        assert held == [2 * i, 2 * i + 1]
        prefixes = {n.split(".")[2] for n in stage.model.state_dict() if ".layers." in n}
        assert prefixes == {str(j) for j in held}
        assert len(stage.kv_caches) == 2
        assert _slot_tensors(stage) == 1
        assert stage.kv_caches[0].shape[0] == stage.pool.num_blocks
    assert stages[0].model.model.embed_tokens is not None
    assert all(s.model.model.embed_tokens is None for s in stages[1:])
    assert stages[2].model.lm_head is not None and stages[2].model.model.norm is not None
    assert all(s.model.lm_head is None and s.model.model.norm is None for s in stages[:2])


def test_a_stage_without_full_attention_builds_only_its_groups(tiny_models) -> None:
    """Stage 0 of Gemma 3 in 3 stages holds only sliding layers: no full-attention group
    metadata is built there, and it still holds every group's page count."""
    stages = _stages(tiny_models["gemma3"].path, 3)
    plan = stages[0].plan
    full = [g.group_id for g in plan.groups if g.policy.name == "full"]
    assert full
    assert not set(full) & set(stages[0]._groups)
    assert set(full) <= set(stages[1]._groups) | set(stages[2]._groups)


@pytest.fixture(scope="module")
def seed_000_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Gemma 3 whose layers are full.0 sw.0 sw.1 full.1 sw.2 sw.3 (seed 000's example)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    f, s = "full_attention", "sliding_attention"
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, sliding_window=8, num_hidden_layers=6,
        layer_types=[f, s, s, f, s, s], max_position_embeddings=512,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("seed000")
    Gemma3ForCausalLM(config).save_pretrained(path)
    return path


def test_seed_000_stages_hold_one_layer_per_group(
    seed_000_checkpoint, drive, run_scenario, check_same_outputs, chain
) -> None:
    """Two stages of {full.0, sw.0, sw.1} and {full.1, sw.2, sw.3}: groups (full.0, full.1),
    (sw.0, sw.2), (sw.1, sw.3), so each stage needs one slot, no padding slot."""
    stages = _stages(seed_000_checkpoint, 2)
    names = [f"model.layers.{i}.self_attn" for i in range(6)]
    groups = [g.layer_names for g in stages[0].plan.groups]
    assert groups == [
        (names[0], names[3]),
        (names[1], names[4]),
        (names[2], names[5]),
    ]
    assert [_slot_tensors(s) for s in stages] == [1, 1]
    one = ModelExecutor.from_pretrained(
        seed_000_checkpoint, LoadOptions(kv_cache_bytes=KV_BYTES, block_size=4)
    )
    assert stages[0].pool.num_blocks == 2 * one.pool.num_blocks  # half the layers per device
    expected = run_scenario(drive(one))
    check_same_outputs(run_scenario(drive(chain(stages))), expected)
