"""What structured output costs per sampled token, and once per tokenizer.

The sampler alone (no model): one row of random logits of the tokenizer's width, steered
towards the tokens of a JSON document, sampled through ``Sampler.sample`` with a JSON
schema (the grammar mask computed, applied, the matcher advanced) and without (the same
row, plain greedy), alternating token by token so both see the same machine load. Also
the grammar mask alone (llguidance's ``compute_bitmask`` and the unpacking), the
one-off vocabulary read (``enable_structured_output``) and the compile of the schema.

The tokenizer is the built-in Gemma 3 one (262,144 tokens) when it has been converted
(``hybridkv demo`` or ``make run`` does it), else a 257-token byte-level one.

    python -m benchmarks.decode.structured_output [--documents 20]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from hybridkv.executor.sampler import Sampler
from hybridkv.scheduler import SamplingParams, StepRequest
from hybridkv.scheduler.params import StructuredOutput
from hybridkv.serving.cli.builtin_models import cache_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
}


def document(i: int) -> str:
    """The ``i``-th JSON document the rows are steered to (it fits SCHEMA)."""
    value = {
        "name": f"Person number {i}",
        "age": 20 + i,
        "email": f"person{i}@example.org",
        "tags": ["alpha", "beta", f"gamma-{i}"],
        "address": {"city": "Amsterdam", "zip": f"10{i:02d} AB"},
    }
    return json.dumps(value)


def tokenizer_and_eos() -> tuple[Tokenizer, str, list[int]]:
    """The Gemma 3 tokenizer if converted here, else a byte-level one."""
    path = cache_dir() / "gemma-3-270m" / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path)), "gemma-3-270m", [1, 106]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<eos>", special=True)])
    return tokenizer, "byte-level", [256]


def row_request(
    params: SamplingParams, rid: str, tokens: list[int], num_prompt: int
) -> StepRequest:
    return StepRequest(
        request_id=rid,
        token_ids=tokens[-1:],
        start_position=len(tokens) - 1,
        block_tables=[],
        sample=True,
        params=params,
        output_index=len(tokens) - num_prompt,
        all_token_ids=tokens,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer, name, eos = tokenizer_and_eos()
    vocab = tokenizer.get_vocab_size()
    sampler = Sampler(eos_token_ids=eos, seed=0)
    start = time.perf_counter()
    sampler.enable_structured_output(tokenizer, vocab)
    setup_s = time.perf_counter() - start
    assert sampler.grammars is not None
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    guided = SamplingParams(temperature=0.0, structured_output=spec)
    plain = SamplingParams(temperature=0.0)
    noise = torch.Generator().manual_seed(0)
    with_us, without_us, mask_us, compile_ms = [], [], [], []
    for i in range(args.documents):
        target = [*tokenizer.encode(document(i), add_special_tokens=False).ids, eos[0]]
        tokens = [2]  # a one-token prompt
        rid = f"doc{i}"
        start = time.perf_counter()
        sampler.grammars.logit_mask(row_request(guided, rid, tokens, 1))  # compile (cached after)
        compile_ms.append((time.perf_counter() - start) * 1e3)
        for token in target:
            logits = torch.randn(1, vocab, generator=noise)
            logits[0, token] += 50.0  # steer to the document; the mask must allow it
            start = time.perf_counter()
            (sampled,) = sampler.sample(logits, [row_request(guided, rid, tokens, 1)])
            with_us.append((time.perf_counter() - start) * 1e6)
            start = time.perf_counter()
            sampler.sample(logits, [row_request(plain, "plain", tokens, 1)])
            without_us.append((time.perf_counter() - start) * 1e6)
            start = time.perf_counter()
            sampler.grammars.logit_mask(row_request(guided, rid, tokens, 1))
            mask_us.append((time.perf_counter() - start) * 1e6)
            assert sampled == token, "the grammar refused a token of a valid document"
            tokens.append(sampled)
    result = {
        "tokenizer": name,
        "vocab": vocab,
        "tokens": len(with_us),
        "vocabulary_read_s": round(setup_s, 2),
        "schema_compile_ms_first": round(compile_ms[0], 2),
        "schema_compile_ms_cached_median": round(
            statistics.median(compile_ms[1:] or compile_ms), 3
        ),
        "mask_us_median": round(statistics.median(mask_us), 1),
        "sample_with_grammar_us_median": round(statistics.median(with_us), 1),
        "sample_without_us_median": round(statistics.median(without_us), 1),
        "grammar_cost_us_per_token": round(
            statistics.median(with_us) - statistics.median(without_us), 1
        ),
    }
    print(f"tokenizer {name} ({vocab} tokens), {len(with_us)} tokens of {args.documents} documents")
    rows = [
        ("vocabulary read once (s)", setup_s),
        ("schema compile, first (ms)", compile_ms[0]),
        ("schema compile, cached (ms)", result["schema_compile_ms_cached_median"]),
        ("grammar mask alone (us/token)", result["mask_us_median"]),
        ("sample with the grammar (us/token)", result["sample_with_grammar_us_median"]),
        ("sample without, greedy (us/token)", result["sample_without_us_median"]),
    ]
    for label, value in rows:
        print(f"{label:<36} {value:9.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
