"""gspo-megatron vs TRL's GSPO (GRPOTrainer, importance_sampling_level="sequence"), side by side
on CPU, on the same tiny Qwen3-MoE weights, prompts, group size, lengths and optimizer.

    python benchmarks/bench_vs_trl.py [--steps 25] [--repeats 2] [--seed 0] [--threads 1]
        [--out DIR] [--figure reward.png] [--skip-training]
    # docs/REPRODUCTION.md: --steps 150 --repeats 3 --figure docs/figures/bench_vs_trl_reward.png

Needs `trl` (pip install trl; see docs/REPRODUCTION.md). One invocation does three things and
prints one table:

1. **Loss on one identical batch.** A random tiny Qwen3-MoE (the `tiny_moe` preset's shape, saved
   as a Hugging Face directory) samples 16 prompts x 8 responses; old log-probs come from those
   weights, the "current" policy is the same weights plus small noise (so sequence ratios lie
   around the 3e-4/4e-4 clip bounds and some are clipped). The GSPO loss of that batch is
   computed by TRL's `GRPOTrainer._compute_loss` (loss_type "grpo", as TRL recommends for
   GSPO, and TRL's default "dapo"), by our library (`policy_loss("gspo")`), by our training
   engine (megatron-core forward, several micro-batches, exactly the loss `gspo-train`
   optimises), and by hand from the paper's formula in float64. Gradients of TRL's loss and of
   ours w.r.t. the same HF parameters are compared too.
2. **Training, ours:** `gspo-train` from those weights (HF -> megatron via
   `gspo_megatron.checkpoint`) for --steps RL steps: 16 prompts x 8 responses per step (read in
   file order, no shuffling), responses of at most 5 tokens, 4 optimizer steps per rollout batch
   (minibatches of 32), Adam lr 3e-4 (constant), betas 0.9/0.999, eps 1e-8, no weight decay,
   gradient clipping 1.0, clip 3e-4/4e-4, no KL, router aux loss 0.001.
3. **Training, TRL:** GRPOTrainer with the same settings: per_device_train_batch_size 32,
   steps_per_generation 4 (= 4 optimizer steps per generation batch of 128), num_generations 8,
   max_completion_length 5, max_steps 4 x --steps, the same reward function on the same token
   ids, router aux loss with the same coefficient (TRL turns router logits on in its loss
   forward; they stay off in config.json because transformers' generate fails with them).

Time per RL step (generate + old log-probs + 4 optimizer steps), as wall time and as the CPU time
of the process, is the median over the steps of --repeats runs per side (each without its first
step); the sides alternate, each run in a fresh process with the same torch thread count, ours
through gspo-train's own code path (Hydra compose, resolve, build_trainer, Trainer.train).
Reward after K steps is the mean training reward of the last 5 RL steps of the first run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROMPTS_PER_STEP = 16
GROUP_SIZE = 8
MAX_NEW_TOKENS = 5
NUM_MINIBATCHES = 4
LR = 3e-4
CLIP_LOW, CLIP_HIGH = 3e-4, 4e-4
AUX_LOSS_COEF = 0.001
TASK = dict(name="copy", min_digits=2, max_digits=3)
NOISE_STD = 2e-3  # perturbation of the "current" policy in the loss check (relative to 0.02 init)


# -- shared pieces --------------------------------------------------------------------------------


def tiny_moe_architecture() -> dict:
    import yaml

    cfg = yaml.safe_load((REPO / "conf" / "model" / "tiny_moe.yaml").read_text())
    return cfg


def make_hf_model(out: Path, seed: int) -> None:
    """The tiny_moe preset as a Hugging Face Qwen3-MoE directory (random init, std 0.02)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gspo_megatron.data.tokenizer import build_char_tokenizer

    a = tiny_moe_architecture()
    tok = build_char_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=a["vocab_size"],
        hidden_size=a["hidden_size"],
        intermediate_size=a["intermediate_size"],
        num_hidden_layers=a["num_hidden_layers"],
        num_attention_heads=a["num_attention_heads"],
        num_key_value_heads=a["num_key_value_heads"],
        head_dim=a["head_dim"],
        rope_theta=a["rope_theta"],
        rms_norm_eps=a["rms_norm_eps"],
        max_position_embeddings=a["max_position_embeddings"],
        tie_word_embeddings=a["tie_word_embeddings"],
        num_experts=a["num_experts"],
        num_experts_per_tok=a["num_experts_per_tok"],
        moe_intermediate_size=a["moe_intermediate_size"],
        norm_topk_prob=a["norm_topk_prob"],
        router_aux_loss_coef=AUX_LOSS_COEF,
        # True breaks HF generate with a KV cache; TRL turns it on in its loss forward.
        output_router_logits=False,
        initializer_range=a["init_method_std"],
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).float()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)


