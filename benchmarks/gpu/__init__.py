"""``make gpu-check``: one command that says whether the GPU path works and how fast it is."""
