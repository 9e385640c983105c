"""The demo's workload: ``run`` drives it, ``text`` writes its prompts, ``report``
prints its results and ``plots`` draws them.

Until 0.2 ``run`` was this package's name as a module; its names still import from here
for one release, with a ``DeprecationWarning``.
"""

from hybridkv.errors.moved import names_of

__getattr__ = names_of("hybridkv.serving.cli.workload", "hybridkv.serving.cli.workload.run")
