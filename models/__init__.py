"""Model architectures on paged KV caches: Llama, Gemma 2, Gemma 3 (text), Bamba, Granite 4.0-H.

Architectures only: the config parse (``config``, ``specs``, ``hf_config``,
``state_shapes``), checkpoint reading (``checkpoint``), the shared blocks (``layers``,
``rope``, ``mamba2``, ``moe``, ``transformer``), one module per family, and the weight
formats in ``weights/``. Nothing here imports the scheduler, the executor or the server:
``hybridkv.executor.ModelExecutor`` runs these models as the engine's executor.
"""
