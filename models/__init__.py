"""Model families on paged KV caches: Llama, Gemma 2, Gemma 3 (text), Bamba, Granite 4.0-H.

``families/`` holds one small module per family (its config vocabulary, its layers'
kinds, the shape of its decoder layer), found by ``model_type`` through a lazy registry;
``blocks/`` the torch modules every family is built from (norms, rope, paged attention,
MLPs, experts, the Mamba2 mixer, the one decoder layer); ``shapes/`` the torch-free
shapes they are built to (rope parameters, the Mamba2 state, the decoder's residual
shape). Around them: the config parse (``config``, ``specs``, ``hf_config``), checkpoint
reading (``checkpoint``), the causal LM (``transformer``), pipeline stages (``stages``)
and the weight formats in ``weights/``. Nothing here imports the scheduler, the executor
or the server: ``hybridkv.executor.ModelExecutor`` runs these models as the engine's
executor.
"""
