"""Policy losses against float64 loop references, properties from the papers, and the
normalization contract (micro-batches, duplicated batches, simulated context parallelism)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from gspo_megatron.algorithms import (
    POLICY_LOSSES,
    denominator_count,
    get_policy_loss,
    policy_loss,
    policy_loss_terms,
    sapo_gate,
    sum_loss_terms,
)
from gspo_megatron.algorithms.metrics import finalize_metrics

F64 = torch.float64
LMAX = 16  # dr_grpo's max_response_length in these tests
ALL_LOSSES = sorted(POLICY_LOSSES)
SEQ_LEVEL = {"gspo", "gmpo"}
TOKEN_ADV_LOSSES = [n for n in ALL_LOSSES if n not in SEQ_LEVEL]


def base_hparams(name: str) -> dict:
    return {"max_response_length": LMAX} if name == "dr_grpo" else {}


# ---------------------------------------------------------------------------------------------
# Random variable-length batches


def make_batch(seed: int, *, B: int = 8, T: int = 12, token_adv: bool = False, noise: float = 0.3):
    """logprobs (leaf), old logprobs, advantages, mask with an all-masked row (2), a full row (0),
    holes inside responses (multi-turn), and log-ratios of mixed size (some beyond every clip)."""
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=F64) * 3.0).requires_grad_()
    scale = noise * (1.0 + 2.0 * (torch.rand(B, 1, generator=g, dtype=F64) > 0.7))
    old = logp.detach() + scale * torch.randn(B, T, generator=g, dtype=F64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    mask &= torch.rand(B, T, generator=g) > 0.15
    mask[0] = True
    mask[2] = False
    if token_adv:
        adv = torch.randn(B, T, generator=g, dtype=F64)
    else:
        adv = torch.randn(B, generator=g, dtype=F64)
        adv[3] = 0.0
    return logp, old, adv, mask


# ---------------------------------------------------------------------------------------------
# Float64 references: loops over sequences and tokens, textbook formulas, no library code


def ref_kl(lp, r, estimator):
    log_r = r - lp  # log(pi_ref / pi)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.exp(log_r) - 1 - log_r
    raise AssertionError(estimator)


def reference_loss(
    name, lp, o, A, m, hp, *, ref=None, kl_coef=0.0, kl_est="k3", is_w=None, ent=None, ent_coef=0.0
):
    """Returns (loss, number of clipped response tokens, number of clipped sequences). The KL
    penalty and the entropy bonus are per-token regularisers, summed into `kl_sum`."""
    defaults = dict(POLICY_LOSSES[name].defaults) | hp
    lo, hi = defaults.get("clip_low"), defaults.get("clip_high")
    B, T = lp.shape
    rows = [[t for t in range(T) if m[i, t]] for i in range(B)]
    n_seq = sum(1 for r in rows if r)
    n_tok = sum(len(r) for r in rows)

    def adv(i, t):
        return A[i] if A.dim() == 1 else A[i, t]

    def weight(i, t):
        if is_w is None:
            return 1.0
        return is_w[i] if is_w.dim() == 1 else is_w[i, t]

    total = torch.zeros((), dtype=F64)
    clipped_tokens = clipped_seqs = 0
    for i, toks in enumerate(rows):
        if not toks:
            continue
        n = len(toks)
        kl_sum = torch.zeros((), dtype=F64)
        if kl_coef:
            kl_sum = sum((ref_kl(lp[i, t], ref[i, t], kl_est) for t in toks), kl_sum)
        if ent_coef:  # folded into kl_sum, which every branch multiplies by kl_coef
            kl_sum = kl_sum - ent_coef / kl_coef * sum(ent[i, t] for t in toks)
        seq_clipped = False
        if name == "gspo":
            s = torch.exp(sum(lp[i, t] - o[i, t] for t in toks) / n)
            unclipped = s * A[i]
            obj = min(unclipped, torch.clamp(s, 1 - lo, 1 + hi) * A[i])
            total = total - obj * weight(i, 0) + kl_coef * kl_sum / n
            if obj.item() != unclipped.item():
                seq_clipped, clipped_tokens = True, clipped_tokens + n
        elif name == "gmpo":
            a = A[i]
            if a.item() != 0.0:
                prod = torch.ones((), dtype=F64)
                for t in toks:
                    rho = torch.exp(lp[i, t] - o[i, t])
                    unclipped = rho * a
                    v = min(unclipped, torch.clamp(rho, math.exp(-lo), math.exp(hi)) * a)
                    prod = prod * torch.abs(v)
                    if v.item() != unclipped.item():
                        seq_clipped, clipped_tokens = True, clipped_tokens + 1
                total = total - prod ** (1.0 / n) * torch.sign(a) * weight(i, 0)
            total = total + kl_coef * kl_sum / n
        else:
            seq_total = torch.zeros((), dtype=F64)
            s = torch.exp(sum(lp[i, t] - o[i, t] for t in toks) / n).detach()
            for t in toks:
                a = adv(i, t)
                if name == "gspo_token":
                    ratio = s * torch.exp(lp[i, t] - lp[i, t].detach())
                else:
                    ratio = torch.exp(lp[i, t] - o[i, t])
                if name == "sapo":
                    tau = defaults["tau_pos"] if a > 0 else defaults["tau_neg"]
                    term = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a
                elif name == "cispo":
                    term = -torch.clamp(ratio, max=1 + hi).detach() * a * lp[i, t]
                    clipped_tokens += int(ratio.item() > 1 + hi)
                else:
                    unclipped = ratio * a
                    obj = min(unclipped, torch.clamp(ratio, 1 - lo, 1 + hi) * a)
                    c = defaults.get("clip_c")
                    if c is not None and a < 0:
                        obj = max(obj, c * a)
                    term = -obj
                    if obj.item() != unclipped.item():
                        seq_clipped, clipped_tokens = True, clipped_tokens + 1
                seq_total = seq_total + term * weight(i, t)
            if name in ("grpo", "gspo_token", "sapo"):
                total = total + seq_total / n + kl_coef * kl_sum / n
            elif name == "dr_grpo":
                total = total + (seq_total + kl_coef * kl_sum) / defaults["max_response_length"]
            else:  # ppo, dapo, cispo: token sums
                total = total + seq_total + kl_coef * kl_sum
        clipped_seqs += int(seq_clipped)
    denominator = n_tok if name in ("ppo", "dapo", "cispo") else n_seq
    return total / max(denominator, 1), clipped_tokens, clipped_seqs


# ---------------------------------------------------------------------------------------------
# Value, gradient and clip decisions against the references


CASES = []
for _name in ALL_LOSSES:
    CASES.append((_name, {}, False))
    if _name not in SEQ_LEVEL:
        CASES.append((_name, {}, True))
CASES += [
    ("gspo", {"clip_low": 0.05, "clip_high": 0.08}, False),
    ("gspo_token", {"clip_low": 0.05, "clip_high": 0.08}, False),
    ("gmpo", {"clip_low": 0.1, "clip_high": 0.15}, False),
    ("grpo", {"clip_c": 1.3}, False),
    ("ppo", {"clip_c": 3.0}, True),
    ("dapo", {"clip_c": 1.3}, True),
    ("dr_grpo", {"clip_c": 1.3, "clip_low": 0.1}, False),
    ("sapo", {"tau_pos": 0.5, "tau_neg": 2.0}, True),
    ("cispo", {"clip_high": 0.1}, True),
]


@pytest.mark.parametrize(("name", "hp", "token_adv"), CASES)
def test_loss_value_gradient_and_clipping_match_reference(name, hp, token_adv):
    hp = base_hparams(name) | hp
    for seed in (0, 1):
        lp, o, A, m = make_batch(seed, token_adv=token_adv)
        loss, metrics = policy_loss(name, lp, o, A, m, **hp)
        (grad,) = torch.autograd.grad(loss, lp)
        ref, ref_clip_tok, ref_clip_seq = reference_loss(name, lp, o, A, m, hp)
        (ref_grad,) = torch.autograd.grad(ref, lp)
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)
        assert metrics["clip_fraction"] == pytest.approx(ref_clip_tok / m.sum().item(), abs=1e-15)
        if name in ("gspo", "gspo_token", "gmpo"):
            n_seq = m.any(-1).sum().item()
            assert metrics["seq_clip_fraction"] == pytest.approx(ref_clip_seq / n_seq, abs=1e-15)
        assert grad[~m].abs().max() == 0  # padding gets no gradient


def test_references_see_both_clip_branches():
    """The batches exercise clipped and unclipped terms, or the comparisons above prove little."""
    for name, hp, token_adv in CASES:
        if name == "sapo" or (name == "cispo" and not hp):  # no hard clip; r > 5 is rare here
            continue
        hp = base_hparams(name) | hp
        fractions = [
            policy_loss(name, *make_batch(s, token_adv=token_adv), **hp)[1]["clip_fraction"]
            for s in (0, 1)
        ]
        assert max(fractions) > 0.0 and min(fractions) < 1.0, (name, hp, fractions)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("name", ALL_LOSSES)
def test_kl_term_entropy_bonus_and_is_weights_match_reference(name, estimator):
    hp = base_hparams(name)
    lp, o, A, m = make_batch(3)
    g = torch.Generator().manual_seed(7)
    ref_logp = lp.detach() + 0.2 * torch.randn(lp.shape, generator=g, dtype=F64)
    shape = A.shape if name in SEQ_LEVEL else lp.shape
    is_w = torch.rand(shape, generator=g, dtype=F64) * 2
    entropy = (torch.rand(lp.shape, generator=g, dtype=F64) * 3).requires_grad_(True)
    kw = {"ref_logprobs": ref_logp, "kl_coef": 0.3, "kl_estimator": estimator, "is_weights": is_w}
    kw |= {"entropy": entropy, "entropy_coef": 0.07}
    loss, metrics = policy_loss(name, lp, o, A, m, **kw, **hp)
    grads = torch.autograd.grad(loss, (lp, entropy))
    ref, _, _ = reference_loss(
        name, lp, o, A, m, hp, ref=ref_logp, kl_coef=0.3, kl_est=estimator, is_w=is_w,
        ent=entropy, ent_coef=0.07,
    )  # fmt: skip
    ref_grads = torch.autograd.grad(ref, (lp, entropy))
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-14)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)
    assert grads[1][~m].abs().max() == 0 and grads[1][m].abs().min() > 0
    expected_kl = (
        sum(ref_kl(lp[i, t], ref_logp[i, t], estimator).item() for i, t in m.nonzero().tolist())
        / m.sum().item()
    )
    assert metrics["kl_ref"] == pytest.approx(expected_kl, rel=1e-12)


def test_metrics_match_loops():
    lp, o, A, m = make_batch(4, token_adv=True)
    _, metrics = policy_loss("grpo", lp, o, A, m)
    ratios = [math.exp(lp[i, t].item() - o[i, t].item()) for i, t in m.nonzero().tolist()]
    advs = [A[i, t].item() for i, t in m.nonzero().tolist()]
    kls = [r - 1 - math.log(r) for r in ratios]
    assert metrics["ratio_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-12)
    assert metrics["ratio_max"] == pytest.approx(max(ratios), rel=1e-12)
    assert metrics["ratio_min"] == pytest.approx(min(ratios), rel=1e-12)
    assert metrics["approx_kl"] == pytest.approx(sum(kls) / len(kls), rel=1e-9)
    assert metrics["advantage_mean"] == pytest.approx(sum(advs) / len(advs), rel=1e-12)
    assert (metrics["advantage_min"], metrics["advantage_max"]) == (min(advs), max(advs))
    assert (metrics["num_tokens"], metrics["num_sequences"]) == (m.sum().item(), 7.0)

    lp, o, A, m = make_batch(4)
    _, metrics = policy_loss("gspo", lp, o, A, m)
    rows = [i for i in range(lp.shape[0]) if m[i].any()]
    seq_ratios = [math.exp((lp[i] - o[i])[m[i]].mean().item()) for i in rows]
    assert metrics["ratio_mean"] == pytest.approx(sum(seq_ratios) / len(rows), rel=1e-12)
    assert metrics["ratio_max"] == pytest.approx(max(seq_ratios), rel=1e-12)
    assert metrics["ratio_min"] == pytest.approx(min(seq_ratios), rel=1e-12)
    assert metrics["advantage_mean"] == pytest.approx(
        sum(A[i].item() for i in rows) / len(rows), rel=1e-12
    )


# ---------------------------------------------------------------------------------------------
# Properties


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_on_policy_gradient_is_the_policy_gradient(name):
    """At theta = theta_old every loss's gradient is its aggregation of -A·grad(lp)."""
    token_adv = name not in SEQ_LEVEL
    lp, _, A, m = make_batch(5, token_adv=token_adv)
    loss, _ = policy_loss(name, lp, lp.detach(), A, m, **base_hparams(name))
    (grad,) = torch.autograd.grad(loss, lp)
    A_bt = (A if token_adv else A[:, None].expand(lp.shape)) * m
    n_seq, n_tok = m.any(-1).sum(), m.sum()
    lengths = m.sum(-1, keepdim=True).clamp(min=1)
    expected = {
        "sequences_mean": -A_bt / lengths / n_seq,  # (1/N) Σ_i A_i mean_t grad l_it
        "tokens": -A_bt / n_tok,
        "constant": -A_bt / LMAX / n_seq,
    }
    kind = {"ppo": "tokens", "dapo": "tokens", "cispo": "tokens", "dr_grpo": "constant"}.get(
        name, "sequences_mean"
    )
    torch.testing.assert_close(grad, expected[kind], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("hp", [{}, {"clip_low": 0.05, "clip_high": 0.08}])
@pytest.mark.parametrize("token_form", [False, True])
def test_gspo_equals_gspo_token_with_sequence_advantages(hp, token_form):
    for seed in range(3):
        lp, o, A, m = make_batch(seed)
        loss_seq, metrics_seq = policy_loss("gspo", lp, o, A, m, **hp)
        A_tok = A[:, None].expand(lp.shape).clone() if token_form else A
        loss_tok, metrics_tok = policy_loss("gspo_token", lp, o, A_tok, m, **hp)
        g_seq, g_tok = (torch.autograd.grad(x, lp)[0] for x in (loss_seq, loss_tok))
        torch.testing.assert_close(loss_seq, loss_tok, rtol=1e-14, atol=1e-16)
        torch.testing.assert_close(g_seq, g_tok, rtol=1e-12, atol=1e-16)
        assert metrics_seq.keys() == metrics_tok.keys()
        for key in ("clip_fraction", "seq_clip_fraction", "ratio_mean", "ratio_min", "ratio_max"):
            assert metrics_seq[key] == pytest.approx(metrics_tok[key], rel=1e-14), key


@pytest.mark.parametrize("tau", [0.3, 1.0, 1.05, 4.0])
def test_sapo_gate_has_slope_one_and_value_two_over_tau_at_ratio_one(tau):
    r = torch.ones((), dtype=F64, requires_grad=True)
    f = sapo_gate(r, tau)
    (slope,) = torch.autograd.grad(f, r)
    assert slope.item() == pytest.approx(1.0, abs=1e-14)
    assert f.item() == pytest.approx(2.0 / tau, abs=1e-14)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_duplicating_the_batch_changes_nothing(name):
    hp = base_hparams(name)
    lp, o, A, m = make_batch(6, token_adv=name not in SEQ_LEVEL)
    loss, metrics = policy_loss(name, lp, o, A, m, **hp)
    (grad,) = torch.autograd.grad(loss, lp)

    def twice(t):
        return torch.cat([t, t])

    loss2, metrics2 = policy_loss(name, twice(lp), twice(o), twice(A), twice(m), **hp)
    (grad2,) = torch.autograd.grad(loss2, lp)
    torch.testing.assert_close(loss2, loss, rtol=1e-13, atol=1e-16)
    torch.testing.assert_close(grad2, grad, rtol=1e-12, atol=1e-16)
    for key, value in metrics.items():
        expected = 2 * value if key.startswith("num_") else value
        assert metrics2[key] == pytest.approx(expected, rel=1e-12, abs=1e-15), key


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_micro_batches_sum_to_the_global_loss(name):
    hp = base_hparams(name)
    lp, o, A, m = make_batch(7, B=9, token_adv=name not in SEQ_LEVEL)
    loss, metrics = policy_loss(name, lp, o, A, m, **hp)
    (grad,) = torch.autograd.grad(loss, lp)
    parts = [
        policy_loss_terms(name, lp[rows], o[rows], A[rows], m[rows], **hp)
        for rows in (slice(0, 2), slice(2, 3), slice(3, 9))  # slice(2, 3): the all-masked row
    ]
    total = sum_loss_terms(parts)
    (grad_mb,) = torch.autograd.grad(total.loss(), lp)
    torch.testing.assert_close(total.loss(), loss, rtol=1e-13, atol=1e-16)
    torch.testing.assert_close(grad_mb, grad, rtol=1e-12, atol=1e-16)
    assert finalize_metrics(total.metric_sums) == pytest.approx(metrics, rel=1e-12, abs=1e-15)
    assert parts[1].denominator.item() == 0.0 and parts[1].loss_sum.item() == 0.0


def _simulated_cp(name, lp, o, A, m, hp, share_mode, token_kwargs=None):
    """Two fake context-parallel ranks in threads: each holds Megatron's load-balanced chunks
    (rank 0: 1st and 4th quarter of T, rank 1: the middle half); seq_sum is an all-reduce whose
    result depends, with autograd, on both ranks' partial sums. ``token_kwargs``: further [B, T]
    arguments, split like the log-probs."""
    B, T = lp.shape
    q = T // 4
    chunks = [
        torch.cat([torch.arange(0, q), torch.arange(3 * q, T)]),
        torch.arange(q, 3 * q),
    ]
    barrier = threading.Barrier(2, timeout=30)
    slots: list = [None, None]
    calls = [0, 0]
    results: list = [None, None]
    errors: list = []

    def all_reduce(rank):
        def seq_sum(x):
            calls[rank] += 1
            slots[rank] = x
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()  # both read before any later call overwrites a slot
            return total

        return seq_sum

    def rank_main(rank):
        try:
            ix = chunks[rank]
            if share_mode == "half":
                share = torch.full((B,), 0.5, dtype=F64)
            else:  # one rank owns every sequence
                share = torch.full((B,), 1.0 if rank == 0 else 0.0, dtype=F64)
            adv = A if A.dim() == 1 else A[:, ix]
            split = {k: v[:, ix] for k, v in (token_kwargs or {}).items()}
            results[rank] = policy_loss_terms(
                name, lp[:, ix], o[:, ix], adv, m[:, ix],
                seq_sum=all_reduce(rank), seq_share=share, **hp, **split,
            )  # fmt: skip
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert calls == [1, 1]
    return sum_loss_terms(results)


@pytest.mark.parametrize("share_mode", ["half", "owner"])
@pytest.mark.parametrize(
    ("name", "token_adv"),
    [(n, False) for n in ALL_LOSSES] + [(n, True) for n in TOKEN_ADV_LOSSES],
)
def test_context_parallel_split_equals_unsplit_batch(name, token_adv, share_mode):
    hp = base_hparams(name)
    lp, o, A, m = make_batch(8, B=10, T=16, token_adv=token_adv)
    m[5, 4:] = False  # a sequence held entirely by rank 0 ...
    m[6, :4] = False  # ... and one held entirely by rank 1
    m[6, 12:] = False
    # The KL term and [B] mismatch weights (the same on both ranks) under CP too.
    ref = lp.detach() + 0.1 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    # The entropy bonus's entropy is a function of the log-probs here, so its gradient is checked.
    kw = {"kl_coef": 0.2, "is_weights": torch.linspace(0.5, 1.5, lp.shape[0], dtype=F64)}
    kw["entropy_coef"] = 0.05
    token_kw = {"ref_logprobs": ref, "entropy": -lp.exp() * lp}
    loss, metrics = policy_loss(name, lp, o, A, m, **token_kw, **hp, **kw)
    (grad,) = torch.autograd.grad(loss, lp, retain_graph=True)  # the entropy's graph is shared
    total = _simulated_cp(name, lp, o, A, m, hp | kw, share_mode, token_kw)
    (grad_cp,) = torch.autograd.grad(total.loss(), lp)
    torch.testing.assert_close(total.loss(), loss, rtol=1e-13, atol=1e-16)
    torch.testing.assert_close(grad_cp, grad, rtol=1e-12, atol=1e-16)
    assert finalize_metrics(total.metric_sums) == pytest.approx(metrics, rel=1e-12, abs=1e-15)


# ---------------------------------------------------------------------------------------------
# Edge cases and bad input


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_all_masked_batch_gives_zero_loss_zero_grad(name):
    lp, o, A, m = make_batch(9)
    m[:] = False
    terms = policy_loss_terms(name, lp, o, A, m, **base_hparams(name))
    loss, metrics = policy_loss(name, lp, o, A, m, **base_hparams(name))
    (grad,) = torch.autograd.grad(loss, lp)
    assert terms.denominator.item() == 0.0 and loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
@pytest.mark.parametrize("name", ALL_LOSSES)
def test_extreme_log_ratios_give_finite_loss_and_gradient(name, dtype):
    lp, o, A, m = make_batch(10, token_adv=name not in SEQ_LEVEL)
    o = lp.detach().clone()
    o[:, ::2] += 50.0  # r = e^-50
    o[:, 1::2] -= 50.0  # r = e^+50
    o[4] += 50.0  # a whole sequence at log-ratio -50 (and GSPO's mean too)
    o[5] -= 60.0
    lp = lp.detach().to(dtype).requires_grad_()
    kw = {"ref_logprobs": (lp.detach() + 50.0).to(dtype), "kl_coef": 0.1}
    for clip_c in [None, 3.0] if name in ("ppo", "grpo", "dapo", "dr_grpo") else [None]:
        hp = base_hparams(name) | ({"clip_c": clip_c} if clip_c else {})
        loss, _ = policy_loss(name, lp, o.to(dtype), A.to(dtype), m, **hp, **kw)
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), (name, dtype, clip_c)
        assert grad.dtype == dtype