def write_prompts(path: Path, count: int, seed: int) -> None:
    from gspo_megatron.data.synthetic import synthetic_records

    records = synthetic_records(
        TASK["name"],
        count,
        seed=seed,
        split="train",
        min_digits=TASK["min_digits"],
        max_digits=TASK["max_digits"],
    )
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def response_text(tok, ids: list[int]) -> str:
    """What gspo-train's reward sees (RolloutCollector.response_text): all but a final <eos>."""
    if ids and ids[-1] == tok.eos_token_id:
        ids = ids[:-1]
    return tok.decode(ids, skip_special_tokens=False)


def trl_reward(tok):
    from gspo_megatron.rewards.synthetic import partial_credit

    def copy_reward(prompts, completions, completion_ids, label, **kwargs):
        return [
            partial_credit(response_text(tok, list(ids)), str(t))
            for ids, t in zip(completion_ids, label, strict=True)
        ]

    return copy_reward


def trl_config(
    out: Path, seed: int, steps: int, loss_type: str = "grpo", aux_loss_coef: float = AUX_LOSS_COEF
):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=seed,
        report_to="none",
        save_strategy="no",
        logging_steps=NUM_MINIBATCHES,
        disable_tqdm=True,
        max_steps=NUM_MINIBATCHES * steps,
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP_SIZE // NUM_MINIBATCHES,
        gradient_accumulation_steps=1,
        steps_per_generation=NUM_MINIBATCHES,
        num_iterations=1,
        num_generations=GROUP_SIZE,
        max_completion_length=MAX_NEW_TOKENS,
        shuffle_dataset=False,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        optim="adamw_torch",
        beta=0.0,
        epsilon=CLIP_LOW,
        epsilon_high=CLIP_HIGH,
        importance_sampling_level="sequence",
        loss_type=loss_type,
        scale_rewards="group",
        router_aux_loss_coef=aux_loss_coef,
        dataloader_num_workers=0,
    )


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


# -- phase 1: the loss of one identical batch ------------------------------------------------------


