"""`gspo-train` / `python -m gspo_megatron.train`: compose and validate the Hydra config,
build the trainer, train, always close. Under torchrun every rank runs this."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from gspo_megatron.config import ConfigError, resolve
from gspo_megatron.data.dataset import DataError
from gspo_megatron.data.vocab import VocabMismatchError

# Messages megatron-core and torch print on every CPU run that say nothing about this run.
_LIBRARY_NOISE = (
    "Apex is not installed",
    "Transformer Engine and Apex are not installed",
    "full scope is deprecated",
    "The .grad attribute of a Tensor that is not a leaf",
    "`torch.distributed.reduce_scatter_tensor` is deprecated",
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    "Please use DTensor instead",
    "torch.distributed is disabled",
    "The argument order of load has been changed",
)


def _quiet_libraries() -> None:
    for message in _LIBRARY_NOISE:
        warnings.filterwarnings("ignore", message=f".*{message}")
    logging.getLogger("megatron").setLevel(logging.WARNING)


# An absolute path: relative ones resolve against the calling module, which differs between
# `python -m gspo_megatron.train` and the `gspo-train` console script.
CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "conf")


@hydra.main(config_path=CONFIG_DIR, config_name="config", version_base="1.3")
def run(cfg: DictConfig) -> None:
    _quiet_libraries()
    from gspo_megatron.checkpoint.mapping import ConversionError
    from gspo_megatron.megatron.checkpointing import CheckpointError

    try:
        raw = OmegaConf.to_container(cfg, resolve=True)
        run_cfg, model, layout = resolve(raw, int(os.environ.get("WORLD_SIZE", "1")))
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        from gspo_megatron.run_files import check_run_directory

        check_run_directory(run_dir, run_cfg)
        from gspo_megatron.components import build_trainer

        trainer = build_trainer(run_cfg, model, layout, run_dir)
    except ConfigError as err:
        sys.exit(f"gspo-train: config error: {err}")
    except (DataError, VocabMismatchError, CheckpointError, ConversionError) as err:
        sys.exit(f"gspo-train: {err}")
    try:
        trainer.train()
    finally:
        trainer.close()
        from gspo_megatron.megatron import parallel

        parallel.destroy()


def main() -> None:
    run()


if __name__ == "__main__":
    main()
