"""The data-parallel front end: one OpenAI-compatible address over several replicas.

``front_end`` (the app that forwards), ``replicas`` (where each serves, whether it does,
the order to try them in), ``routed_prompt`` (the tokens a request routes by),
``upstream`` (the connections it forwards over) and ``front_end_metrics``; the router
it runs: ``index`` (a replica's blocks, from its KV events), ``feed`` (following those
events) and ``ranking`` (the replicas for a prompt); ``ray/``, the same routing as a Ray
Serve request router.
"""
