"""Torch-free shapes the blocks are built to, read from config.json: rope parameters, the
Mamba2 state, the decoder layer's residual shape and part names."""
