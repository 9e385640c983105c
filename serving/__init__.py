"""The ``hybridkv`` command line and the OpenAI-compatible HTTP server.

Modules: ``app`` (the ASGI app around an engine), ``server`` (run it with uvicorn in your
own event loop), ``service`` (one generation request, without HTTP), ``protocol``
(request parsing and error bodies), ``metrics`` (Prometheus), ``builtin_models`` (the
built-in Gemma 3 270M, converted once), ``loading`` (flags to a loaded model), and the
``commands_*`` modules behind ``hybridkv serve|generate|demo|bench``.

Kept free of imports so that ``hybridkv --help`` stays fast.
"""