def phase_loss(hf_dir: Path, work: Path, seed: int, threads: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from gspo_megatron.algorithms import group_advantages, policy_loss
    from gspo_megatron.data.tokenizer import build_char_tokenizer
    from gspo_megatron.rewards.synthetic import partial_credit

    _set_threads(threads)
    torch.manual_seed(seed)
    tok = build_char_tokenizer()
    records = [json.loads(x) for x in (work / "prompts.jsonl").read_text().splitlines()]
    records = records[:PROMPTS_PER_STEP]

    # Sample the batch from the old policy (W0).
    old_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompts = [tok(r["prompt"]).input_ids for r in records for _ in range(GROUP_SIZE)]
    labels = [r["label"] for r in records for _ in range(GROUP_SIZE)]
    width = max(map(len, prompts))
    prompt_ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    prompt_mask = (
        torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]
    ).long()
    with torch.no_grad():
        generated = old_model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=MAX_NEW_TOKENS,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )[:, width:]
    completions = []
    for row in generated.tolist():
        ids = []
        for t in row:
            ids.append(t)
            if t == tok.eos_token_id:
                break
        completions.append(ids)
    c_width = max(map(len, completions))
    completion_ids = torch.tensor(
        [c + [tok.pad_token_id] * (c_width - len(c)) for c in completions]
    )
    completion_mask = torch.tensor([[1] * len(c) + [0] * (c_width - len(c)) for c in completions])
    rewards = torch.tensor(
        [
            partial_credit(response_text(tok, c), lab)
            for c, lab in zip(completions, labels, strict=True)
        ]
    )
    advantages = group_advantages(rewards.view(PROMPTS_PER_STEP, GROUP_SIZE)).flatten()

    def hf_logprobs(model, grad: bool = False) -> torch.Tensor:
        ids = torch.cat([prompt_ids, completion_ids], 1)
        mask = torch.cat([prompt_mask, completion_mask], 1)
        with torch.set_grad_enabled(grad):
            logits = model(input_ids=ids, attention_mask=mask).logits[:, width - 1 : -1].float()
            return torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None]).squeeze(-1)

    old_lp = hf_logprobs(old_model) * completion_mask

    # The current policy W1 = W0 + noise, saved so that every side loads the same weights.
    new_dir = work / "hf_current"
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in old_model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * NOISE_STD)
    old_model.save_pretrained(new_dir)
    tok.save_pretrained(new_dir)
    del old_model

    results: dict[str, float] = {}
    mask_f = completion_mask.to(torch.float64)

    # The paper's formula, by hand, float64, from the HF log-probs of W1.
    model = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32)
    model.config.output_router_logits = False  # the policy loss alone (no aux loss) on every side
    new_lp_hf = hf_logprobs(model).double() * mask_f
    terms = []
    for i in range(len(completions)):
        n = int(mask_f[i].sum())
        s = math.exp(sum(float(new_lp_hf[i, t] - old_lp[i, t]) for t in range(n)) / n)
        a = float(advantages[i])
        clipped = min(max(s, 1 - CLIP_LOW), 1 + CLIP_HIGH)
        terms.append(min(s * a, clipped * a))
    results["paper formula (float64, HF log-probs)"] = -sum(terms) / len(terms)
    ratios = torch.exp(((new_lp_hf - old_lp.double()) * mask_f).sum(1) / mask_f.sum(1))
    seq_clipped = ((advantages > 0) & (ratios > 1 + CLIP_HIGH)) | (
        (advantages < 0) & (ratios < 1 - CLIP_LOW)
    )
    info = {
        "sequences": len(completions),
        "tokens": int(mask_f.sum()),
        "ratio_min": float(ratios.min()),
        "ratio_max": float(ratios.max()),
        "seq_clip_fraction": float(seq_clipped.float().mean()),
        "lengths": sorted({len(c) for c in completions}),
    }

    # Ours, library: policy_loss("gspo") on the HF log-probs (with autograd, for gradients).
    model.train()
    model.zero_grad()
    lp = hf_logprobs(model, grad=True)
    ours, _ = policy_loss(
        "gspo",
        lp,
        old_lp,
        advantages,
        completion_mask.bool(),
        clip_low=CLIP_LOW,
        clip_high=CLIP_HIGH,
    )
    ours.backward()
    ours_grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    results["gspo-megatron policy_loss('gspo') (HF log-probs)"] = float(ours.detach())

    # TRL: GRPOTrainer._compute_loss on the same inputs, loss_type grpo (recommended for GSPO)
    # and dapo (TRL's default).
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages.float(),
        "old_per_token_logps": old_lp.float(),
        "num_items_in_batch": completion_mask.sum(),
    }
    dataset = Dataset.from_list(records)
    trl_grads = None
    for loss_type in ("grpo", "dapo"):
        cfg = trl_config(work / f"trl_loss_{loss_type}", seed, 1, loss_type, aux_loss_coef=0.0)
        cfg.steps_per_generation = 1
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=trl_reward(tok),
            args=cfg,
            train_dataset=dataset,
            processing_class=tok,
        )
        trainer.model.train()
        trainer.model.zero_grad()
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train() per step
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        if loss_type == "grpo":
            trl_grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        default = " (TRL's default)" if loss_type == "dapo" else " (TRL's advice for GSPO)"
        results[f"TRL GRPOTrainer._compute_loss, loss_type='{loss_type}'{default}"] = float(
            loss.detach()
        )
    num = sum(float((a - b).norm() ** 2) for a, b in zip(trl_grads, ours_grads, strict=True))
    den = sum(float(b.norm() ** 2) for b in ours_grads)
    info["grad_rel_diff_trl_grpo_vs_ours"] = math.sqrt(num / den) if den else float("nan")
    info["grad_norm_ours"] = math.sqrt(den)

    # Ours, training engine: megatron-core model loaded from the same HF weights; log-probs from
    # its forward, and the loss its train_step optimises (several micro-batches).
    results.update(_engine_losses(new_dir, prompts, completions, old_lp, advantages, info))
    return {"losses": results, "batch": info}


