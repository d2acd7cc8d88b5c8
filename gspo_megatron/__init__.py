"""gspo-megatron: GSPO-family RL for Mixture-of-Experts language models on megatron-core."""

__version__ = "0.1.0"
