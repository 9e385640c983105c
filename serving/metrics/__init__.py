"""What the server measures: ``prometheus`` (its series, served at ``/metrics``),
``vllm_series`` (the same under vLLM's names) and ``stats_log`` (the periodic line).

Until 0.2 this was one module; its names still import from here for one release, with
a ``DeprecationWarning``.
"""

from hybridkv.errors.moved import names_of

__getattr__ = names_of("hybridkv.serving.metrics", "hybridkv.serving.metrics.prometheus")