def _engine_losses(hf_dir, prompts, completions, old_lp, advantages, info) -> dict[str, float]:
    import torch

    from gspo_megatron.algorithms import policy_loss
    from gspo_megatron.megatron import cpu_compat

    cpu_compat.apply()  # before megatron-core is imported
    from gspo_megatron.megatron import parallel
    from gspo_megatron.megatron.training_engine import TrainingEngine
    from gspo_megatron.megatron.weight_loading import load_engine_hf_weights
    from gspo_megatron.spec.layout import ParallelLayout
    from gspo_megatron.spec.loss import LossSettings
    from gspo_megatron.spec.model_config import ModelConfig
    from gspo_megatron.spec.sample import TrainSample
    from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

    arch = tiny_moe_architecture()
    fields = {k: v for k, v in arch.items() if k in ModelConfig.__dataclass_fields__}
    model_config = ModelConfig(**fields)
    layout = ParallelLayout(world_size=1)
    parallel.initialize(layout, seed=0)
    try:
        engine = TrainingEngine(
            model_config,
            layout,
            EngineSettings(max_sequence_length=64, max_tokens_per_microbatch=256),
            OptimizerSettings(lr=LR, weight_decay=0.0, clip_grad=1.0),
        )
        load_engine_hf_weights(engine, hf_dir)
        samples = [
            TrainSample(
                prompt_ids=list(p),
                response_ids=list(c),
                advantage=float(a),
                old_logprobs=old_lp[i, : len(c)].tolist(),
            )
            for i, (p, c, a) in enumerate(zip(prompts, completions, advantages, strict=True))
        ]
        forward = engine.forward(samples)
        width = old_lp.shape[1]
        lp = torch.zeros(len(samples), width, dtype=torch.float64)
        for i, row in enumerate(forward.logprobs):
            lp[i, : len(row)] = torch.as_tensor(row, dtype=torch.float64)
        mask = old_lp.new_zeros(old_lp.shape, dtype=torch.bool)
        for i, c in enumerate(completions):
            mask[i, : len(c)] = True
        lib, _ = policy_loss(
            "gspo",
            lp,
            old_lp.double(),
            advantages.double(),
            mask,
            clip_low=CLIP_LOW,
            clip_high=CLIP_HIGH,
        )
        metrics = engine.train_step(
            samples, LossSettings("gspo", {"clip_low": CLIP_LOW, "clip_high": CLIP_HIGH})
        )
        info["engine_microbatches"] = metrics.get("num_microbatches")
        return {
            "gspo-megatron policy_loss('gspo') (megatron log-probs)": float(lib),
            "gspo-megatron TrainingEngine.train_step (what gspo-train optimises)": metrics["loss"],
        }
    finally:
        parallel.destroy()


# -- phase 2/3: training runs ----------------------------------------------------------------------


def our_overrides(hf_dir: Path, work: Path, seed: int, steps: int) -> list[str]:
    """gspo-train's Hydra overrides for the same work as the TRL run."""
    return [
        "model=tiny_moe",
        f"model.init_from={hf_dir}",
        "model.tokenizer=char",
        "algorithm.moe_aux_loss=aux_loss",
        f"algorithm.moe_aux_loss_coef={AUX_LOSS_COEF}",
        "data=jsonl",
        f"data.train_files=[{work / 'prompts.jsonl'}]",
        "data.apply_chat_template=false",
        "data.shuffle=false",
        "data.max_prompt_length=32",
        "reward=synthetic",
        "rollout=embedded",
        f"rollout.prompts_per_step={PROMPTS_PER_STEP}",
        f"rollout.group_size={GROUP_SIZE}",
        f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
        "rollout.temperature=1.0",
        "algorithm=gspo",
        f"algorithm.hparams.clip_low={CLIP_LOW}",
        f"algorithm.hparams.clip_high={CLIP_HIGH}",
        f"algorithm.num_minibatches={NUM_MINIBATCHES}",
        f"trainer.steps={steps}",
        f"optimizer.lr={LR}",
        "optimizer.weight_decay=0.0",
        "optimizer.clip_grad=1.0",
        "eval.every=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        f"seed={seed}",
    ]


