"""Weight formats: int8 and int4 linears, the rescored LM head, GGUF grids, joined linears."""
