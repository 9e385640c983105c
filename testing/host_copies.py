"""A guard that counts the device->host copies of code run under it, on any machine.

On a GPU, each ``tolist``, ``item``, ``bool(t)`` or ``.cpu()`` of a device tensor waits
for the kernels queued before it. A step may read back only through
``hybridkv.executor.host_copy``; this guard finds every other read, without a GPU. On a
CPU every tensor is a host tensor, so it tells the tensors that would live on the device
by taint, under a ``TorchFunctionMode``::

    seeds        the tensors given (a model's weights, the KV caches); tensors made with
                 ``device=`` the device; ``.to(device)`` of a host tensor
    propagation  every tensor a torch function returns from a tainted argument; the
                 tensor an in-place method or ``out=`` writes a tainted value into
    counted      on a tainted tensor: tolist, item, bool/int/float/index, cpu, numpy,
                 formatting, ``.to`` the host; ``copy_`` or ``t[i] =`` into a host
                 tensor; ops whose output size is read back (nonzero, unique, masks)

The device is the one given (``executor.device``), or any device but the CPU. Where the
device is the CPU, the host is told from it by its spelling: the string ``"cpu"`` and
``.device`` of a host tensor name the host (``.to("cpu")`` is a copy), a ``torch.device``
otherwise names the device (``.to(self.device)``, ``device=t.device`` of a tainted ``t``
are not). Each copy is recorded with the line outside torch that asked for it; one made
inside ``hybridkv.executor.host_copy`` is allowed, under the helper's name::

    with HostCopyGuard.for_executor(executor) as guard:   # on the thread running steps
        driver.step()
    guard.check(to_host_list=1)        # HostCopyError lists every other copy's line

The guard watches the thread it is entered on (close an executor's torch thread first),
from then on: enter it before the first step, so that caches built then are tainted.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from hybridkv.executor.model_executor import ModelExecutor

_READS = frozenset({
    "tolist", "item", "__bool__", "__int__", "__float__", "__index__", "__complex__", "cpu",
    "numpy", "__array__", "__format__", "__repr__", "__contains__", "equal", "allclose",
    "is_nonzero",
})  # fmt: skip
# Ops that read their tainted inputs' data on the host: for the size of their output
# (nonzero, unique, bincount, masks), or its contents (tensor() of tainted scalars).
_DATA_READS = frozenset({
    "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "bincount", "tensor",
})  # fmt: skip
_MASKED = ("__getitem__", "__setitem__", "index_put_")
_IN_PLACE = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__",
})  # fmt: skip
_HELPERS = "hybridkv.executor.host_copy"
_DEVICE_OF = torch.Tensor.device.__get__


class HostCopyError(AssertionError):
    """Code under a :class:`HostCopyGuard` read device tensors back where it should not."""


@attrs.frozen
class HostCopy:
    """One read of a device tensor: the method (or helper) and the line that asked."""

    name: str
    where: str


class HostCopyGuard(TorchFunctionMode):
    """Records each device->host copy made under it (see the module).

    Args:
        device_tensors: Tensors that live on the device.
        device: The device the code under test runs on.

    Attributes:
        allowed: Copies made by ``hybridkv.executor.host_copy``, in order.
        unexpected: Every other copy, in order.
    """

    def __init__(
        self, device_tensors: Iterable[torch.Tensor], *, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        self._device = torch.device(device)
        self._host = torch.device("cpu")  # what ``.device`` of a host tensor returns
        self._tainted: dict[int, weakref.ref[torch.Tensor]] = {}
        self.allowed: list[HostCopy] = []
        self.unexpected: list[HostCopy] = []
        for tensor in device_tensors:
            self._taint(tensor)

    @classmethod
    def for_executor(cls, executor: ModelExecutor) -> HostCopyGuard:
        """A guard over the executor's device, seeded with its KV caches and its model's
        parameters, buffers and other tensor attributes."""
        model = executor.model
        attributes = [v for m in model.modules() for v in vars(m).values()]
        tensors = [*model.parameters(), *model.buffers(), *executor.kv_caches, *attributes]
        return cls([t for t in tensors if isinstance(t, torch.Tensor)], device=executor.device)

    def check(self, **allowed: int) -> None:
        """Raise unless the only copies are the allowed ones, as many calls of each
        helper as given (``check(to_host_list=3)``).

        Raises:
            HostCopyError: naming each helper called a different number of times, and
                the line and method of every other copy.
        """
        counts = Counter(c.name for c in self.allowed)
        problems = [
            f"{name}: {counts[name]} calls, expected {n}"
            for name, n in sorted({**dict.fromkeys(counts, 0), **allowed}.items())
            if counts[name] != n
        ]
        lines = Counter(f"{c.where}: {c.name}" for c in self.unexpected)
        problems += [f"{line} (x{n})" for line, n in lines.items()]
        if problems:
            raise HostCopyError("device->host copies:\n  " + "\n  ".join(problems))

    def is_tainted(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` stands for a device tensor."""
        return id(tensor) in self._tainted

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        tainted = any(self.is_tainted(t) for t in inputs)
        this = args[0] if args and isinstance(args[0], torch.Tensor) else None
        target = self._target(name, args, kwargs)
        result = func(*args, **kwargs)
        if func == _DEVICE_OF and not tainted and result.type == "cpu":
            return self._host
        if tainted and self._reads(name, this, target, args):
            self._record(name)
            # What came back is a host tensor, even where it is the same one (the CPU).
            return result.view_as(result) if this is not None and result is this else result
        in_place = name in _IN_PLACE or (name.endswith("_") and name[0] != "_")
        if tainted and in_place and this is not None and not self.is_tainted(this):
            if name in ("copy_", "__setitem__"):
                self._record(name)  # a device value written into a host tensor
                return result
            self._taint(this)
        if tainted and isinstance(kwargs.get("out"), torch.Tensor):
            self._taint(kwargs["out"])
        if tainted and name == "__iter__":
            items = list(result)
            for item in items:
                self._taint(item)
            return iter(items)
        if target if target is not None else tainted:
            if this is not None and result is this and not tainted:
                result = result.view_as(result)  # the host tensor itself stays a host one
            for leaf in tree_leaves(result):
                if isinstance(leaf, torch.Tensor):
                    self._taint(leaf)
        return result

    def _reads(
        self, name: str, this: torch.Tensor | None, target: bool | None, args: tuple[Any, ...]
    ) -> bool:
        """Whether a call with a tainted argument reads device data on the host."""
        reads_this = name in _READS or (name == "to" and target is False)
        if reads_this and this is not None and self.is_tainted(this):
            return True
        if name in _DATA_READS or (name == "where" and len(args) == 1):
            return True
        if name in _MASKED and len(args) > 1:
            masks = [i for i in tree_leaves(args[1]) if isinstance(i, torch.Tensor)]
            return any(i.dtype == torch.bool and self.is_tainted(i) for i in masks)
        return False

    def _target(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool | None:
        """Whether the call names the device (True), the host (False) or neither (None)."""
        device = kwargs.get("device")
        if name == "cuda":
            return True
        if name == "to" and device is None:
            kinds = (str, torch.device, torch.Tensor)
            device = next((a for a in args[1:] if isinstance(a, kinds)), None)
        if device is None:
            return None
        if isinstance(device, torch.Tensor):
            return self.is_tainted(device)
        if device is self._host:
            return False
        if isinstance(device, torch.device) and device == self._device:
            return True
        return torch.device(device).type != "cpu"

    def _taint(self, tensor: torch.Tensor) -> None:
        key = id(tensor)
        if key not in self._tainted:
            self._tainted[key] = weakref.ref(tensor, lambda _: self._tainted.pop(key, None))

    def _record(self, name: str) -> None:
        """Record a copy, at the first line outside torch and this module that asked."""
        frame = sys._getframe(2)
        helper = None
        while frame.f_back is not None:
            module = frame.f_globals.get("__name__", "")
            if module == _HELPERS and helper is None:
                helper = frame.f_code.co_name
            elif module.split(".")[0] != "torch" and module != __name__:
                break
            frame = frame.f_back
        where = f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno}"
        (self.allowed if helper else self.unexpected).append(HostCopy(helper or name, where))
