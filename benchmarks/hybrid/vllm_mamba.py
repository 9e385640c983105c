"""vLLM 0.33's KVCacheManager on hybrid_cliffs.py's workloads, Mamba2 groups included:
the source fetched into the peer cache, MambaSpec groups, the chunk clipping of its scheduler."""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import types
import zipfile
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common.layouts import Layout
from benchmarks.hybrid.workloads import Job, job_order, run_summary
from hybridkv.memory.layout_planner import policy_label
from hybridkv.policies import FullAttention, MambaLike, SlidingWindow

VLLM_VERSION = "0.33.0"


# -- vLLM 0.33: its KVCacheManager, driven as its scheduler does ---------------------------


def reference_source(
    args: argparse.Namespace, version: str = VLLM_VERSION
) -> tuple[Path | None, str]:
    """An unpacked vLLM ``version`` source tree (``--reference-src``, else fetched into the
    cache once), or None with the reason."""
    if args.no_reference:
        return None, "skipped (--no-reference)"
    if args.reference_src:
        return Path(args.reference_src), "--reference-src"
    from benchmarks.peers.llama_peers import cache_root

    folder = cache_root() / f"vllm-{version}"
    src, done = folder / "src", folder / "src" / ".done"
    if done.exists():
        return src, f"pip download vllm=={version} --no-deps (cached)"
    wheels = folder / "wheel"
    command = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps",
               "--only-binary=:all:", "--quiet", "--dest", str(wheels)]  # fmt: skip
    print(f"fetching the vllm=={version} wheel (no dependencies) into the peer cache ...")
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=1800)
        wheel = next(wheels.glob(f"vllm-{version}-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            names = [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")]
            archive.extractall(src, members=names)
    except (OSError, StopIteration, subprocess.SubprocessError, zipfile.BadZipFile) as exc:
        detail = getattr(exc, "stderr", None) or exc
        lines = str(detail).strip().splitlines() or [type(exc).__name__]
        return None, f"could not obtain vllm=={version}: {lines[-1]}"
    wheel.unlink()  # the sources are what is kept
    done.write_text(f"vllm=={version}\n")
    return src, f"pip download vllm=={version} --no-deps"


def load_reference(
    args: argparse.Namespace, version: str = VLLM_VERSION, part: str = "KVCacheManager"
) -> tuple[Any, str]:
    """vLLM ``version``'s modules (or None) and a line saying what was loaded (its
    ``part`` the script runs) or why not."""
    src, how = reference_source(args, version)
    if src is None:
        return None, f"vLLM not run: {how}"
    import benchmarks.common.vllm_reference as _vllm_reference

    try:
        vllm = _vllm_reference.load(src)
    except (ImportError, OSError, RuntimeError) as exc:
        return None, f"vLLM not run: {exc}"
    return vllm, f"vLLM {vllm.version} {part} ({how})"


def vllm_groups(layout: Layout) -> list[dict[str, Any]]:
    """The layout's groups as ``_vllm_source`` group dicts (``mamba`` for state groups)."""
    out: list[dict[str, Any]] = []
    for policy in layout.pool.policies:
        if isinstance(policy, FullAttention):
            out.append({"type": "full"})
        elif isinstance(policy, SlidingWindow):
            out.append({"type": "sliding_window", "sliding_window": policy.window})
        elif isinstance(policy, MambaLike):
            out.append({"type": "mamba", "shapes": layout.state_shapes})
        else:
            raise ValueError(f"no vLLM group for policy {policy_label(policy)}")
    return out