def test_padding_values_never_reach_loss_or_gradient():
    lp, o, A, m = make_batch(11, token_adv=True)
    dirty_o = torch.where(m, o, torch.tensor(float("-inf"), dtype=F64))
    dirty_A = torch.where(m, A, torch.tensor(float("inf"), dtype=F64))
    for name in TOKEN_ADV_LOSSES:
        hp = base_hparams(name)
        clean, _ = policy_loss(name, lp, o, A, m, **hp)
        dirty_l = torch.where(m, lp, torch.tensor(float("nan"), dtype=F64))
        dirty, _ = policy_loss(name, dirty_l, dirty_o, dirty_A, m, **hp)
        (g_clean,) = torch.autograd.grad(clean, lp)
        (g_dirty,) = torch.autograd.grad(dirty, lp)
        torch.testing.assert_close(dirty, clean)
        torch.testing.assert_close(g_dirty, g_clean)


def test_mask_as_0_1_floats_equals_bool_mask():
    lp, o, A, m = make_batch(12)
    for name in ALL_LOSSES:
        a, _ = policy_loss(name, lp, o, A, m, **base_hparams(name))
        b, _ = policy_loss(name, lp, o, A, m.double(), **base_hparams(name))
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_denominator_kinds_and_pre_forward_counts():
    kinds = {name: spec.denominator for name, spec in POLICY_LOSSES.items()}
    assert kinds == {
        "gspo": "sequences", "gspo_token": "sequences", "grpo": "sequences",
        "dr_grpo": "sequences", "sapo": "sequences", "gmpo": "sequences",
        "ppo": "tokens", "dapo": "tokens", "cispo": "tokens",
    }  # fmt: skip
    lp, o, A, m = make_batch(13)
    for name in ALL_LOSSES:
        terms = policy_loss_terms(name, lp, o, A, m, **base_hparams(name))
        assert terms.denominator.item() == denominator_count(name, m).item()
    assert get_policy_loss("dr_grpo").advantage_estimator == "group_mean"
    assert get_policy_loss("gspo").advantage_estimator == "group_mean_std"


