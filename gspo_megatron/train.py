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

from gspo_megatron import CONF_DIR
from gspo_megatron.config import (
    ConfigError,
    check_overrides,
    help_text,
    register_schema,
    resolve,
)
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


def quiet_libraries() -> None:
    for message in _LIBRARY_NOISE:
        warnings.filterwarnings("ignore", message=f".*{message}")
    # Every other library warning goes to the run's log file (conf/hydra/job_logging).
    logging.captureWarnings(True)
    logging.getLogger("megatron").setLevel(logging.WARNING)


@hydra.main(
    # An absolute path: relative ones resolve against the calling module, which differs between
    # `python -m gspo_megatron.train` and the `gspo-train` console script.
    config_path=str(CONF_DIR),
    config_name="config",
    version_base="1.3",
)
def run(cfg: DictConfig) -> None:
    quiet_libraries()
    run_composed(
        OmegaConf.to_container(cfg, resolve=True), Path(HydraConfig.get().runtime.output_dir)
    )


def run_composed(raw: dict, run_dir: Path) -> None:
    """Everything gspo-train does with a composed config: validate, build, train, close.

    Exits (SystemExit) with one line on a bad config or a failed run. The config and the run
    directory are checked before megatron-core, transformers or the model are loaded.
    """
    from gspo_megatron.checkpoint.mapping import ConversionError
    from gspo_megatron.checkpoint.meta import CheckpointError
    from gspo_megatron.files import LaunchError
    from gspo_megatron.run_files import RunFileError, check_run_directory

    try:
        run_cfg, model, layout = resolve(raw, int(os.environ.get("WORLD_SIZE", "1")))
        # Rank 0 takes the run directory (its lock, kept until this process ends) and writes
        # run_config.json; every rank checks it. Before the process group exists.
        lock = check_run_directory(run_dir, run_cfg)  # noqa: F841 - held for the run's life
        from gspo_megatron.components import build_trainer
        from gspo_megatron.megatron import cpu_compat

        cpu_compat.apply()  # before megatron-core is imported

        trainer = build_trainer(run_cfg, model, layout, run_dir)
    except ConfigError as err:
        sys.exit(f"gspo-train: config error: {err}")
    except (
        DataError, VocabMismatchError, CheckpointError, ConversionError, RunFileError, LaunchError
    ) as err:  # fmt: skip
        fail(err, traceback=False)
    except Exception as err:  # noqa: BLE001 - one line here, the traceback in the run's log
        fail(err)
    try:
        trainer.train()
    except Exception as err:  # noqa: BLE001 - one line here, the traceback in the run's log
        fail(err)
    finally:
        trainer.close()
        from gspo_megatron.megatron import parallel

        parallel.destroy()


def fail(err: BaseException, *, traceback: bool = True, program: str = "gspo-train") -> None:
    """Print one line (on each failing rank) and exit 1; the traceback goes to the log file."""
    rank = os.environ.get("RANK", "0")
    where = f"rank {rank}: " if os.environ.get("WORLD_SIZE", "1") != "1" else ""
    log = logging.getLogger("gspo_megatron")
    hint = ""
    if traceback:
        log.error("run failed", exc_info=err)
        files = [h.baseFilename for h in logging.getLogger().handlers if hasattr(h, "baseFilename")]
        hint = f" (traceback in {files[0]})" if files else ""
    else:
        log.error("run failed: %s", err)
    print(f"{program}: {where}error: {err}{hint}", file=sys.stderr, flush=True)
    sys.exit(1)


def start(program: str, app) -> None:
    """A console script: the schema, keys of earlier versions refused by name, --help (see
    config.help_text), Hydra's `app`.

    Errors in Hydra's own set-up come back as one line: a bad override or config group, or
    the run directory or its log file that cannot be created (a full disk, a quota,
    permissions), which Hydra would print as a traceback."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from gspo_megatron.torchrun import die_with_launcher

    die_with_launcher()
    register_schema()
    args = sys.argv[1:]
    try:
        check_overrides(args)
        if "--help" in args or "-h" in args:
            print(help_text(program, [a for a in args if a not in ("--help", "-h")]))
            return
    except ConfigError as err:
        sys.exit(f"{program}: config error: {err}")
    except (HydraException, OmegaConfBaseException) as err:  # in --help's composition
        sys.exit(f"{program}: config error: {_hydra_error(err)}")
    # Hydra raises what fails in its set-up instead of printing it (the run function itself
    # never raises: it ends with one line and an exit status).
    os.environ["HYDRA_FULL_ERROR"] = "1"
    quiet_failure_noise()
    try:
        app()
    except HydraException as err:
        sys.exit(f"{program}: config error: {_hydra_error(err)}")
    except Exception as err:
        reason = _os_error_in(err)
        if reason is None:
            raise
        sys.exit(f"{program}: error: {_one_line(reason)}")


def quiet_failure_noise() -> None:
    """When a rank of the job is gone, the others leave with one line each; two libraries
    would add to it on the user's terminal (this process's environment reaches its children):

    - c10d's store client logs every failed call with its C++ stack (the job's store dies with
      the launcher): torch's C++ warnings are off unless TORCH_CPP_LOG_LEVEL says otherwise;
    - Python's resource tracker, cleaning up the semaphores of the rollout generator's queues
      (rollout.mode=async) after rank 0 ended abruptly, warns that they "leaked": they are
      unlinked, nothing is lost.
    """
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    tracker = "ignore:resource_tracker:UserWarning"
    filters = [f for f in os.environ.get("PYTHONWARNINGS", "").split(",") if f]
    if tracker not in filters:
        os.environ["PYTHONWARNINGS"] = ",".join([*filters, tracker])


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def _hydra_error(err: BaseException) -> str:
    """Hydra's error on one line, without the config search path it appends, and its cause
    (why a value did not merge) in parentheses."""
    message = " ".join(str(err).split("Config search path:")[0].split())
    cause = f" ({_one_line(err.__cause__)})" if err.__cause__ else ""
    return f"{message}{cause}"


def _os_error_in(err: BaseException) -> OSError | None:
    """The OSError an exception is, or was raised from (logging's "Unable to configure
    handler" wraps the log file's)."""
    seen: set[int] = set()
    node: BaseException | None = err
    while node is not None and id(node) not in seen:
        if isinstance(node, OSError):
            return node
        seen.add(id(node))
        node = node.__cause__ or node.__context__
    return None


def main() -> None:
    start("gspo-train", run)


if __name__ == "__main__":
    main()
