"""The data-parallel front end: one OpenAI-compatible address over several replicas.

``front_end`` (the app that forwards), ``replicas`` (where each serves, whether it does,
the order to try them in), ``routed_prompt`` (the tokens a request routes by),
``upstream`` (the connections it forwards over) and ``front_end_metrics``; ``ray/``, the
same routing as a Ray Serve request router. The router's index, feed and policy read
the replicas' KV events (``parallel/kv_index.py``, ``kv_feed.py``, ``kv_router.py``).
"""
