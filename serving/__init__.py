"""The ``hybridkv`` command line and the OpenAI-compatible HTTP server, by concern.

The import order runs one way: ``cli`` -> ``router`` -> ``http`` -> ``openai`` ->
``metrics`` (``tests/test_layering.py`` holds it):

- ``openai/``: the protocol without HTTP (request bodies to checked requests, prompts to
  token ids, outputs to answers, the generation service);
- ``http/``: the Starlette app, bodies, streaming, access checks, connection limits,
  uvicorn and hypercorn;
- ``metrics/``: Prometheus series, vLLM's names for them, the periodic stats line;
- ``router/``: the data-parallel front end, and ``router/ray/`` in Ray Serve;
- ``cli/``: the ``hybridkv`` command line, ``cli/flags/`` its flag groups and
  ``cli/workload/`` the demo's workload.

Modules that moved in 0.2 still import from their old paths for one release, with a
``DeprecationWarning`` (``errors/moved.py``). Kept free of other imports so that ``hybridkv
--help`` stays fast.
"""

from hybridkv.errors import moved

moved.install()
