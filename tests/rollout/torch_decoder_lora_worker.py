"""Run alone: the embedded engine's lean torch decoder serving a LoRA policy (one process).

    python tests/rollout/torch_decoder_lora_worker.py --model tiny_moe

Every check prints one JSON line {"check", "value", "tol", "ok"}. The reference is megatron's own
forward with the adapter layers (`MegatronDecoder`, `TrainingEngine.forward`); the torch decoder
merges each adapter into its weight at every batch (rollout/embedded/decoders.py).
"""

from __future__ import annotations

import argparse
import warnings

import torch

from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()  # before megatron-core is imported

from embedded_worker import flat, make_prompts, max_logprob_diff, recomputed_logprobs, report

from gspo_megatron.megatron import parallel
from gspo_megatron.megatron.lora import adapters_off
from gspo_megatron.megatron.training_engine import TrainingEngine
from gspo_megatron.rollout.base import SamplingParams
from gspo_megatron.rollout.embedded.decoders import (
    MegatronDecoder,
    check_against,
    decoder_spec,
    megatron_decoder_weights,
    megatron_torch_decoder,
)
from gspo_megatron.rollout.embedded.in_process import EmbeddedEngine
from gspo_megatron.rollout.embedded.torch_decoder import TorchDecoder
from gspo_megatron.spec.layout import ParallelLayout
from gspo_megatron.spec.lora import LoRASettings
from gspo_megatron.spec.loss import LossSettings
from gspo_megatron.spec.model_config import load_preset
from gspo_megatron.spec.sample import TrainSample
from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

TOL = 1e-5  # float32
MAX_LEN = 40


def decoders(policy):
    """(the torch decoder over the policy, the same with the adapters off, megatron's)."""
    model, config = policy.unwrapped_chunks[0], policy.config
    vocab = policy.model_config.vocab_size
    spec = decoder_spec(model, config, vocab)

    def base_weights():
        with adapters_off(policy.unwrapped_chunks):
            return megatron_decoder_weights(model, spec)

    fast = megatron_torch_decoder(model, config, vocab)
    return fast, TorchDecoder(spec, base_weights), MegatronDecoder(model, vocab)


def compare(policy, tag: str) -> None:
    """The torch decoder equals megatron's forward with the adapters; with them off it does not
    (the adapters are far from zero, so leaving one out would fail the first check)."""
    fast, base, reference = decoders(policy)
    vocab = policy.model_config.vocab_size
    with policy.generation_mode(record_routes=False):
        report(f"{tag}torch_vs_megatron", check_against(fast, reference, vocab), TOL)
        gap = check_against(base, reference, vocab)
    report(f"{tag}adapters_change_logprobs", gap, ok=gap > 100 * TOL)


def perturb(policy, scale: float) -> None:
    """Every trained parameter moved: adapters (B off zero) and the whole weights beside them."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in policy.unwrapped_chunks[0].parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)


def train_steps(policy, engine, steps: int) -> None:
    """A few Adam steps on the engine's own samples (rewards: even tokens good), the engine
    updated after each."""
    prompts = make_prompts(6, seed=8, vocab=policy.model_config.vocab_size)
    for step in range(steps):
        samples = flat(engine.generate(prompts, 4, SamplingParams(max_new_tokens=8, seed=step)))
        rewards = [sum(t % 2 == 0 for t in s.response_ids) / 8 for s in samples]
        mean = sum(rewards) / len(rewards)
        train = [
            TrainSample(s.prompt_ids, s.response_ids, advantage=r - mean, old_logprobs=s.logprobs)
            for s, r in zip(samples, rewards, strict=True)
        ]
        policy.train_step(train, LossSettings("grpo"))
        engine.update_weights(None, step + 1)


def check_engine(policy, tag: str) -> None:
    """The engine picks the torch decoder for the LoRA policy, and its sampled log-probs equal
    the trainer's recompute with the adapters, before and after a few training steps."""
    engine = EmbeddedEngine(policy, backend="auto")
    report(f"{tag}auto_picks_torch", engine.decoder.name, ok=engine.decoder.name == "torch")
    prompts = make_prompts(5, seed=17, vocab=policy.model_config.vocab_size)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=5)
    samples = flat(engine.generate(prompts, 3, params))
    ref = recomputed_logprobs(policy, samples).logprobs
    report(f"{tag}sampled_logprob_vs_trainer", max_logprob_diff(samples, ref), TOL)
    before = {n: p.detach().clone() for n, p in policy.unwrapped_chunks[0].named_parameters()}
    train_steps(policy, engine, 3)
    moved = {
        n: float((p - before[n]).abs().max())
        for n, p in policy.unwrapped_chunks[0].named_parameters()
    }
    adapters = min(v for n, v in moved.items() if n.endswith(("lora_a", "lora_b")))
    report(f"{tag}trained_adapters_moved", adapters, ok=adapters > 0)
    samples = flat(engine.generate(prompts, 3, params))
    ref = recomputed_logprobs(policy, samples).logprobs
    report(f"{tag}trained_sampled_logprob_vs_trainer", max_logprob_diff(samples, ref), TOL)
    engine.close()
    compare(policy, f"{tag}trained_")


def main() -> int:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny_moe")
    args = parser.parse_args()
    layout = ParallelLayout(world_size=1)
    parallel.initialize(layout, seed=1234)
    parallel.seed_everything(1234)
    model = load_preset(args.model)
    # whole weights trained beside the adapters; a tied output layer cannot be one (refused)
    saved = ["final_norm"] if model.tie_word_embeddings else ["output_layer", "final_norm"]
    policy = TrainingEngine(
        model,
        layout,
        EngineSettings(max_sequence_length=MAX_LEN),
        OptimizerSettings(lr=3e-2),
        lora=LoRASettings(rank=8, modules_to_save=saved),
    )
    tag = f"{args.model}_"
    fresh, _, reference = decoders(policy)
    with policy.generation_mode(record_routes=False):
        diff = check_against(fresh, reference, policy.model_config.vocab_size)
    report(f"{tag}fresh_torch_vs_megatron", diff, TOL)
    perturb(policy, scale=0.05)
    compare(policy, tag)
    check_engine(policy, tag)
    policy.close()
    parallel.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
