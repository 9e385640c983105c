"""The ``hybridkv`` command line: ``main`` builds the parser from one registrar per command.

``plan`` (layouts), ``serve`` (``serve`` and ``generate``), ``route`` and
``data_parallel`` with ``replica_processes`` (the data-parallel front end), ``demo``
(``demo`` and ``bench``), ``policies``; ``loading`` turns flags into a loaded model and an
engine config; ``builtin_models`` converts the built-in model once. ``flags/`` holds the
flag groups the commands share (and ``values``, which parses sizes and dtypes);
``workload/`` drives, prints and plots the demo's run. Kept free of imports so that
``hybridkv --help`` stays fast.
"""
