"""Test helpers for code that embeds hybridkv or writes memory policies.

Everything runs without a model or a download, and the pytest plugin of this package
(``hybridkv.testing.plugin``, loaded by pytest wherever hybridkv is installed) gives
fixtures for an engine, a live server and a tiny checkpoint::

    from hybridkv.testing import AttendingFakeExecutor, check_policy_laws

    def test_my_policy_keeps_what_attention_reads():
        check_policy_laws(MyPolicy(window=8))          # the allocator's laws
        fake = AttendingFakeExecutor.for_config(config)  # tokens drawn from every live position
        ...

- executors: :class:`FakeExecutor` (each token a hash of the last position, pages
  checked), :class:`AttendingFakeExecutor` (each token drawn from every position the
  group's policy keeps live: a policy that drops one changes the output),
  :class:`SamplingFakeExecutor` (random logits the real sampler samples);
- tokenizers: :func:`word_tokenizer`, :func:`byte_tokenizer`;
- a server: :func:`live_server`, :class:`LiveServer`;
- leaks: :func:`wait_until_free`, :func:`check_no_leaks`, :class:`LeakError`;
- device syncs: :class:`HostCopyGuard` (counts the step loop's device->host copies, on
  the CPU too), :class:`HostCopyError`;
- policies: :func:`check_policy_laws`, :class:`PolicyLawError`;
- speculative decoding: :class:`ReferenceProposer` (the fakes' own continuation, a
  chosen share of it wrong);
- checkpoints: :func:`save_tiny_llama`, :func:`save_tiny` of each of
  :data:`TINY_ARCHITECTURES` (need transformers).

Names are imported on first use, so ``import hybridkv.testing`` needs neither the
server's packages nor transformers until the helper that uses them is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridkv.policies.laws import PolicyLawError, check_policy_laws
    from hybridkv.scheduler.fake import FakeExecutor
    from hybridkv.scheduler.fake_attending import AttendingFakeExecutor
    from hybridkv.testing.host_copies import HostCopyError, HostCopyGuard
    from hybridkv.testing.leaks import LeakError, check_no_leaks, wait_until_free
    from hybridkv.testing.plugin import default_config
    from hybridkv.testing.proposers import ReferenceProposer
    from hybridkv.testing.sample_tokenizers import (
        BYTE_EOS,
        WORD_EOS,
        byte_tokenizer,
        word_tokenizer,
    )
    from hybridkv.testing.sampling_fake import SamplingFakeExecutor
    from hybridkv.testing.server import LiveServer, live_server
    from hybridkv.testing.tiny_models import TINY_ARCHITECTURES, save_tiny, save_tiny_llama

_WHERE = {
    "FakeExecutor": "hybridkv.scheduler.fake",
    "AttendingFakeExecutor": "hybridkv.scheduler.fake_attending",
    "SamplingFakeExecutor": "hybridkv.testing.sampling_fake",
    "word_tokenizer": "hybridkv.testing.sample_tokenizers",
    "byte_tokenizer": "hybridkv.testing.sample_tokenizers",
    "WORD_EOS": "hybridkv.testing.sample_tokenizers",
    "BYTE_EOS": "hybridkv.testing.sample_tokenizers",
    "LiveServer": "hybridkv.testing.server",
    "live_server": "hybridkv.testing.server",
    "wait_until_free": "hybridkv.testing.leaks",
    "check_no_leaks": "hybridkv.testing.leaks",
    "LeakError": "hybridkv.testing.leaks",
    "HostCopyGuard": "hybridkv.testing.host_copies",
    "HostCopyError": "hybridkv.testing.host_copies",
    "check_policy_laws": "hybridkv.policies.laws",
    "PolicyLawError": "hybridkv.policies.laws",
    "save_tiny_llama": "hybridkv.testing.tiny_models",
    "save_tiny": "hybridkv.testing.tiny_models",
    "TINY_ARCHITECTURES": "hybridkv.testing.tiny_models",
    "default_config": "hybridkv.testing.plugin",
    "ReferenceProposer": "hybridkv.testing.proposers",
}

__all__ = [
    "BYTE_EOS",
    "TINY_ARCHITECTURES",
    "WORD_EOS",
    "AttendingFakeExecutor",
    "FakeExecutor",
    "HostCopyError",
    "HostCopyGuard",
    "LeakError",
    "LiveServer",
    "PolicyLawError",
    "ReferenceProposer",
    "SamplingFakeExecutor",
    "byte_tokenizer",
    "check_no_leaks",
    "check_policy_laws",
    "default_config",
    "live_server",
    "save_tiny",
    "save_tiny_llama",
    "wait_until_free",
    "word_tokenizer",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridkv.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