def _bad_inputs():
    lp, o, A, m = make_batch(14)
    A_bt = A[:, None].expand(lp.shape).clone()
    nan_l = lp.detach().clone()
    nan_l[0, 0] = float("nan")
    inf_o = o.clone()
    inf_o[1, 0] = float("inf")
    ok = (lp, o, A, m)
    return [
        ("name", ("trpo", *ok), {}),
        ("name", (None, *ok), {}),
        ("old_logprobs", ("grpo", lp, o[:, :-1], A, m), {}),
        ("response_mask", ("grpo", lp, o, A, m[:-1]), {}),
        ("advantages", ("grpo", lp, o, A[:-1], m), {}),
        ("advantages", ("gspo", lp, o, A_bt, m), {}),
        ("advantages", ("gmpo", lp, o, A_bt, m), {}),
        ("logprobs", ("grpo", lp[0], o[0], A, m[0]), {}),
        ("logprobs", ("grpo", lp.long(), o, A, m), {}),
        ("logprobs", ("grpo", nan_l, o, A, m), {}),
        ("old_logprobs", ("grpo", lp, inf_o, A, m), {}),
        ("advantages", ("grpo", lp, o, torch.full_like(A, float("nan")), m), {}),
        ("response_mask", ("grpo", lp, o, A, m.double() * 2), {}),
        ("clip_low", ("grpo", *ok), {"clip_low": -0.1}),
        ("clip_high", ("gspo", *ok), {"clip_high": -1e-4}),
        ("clip_low", ("gmpo", *ok), {"clip_low": -0.4}),
        ("clip_high", ("cispo", *ok), {"clip_high": -1.0}),
        ("clip_c", ("grpo", *ok), {"clip_c": 0.9}),
        ("clip_c", ("gspo", *ok), {"clip_c": 3.0}),  # not a GSPO hyperparameter
        ("tau_pos", ("sapo", *ok), {"tau_pos": 0.0}),
        ("tau_neg", ("sapo", *ok), {"tau_neg": -1.0}),
        ("max_response_length", ("dr_grpo", *ok), {}),
        ("max_response_length", ("dr_grpo", *ok), {"max_response_length": 0}),
        ("clip_low", ("grpo", *ok), {"clip_low": float("nan")}),
        ("clip_low", ("grpo", *ok), {"clip_low": "0.2"}),
        ("kl_coef", ("grpo", *ok), {"kl_coef": -1.0}),
        ("ref_logprobs", ("grpo", *ok), {"kl_coef": 0.1}),
        ("ref_logprobs", ("grpo", *ok), {"kl_coef": 0.1, "ref_logprobs": o[:, :3]}),
        ("kl_estimator", ("grpo", *ok), {"kl_estimator": "k4"}),
        ("entropy_coef", ("grpo", *ok), {"entropy_coef": -0.1, "entropy": o}),
        ("entropy", ("grpo", *ok), {"entropy_coef": 0.1}),
        ("entropy", ("grpo", *ok), {"entropy_coef": 0.1, "entropy": o[:, :3]}),
        ("entropy", ("grpo", *ok), {"entropy_coef": 0.1, "entropy": inf_o}),
        ("is_weights", ("gspo", *ok), {"is_weights": torch.ones_like(o)}),
        ("is_weights", ("grpo", *ok), {"is_weights": -torch.ones_like(A)}),
        ("seq_share", ("grpo", *ok), {"seq_share": torch.ones(3)}),
    ]


