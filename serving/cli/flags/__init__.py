"""The flag groups the commands share: ``engine`` (the model and the engine), ``serve``
(transport and access), ``kv_events``, ``offload``, ``speculative``, ``config_file``
(``--config FILE``), ``console`` (logging) and ``values`` (sizes and dtypes)."""