def phase_ours(hf_dir: Path, work: Path, seed: int, steps: int, threads: int, tag: str) -> dict:
    """gspo-train's own code path (compose, resolve, build_trainer, train) in this process, so
    that each RL step's CPU time can be read as well as its wall time."""
    from gspo_megatron.components import build_trainer
    from gspo_megatron.config import compose, resolve
    from gspo_megatron.megatron import cpu_compat

    cpu_compat.apply()  # before megatron-core is imported
    from gspo_megatron.megatron import parallel
    from gspo_megatron.run_files import check_run_directory
    from gspo_megatron.train import quiet_libraries

    _set_threads(threads)
    quiet_libraries()
    run_dir = work / f"ours_run{tag}"
    run_cfg, model, layout = resolve(compose(our_overrides(hf_dir, work, seed, steps)), 1)
    check_run_directory(run_dir, run_cfg)
    trainer = build_trainer(run_cfg, model, layout, run_dir)
    cpu_stamps: list[float] = []
    write = trainer.log.write

    def write_and_stamp(step, metrics):  # called once per RL step, right after it
        cpu_stamps.append(time.process_time())
        write(step, metrics)

    trainer.log.write = write_and_stamp
    started = time.perf_counter()
    cpu_stamps.append(time.process_time())
    try:
        trainer.train()
    finally:
        trainer.close()
        parallel.destroy()
    wall = time.perf_counter() - started
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "step_s": [r["time/step"] for r in records],
        "step_cpu_s": [b - a for a, b in zip(cpu_stamps, cpu_stamps[1:], strict=False)],
        "reward": [r["reward/mean"] for r in records],
        "wall_s": wall,
    }


def phase_trl(hf_dir: Path, work: Path, seed: int, steps: int, threads: int, tag: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    from gspo_megatron.data.tokenizer import build_char_tokenizer

    _set_threads(threads)
    tok = build_char_tokenizer()
    records = [json.loads(x) for x in (work / "prompts.jsonl").read_text().splitlines()]
    stamps: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            stamps.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, args, state, control, **kwargs):
            stamps.append((time.perf_counter(), time.process_time()))

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=trl_reward(tok),
        args=trl_config(work / f"trl_run{tag}", seed, steps),
        train_dataset=Dataset.from_list(records),
        processing_class=tok,
        callbacks=[Clock()],
    )
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    ends = range(NUM_MINIBATCHES, len(stamps), NUM_MINIBATCHES)  # one RL step = 4 optimizer steps
    step_s = [stamps[k][0] - stamps[k - NUM_MINIBATCHES][0] for k in ends]
    step_cpu_s = [stamps[k][1] - stamps[k - NUM_MINIBATCHES][1] for k in ends]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"step_s": step_s, "step_cpu_s": step_cpu_s, "reward": rewards, "wall_s": wall}


# -- driver ---------------------------------------------------------------------------------------


def worker(args) -> int:
    work = Path(args.work)
    if args.worker == "loss":
        result = phase_loss(work / "hf_init", work, args.seed, args.threads)
    else:
        phase = phase_trl if args.worker == "trl" else phase_ours
        result = phase(work / "hf_init", work, args.seed, args.steps, args.threads, args.tag)
    (work / f"{args.worker}{args.tag}.json").write_text(json.dumps(result, indent=2))
    return 0


def spawn(name: str, work: Path, args, tag: str = "") -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        name,
        "--work",
        str(work),
        f"--seed={args.seed}",
        f"--steps={args.steps}",
        f"--threads={args.threads}",
        f"--tag={tag}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} worker failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads((work / f"{name}{tag}.json").read_text())