@pytest.mark.parametrize(("argument", "args", "kwargs"), _bad_inputs())
def test_bad_input_raises_value_error_naming_the_argument(argument, args, kwargs):
    fn = policy_loss_terms if "seq_share" in kwargs else policy_loss
    with pytest.raises(ValueError, match=argument):
        fn(*args, **kwargs)


def test_seq_sum_must_keep_the_shape():
    lp, o, A, m = make_batch(15)
    with pytest.raises(ValueError, match="seq_sum"):
        policy_loss_terms("gspo", lp, o, A, m, seq_sum=lambda x: x.sum(0))
    with pytest.raises(ValueError, match="seq_sum"):
        policy_loss("gspo", lp, o, A, m, seq_sum=lambda x: x)


# ---------------------------------------------------------------------------------------------
# Train/rollout mismatch corrections composed with every loss (the config's option matrix)


def loop_mismatch_weights(rollout, old, m, mode, level, cap=1.15, lower=0.8, upper=1.25):
    """Float64 loops: [B, T] token weights or [B] sequence weights."""
    B, T = m.shape
    rows = [[t for t in range(T) if m[i, t]] for i in range(B)]

    def correct(w):
        return min(w, cap) if mode == "tis" else (w if lower <= w <= upper else 0.0)

    if level == "token":
        return torch.tensor(
            [[correct(math.exp(old[i, t] - rollout[i, t])) if m[i, t] else 0.0 for t in range(T)]
             for i in range(B)],
            dtype=F64,
        )  # fmt: skip
    out = []
    for i, toks in enumerate(rows):
        log_w = sum((old[i, t] - rollout[i, t]).item() for t in toks)
        if level == "geometric" and toks:
            log_w /= len(toks)
        out.append(correct(math.exp(log_w)) if toks else 1.0)
    return torch.tensor(out, dtype=F64)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
