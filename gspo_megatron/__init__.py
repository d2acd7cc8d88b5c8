"""gspo-megatron: GSPO-family RL for Mixture-of-Experts language models on megatron-core."""

from pathlib import Path

__version__ = "0.1.0"

# The Hydra configuration tree (model presets, algorithm presets, ...), next to the package.
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