def summarize(runs: list[dict]) -> dict:
    """Step times of every repeat (each without its first, warm-up step); rewards of the first."""

    def pooled(key: str) -> list[float]:
        return [t for run in runs for t in (run[key][1:] or run[key])]

    first = runs[0]
    return {
        "median_step_s": statistics.median(pooled("step_s")),
        "mean_step_s": statistics.fmean(pooled("step_s")),
        "median_step_cpu_s": statistics.median(pooled("step_cpu_s")),
        "median_step_s_per_repeat": [
            statistics.median(r["step_s"][1:] or r["step_s"]) for r in runs
        ],
        "median_step_cpu_s_per_repeat": [
            statistics.median(r["step_cpu_s"][1:] or r["step_cpu_s"]) for r in runs
        ],
        "reward_last5": statistics.fmean(first["reward"][-5:]),
        "reward_first": first["reward"][0],
        "reward_curve": first["reward"],
        "steps": len(first["reward"]),
        "repeats": len(runs),
        "wall_s": [r["wall_s"] for r in runs],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25, help="RL steps per side")
    parser.add_argument("--repeats", type=int, default=2, help="training runs per side, alternated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on each side")
    parser.add_argument("--out", type=Path, default=None, help="keep the work files here")
    parser.add_argument("--skip-training", action="store_true", help="only the loss check")
    parser.add_argument("--figure", type=Path, default=None, help="PNG of both reward curves")
    parser.add_argument("--worker", choices=["loss", "trl", "ours"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    try:
        import trl  # noqa: F401
    except ImportError:
        print("bench_vs_trl: TRL is not installed (pip install trl; see docs/REPRODUCTION.md)")
        return 2

    with tempfile.TemporaryDirectory() as tmp:
        work = (args.out or Path(tmp)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        make_hf_model(work / "hf_init", args.seed)
        write_prompts(work / "prompts.jsonl", PROMPTS_PER_STEP * max(args.steps, 1), args.seed)
        loss = spawn("loss", work, args)
        ours = trl_run = None
        if not args.skip_training:
            trl_runs, our_runs = [], []
            for k in range(args.repeats):  # alternate, so that load changes hit both sides
                trl_runs.append(spawn("trl", work, args, tag=f"_{k}"))
                our_runs.append(spawn("ours", work, args, tag=f"_{k}"))
            trl_run, ours = summarize(trl_runs), summarize(our_runs)
        report = {
            "loss": loss,
            "ours": ours,
            "trl": trl_run,
            "args": {k: str(v) for k, v in vars(args).items()},
            "versions": _versions(),
        }
        (work / "bench_vs_trl.json").write_text(json.dumps(report, indent=2))
        print_report(report)
        if args.figure and ours is not None:
            plot_rewards(ours, trl_run, args.figure)
            print(f"figure: {args.figure}")
    return 0


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("torch", "transformers", "trl", "megatron-core", "accelerate")}


def plot_rewards(ours: dict, trl_run: dict, path: Path, window: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for name, run, color in (("gspo-megatron", ours, "tab:blue"), ("TRL", trl_run, "tab:red")):
        values = run["reward_curve"]
        smooth = [
            statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))
        ]
        ax.plot(range(1, len(values) + 1), smooth, color=color, label=name)
    ax.set_title(f"GSPO, same weights/prompts/settings: training reward ({window}-step mean)")
    ax.set_xlabel("RL step (128 samples, 4 optimizer steps)")
    ax.set_ylabel("reward/mean")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_report(report: dict) -> None:
    loss, batch = report["loss"]["losses"], report["loss"]["batch"]
    reference = loss["paper formula (float64, HF log-probs)"]
    print(
        f"\nGSPO loss of one identical batch ({batch['sequences']} sequences, {batch['tokens']} "
        f"tokens, lengths {batch['lengths']}, sequence ratios {batch['ratio_min']:.6f}.."
        f"{batch['ratio_max']:.6f}, {batch['seq_clip_fraction']:.0%} of sequences clipped)"
    )
    print(f"{'computed by':<72} {'loss':>14} {'- paper':>10}")
    for name, value in loss.items():
        print(f"{name:<72} {value:>14.9f} {value - reference:>10.1e}")
    print(
        f"gradient w.r.t. the HF parameters, TRL (grpo) vs ours: relative difference "
        f"{batch['grad_rel_diff_trl_grpo_vs_ours']:.1e} (|grad| {batch['grad_norm_ours']:.3e})"
    )
    ours, trl_run = report["ours"], report["trl"]
    if ours is None:
        return
    print(
        f"\nTraining, {ours['steps']} RL steps each, {ours['repeats']} alternated runs per side "
        "(128 samples and 4 optimizer steps per RL step; first step of each run left out)"
    )
    print(
        f"{'':<16} {'wall s/step':>12} {'CPU s/step':>11} {'wall per run':>22} "
        f"{'reward step 1':>14} {'reward last 5':>14}"
    )
    for name, r in (("gspo-megatron", ours), ("TRL", trl_run)):
        runs = ", ".join(f"{t:.3f}" for t in r["median_step_s_per_repeat"])
        print(
            f"{name:<16} {r['median_step_s']:>12.3f} {r['median_step_cpu_s']:>11.3f} "
            f"{runs:>22} {r['reward_first']:>14.3f} {r['reward_last5']:>14.3f}"
        )
    wall = trl_run["median_step_s"] / ours["median_step_s"]
    cpu = trl_run["median_step_cpu_s"] / ours["median_step_cpu_s"]
    print(
        f"speed-up of gspo-megatron over TRL per RL step (medians): wall {wall:.2f}x, "
        f"CPU time {cpu:.2f}x  (goal >= 1.5x; CPU time is the steadier figure on a shared machine)"
    )


if __name__ == "__main__":
    sys.exit(main())
