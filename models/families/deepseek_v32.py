"""DeepSeek V3.2: DeepSeek V3's layers (``deepseek_v3.py``) with DeepSeek Sparse Attention,
a lightning indexer in each that picks the ``index_topk`` keys every query attends
(``blocks/sparse_indexer.py``) and keeps a key of its own a token (``index_head_dim``),
a second memory of the layer in pages of its own (``AttentionSpec.beside``). Its
config is read by DeepSeek V3's parser: the indexer's fields are the latent's shape's
(``shapes/latent.py``)."""

from __future__ import annotations

from hybridkv.models.families import Family
from hybridkv.models.families.deepseek_v3 import parse_deepseek_v3
from hybridkv.models.kinds import FULL, kinds_by
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.latent import latent_width
from hybridkv.models.shapes.mtp import MtpShape

FAMILY = Family(
    model_types=("deepseek_v32",),
    layer_kinds=kinds_by(lambda cfg, n: [FULL] * n, {"indexed_attention": FULL}),
    parse=parse_deepseek_v3,
    decoder=DecoderShape(mlp="experts"),
    latent_width=latent_width,
    mtp=MtpShape(layout="after"),  # indexed latent attention and experts
)
