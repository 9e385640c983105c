"""The ``hybridkv`` command line: ``main`` builds the parser from one registrar per command.

``plan`` (layouts), ``serve`` (``serve`` and ``generate``), ``demo`` (``demo`` and
``bench``); ``values`` parses sizes and dtypes; ``loading`` turns flags into a loaded
model and an engine config; ``serve_flags``, ``offload_flags`` and ``console`` hold the
flags the commands share; ``workload``, ``workload_text`` and ``report`` drive and print
the demo's run; ``builtin_models`` converts the built-in model once. Kept free of
imports so that ``hybridkv --help`` stays fast.
"""
