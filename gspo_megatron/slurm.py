"""What the slurm/*.sbatch scripts call: checks before any rank starts, one torchrun per node, and
a supervisor that turns Slurm's SIGTERM into a checkpoint (and a requeue).

    python -m gspo_megatron.slurm preflight [OVERRIDES...]
        In the batch script: the allocation (nodes x GPUs) from Slurm's environment, the Hydra
        config composed and validated for that world size (gspo_megatron.config.resolve), input
        paths checked, the memory plan (gspo_megatron.memory_plan) checked against the GPUs'
        memory; prints the run directory and whether the run resumes. Exit 1 with a message
        naming the setting when anything is wrong, before any rank is started.
    python -m gspo_megatron.slurm preflight --dry-run --nodes 2 --gpus-per-node 8 \\
            --gpu-memory-gib 79.6 [OVERRIDES...]
        The same checks anywhere (a login node, a laptop), without Slurm and without workers.
    python -m gspo_megatron.slurm torchrun --run-dir DIR [OVERRIDES...]
        Under `srun --ntasks-per-node=1`: exec one torchrun on this node (rank from SLURM_NODEID,
        rendezvous at MASTER_ADDR:MASTER_PORT), with Hydra's run directory pinned.
    python -m gspo_megatron.slurm supervise --step-name NAME -- srun ...
        The batch step's main process (`exec`): runs srun, and on SIGTERM sends SIGTERM to the
        training step through Slurm (srun itself would kill its tasks), waits for the checkpoint,
        and requeues the job if the signal was the time-limit warning (--signal=B:TERM@120).

Signals: slurmstepd delivers a step's signals to every process of the step, so each training rank
gets SIGTERM directly; torchrun is told to ignore it (else it would SIGKILL its workers 30 s
later and exit 1, which `srun --kill-on-bad-exit` would turn into killing the other nodes'
checkpoint writers). The trainer finishes the current step, checkpoints and exits 0.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEP_NAME = "gspo-train"
DEFAULT_RUN_ROOT = "outputs/slurm"


class SlurmError(RuntimeError):
    """Bad environment or input for a Slurm launch; the message says what to change."""


# -- the allocation ---------------------------------------------------------------------------


def _env(env: Mapping[str, str], name: str, het_group: int | None) -> str | None:
    """SLURM_X, or SLURM_X_HET_GROUP_<g> in a heterogeneous job's component g."""
    if het_group is not None:
        value = env.get(f"{name}_HET_GROUP_{het_group}")
        if value:
            return value
    return env.get(name) or None


def _require(env: Mapping[str, str], name: str, het_group: int | None = None) -> str:
    value = _env(env, name, het_group)
    if value is None:
        where = f" (or {name}_HET_GROUP_{het_group})" if het_group is not None else ""
        raise SlurmError(
            f"{name}{where} is not set: this must run inside a Slurm job (sbatch "
            "slurm/train.sbatch ...); to check a config without Slurm use "
            "`python -m gspo_megatron.slurm preflight --dry-run --nodes N --gpus-per-node G ...`"
        )
    return value