@pytest.mark.parametrize("name", ALL_LOSSES)
def test_mismatch_option_matrix_matches_reference(name, mode, level):
    """Every loss x {tis, mis} x {token, sequence, geometric}: either refused with a reason
    (token-level weights for a sequence-ratio loss), or the weights correct_mismatch computes,
    fed to the loss, give the float64 reference's weighted loss and gradient."""
    from gspo_megatron.algorithms import correct_mismatch, mismatch_support

    problem = mismatch_support(name, mode, level)
    if name in SEQ_LEVEL and level == "token":
        assert problem and "one importance weight per sequence" in problem
        return
    assert problem is None
    hp = base_hparams(name)
    lp, old, A, m = make_batch(5)
    g = torch.Generator().manual_seed(11)
    rollout = old + 0.05 * torch.randn(old.shape, generator=g, dtype=F64)
    kw = {"cap": 1.15, "lower": 0.8, "upper": 1.25}
    correction = correct_mismatch(rollout, m, old_logprobs=old, mode=mode, level=level, **kw)
    expected_w = loop_mismatch_weights(rollout, old, m, mode, level)
    torch.testing.assert_close(
        torch.where(m if level == "token" else m.any(-1), correction.is_weights, 0.0),
        torch.where(m if level == "token" else m.any(-1), expected_w, 0.0),
        rtol=1e-12, atol=1e-14,
    )  # fmt: skip
    loss, _ = policy_loss(name, lp, old, A, m, is_weights=correction.is_weights, **hp)
    (grad,) = torch.autograd.grad(loss, lp)
    ref, _, _ = reference_loss(name, lp, old, A, m, hp, is_w=expected_w)
    (ref_grad,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)
