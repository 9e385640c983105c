"""The import paths of modules that moved in 0.2, kept for one release: importing one
gives the module at its new path, with a ``DeprecationWarning`` that names it.

Here, below every folder, because an old path's package must answer it before anything
else is imported: ``install()`` (run by ``hybridkv/serving/__init__.py`` and
``hybridkv/parallel/__init__.py``, whose router modules went to ``serving/router/``) adds
a finder that knows only the names of :data:`MOVED`; a name it knows is answered with a
stand-in module that forwards every attribute to the new module and warns once, on
import. Two modules became
packages of the same name (``serving/metrics.py``, ``cli/workload.py``): their packages
forward the old names with :func:`names_of`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

#: Old module -> where it is now.
MOVED = {
    "hybridkv.parallel.kv_index": "hybridkv.serving.router.index",
    "hybridkv.parallel.kv_feed": "hybridkv.serving.router.feed",
    "hybridkv.parallel.kv_router": "hybridkv.serving.router.ranking",
    "hybridkv.serving.protocol": "hybridkv.serving.openai.protocol",
    "hybridkv.serving.fields": "hybridkv.serving.openai.fields",
    "hybridkv.serving.sampling_fields": "hybridkv.serving.openai.sampling_fields",
    "hybridkv.serving.structured": "hybridkv.serving.openai.structured",
    "hybridkv.serving.messages": "hybridkv.serving.openai.messages",
    "hybridkv.serving.tools": "hybridkv.serving.openai.tools",
    "hybridkv.serving.prompts": "hybridkv.serving.openai.prompts",
    "hybridkv.serving.chat": "hybridkv.serving.openai.chat_template",
    "hybridkv.serving.template_sandbox": "hybridkv.serving.openai.template_sandbox",
    "hybridkv.serving.admission": "hybridkv.serving.openai.admission",
    "hybridkv.serving.grammar_check": "hybridkv.serving.openai.grammar_check",
    "hybridkv.serving.service": "hybridkv.serving.openai.service",
    "hybridkv.serving.choices": "hybridkv.serving.openai.choices",
    "hybridkv.serving.text": "hybridkv.serving.openai.text",
    "hybridkv.serving.logprobs": "hybridkv.serving.openai.logprobs",
    "hybridkv.serving.responses": "hybridkv.serving.openai.response_bodies",
    "hybridkv.serving.openai_responses": "hybridkv.serving.openai.responses_api",
    "hybridkv.serving.errors": "hybridkv.serving.openai.errors",
    "hybridkv.serving.app": "hybridkv.serving.http.app",
    "hybridkv.serving.utility_routes": "hybridkv.serving.http.utility_routes",
    "hybridkv.serving.body": "hybridkv.serving.http.bodies",
    "hybridkv.serving.streaming": "hybridkv.serving.http.streaming",
    "hybridkv.serving.guard": "hybridkv.serving.http.guard",
    "hybridkv.serving.connection": "hybridkv.serving.http.connection",
    "hybridkv.serving.server": "hybridkv.serving.http.uvicorn_server",
    "hybridkv.serving.hypercorn_server": "hybridkv.serving.http.hypercorn_server",
    "hybridkv.serving.vllm_metrics": "hybridkv.serving.metrics.vllm_series",
    "hybridkv.serving.stats_log": "hybridkv.serving.metrics.stats_log",
    "hybridkv.serving.route_app": "hybridkv.serving.router.front_end",
    "hybridkv.serving.replicas": "hybridkv.serving.router.replicas",
    "hybridkv.serving.route_metrics": "hybridkv.serving.router.front_end_metrics",
    "hybridkv.serving.route_prompt": "hybridkv.serving.router.routed_prompt",
    "hybridkv.serving.upstream": "hybridkv.serving.router.upstream",
    "hybridkv.serving.ray_engine": "hybridkv.serving.router.ray.engine",
    "hybridkv.serving.ray_replicas": "hybridkv.serving.router.ray.replicas",
    "hybridkv.serving.ray_router": "hybridkv.serving.router.ray.router",
    "hybridkv.serving.cli.engine_flags": "hybridkv.serving.cli.flags.engine",
    "hybridkv.serving.cli.serve_flags": "hybridkv.serving.cli.flags.serve",
    "hybridkv.serving.cli.kv_events_flags": "hybridkv.serving.cli.flags.kv_events",
    "hybridkv.serving.cli.offload_flags": "hybridkv.serving.cli.flags.offload",
    "hybridkv.serving.cli.speculative_flags": "hybridkv.serving.cli.flags.speculative",
    "hybridkv.serving.cli.config_file": "hybridkv.serving.cli.flags.config_file",
    "hybridkv.serving.cli.values": "hybridkv.serving.cli.flags.values",
    "hybridkv.serving.cli.console": "hybridkv.serving.cli.flags.console",
    "hybridkv.serving.cli.workload_text": "hybridkv.serving.cli.workload.text",
    "hybridkv.serving.cli.report": "hybridkv.serving.cli.workload.report",
    "hybridkv.serving.cli.plots": "hybridkv.serving.cli.workload.plots",
    "hybridkv.serving.watchdog": "hybridkv.scheduler.watchdog",
}


class _Moved(types.ModuleType):
    """Stands in at an old path: every attribute is the new module's."""

    def __init__(self, name: str, target: types.ModuleType) -> None:
        super().__init__(name, target.__doc__)
        self.__target = target

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__target, name)

    def __dir__(self) -> list[str]:
        return dir(self.__target)


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED[spec.name]
        _warn(spec.name, new)
        return _Moved(spec.name, importlib.import_module(new))

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader())


def names_of(package: str, module: str) -> Callable[[str], Any]:
    """A package's ``__getattr__`` that gives the names of ``module`` (where the module
    of the package's name moved), each with a ``DeprecationWarning``."""

    def forward(name: str) -> Any:
        target = importlib.import_module(module)
        if name.startswith("__") or not hasattr(target, name):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        _warn(f"{package}.{name}", f"{module}.{name}")
        return getattr(target, name)

    return forward


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} moved to {new}; the old path goes in the next release",
        DeprecationWarning,
        stacklevel=3,
    )


def install() -> None:
    """Answer the old paths (once per interpreter)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.append(_Finder())