def gpus_per_node(env: Mapping[str, str], het_group: int | None = None) -> int:
    """GPUs per node of the allocation: SLURM_GPUS_ON_NODE / SLURM_GPUS_PER_NODE (e.g. "h100:8"),
    or GSPO_NPROC_PER_NODE where GPUs are not a Slurm resource."""
    for name in ("GSPO_NPROC_PER_NODE", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        raw = _env(env, name, het_group)
        if raw:
            match = re.fullmatch(r"(?:[\w-]+:)*(\d+)(?:\(.*\))?", raw.strip())
            if not match or int(match.group(1)) < 1:
                raise SlurmError(f"{name}={raw!r} is not a GPU count")
            return int(match.group(1))
    raise SlurmError(
        "no GPUs in this allocation: request them (#SBATCH --gpus-per-node=8), or set "
        "GSPO_NPROC_PER_NODE to the number of ranks per node where GPUs are not a Slurm resource"
    )


def scontrol_hostnames(nodelist: str) -> list[str]:
    """`scontrol show hostnames NODELIST`: node01,node[02-03] -> [node01, node02, node03]."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    except FileNotFoundError as err:
        raise SlurmError("scontrol not found: Slurm's client commands must be on PATH") from err
    except subprocess.CalledProcessError as err:
        raise SlurmError(
            f"scontrol show hostnames {nodelist} failed: {err.stderr.strip()}"
        ) from err
    return out.split()


@dataclass(frozen=True)
class Allocation:
    """The nodes and GPUs a job (or one component of a heterogeneous job) holds."""

    job_id: str
    job_name: str
    nodes: tuple[str, ...]
    gpus_per_node: int

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.gpus_per_node

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str],
        het_group: int | None = None,
        hostnames: Callable[[str], list[str]] = scontrol_hostnames,
    ) -> Allocation:
        job_id = _require(env, "SLURM_JOB_ID")
        nodes = tuple(hostnames(_require(env, "SLURM_JOB_NODELIST", het_group)))
        expected = _env(env, "SLURM_JOB_NUM_NODES", het_group) or _env(
            env, "SLURM_NNODES", het_group
        )
        if expected and int(expected) != len(nodes):
            raise SlurmError(
                f"SLURM_JOB_NODELIST names {len(nodes)} nodes but SLURM_JOB_NUM_NODES={expected}"
            )
        return cls(
            job_id=job_id.split("+")[0],
            job_name=env.get("SLURM_JOB_NAME") or "gspo",
            nodes=nodes,
            gpus_per_node=gpus_per_node(env, het_group),
        )


# -- run directory and overrides --------------------------------------------------------------


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def run_dir_of(overrides: Sequence[str]) -> str | None:
    for override in overrides:
        if _override_key(override) == "hydra.run.dir":
            return override.split("=", 1)[1]
    return None


def default_run_dir(job_name: str, job_id: str, root: str = DEFAULT_RUN_ROOT) -> str:
    """<root>/<job name>_<job id>: a requeued job keeps its id, so it finds its checkpoints."""
    name = re.sub(r"[^\w.-]", "_", job_name)
    return f"{root}/{name}_{job_id}"


def with_run_dir(overrides: Sequence[str], default: str) -> list[str]:
    """Pin Hydra's run directory: the user's hydra.run.dir if given, else `default`.

    Every rank must get the same directory (Hydra's default is a timestamp per process), and a
    requeued or resubmitted job must get its run's directory back to resume from it
    (trainer.resume=auto).
    """
    if run_dir_of(overrides) is not None:
        return list(overrides)
    return [*overrides, f"hydra.run.dir={default}"]


def sglang_overrides(overrides: Sequence[str], urls: Sequence[str], master_addr: str) -> list[str]:
    """Point the trainer at SGLang servers on other nodes (weights by NCCL broadcast)."""
    keys = {_override_key(o) for o in overrides}
    for key in ("rollout.sglang.urls", "rollout.sglang.launch", "rollout.sglang.router_url"):
        if key in keys:
            raise SlurmError(
                f"{key} is set by the disaggregated script (servers of the job's "
                "second component); remove it from the overrides"
            )
    added = [] if "rollout" in keys else ["rollout=sglang"]
    added.append("++rollout.sglang.urls=[" + ",".join(f'"{u}"' for u in urls) + "]")
    if "rollout.sglang.weight_sync" not in keys:
        added.append("++rollout.sglang.weight_sync=distributed")
    if "rollout.sglang.master_address" not in keys:
        added.append(f"++rollout.sglang.master_address={master_addr}")
    return [*overrides, *added]


def sglang_urls(
    env: Mapping[str, str],
    het_group: int,
    port: int,
    hostnames: Callable[[str], list[str]] = scontrol_hostnames,
) -> list[str]:
    """One server per node of the heterogeneous job's component `het_group`."""
    nodelist = env.get(f"SLURM_JOB_NODELIST_HET_GROUP_{het_group}")
    if not nodelist:
        raise SlurmError(
            f"SLURM_JOB_NODELIST_HET_GROUP_{het_group} is not set: the SGLang servers run in "
            f"component {het_group} of a heterogeneous job (#SBATCH hetjob)"
        )
    return [f"http://{host}:{port}" for host in hostnames(nodelist)]


# -- preflight --------------------------------------------------------------------------------


@dataclass
class Preflight:
    """The result of the checks: printable lines; `ok` is False when the run must not start."""

    lines: list[str]
    ok: bool

    def text(self) -> str:
        return "\n".join(self.lines)


def gpu_memory_gib_here() -> float | None:
    """Memory of this node's first GPU (nvidia-smi), None where there is none."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return int(out[0]) / 1024 if out else None


def preflight(
    overrides: Sequence[str],
    *,
    nodes: int,
    gpus_per_node: int,
    gpu_memory_gib: float | None,
    check_inputs: bool = True,
    memory_check: bool = True,
) -> Preflight:
    """Compose + validate the config for nodes x gpus_per_node ranks; plan memory; check paths."""
    from gspo_megatron.config import ConfigError, compose, missing_inputs, resolve
    from gspo_megatron.memory_plan import PlanError, plan, settings_from_config
    from gspo_megatron.rollout.backends import rollout_backend

    world = nodes * gpus_per_node
    lines = [f"allocation: {nodes} node(s) x {gpus_per_node} GPU(s) = {world} ranks"]
    try:
        raw = compose(list(overrides))
        run_cfg, model, layout = resolve(raw, world, check_inputs=False)
    except (ConfigError, ValueError) as err:
        return Preflight([*lines, f"error: config: {err}"], ok=False)
    except Exception as err:  # noqa: BLE001 - Hydra's composition errors (unknown group, syntax)
        return Preflight([*lines, f"error: config: {type(err).__name__}: {err}"], ok=False)
    lines.append(f"layout: {layout.describe()}")
    if line := rollout_backend(run_cfg.rollout.engine).describe(run_cfg):
        lines.append(line)
    ok = True
    missing = missing_inputs(run_cfg)
    for path in missing:
        if check_inputs:
            lines.append(f"error: {path}")
            ok = False
        else:
            lines.append(f"note (dry run, not an error here): {path}")
    run_dir = run_dir_of(overrides)
    if run_dir:
        lines.append(f"run directory: {run_dir} ({_resume_state(Path(run_dir), run_cfg)})")
    if gpu_memory_gib is None:
        lines.append(
            "memory: no GPU memory known here (no nvidia-smi, no --gpu-memory-gib): "
            "the memory plan is not checked"
        )
        return Preflight(lines, ok=ok)
    try:
        settings = settings_from_config(run_cfg, model, layout, gpu_memory_gib=gpu_memory_gib)
        memory = plan(model, layout, settings)
    except PlanError as err:
        return Preflight([*lines, f"error: memory plan: {err}"], ok=False)
    lines.append(memory.table())
    if not memory.fits:
        advice = f"; change: {memory.advice()}"
        if memory_check:
            lines.append(
                f"error: the model does not fit in {gpu_memory_gib:.1f} GiB per GPU "
                f"per the memory plan (tools/plan_memory.py){advice}. The plan is an "
                "estimate: --no-memory-check (GSPO_NO_MEMORY_CHECK=1) starts anyway"
            )
            ok = False
        else:
            lines.append(f"warning: the memory plan says it does not fit{advice}")
    return Preflight(lines, ok=ok)


def _resume_state(run_dir: Path, run_cfg: Any) -> str:
    if run_cfg.trainer.resume == "never":
        return "trainer.resume=never: starts from step 0"
    if run_cfg.trainer.resume != "auto":
        return f"resumes from {run_cfg.trainer.resume}"
    from gspo_megatron.run_files import checkpoint_dirs

    steps = [step for step, _ in checkpoint_dirs(run_dir)]
    return f"resumes after step {steps[-1]} (if it validates)" if steps else "new run"


# -- one torchrun per node --------------------------------------------------------------------


@dataclass(frozen=True)
class NodeLaunch:
    """torchrun's arguments for this node of the job."""

    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls, env: Mapping[str, str], het_group: int | None = None) -> NodeLaunch:
        nnodes = int(_require(env, "SLURM_NNODES"))
        node_rank = int(_require(env, "SLURM_NODEID"))
        master_addr = env.get("MASTER_ADDR")
        master_port = env.get("MASTER_PORT")
        if not master_addr or not master_port:
            raise SlurmError(
                "MASTER_ADDR and MASTER_PORT must be set by the batch script "
                '(MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1))'
            )
        if not 0 <= node_rank < nnodes:
            raise SlurmError(f"SLURM_NODEID={node_rank} is outside 0..{nnodes - 1}")
        return cls(
            nnodes=nnodes,
            node_rank=node_rank,
            nproc_per_node=gpus_per_node(env, het_group),
            master_addr=master_addr,
            master_port=int(master_port),
        )

    def argv(self, python: str, overrides: Sequence[str]) -> list[str]:
        return [
            python,
            "-m",
            "torch.distributed.run",
            f"--nnodes={self.nnodes}",
            f"--node-rank={self.node_rank}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--master-addr={self.master_addr}",
            f"--master-port={self.master_port}",
            "-m",
            "gspo_megatron.train",
            *overrides,
        ]


def torchrun_environment(env: Mapping[str, str]) -> dict[str, str]:
    """torchrun leaves SIGTERM to Slurm (see the module doc).

    `--signals-to-handle`, read from its PET_ variable (torch 2.13 has it); older torchrun handles
    SIGTERM anyway and gives the ranks TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s) to checkpoint.
    """
    out = dict(env)
    out["PET_SIGNALS_TO_HANDLE"] = "SIGINT,SIGHUP,SIGQUIT"
    return out


# -- the batch step's supervisor --------------------------------------------------------------


class Supervisor:
    """Run the srun command; on SIGTERM signal the training step via Slurm; requeue after a
    time-limit warning.

    Who sent SIGTERM decides what follows, read from the job's state when it arrives: RUNNING is
    the warning before the time limit (--signal=B:TERM@N), so the job is requeued once the step
    has checkpointed; a cancelled job is already COMPLETING (no requeue), and a preempted job is
    requeued by Slurm itself.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        job_id: str,
        step_name: str,
        requeue: bool = True,
        run: Callable[..., Any] = subprocess.run,
    ) -> None:
        self.command = list(command)
        self.job_id = job_id
        self.step_name = step_name
        self.requeue = requeue
        self.stop_requested = False
        self.requeue_wanted = False
        self._run = run

    def _slurm(self, *cmd: str) -> subprocess.CompletedProcess:
        return self._run(list(cmd), capture_output=True, text=True, timeout=60)

    def job_state(self) -> str | None:
        out = self._slurm("scontrol", "show", "job", "-o", self.job_id).stdout or ""
        match = re.search(r"\bJobState=(\S+)", out)
        return match.group(1) if match else None

    def step_ids(self) -> list[str]:
        """Ids (JOB.STEP) of this job's running steps named `step_name`."""
        out = self._slurm("squeue", "-h", "-s", "-j", self.job_id, "-o", "%i|%j").stdout or ""
        ids = []
        for line in out.splitlines():
            step_id, _, name = line.strip().partition("|")
            if name == self.step_name:
                ids.append(step_id)
        return ids

    def forward_sigterm(self) -> None:
        if not self.stop_requested:
            state = self.job_state()
            self.requeue_wanted = self.requeue and state == "RUNNING"
            then = "then requeues the job" if self.requeue_wanted else "no requeue"
            _log(
                f"got SIGTERM (job state {state}): the trainer checkpoints after its current "
                f"step; {then}"
            )
        self.stop_requested = True
        targets = self.step_ids() or [self.job_id]  # the job: all of its non-batch steps
        _log(f"sending SIGTERM to step(s) {', '.join(targets)}")
        done = self._slurm("scancel", "--signal=TERM", *targets)
        if done.returncode and targets != [self.job_id]:
            _log(f"scancel failed ({(done.stderr or '').strip()}): signalling all steps")
            self._slurm("scancel", "--signal=TERM", self.job_id)

    def run(self) -> int:
        pending: list[int] = []
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: pending.append(signum))
        try:
            proc = subprocess.Popen(self.command)
            while True:
                while pending:
                    pending.pop()
                    self.forward_sigterm()
                try:
                    code = proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    continue
        finally:
            signal.signal(signal.SIGTERM, previous)
        _log(f"training step exited with {code}")
        if self.requeue_wanted and code == 0:
            _log(
                f"requeueing job {self.job_id}; it resumes from its checkpoint in the same "
                "run directory"
            )
            done = self._slurm("scontrol", "requeue", self.job_id)
            if done.returncode:
                _log(f"scontrol requeue failed: {(done.stderr or '').strip()}")
        return code


