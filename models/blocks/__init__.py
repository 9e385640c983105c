"""The torch modules every family is built from: norms, rope, paged attention, MLPs, the
mixture of experts, the Mamba2 mixer, and the one decoder layer that joins them."""
