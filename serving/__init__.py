"""The ``hybridkv`` command line and the OpenAI-compatible HTTP server.

Modules: ``app`` (the ASGI app around an engine), ``server`` and ``connection`` (run it
with uvicorn in your own event loop, with connection limits), ``service`` and
``choices`` (one generation request, without HTTP), ``body``, ``fields``, ``protocol``,
``sampling_fields`` and ``structured`` (request bodies to checked requests),
``prompts``, ``chat`` and ``template_sandbox`` (prompts to token ids), ``text`` and
``logprobs`` (outputs to text), ``streaming``, ``responses``, ``guard``, ``watchdog``,
``metrics`` (Prometheus), ``utility_routes``; ``replicas``, ``route_app`` and
``route_metrics`` (the data-parallel front end), ``ray_replicas``, ``ray_router`` and
``ray_engine`` (the same routing in Ray Serve); and ``cli/``, the ``hybridkv`` command
line.

Kept free of imports so that ``hybridkv --help`` stays fast.
"""