@contextlib.contextmanager
def _with_mamba_groups() -> Iterator[None]:
    """Let ``ReferenceAllocator`` build mamba groups too, while it is constructed.

    ``_vllm_source.kv_cache_config`` builds full and sliding-window groups only; this wraps
    it: the attention groups are its own, each mamba group a ``MambaSpec`` as vLLM's Mamba2
    mixer declares it with prefix caching on (mode "align", one prefill checkpoint block,
    checkpoint alignment 1), with our float32 state shapes.
    """
    import torch

    import benchmarks.common.vllm_reference as _vllm_reference

    base = _vllm_reference.kv_cache_config

    def config(vllm: Any, groups: Sequence[dict[str, Any]], *, num_blocks: int, block_size: int):
        attention = [g for g in groups if g["type"] != "mamba"]
        out = base(vllm, attention, num_blocks=num_blocks, block_size=block_size)
        kv = iter(out.kv_cache_groups)
        merged = []
        for index, group in enumerate(groups):
            if group["type"] != "mamba":
                merged.append(next(kv))
                continue
            spec = vllm.spec.MambaSpec(
                block_size=block_size,
                shapes=tuple(group["shapes"]),
                dtypes=(torch.float32,) * len(group["shapes"]),
                mamba_cache_mode="align",
                num_prefill_checkpoint_blocks=1,
                prefill_checkpoint_alignment=1,
            )
            merged.append(vllm.spec.KVCacheGroupSpec([f"mamba.{index}"], spec))
        out.kv_cache_groups[:] = merged
        return out

    _vllm_reference.kv_cache_config = config
    try:
        yield
    finally:
        _vllm_reference.kv_cache_config = base


def make_reference(
    vllm: Any, layout: Layout, max_model_len: int, *, use_eagle: bool = False
) -> tuple[Any, dict]:
    """vLLM's allocator for ``layout``, or None and why: ``not_driven`` where the adapter
    cannot express the layout (several block sizes, a policy it has no group for),
    ``refused`` with the error vLLM raised building its manager for it."""
    import benchmarks.common.vllm_reference as _vllm_reference

    sizes = set(layout.block_sizes)
    if len(sizes) != 1:
        reason = f"ReferenceAllocator takes one block size, the layout has {sorted(sizes)}"
        return None, {"not_driven": reason}
    try:
        groups = vllm_groups(layout)
    except ValueError as exc:
        return None, {"not_driven": str(exc)}
    try:
        with _with_mamba_groups():
            alloc = _vllm_reference.ReferenceAllocator(
                vllm,
                groups,
                layout.pool.num_blocks,
                sizes.pop(),
                max_model_len=max_model_len,
                reserve_full_isl=True,  # vLLM's default scheduler_reserve_full_isl
                use_eagle=use_eagle,
            )
    except Exception as exc:  # vLLM's own refusal, whatever its type
        return None, {"refused": f"{type(exc).__name__}: {exc}"}
    return alloc, {}


def mamba_split(
    vllm: Any, alloc: Any, budget: int, *, use_eagle: bool = False
) -> Callable[[Any, int, int], int] | None:
    """vLLM's ``Scheduler._mamba_block_aligned_split`` over the fields its scheduler would
    hold for this manager (None where it would not split: no mamba group in "align")."""
    manager = alloc.manager
    config = manager.kv_cache_config
    mamba = [g.kv_cache_spec for g in config.kv_cache_groups]
    mamba = [s for s in mamba if isinstance(s, vllm.spec.MambaSpec)]
    if not mamba or any(s.mamba_cache_mode != "align" for s in mamba):
        return None
    hash_block_size = manager.block_pool.hash_block_size
    block_size = mamba[0].block_size
    ns = types.SimpleNamespace
    scheduler = ns(
        cache_config=ns(block_size=block_size),
        block_size=block_size,
        scheduler_config=ns(long_prefill_token_threshold=0),
        hash_block_size=hash_block_size,
        max_num_scheduled_tokens=budget,
        use_eagle_block_drop=use_eagle,
        num_hash_lookahead_tokens=0,
        mamba_prefill_checkpoint_alignment=mamba[0].prefill_checkpoint_alignment,
        mamba_has_prefill_checkpoint_blocks=all(s.num_prefill_checkpoint_blocks > 0 for s in mamba),
        mamba_partial_cache_hit=hash_block_size < block_size
        and manager.coordinator.enable_partial_hash_hits,
        mamba_shared_prefix_checkpoint=False,
    )
    split = vllm.scheduler.Scheduler._mamba_block_aligned_split

    def clip(request: Any, num_new: int, num_hit: int) -> int:
        return split(scheduler, request, num_new, num_hit, 0)

    return clip


