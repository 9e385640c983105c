"""Mamba2 kernels against transformers' torch reference, in chunks and one token at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.kernels.ssm import (
    causal_conv1d,
    causal_conv1d_decode,
    causal_conv1d_states,
    ssd_decode,
    ssd_scan,
    ssd_scan_states,
)

mamba2 = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")

L, H, P, G, N, K, CHUNK = 37, 4, 8, 2, 16, 4, 8
TOL = 1e-5


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """One request's worth of random SSM inputs (dt biased and softplus-ed already)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(L, H, P, generator=g),
        "dt": F.softplus(torch.randn(L, H, generator=g)),
        "a": -torch.exp(torch.randn(H, generator=g)),
        "b": torch.randn(L, G, N, generator=g),
        "c": torch.randn(L, G, N, generator=g),
        "d": torch.randn(H, generator=g),
    }


def reference(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' chunked scan over the whole sequence at once."""
    out, final = mamba2.mamba2_chunk_scan(
        t["x"][None],
        t["dt"][None],
        t["a"],
        t["b"][None],
        t["c"][None],
        chunk_size=CHUNK,
        D=t["d"],
        return_final_states=True,
    )
    return out[0], final[0]


def test_scan_of_the_whole_sequence_matches_transformers() -> None:
    """One call from a zero state gives transformers' outputs and final state."""
    t = inputs()
    y, state = ssd_scan(**t, ssm_state=torch.zeros(H, P, N), chunk_size=CHUNK)
    expected_y, expected_state = reference(t)
    torch.testing.assert_close(y, expected_y, atol=TOL, rtol=TOL)
    torch.testing.assert_close(state, expected_state, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("cuts", [(5,), (8, 16), (3, 11, 30), (36,)])
def test_chunks_from_saved_states_match_the_whole(cuts: tuple[int, ...]) -> None:
    """Pieces that cross SSD chunk boundaries, each from the previous state, equal one call."""
    t = inputs(1)
    expected_y, expected_state = reference(t)
    state = torch.zeros(H, P, N)
    pieces = []
    for start, stop in zip((0, *cuts), (*cuts, L), strict=True):
        part = {k: (v[start:stop] if v.shape[0] == L else v) for k, v in t.items()}
        y, state = ssd_scan(**part, ssm_state=state, chunk_size=CHUNK)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces), expected_y, atol=TOL, rtol=TOL)
    torch.testing.assert_close(state, expected_state, atol=TOL, rtol=TOL)


def test_decode_steps_continue_the_scan() -> None:
    """After a prefix, one-token steps give the scan's outputs at the next positions."""
    t = inputs(2)
    expected_y, expected_state = reference(t)
    prefix = 30
    part = {k: (v[:prefix] if v.shape[0] == L else v) for k, v in t.items()}
    _, state = ssd_scan(**part, ssm_state=torch.zeros(H, P, N), chunk_size=CHUNK)
    states = state[None]
    for i in range(prefix, L):
        y, states = ssd_decode(
            t["x"][i : i + 1], t["dt"][i : i + 1], t["a"], t["b"][i : i + 1],
            t["c"][i : i + 1], t["d"], states,
        )  # fmt: skip
        torch.testing.assert_close(y[0], expected_y[i], atol=TOL, rtol=TOL)
    torch.testing.assert_close(states[0], expected_state, atol=TOL, rtol=TOL)


def test_decode_batches_requests_independently() -> None:
    """A batch of decodes equals each request decoded alone."""
    ts = [inputs(seed) for seed in (3, 4, 5)]
    states = torch.randn(3, H, P, N)
    y, new = ssd_decode(
        torch.stack([t["x"][0] for t in ts]), torch.stack([t["dt"][0] for t in ts]),
        ts[0]["a"], torch.stack([t["b"][0] for t in ts]), torch.stack([t["c"][0] for t in ts]),
        ts[0]["d"], states,
    )  # fmt: skip
    for i, t in enumerate(ts):
        alone_y, alone_state = ssd_decode(
            t["x"][:1], t["dt"][:1], ts[0]["a"], t["b"][:1], t["c"][:1], ts[0]["d"],
            states[i : i + 1],
        )  # fmt: skip
        torch.testing.assert_close(y[i], alone_y[0])
        torch.testing.assert_close(new[i], alone_state[0])


def test_bfloat16_inputs_keep_a_float32_state() -> None:
    """The state stays float32 and close to the float32 run for bfloat16 inputs."""
    t = inputs(6)
    low = {k: v.to(torch.bfloat16) for k, v in t.items()}
    y, state = ssd_scan(**low, ssm_state=torch.zeros(H, P, N), chunk_size=CHUNK)
    _, expected_state = reference(t)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32
    torch.testing.assert_close(state, expected_state, atol=0.1, rtol=0.05)


