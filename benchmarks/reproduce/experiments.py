"""The reproduction experiments of the GSPO paper's claims (arXiv 2507.18071), at CPU scale.

Every method runs the same work: the same model (tiny_moe, random init), task, prompts per step,
group size, response length, optimizer and learning rate, the same number of RL steps and
`algorithm.num_minibatches=4` optimizer steps per rollout batch (off-policy updates, as in the
paper). Only the `algorithm` settings differ, so "equal compute" is equal rollout samples and
equal optimizer steps per method. Runs are shared between experiments: a (method, seed) run is
trained once and every experiment that needs it reads its metrics.jsonl.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The work every run does (Hydra overrides on top of conf/config.yaml). The copy task with 2-3
# digits is what the tiny MoE learns from scratch on CPU in a few hundred steps; 16 prompts x 8
# responses = 128 rollout samples per step, cut into 4 minibatches of 32 (4 optimizer steps).
COMMON: tuple[str, ...] = (
    "model=tiny_moe",
    "data=synthetic",
    "data.task=copy",
    "data.task_kwargs.min_digits=2",
    "data.task_kwargs.max_digits=3",
    "reward=synthetic",
    "rollout=embedded",
    "rollout.prompts_per_step=16",
    "rollout.group_size=8",
    "rollout.max_new_tokens=5",
    "eval.heldout.problems=64",
    "algorithm.num_minibatches=4",
    "optimizer.lr=3e-4",
    "eval.every=10",
    "trainer.save_every=0",
    "trainer.keep_last=1",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.moe_route_metrics=true",
)

DEFAULT_STEPS = 600
DEFAULT_SEEDS = (0, 1, 2, 3, 4)

# A task learnt gradually (copy, above, is learnt in a sudden jump: final values are bimodal
# over seeds): sort 3-6 digits, per-position partial credit. GSPO's held-out mean reward rises
# steadily from ~0.12 to ~0.35 over 400 steps, with almost no exact solves.
GRADUAL_TASK: tuple[str, ...] = (
    "data.task=sort",
    "data.task_kwargs.min_digits=3",
    "data.task_kwargs.max_digits=6",
    "rollout.max_new_tokens=8",
)


@dataclass(frozen=True)
class Method:
    label: str  # shown in figures and tables
    overrides: tuple[str, ...]
    color: str


METHODS: dict[str, Method] = {
    "gspo": Method("GSPO (3e-4/4e-4)", ("algorithm=gspo",), "tab:blue"),
    "grpo": Method("GRPO (0.2/0.27)", ("algorithm=grpo_paper_baseline",), "tab:red"),
    "grpo_rr": Method(
        "GRPO + Routing Replay (R2)",
        ("algorithm=grpo_paper_baseline", "algorithm.routing_replay=r2"),
        "tab:orange",
    ),
    "gspo_token": Method("GSPO-token", ("algorithm=gspo_token",), "tab:cyan"),
    "sapo": Method("SAPO (τ+ 1.0, τ− 1.05)", ("algorithm=sapo",), "tab:green"),
    # The baseline GRPO and GSPO replaced: a learned critic (the policy's architecture with a
    # value head, its own Adam at lr 1e-3) and GAE instead of group advantages; the same samples
    # and the same 4 policy optimizer steps per RL step (plus the critic's 4).
    "ppo": Method("PPO + critic (GAE)", ("algorithm=ppo",), "tab:purple"),
}


@dataclass(frozen=True)
class Figure:
    name: str  # docs/figures/<experiment>_<name>.png
    metric: str  # key in metrics.jsonl
    title: str
    smooth: int = 1  # trailing-window average before the mean over seeds
    log_y: bool = False  # log scale; values below 1e-5 (e.g. steps without clipping) drawn at 1e-5
    exclude: tuple[str, ...] = ()  # methods the metric does not apply to


@dataclass(frozen=True)
class Comparison:
    """A claim about two methods, decided per metric by a permutation test over seeds and, with
    the experiment's margin, an equivalence test (report.py): `expect` is "A > B" (the claim
    holds when A is significantly above B), "A >= B" (A is not worse: above, or equivalent) or
    "equal" (a noise control: two methods that compute the same thing, which holds when they
    are equivalent within the margin)."""

    a: str
    b: str
    claim: str
    expect: str = "A > B"


@dataclass(frozen=True)
class Experiment:
    claim: str
    methods: tuple[str, ...]
    figures: tuple[Figure, ...]
    extra: tuple[str, ...] = field(default_factory=tuple)  # overrides for this experiment only
    # Runs with `extra` are not the shared ones: they live in <out>/<runs>/<method>/seed<k>.
    runs: str = ""
    comparisons: tuple[Comparison, ...] = ()
    seeds: tuple[int, ...] = DEFAULT_SEEDS
    steps: int = DEFAULT_STEPS
    # Differences smaller than this (in reward) count as none: two methods whose 90% interval
    # of the difference lies inside +-margin are equivalent (report.py). None: no such verdict.
    margin: float | None = None


REWARD = Figure("reward", "reward/mean", "training reward (partial credit)", smooth=10)
ACCURACY = Figure("accuracy", "reward/accuracy", "training accuracy (exact solves)", smooth=10)
HELDOUT = Figure("heldout", "eval/pass@1", "held-out accuracy (greedy pass@1)")
CLIP = Figure(
    "clip_fraction",
    "actor/clip_fraction",
    "fraction of tokens clipped (SAPO has no hard clip: left out)",
    smooth=10,
    log_y=True,
    exclude=("sapo",),
)
ROUTES = Figure(
    "route_change", "moe/route_change_fraction", "tokens whose top-k experts changed", smooth=10
)
HELDOUT_REWARD = Figure("heldout_reward", "eval/reward_mean", "held-out mean reward (greedy)")
EXPLAINED_VARIANCE = Figure(
    "explained_variance",
    "critic/explained_variance",
    "critic: explained variance of the returns (PPO only)",
    smooth=10,
    exclude=tuple(m for m in METHODS if m != "ppo"),
)

EXPERIMENTS: dict[str, Experiment] = {
    # (a) GSPO trains better than GRPO at equal compute (paper Fig. 1).
    "efficiency": Experiment(
        claim="GSPO learns more per rollout sample than GRPO (and its variants compare)",
        methods=("gspo", "grpo", "gspo_token", "sapo"),
        figures=(REWARD, HELDOUT, ACCURACY),
    ),
    # (b) GSPO clips ~2 orders of magnitude more tokens yet learns better (paper Fig. 2).
    "clipping": Experiment(
        claim="GSPO clips far more tokens than GRPO (paper: ~0.15 vs ~0.0013) yet learns better",
        methods=("gspo", "grpo"),
        figures=(CLIP, REWARD),
    ),
    # (c) GRPO needs Routing Replay on MoE; GSPO does not (paper §5.3, Fig. 3).
    "routing_replay": Experiment(
        claim="on an MoE policy GRPO needs Routing Replay to converge, GSPO does not",
        methods=("grpo", "grpo_rr", "gspo"),
        figures=(REWARD, HELDOUT, ROUTES),
    ),
    # The baseline: PPO with a critic against the critic-free methods, at the same work.
    "baseline": Experiment(
        claim="PPO with a learned critic, the baseline GRPO and GSPO replaced",
        methods=("ppo", "grpo", "gspo"),
        figures=(REWARD, HELDOUT, EXPLAINED_VARIANCE),
    ),
    # The claims again, decided by tests over enough seeds, on a task learnt gradually.
    "powered": Experiment(
        claim="the paper's claims and the PPO baseline, each decided by a test over seeds",
        methods=("gspo", "grpo", "grpo_rr", "gspo_token", "ppo"),
        figures=(REWARD, HELDOUT_REWARD, CLIP, ROUTES),
        extra=GRADUAL_TASK,
        runs="powered",
        comparisons=(
            Comparison("gspo", "grpo", "(a) GSPO learns more per sample than GRPO"),
            Comparison("gspo", "gspo_token", "noise control: GSPO = GSPO-token", "equal"),
            Comparison("grpo_rr", "grpo", "(c) GRPO needs Routing Replay on MoE"),
            Comparison("gspo", "grpo_rr", "(c) GSPO without replay ≥ GRPO with it", "A >= B"),
            Comparison("ppo", "gspo", "PPO with a critic vs GSPO"),
        ),
        seeds=tuple(range(8)),
        steps=400,
        margin=0.05,  # 5 points of per-position accuracy
    ),
    # Every method and every figure: the full sweep behind the experiments above.
    "all": Experiment(
        claim="all methods, all metrics",
        methods=tuple(METHODS),
        figures=(REWARD, HELDOUT, ACCURACY, CLIP, ROUTES, EXPLAINED_VARIANCE),
    ),
}

# A run of a couple of steps with a smaller batch: the CI smoke test of every command.
SMOKE: tuple[str, ...] = (
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "eval.heldout.problems=8",
    "eval.every=1",
)