class _Turn:
    __slots__ = ("hit", "index", "job", "num_generated")

    def __init__(self, index: int, job: Job) -> None:
        self.index, self.job = index, job
        self.hit: int | None = None
        self.num_generated = 0


def run_vllm(
    vllm: Any,
    layout: Layout,
    jobs: Sequence[Job],
    in_flight: int,
    budget: int,
    *,
    use_eagle: bool = False,
) -> dict[str, Any]:
    """Serve ``jobs`` on vLLM's KVCacheManager at ``layout``'s pool, as its scheduler would:
    running requests first (the newest preempted when one cannot grow), then admissions
    while none was preempted, each prefill chunk clipped for mamba groups. ``use_eagle``:
    as its scheduler builds them for EAGLE and MTP drafts (``use_eagle_block_drop``)."""
    max_model_len = max(len(j.prompt) + len(j.output) for j in jobs) + 1
    alloc, problem = make_reference(vllm, layout, max_model_len, use_eagle=use_eagle)
    if alloc is None:
        return problem
    try:
        clip = mamba_split(vllm, alloc, budget, use_eagle=use_eagle)
        return _serve_vllm(alloc, jobs, in_flight, budget, clip)
    except Exception as exc:  # vLLM's manager failing mid-run: reported, ours still printed
        return {"error": f"{type(exc).__name__}: {exc}"}


def _serve_vllm(
    alloc: Any,
    jobs: Sequence[Job],
    in_flight: int,
    budget: int,
    split: Callable[[Any, int, int], int] | None,
) -> dict[str, Any]:
    clip = split or (lambda request, num, hit: num)
    queued, children = job_order(jobs)
    ids = iter(range(len(jobs)))
    waiting: deque[_Turn] = deque()
    running: list[_Turn] = []
    hits: dict[str, int] = {}
    preemptions = 0

    def queue(job: Job) -> None:
        turn = _Turn(next(ids), job)
        alloc.add(turn.index, list(job.prompt))
        waiting.append(turn)

    for job in queued:
        queue(job)
    while waiting or running:
        alloc.step_starts()
        left, scheduled, preempted = budget, [], False
        i = 0
        while i < len(running) and left > 0:
            turn = running[i]
            request = alloc.requests[turn.index]
            num = clip(request, min(request.num_tokens - request.num_computed_tokens, left), 0)
            if num <= 0:
                i += 1
                continue
            while alloc.extend(turn.index, num) is None:
                victim = running.pop()
                alloc.free(victim.index, True)
                waiting.appendleft(victim)
                preemptions += 1
                preempted = True
                if victim is turn:
                    break
            else:
                scheduled.append(turn)
                left -= num
                i += 1
        while not preempted and waiting and len(running) < in_flight and left > 0:
            turn = waiting[0]
            request = alloc.requests[turn.index]
            hit = alloc.lookup(turn.index)
            num = clip(request, min(request.num_tokens - hit, left), hit)
            if num <= 0 or alloc.admit(turn.index, num, True) is None:
                break
            waiting.popleft()
            if turn.hit is None:
                turn.hit = hit
            running.append(turn)
            scheduled.append(turn)
            left -= num
        if not scheduled:
            raise RuntimeError("vLLM's manager schedules nothing and nothing runs")
        for turn in scheduled:  # the step ran; a request whose sequence is computed samples
            request = alloc.requests[turn.index]
            if request.num_computed_tokens < request.num_tokens:
                continue
            alloc.append(turn.index, turn.job.output[turn.num_generated])
            turn.num_generated += 1
            if turn.num_generated == len(turn.job.output):
                alloc.free(turn.index, False)
                running.remove(turn)
                hits[turn.job.key] = turn.hit or 0
                for job in children.get(turn.job.key, ()):
                    queue(job)
    return run_summary(jobs, hits, preemptions)