def test_convolution_in_chunks_and_steps_matches_transformers() -> None:
    """The causal conv run as chunks, then decodes, equals transformers' whole-sequence conv."""
    g = torch.Generator().manual_seed(7)
    dim = 12
    x = torch.randn(L, dim, generator=g)
    weight, bias = torch.randn(dim, K, generator=g), torch.randn(dim, generator=g)
    expected = mamba2.causal_conv1d_fn(x.t()[None], weight, bias, activation="silu")[0].t()
    state = torch.zeros(dim, K - 1)
    outs = []
    for start, stop in ((0, 2), (2, 19), (19, 30)):
        y, state = causal_conv1d(x[start:stop], state, weight, bias)
        outs.append(y)
    states = state[None]
    for i in range(30, L):
        y, states = causal_conv1d_decode(x[i : i + 1], states, weight, bias)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs), expected, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("counts", [(1,), (8,), (5, 8, 16, 21), (7, 9, 36, 37)])
def test_states_at_counts_equal_the_scans_cut_there(counts: tuple[int, ...]) -> None:
    """The state after t tokens, taken inside one scan, equals the final state of a scan of
    the first t tokens, across SSD chunk boundaries."""
    t = inputs(2)
    start = torch.randn(H, P, N, generator=torch.Generator().manual_seed(3))
    y, states = ssd_scan_states(**t, ssm_state=start, chunk_size=CHUNK, counts=counts)
    whole_y, whole_state = ssd_scan(**t, ssm_state=start, chunk_size=CHUNK)
    torch.testing.assert_close(y, whole_y)
    torch.testing.assert_close(states[-1], whole_state)
    for i, count in enumerate(counts):
        cut = {k: v[:count] if v.dim() > 1 else v for k, v in t.items()}
        _, expected = ssd_scan(**cut, ssm_state=start, chunk_size=CHUNK)
        torch.testing.assert_close(states[i], expected, atol=TOL, rtol=TOL)


def test_convolution_states_at_counts_are_the_inputs_before_them() -> None:
    """The conv state after t tokens is the final state of the convolution of t tokens."""
    g = torch.Generator().manual_seed(4)
    x, weight = torch.randn(11, 6, generator=g), torch.randn(6, K, generator=g)
    start = torch.randn(6, K - 1, generator=g)
    out, states = causal_conv1d_states(x, start, weight, None, (0, 2, 5, 11))
    torch.testing.assert_close(out, causal_conv1d(x, start, weight, None)[0])
    torch.testing.assert_close(states[0], start)
    for i, count in enumerate((2, 5, 11), start=1):
        torch.testing.assert_close(states[i], causal_conv1d(x[:count], start, weight, None)[1])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scan_decode_and_convolution_on_the_device_match_the_cpu(
    check_device: torch.device, dtype: torch.dtype
) -> None:
    """Chunked prefill from a state, then batched decodes, on the device: the CPU's
    outputs and float32 states (bf16 inputs: within bf16's rounding of the outputs)."""
    t = {k: v.to(dtype) if k in ("x", "b", "c") else v for k, v in inputs(3).items()}
    state = torch.randn(H, P, N)

    def run(device: torch.device) -> list[torch.Tensor]:
        d = {k: v.to(device) for k, v in t.items()}
        y, states = ssd_scan_states(
            **d, ssm_state=state.to(device), chunk_size=CHUNK, counts=(5, 20)
        )
        x2, dt2 = d["x"][:3], d["dt"][:3]
        step_y, step_states = ssd_decode(
            x2, dt2, d["a"], d["b"][:3], d["c"][:3], d["d"], states[:1].expand(3, -1, -1, -1)
        )
        weight = torch.randn(H * P, K, generator=torch.Generator().manual_seed(1)).to(device)
        conv, conv_state = causal_conv1d(
            d["x"].reshape(L, -1),
            torch.zeros(H * P, K - 1, device=device, dtype=dtype),
            weight.to(dtype),
            None,
        )
        return [y, states, step_y, step_states, conv, conv_state]

    tol = TOL * 10 if dtype == torch.float32 else 3e-2
    for got, expected in zip(run(check_device), run(torch.device("cpu")), strict=True):
        assert got.device.type == check_device.type
        torch.testing.assert_close(got.cpu().float(), expected.float(), atol=tol, rtol=tol)