def _log(message: str) -> None:
    print(f"[gspo-slurm] {message}", file=sys.stderr, flush=True)


# -- command line -----------------------------------------------------------------------------


def _main_preflight(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    overrides = list(args.overrides)
    if args.dry_run:
        if not args.nodes or not args.gpus_per_node:
            raise SlurmError("--dry-run needs --nodes and --gpus-per-node")
        nodes, gpus = args.nodes, args.gpus_per_node
        memory = args.gpu_memory_gib
        if args.run_dir:
            overrides = with_run_dir(overrides, args.run_dir)
        if args.sglang_servers:  # disaggregated: placeholders for the servers' URLs
            urls = [f"http://sglang-{i}:{args.sglang_port}" for i in range(args.sglang_servers)]
            overrides = sglang_overrides(overrides, urls, "trainer-node-0")
    else:
        alloc = Allocation.from_env(env, het_group=args.het_group)
        nodes, gpus = len(alloc.nodes), alloc.gpus_per_node
        overrides = with_run_dir(
            overrides, args.run_dir or default_run_dir(alloc.job_name, alloc.job_id)
        )
        if args.sglang_het_group is not None:
            urls = sglang_urls(env, args.sglang_het_group, args.sglang_port)
            overrides = sglang_overrides(overrides, urls, alloc.nodes[0])
        memory = (
            args.gpu_memory_gib or _float(env.get("GSPO_GPU_MEMORY_GIB")) or (gpu_memory_gib_here())
        )
    result = preflight(
        overrides,
        nodes=nodes,
        gpus_per_node=gpus,
        gpu_memory_gib=memory,
        check_inputs=not args.dry_run,
        memory_check=not (args.no_memory_check or env.get("GSPO_NO_MEMORY_CHECK") == "1"),
    )
    for line in result.text().splitlines():
        print(f"[gspo-slurm] {line}", file=sys.stderr if line.startswith("error") else sys.stdout)
    if not result.ok:
        print("[gspo-slurm] preflight failed: no rank was started", file=sys.stderr)
        return 1
    print(f"[gspo-slurm] preflight ok: {' '.join(overrides)}")
    return 0


def _main_torchrun(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    _require(env, "SLURM_JOB_ID")
    node = NodeLaunch.from_env(env, het_group=args.het_group)
    if not args.run_dir:
        # Inside `srun --job-name=X` SLURM_JOB_NAME is the step's name, not the job's.
        raise SlurmError(
            "torchrun needs --run-dir (the batch script's RUN_DIR) so that every "
            "node and every requeue of the job use the same run directory"
        )
    overrides = with_run_dir(args.overrides, args.run_dir)
    if args.sglang_het_group is not None:
        urls = sglang_urls(env, args.sglang_het_group, args.sglang_port)
        overrides = sglang_overrides(overrides, urls, node.master_addr)
    argv = node.argv(args.python or sys.executable, overrides)
    _log(f"node {node.node_rank}/{node.nnodes} ({os.uname().nodename}): {' '.join(argv)}")
    # Ignored here and in torchrun; the ranks install the trainer's own handler.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.execvpe(argv[0], argv, torchrun_environment(env))
    return 1  # not reached


def _main_supervise(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SlurmError("supervise needs a command after --")
    job_id = _require(env, "SLURM_JOB_ID").split("+")[0]
    requeue = not args.no_requeue and env.get("GSPO_REQUEUE", "1") != "0"
    return Supervisor(command, job_id=job_id, step_name=args.step_name, requeue=requeue).run()


def _float(value: str | None) -> float | None:
    return float(value) if value else None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gspo_megatron.slurm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command_name", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--run-dir", default=None, help="run directory unless the overrides give hydra.run.dir"
        )
        sp.add_argument(
            "--het-group",
            type=int,
            default=None,
            help="the trainer's component of a heterogeneous job",
        )
        sp.add_argument(
            "--sglang-het-group",
            type=int,
            default=None,
            help="component whose nodes run SGLang servers (disaggregated)",
        )
        sp.add_argument("--sglang-port", type=int, default=30000)

    pre = sub.add_parser("preflight", help="validate config, layout, paths and memory")
    pre.add_argument("--dry-run", action="store_true", help="without Slurm: give the allocation")
    pre.add_argument("--nodes", type=int)
    pre.add_argument("--gpus-per-node", type=int)
    pre.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="memory per GPU (default: nvidia-smi here, or GSPO_GPU_MEMORY_GIB)",
    )
    pre.add_argument(
        "--no-memory-check",
        action="store_true",
        help="print the memory plan but start even if it does not fit",
    )
    pre.add_argument(
        "--sglang-servers",
        type=int,
        default=0,
        help="dry run of the disaggregated script: this many SGLang servers (placeholder URLs)",
    )
    common(pre)
    pre.add_argument("overrides", nargs="*", help="Hydra overrides, as for gspo-train")

    tr = sub.add_parser("torchrun", help="exec torchrun for this node (under srun)")
    tr.add_argument("--python", default=None, help="interpreter of the ranks")
    common(tr)
    tr.add_argument("overrides", nargs="*")

    su = sub.add_parser("supervise", help="run srun; forward SIGTERM to the step; requeue")
    su.add_argument("--step-name", default=STEP_NAME)
    su.add_argument("--no-requeue", action="store_true")
    su.add_argument("command", nargs=argparse.REMAINDER)
    return p


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)
    # Hydra overrides may follow options (argparse stops collecting positionals at an option).
    unknown = [e for e in extra if e.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    env = os.environ if env is None else env
    commands = {
        "preflight": _main_preflight,
        "torchrun": _main_torchrun,
        "supervise": _main_supervise,
    }
    try:
        return commands[args.command_name](args, env)
    except SlurmError as err:
        print(f"[gspo-slurm] error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
