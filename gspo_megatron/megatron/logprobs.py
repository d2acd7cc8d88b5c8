"""Per-token log-probs and entropy from vocabulary-parallel logits.

Each tensor-parallel rank holds logits for a slice of the vocabulary. The log-softmax needs the
global max and sum of exponentials, so they are all-reduced over TP; the vocabulary is never
gathered. Work is done in float32 (whatever the logits' dtype) over chunks of tokens, so the
float32 temporaries stay a small, bounded fraction of the logits; the backward pass recomputes
the softmax per chunk from the saved log-normaliser. megatron's vocab_parallel_cross_entropy is
not used: it materialises float32 logits, has no entropy, and its label-smoothing path is wrong
under TP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gspo_megatron.spec.training import DEFAULT_LOGPROB_CHUNK_BYTES


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,  # [N, V_local]
        targets: torch.Tensor,  # [N]
        vocab_start: int,
        valid_local: int,
        group,
        chunk_tokens: int,
        with_entropy: bool,
    ):
        n = logits.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse_all = torch.empty(n, dtype=torch.float32, device=logits.device)
        mean_z_all = torch.empty(n, dtype=torch.float32, device=logits.device)
        local_targets = targets - vocab_start
        in_shard = (local_targets >= 0) & (local_targets < valid_local)
        local_targets = torch.where(in_shard, local_targets, torch.zeros_like(local_targets))
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            z = logits[start:end, :valid_local].float()  # a view when already float32
            if valid_local:
                target_logit = z.gather(1, local_targets[start:end, None]).squeeze(1)
                target_logit = torch.where(in_shard[start:end], target_logit, 0.0)
            else:
                target_logit = torch.zeros(end - start, device=z.device)
            if group is None and not with_entropy:
                # One rank holds the whole vocabulary and only log-probs are wanted.
                lse = torch.logsumexp(z, dim=-1)
                logprobs[start:end] = target_logit - lse
            else:
                zmax = (
                    z.max(dim=-1).values
                    if valid_local
                    else torch.full((end - start,), -torch.inf, device=z.device)
                )  # a rank may hold only vocabulary padding
                if group is not None:
                    dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
                exp = (z - zmax[:, None]).exp_()
                parts = [exp.sum(-1), target_logit]
                if with_entropy:
                    parts.append(torch.linalg.vecdot(exp, z))
                sums = torch.stack(parts)
                if group is not None:
                    dist.all_reduce(sums, group=group)
                lse = zmax + torch.log(sums[0])
                logprobs[start:end] = sums[1] - lse
                if with_entropy:
                    mean_z = sums[2] / sums[0]
            lse_all[start:end] = lse
            if with_entropy:
                mean_z_all[start:end] = mean_z
                entropy[start:end] = lse - mean_z
        ctx.save_for_backward(logits, local_targets, in_shard, lse_all, mean_z_all)
        ctx.valid_local = valid_local
        ctx.chunk_tokens = chunk_tokens
        ctx.with_entropy = with_entropy
        ctx.mark_non_differentiable(lse_all)
        return logprobs, entropy if with_entropy else None

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, local_targets, in_shard, lse_all, mean_z_all = ctx.saved_tensors
        valid = ctx.valid_local
        grad_logits = torch.empty_like(logits)
        grad_logits[:, valid:] = 0
        n = logits.shape[0]
        if grad_logprobs is None:
            grad_logprobs = torch.zeros(n, dtype=torch.float32, device=logits.device)
        use_entropy = ctx.with_entropy and grad_entropy is not None
        in_place = logits.dtype == torch.float32
        for start in range(0, n, ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, n)
            z = logits[start:end, :valid]
            # d logprob_t / dz = onehot(t) - p;  d H / dz = -p * (z - E_p[z]). Both terms share
            # the factor -p: grad = -p * (g_lp + g_H * (z - E_p[z])) + onehot(t) * g_lp, built in
            # the output's float32 rows (or one float32 chunk buffer for lower-precision logits).
            target = grad_logits[start:end, :valid]
            p = torch.sub(z, lse_all[start:end, None], out=target if in_place else None).exp_()
            g_lp = grad_logprobs[start:end, None]
            if use_entropy:
                factor = z.float() - mean_z_all[start:end, None]
                factor.mul_(grad_entropy[start:end, None]).add_(g_lp)
                p.mul_(factor.neg_())
            else:
                p.mul_(-g_lp)
            rows = torch.nonzero(in_shard[start:end]).squeeze(1)
            p[rows, local_targets[start:end][rows]] += g_lp[rows, 0]
            if not in_place:
                target.copy_(p)
        return grad_logits, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    tp_group=None,
    with_entropy: bool = True,
    chunk_bytes: int = DEFAULT_LOGPROB_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `targets` and the entropy of the full distribution, per token, in float32.

    logits: [..., V_local], this TP rank's contiguous slice of the (padded) vocabulary.
    targets: [...] token ids in the global vocabulary. vocab_size: the real vocabulary size;
    rows of the padded vocabulary beyond it are left out of the softmax.
    """
    v_local = logits.shape[-1]
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    world = dist.get_world_size(tp_group) if tp_group is not None else 1
    group = tp_group if world > 1 else None
    vocab_start = rank * v_local
    valid_local = max(0, min(v_local, vocab_size - vocab_start))
    lead_shape = logits.shape[:-1]
    flat = logits.reshape(-1, v_local)
    chunk_tokens = max(1, chunk_bytes // (4 * max(v_local, 1)))
    logprobs, entropy = _VocabParallelLogProbs.apply(
        flat, targets.reshape(-1), vocab_start, valid_local, group, chunk_tokens, with_entropy
    )
    logprobs = logprobs.reshape(lead_shape)
    return logprobs, entropy.reshape(lead_shape) if entropy is not None else None
