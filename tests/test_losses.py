"""Tests for forge_core.losses.

Every loss is checked, value *and* gradient with respect to the policy logprobs, against a
deliberately plain reference written independently from the papers' formulas: explicit Python
loops over sequences and tokens, Python floats (float64), ``math`` only, and gradients derived
by hand (no autograd), so a wrong stop-gradient or a wrong clip branch in the vectorised code
shows up as a gradient mismatch.
"""

import dataclasses
import math

import pytest
import torch

from forge_core import losses as L
from forge_core.advantages import ADVANTAGE_ESTIMATORS, AdvantageConfig, compute_advantages, group_advantages
from forge_core.losses import (
    LOSS_CONFIGS,
    METRIC_KEYS,
    aggregate,
    compute_loss,
    kl_estimate,
    make_loss_config,
)

PG_LOSSES = [n for n in LOSS_CONFIGS if n != "sft"]  # the policy-gradient losses (sft: test_sft_loss below)

F64 = torch.float64


# ============================================================================================
# Plain reference (python floats, loops), written from the papers.
# ============================================================================================


def _clip(x, lo, hi):
    return min(max(x, lo), hi)


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def ref_agg_weights(mask, mode, horizon=None):
    """w[i] such that loss = sum_i sum_t mask * w[i] * l[i][t]."""
    B, T = len(mask), len(mask[0])
    n = [sum(1 for t in range(T) if mask[i][t]) for i in range(B)]
    if mode == "token_mean":
        total = sum(n)
        return [1.0 / total if total else 0.0 for _ in range(B)]
    if mode == "seq_mean":
        nonempty = sum(1 for i in range(B) if n[i] > 0)
        return [1.0 / (nonempty * n[i]) if n[i] > 0 else 0.0 for i in range(B)]
    if mode == "fixed_horizon":
        length = T if horizon is None else horizon
        return [1.0 / (B * length) for _ in range(B)]
    raise AssertionError(mode)


def ref_kl(x_lp, x_ref, est):
    """(value, d value / d lp) of Schulman's estimators of KL(pi || ref), x = lp - ref."""
    x = x_lp - x_ref
    if est == "k1":
        return x, 1.0
    if est == "k2":
        return 0.5 * x * x, x
    if est == "k3":  # r = ref/pi: (r - 1) - log r
        ratio = math.exp(x_ref - x_lp)
        return ratio - 1.0 - math.log(ratio) if ratio > 0 else math.inf, 1.0 - ratio
    raise AssertionError(est)


def ref_ppo_token(r, a, clip_low, clip_high, dual_clip):
    """Objective min(r a, clip(r) a), optionally max(., c a) for a < 0, and d obj / d log r.

    Returns (obj, dobj_dlogr, which) with which in {None, "low", "high", "dual"}.
    """
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    unclipped = r * a
    clipped = _clip(r, lo, hi) * a
    if clipped < unclipped:  # min takes the clipped branch
        obj = clipped
        inside = lo <= r <= hi
        d = r * a if inside else 0.0
        which = None if inside else ("high" if r > hi else "low")
    else:  # min takes the unclipped branch (a tie counts as unclipped: same value, r inside)
        obj, d, which = unclipped, r * a, None
    if dual_clip is not None and a < 0 and dual_clip * a > obj:
        obj, d, which = dual_clip * a, 0.0, "dual"
    return obj, d, which


def ref_loss(cfg, lp, old, adv, mask, ref=None):
    """Loss, gradient dloss/dlp [B][T] and metrics, from the formulas, in plain python."""
    B, T = len(lp), len(lp[0])
    per_seq_adv = not isinstance(adv[0], list)
    A = [[adv[i] if per_seq_adv else adv[i][t] for t in range(T)] for i in range(B)]
    w = ref_agg_weights(mask, cfg.aggregation, getattr(cfg, "horizon", None))
    n = [sum(1 for t in range(T) if mask[i][t]) for i in range(B)]
    loss = 0.0
    grad = [[0.0] * T for _ in range(B)]
    ratios, kls = [], []
    counts = {"low": 0, "high": 0, "dual": 0}
    sapo_weights = []
    # Train-inference mismatch rho = pi_trainer / pi_sampler of each sampled token; with a rollout
    # correction pi_old becomes the trainer's own log-probs and each token's policy term is weighted.
    rho = [[math.exp(lp[i][t] - old[i][t]) for t in range(T)] for i in range(B)]
    cap, corr = cfg.correction_cap, cfg.rollout_correction
    is_w = [[1.0 if corr == "none" else min(x, cap) if corr == "tis" else (x if x <= cap else 0.0) for x in row]
            for row in rho]
    gaps = [lp[i][t] - old[i][t] for i in range(B) for t in range(T) if mask[i][t]]
    if corr != "none":
        old = [row[:] for row in lp]

    for i in range(B):
        if cfg.name == "gspo" and n[i] > 0 and corr != "none":  # GSPO-token with per-token weights
            s = math.exp(sum(lp[i][t] - old[i][t] for t in range(T) if mask[i][t]) / n[i])
            for t in range(T):
                if mask[i][t]:
                    obj, d, which = ref_ppo_token(s, A[i][t], cfg.clip_low, cfg.clip_high, None)
                    loss += w[i] * is_w[i][t] * (-obj)
                    grad[i][t] += w[i] * is_w[i][t] * (-d)
                    ratios.append(s)
                    if which:
                        counts[which] += 1
        elif cfg.name == "gspo" and n[i] > 0:
            # s_i = (prod_t pi/pi_old)^(1/|y_i|) = exp(mean_t (lp - old))   (GSPO eq. 7)
            s = math.exp(sum(lp[i][t] - old[i][t] for t in range(T) if mask[i][t]) / n[i])
            lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
            if per_seq_adv:
                # Sequence-level objective (GSPO eq. 5): l_i = -min(s A, clip(s) A), counted on
                # each of the n_i tokens with weight w_i, i.e. total weight W_i = w_i n_i.
                # d l_i / d lp_it = -(d obj / d s) * s / n_i  (chain rule through the mean).
                a = adv[i]
                unclipped, clipped = s * a, _clip(s, lo, hi) * a
                if clipped < unclipped:
                    obj, dobj_ds = clipped, (a if lo <= s <= hi else 0.0)
                    which = None if lo <= s <= hi else ("high" if s > hi else "low")
                else:
                    obj, dobj_ds, which = unclipped, a, None
                big_w = w[i] * n[i]
                loss += big_w * (-obj)
                for t in range(T):
                    if mask[i][t]:
                        grad[i][t] += big_w * (-dobj_ds * s / n[i])
                        ratios.append(s)
                        if which:
                            counts[which] += 1
            else:
                # GSPO-token (sec. 4.3): s_it = sg(s_i) pi_t / sg(pi_t), d s_it / d lp_it = s_i.
                for t in range(T):
                    if mask[i][t]:
                        obj, d, which = ref_ppo_token(s, A[i][t], cfg.clip_low, cfg.clip_high, None)
                        loss += w[i] * (-obj)
                        grad[i][t] += w[i] * (-d)
                        ratios.append(s)
                        if which:
                            counts[which] += 1
        for t in range(T):
            if not mask[i][t]:
                continue
            a = A[i][t]
            r = math.exp(lp[i][t] - old[i][t])
            if cfg.name in ("grpo", "dr_grpo", "dapo"):
                obj, d, which = ref_ppo_token(r, a, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
                value, dvalue = -obj, -d  # d/d lp = d/d log r
                ratios.append(r)
                if which:
                    counts[which] += 1
            elif cfg.name == "gspo":
                value, dvalue = 0.0, 0.0  # handled per sequence above
            elif cfg.name == "cispo":
                lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
                weight = _clip(r, lo, hi)  # stop-gradient: a constant
                value, dvalue = -weight * a * lp[i][t], -weight * a
                ratios.append(r)
                counts["low"] += r < lo
                counts["high"] += r > hi
            elif cfg.name == "sapo":
                tau = cfg.tau_pos if a > 0 else cfg.tau_neg
                sg = _sigmoid(tau * (r - 1.0))
                value = -(4.0 / tau) * sg * a
                # d/d lp of sigmoid(tau (r - 1)): sg (1 - sg) tau r
                dvalue = -(4.0 / tau) * sg * (1.0 - sg) * tau * r * a
                ratios.append(r)
                sapo_weights.append(4.0 * sg * (1.0 - sg) * r)
            elif cfg.name == "reinforce":
                value, dvalue = -a * lp[i][t], -a
                ratios.append(r)
            else:
                raise AssertionError(cfg.name)
            value, dvalue = is_w[i][t] * value, is_w[i][t] * dvalue  # stop-gradient weight
            if ref is not None:
                k, dk = ref_kl(lp[i][t], ref[i][t], cfg.kl_estimator)
                kls.append(k)
                if cfg.beta > 0:
                    value += cfg.beta * k
                    dvalue += cfg.beta * dk
            loss += w[i] * value
            grad[i][t] += w[i] * dvalue

    n_tok = sum(n)
    metrics = {"masked_frac": 1.0 - n_tok / (B * T)}
    if n_tok:
        metrics.update(
            ratio_mean=sum(ratios) / n_tok,
            ratio_min=min(ratios),
            ratio_max=max(ratios),
            clip_frac_low=counts["low"] / n_tok,
            clip_frac_high=counts["high"] / n_tok,
            kl_mean=sum(kls) / n_tok if kls else 0.0,
            kl_max=max(kls) if kls else 0.0,
            mismatch_kl=sum(math.exp(g) - 1.0 - g for g in gaps) / n_tok,
            mismatch_max=max(abs(g) for g in gaps),
            is_ratio_mean=sum(math.exp(g) for g in gaps) / n_tok,
            is_ratio_max=max(math.exp(g) for g in gaps),
            is_corrected_frac=sum(math.exp(g) > cap for g in gaps) / n_tok,
        )
        if cfg.name in ("grpo", "dr_grpo", "dapo") and cfg.dual_clip is not None:
            metrics["clip_frac_dual"] = counts["dual"] / n_tok
        if cfg.name == "sapo":
            metrics["sapo_grad_weight_mean"] = sum(sapo_weights) / n_tok
    return loss, grad, metrics


# ============================================================================================
# Inputs
# ============================================================================================


def make_inputs(seed, B=6, T=9, token_adv=False):
    """Random float64 inputs with ragged masks, one fully masked row, a hole, big ratios."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=F64) * 4.0 - 0.01
    old = lp + 0.35 * torch.randn(B, T, generator=g, dtype=F64)
    old[4] = lp[4] + 1e-5 * torch.randn(T, generator=g, dtype=F64)  # near on-policy row
    old[0, 0] = lp[0, 0] - 1.6  # ratio ~5: beyond every clip and DAPO's dual clip
    old[5, 1] = lp[5, 1] - 1.3  # ratio ~3.7
    old[3, 0] = lp[3, 0] - math.log(1.24)  # between GRPO's 1.2 and DAPO's 1.28 (A[3] > 0)
    ref = lp + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        start = int(torch.randint(0, 3, (1,), generator=g))
        length = int(torch.randint(1, T - start + 1, (1,), generator=g))
        mask[i, start : start + length] = True
    mask[0, :] = True
    mask[0, 4] = False  # a hole inside a response (e.g. a tool-output token)
    mask[2, :] = False  # fully masked row
    mask[4, 1:7] = True
    mask[5, :3] = True
    mask[3, :2] = True
    if token_adv:
        adv = torch.randn(B, T, generator=g, dtype=F64)
        adv[1, :] = 0.0
    else:
        adv = torch.randn(B, generator=g, dtype=F64)
        adv[1] = 0.0
        adv[0] = -abs(float(adv[0])) - 0.5  # negative advantage on the ratio-5 token
        adv[5] = -abs(float(adv[5])) - 0.5
        adv[3] = abs(float(adv[3])) + 0.5
    return lp, old, ref, adv, mask


def tolist(x):
    return x.tolist()


def run_impl(cfg, lp, old, adv, mask, ref=None):
    leaf = lp.clone().requires_grad_(True)
    loss, metrics = compute_loss(cfg, leaf, old, adv, mask, ref_logprobs=ref)
    loss.backward()
    return loss, leaf.grad, metrics


def run_ref(cfg, lp, old, adv, mask, ref=None):
    loss, grad, metrics = ref_loss(
        cfg, tolist(lp), tolist(old), tolist(adv), tolist(mask),
        None if ref is None else tolist(ref),
    )
    return torch.tensor(loss, dtype=F64), torch.tensor(grad, dtype=F64), metrics


def assert_matches_reference(cfg, lp, old, adv, mask, ref=None):
    loss, grad, metrics = run_impl(cfg, lp, old, adv, mask, ref)
    r_loss, r_grad, r_metrics = run_ref(cfg, lp, old, adv, mask, ref)
    torch.testing.assert_close(loss.detach(), r_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, r_grad, rtol=1e-10, atol=1e-12)
    for key, value in r_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-10, abs=1e-12), key
    return loss, grad, metrics


# Every loss with its defaults, plus variants that move each parameter.
VARIANTS = [
    ("grpo", {}),
    ("grpo", {"clip_low": 0.1, "clip_high": 0.3, "dual_clip": 2.5}),
    ("dr_grpo", {}),
    ("dr_grpo", {"horizon": 16}),
    ("dapo", {}),
    ("dapo", {"dual_clip": None}),
    ("gspo", {}),
    ("gspo", {"clip_low": 0.05, "clip_high": 0.1}),
    ("cispo", {}),
    ("cispo", {"clip_low": 0.2, "clip_high": 0.1}),
    ("sapo", {}),
    ("sapo", {"tau_pos": 0.5, "tau_neg": 3.0}),
    ("reinforce", {}),
    ("reinforce", {"rollout_correction": "tis", "correction_cap": 1.5}),
    ("grpo", {"rollout_correction": "tis"}),
    ("grpo", {"rollout_correction": "mis", "correction_cap": 1.5}),
    ("dapo", {"rollout_correction": "mis"}),
    ("gspo", {"rollout_correction": "tis", "correction_cap": 1.5}),
    ("cispo", {"rollout_correction": "mis", "correction_cap": 3.0}),
    ("sapo", {"rollout_correction": "tis"}),
    ("dr_grpo", {"rollout_correction": "tis", "correction_cap": 1.2}),
]
VARIANT_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}" for n, o in VARIANTS]


@pytest.mark.parametrize("variant", range(len(VARIANTS)), ids=VARIANT_IDS)
@pytest.mark.parametrize("aggregation", L.AGGREGATIONS)
@pytest.mark.parametrize("token_adv", [False, True], ids=["adv[B]", "adv[B,T]"])
@pytest.mark.parametrize("beta", [0.0, 0.07])
def test_loss_and_grad_match_loop_reference(variant, aggregation, token_adv, beta):
    name, overrides = VARIANTS[variant]
    kl_estimator = L.KL_ESTIMATORS[(variant + L.AGGREGATIONS.index(aggregation)) % 3]
    cfg = make_loss_config(name, **overrides)
    cfg = dataclasses.replace(cfg, aggregation=aggregation, beta=beta, kl_estimator=kl_estimator)
    lp, old, ref, adv, mask = make_inputs(seed=100 + variant, token_adv=token_adv)
    loss, grad, _ = assert_matches_reference(cfg, lp, old, adv, mask, ref)
    assert torch.all(grad[~mask] == 0)
    assert grad.abs().sum() > 0  # the comparison is not between two zeros


@pytest.mark.parametrize("variant", range(len(VARIANTS)), ids=VARIANT_IDS)
def test_lazy_metrics_are_the_eager_ones(variant):
    """``lazy=True`` (the trainer: no host sync per micro-batch) returns the same loss and, once
    called, the same metrics; an all-masked batch keeps its neutral values."""
    name, overrides = VARIANTS[variant]
    cfg = make_loss_config(name, **overrides)
    lp, old, ref, adv, mask = make_inputs(seed=300 + variant)
    for m in (mask, torch.zeros_like(mask)):
        loss, metrics = L.compute_loss(cfg, lp, old, adv, m, ref)
        lazy_loss, later = L.compute_loss(cfg, lp, old, adv, m, ref, lazy=True)
        assert callable(later) and torch.equal(loss, lazy_loss)
        assert later() == metrics


def test_reference_comparison_is_sensitive():
    """The comparison fails when the reference uses other parameters: no tautology."""
    lp, old, ref, adv, mask = make_inputs(seed=7)
    pairs = [
        (make_loss_config("dapo"), dict(clip_high=0.2)),
        (make_loss_config("dapo"), dict(dual_clip=None)),
        (make_loss_config("grpo"), dict(aggregation="token_mean")),
        (make_loss_config("grpo"), dict(kl_estimator="k1")),
        (make_loss_config("gspo", clip_low=0.05, clip_high=0.1), dict(clip_high=0.2)),
        (make_loss_config("cispo"), dict(clip_high=0.5)),
        (make_loss_config("sapo"), dict(tau_neg=1.0)),
        (make_loss_config("reinforce", rollout_correction="tis", correction_cap=1.5), dict(correction_cap=2.5)),
        (make_loss_config("grpo", rollout_correction="tis"), dict(rollout_correction="mis")),
        (make_loss_config("grpo", rollout_correction="mis"), dict(rollout_correction="none")),
        (make_loss_config("dr_grpo"), dict(horizon=12)),
    ]
    for cfg, change in pairs:
        loss, grad, _ = run_impl(cfg, lp, old, adv, mask, ref)
        r_loss, r_grad, _ = run_ref(dataclasses.replace(cfg, **change), lp, old, adv, mask, ref)
        differs = not torch.allclose(loss.detach(), r_loss, rtol=1e-8) or not torch.allclose(grad, r_grad, rtol=1e-8)
        assert differs, (cfg.name, change)


# ============================================================================================
# Edge cases
# ============================================================================================


def exact_log(value):
    """x with torch.exp(x) == value exactly in float64 (so a ratio lands on a boundary)."""
    x = math.log(value)
    for _ in range(64):
        got = torch.exp(torch.tensor(x, dtype=F64)).item()
        if got == value:
            return x
        x = math.nextafter(x, math.inf if got < value else -math.inf)
    raise AssertionError(f"no float64 x with exp(x) == {value!r}")


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo"])
def test_ratio_at_and_just_beyond_each_clip_boundary(name):
    cfg = dataclasses.replace(make_loss_config(name), aggregation="token_mean", beta=0.0)
    lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    beyond = 1e-6
    ratios = [hi, hi * (1 + beyond), lo, lo * (1 - beyond), hi * (1 + beyond), lo * (1 - beyond)]
    advs = [1.0, 1.0, -1.0, -1.0, -1.0, 1.0]
    log_r = [exact_log(hi), math.log(ratios[1]), exact_log(lo), math.log(ratios[3]),
             math.log(ratios[4]), math.log(ratios[5])]
    lp = torch.tensor([log_r], dtype=F64)
    old = torch.zeros_like(lp)
    adv = torch.tensor([advs], dtype=F64)
    mask = torch.ones_like(lp, dtype=torch.bool)
    loss, grad, metrics = assert_matches_reference(cfg, lp, old, adv, mask)
    w = 1 / 6
    r = torch.exp(lp)[0].tolist()
    assert r[0] == hi and r[2] == lo  # exactly on the boundaries
    expected_grad = [
        -r[0] * w,  # A>0, r == 1+eps_high: inside, full gradient
        0.0,  # A>0, r just above 1+eps_high: clipped
        r[2] * w,  # A<0, r == 1-eps_low: inside
        0.0,  # A<0, r just below 1-eps_low: clipped
        r[4] * w,  # A<0, r above 1+eps_high: min keeps r*A, not clipped (below dual clip c)
        -r[5] * w,  # A>0, r below 1-eps_low: min keeps r*A, not clipped
    ]
    torch.testing.assert_close(grad[0], torch.tensor(expected_grad, dtype=F64), rtol=1e-12, atol=0)
    expected_obj = [hi, hi, -lo, -lo, -r[4], r[5]]
    assert loss.item() == pytest.approx(-sum(expected_obj) * w, rel=1e-12)
    assert metrics["clip_frac_high"] == pytest.approx(1 / 6)
    assert metrics["clip_frac_low"] == pytest.approx(1 / 6)


def test_dapo_dual_clip_negative_advantages():
    cfg = make_loss_config("dapo")  # clip 0.2 / 0.28, c = 3, token_mean
    # No float64 x has exp(x) == 3.0 exactly; move c by an ulp to a value exp() does reach.
    c = torch.exp(torch.tensor(math.log(cfg.dual_clip), dtype=F64)).item()
    assert abs(c - 3.0) < 1e-15
    cfg = dataclasses.replace(cfg, dual_clip=c)
    ratios = [2.0, c, c * (1 + 1e-6), 10.0, 10.0, 0.5]
    advs = [-1.5, -1.0, -1.0, -2.0, 1.0, -1.0]
    lp = torch.tensor([[math.log(2.0), exact_log(c), math.log(ratios[2]), math.log(10.0),
                        math.log(10.0), math.log(0.5)]], dtype=F64)
    old = torch.zeros_like(lp)
    adv = torch.tensor([advs], dtype=F64)
    mask = torch.ones_like(lp, dtype=torch.bool)
    loss, grad, metrics = assert_matches_reference(cfg, lp, old, adv, mask)
    r = torch.exp(lp)[0].tolist()
    w = 1 / 6
    expected_obj = [
        r[0] * -1.5,  # 1+eps_high < r < c, A<0: unclipped r*A
        r[1] * -1.0,  # r == c: on the dual-clip boundary, still r*A
        c * -1.0,  # r just above c: bounded below by c*A
        c * -2.0,  # r = 10: c*A
        1.28 * 1.0,  # A>0, r = 10: ordinary high clip
        0.8 * -1.0,  # A<0, r = 0.5: ordinary low clip
    ]
    expected_grad = [1.5 * r[0] * w, 1.0 * r[1] * w, 0.0, 0.0, 0.0, 0.0]
    assert loss.item() == pytest.approx(-sum(expected_obj) * w, rel=1e-12)
    torch.testing.assert_close(grad[0], torch.tensor(expected_grad, dtype=F64), rtol=1e-12, atol=0)
    assert metrics["clip_frac_dual"] == pytest.approx(2 / 6)
    assert metrics["clip_frac_high"] == pytest.approx(1 / 6)
    assert metrics["clip_frac_low"] == pytest.approx(1 / 6)
    # Without the dual clip the A<0, r=10 token keeps its (large) gradient and loss.
    loss_nd, grad_nd, _ = assert_matches_reference(dataclasses.replace(cfg, dual_clip=None), lp, old, adv, mask)
    assert grad_nd[0, 3].item() == pytest.approx(2.0 * 10.0 * w)
    assert loss_nd.item() > loss.item()


def test_gspo_sequence_ratio_at_and_beyond_boundary():
    cfg = make_loss_config("gspo")  # 3e-4 / 4e-4, seq_mean
    hi, lo = 1.0 + cfg.clip_high, 1.0 - cfg.clip_low
    # One unmasked token per row, so the sequence ratio is that token's ratio exactly.
    lp = torch.tensor([[exact_log(hi), 0.0], [math.log(hi) + 1e-6, 0.0],
                       [exact_log(lo), 0.0], [math.log(lo) - 1e-6, 0.0]], dtype=F64)
    old = torch.zeros_like(lp)
    mask = torch.tensor([[True, False]] * 4)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=F64)
    loss, grad, metrics = assert_matches_reference(cfg, lp, old, adv, mask)
    w = 1 / 4
    expected = torch.tensor([-hi * w, 0.0, lo * w, 0.0], dtype=F64)
    torch.testing.assert_close(grad[:, 0], expected, rtol=1e-12, atol=0)
    assert metrics["clip_frac_high"] == pytest.approx(1 / 4)
    assert metrics["clip_frac_low"] == pytest.approx(1 / 4)
    # Sequence-level: one off-policy token moves the whole sequence's ratio and clip decision.
    lp2 = torch.tensor([[0.0, 0.0, 0.0, 0.01]], dtype=F64)  # mean log-ratio 0.0025 > log(hi)
    _, grad2, m2 = assert_matches_reference(cfg, lp2, torch.zeros_like(lp2), torch.tensor([1.0], dtype=F64),
                                            torch.ones_like(lp2, dtype=torch.bool))
    assert torch.all(grad2 == 0) and m2["clip_frac_high"] == 1.0


@pytest.mark.parametrize("name,overrides", [("cispo", {}), ("reinforce", {"rollout_correction": "tis",
                                                                         "correction_cap": 2.0})])
def test_weight_clip_boundaries(name, overrides):
    """CISPO / TIS: the weight is clipped but every token keeps a gradient -w*A."""
    cfg = make_loss_config(name, **overrides)
    hi = 2.0 if name == "reinforce" else 1.0 + cfg.clip_high
    lp_vals = [exact_log(hi), math.log(hi) + 1e-6, math.log(5.0), math.log(0.1)]
    lp = torch.tensor([lp_vals], dtype=F64) - 1.0
    old = torch.full_like(lp, -1.0)
    adv = torch.tensor([2.0], dtype=F64)
    mask = torch.ones_like(lp, dtype=torch.bool)
    _, grad, metrics = assert_matches_reference(cfg, lp, old, adv, mask)
    r = torch.exp(lp - old)[0].tolist()
    weights = [min(x, hi) for x in r]
    torch.testing.assert_close(grad[0], torch.tensor([-2.0 * x / 4 for x in weights], dtype=F64), rtol=1e-12, atol=0)
    key = "is_corrected_frac" if name == "reinforce" else "clip_frac_high"
    assert metrics[key] == pytest.approx(2 / 4)  # at the boundary is not clipped
    assert all(g != 0 for g in grad[0].tolist())


@pytest.mark.parametrize("name", PG_LOSSES)
def test_mis_masks_the_tokens_beyond_the_cap_and_tis_truncates_them(name):
    """With pi_old = the trainer's log-probs, a token whose trainer/sampler ratio rho exceeds the cap
    keeps weight C (tis) or none at all (mis); below the cap both weigh it by rho."""
    lp = torch.tensor([[-1.0, -1.0, -1.0, -1.0]], dtype=F64)
    old = lp - torch.tensor([[math.log(3.0), math.log(1.5), 0.0, math.log(0.5)]], dtype=F64)  # rho 3, 1.5, 1, .5
    adv, mask = torch.tensor([1.0], dtype=F64), torch.ones_like(lp, dtype=torch.bool)
    grads = {}
    for corr in ("tis", "mis"):
        cfg = dataclasses.replace(make_loss_config(name), rollout_correction=corr, correction_cap=2.0, beta=0.0,
                                  aggregation="token_mean")
        _, grads[corr], m = run_impl(cfg, lp, old, adv, mask)
        assert m["is_corrected_frac"] == pytest.approx(1 / 4) and m["is_ratio_max"] == pytest.approx(3.0)
    plain = run_impl(dataclasses.replace(make_loss_config(name), beta=0.0, aggregation="token_mean"),
                     lp, lp.clone(), adv, mask)[1]  # on policy: -A/n per token for every loss
    torch.testing.assert_close(grads["tis"][0], plain[0] * torch.tensor([2.0, 1.5, 1.0, 0.5], dtype=F64))
    torch.testing.assert_close(grads["mis"][0], plain[0] * torch.tensor([0.0, 1.5, 1.0, 0.5], dtype=F64))


def test_mismatch_metrics_are_zero_on_policy_and_grow_with_the_gap():
    """mismatch_kl is the k3 estimate of KL(sampler || trainer): 0 when the two agree, and
    rho - 1 - log rho per token otherwise; the correction setting does not change it."""
    lp, _, ref, adv, mask = make_inputs(seed=5)
    _, m0 = compute_loss(make_loss_config("grpo"), lp, lp.clone(), adv, mask, ref)
    assert m0["mismatch_kl"] == 0.0 and m0["mismatch_max"] == 0.0 and m0["is_ratio_mean"] == 1.0
    gap = 0.1
    for corr in ("none", "tis", "mis"):
        _, m = compute_loss(make_loss_config("grpo", rollout_correction=corr), lp, lp - gap, adv, mask, ref)
        assert m["mismatch_kl"] == pytest.approx(math.exp(gap) - 1 - gap, rel=1e-9)
        assert m["mismatch_max"] == pytest.approx(gap) and m["is_ratio_mean"] == pytest.approx(math.exp(gap))
    _, sft = compute_loss(make_loss_config("sft"), lp, torch.zeros_like(lp), adv, mask)
    assert sft["mismatch_kl"] == 0.0 and sft["is_ratio_mean"] == 1.0


@pytest.mark.parametrize("aggregation", L.AGGREGATIONS)
@pytest.mark.parametrize("name", PG_LOSSES)
def test_on_policy_gradient_is_plain_policy_gradient(name, aggregation):
    """behaviour == policy: every loss's gradient is the plain policy gradient -A * w_i."""
    cfg = dataclasses.replace(make_loss_config(name), aggregation=aggregation, beta=0.0)
    lp, _, _, adv, mask = make_inputs(seed=3)
    old = lp.clone()
    _, grad, metrics = run_impl(cfg, lp, old, adv, mask)
    w = ref_agg_weights(mask.tolist(), aggregation)
    expected = torch.tensor([[-adv[i].item() * w[i] * mask[i, t].item() for t in range(lp.shape[1])]
                             for i in range(lp.shape[0])], dtype=F64)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    # and it is what REINFORCE (no importance weight) produces by autograd
    pg = dataclasses.replace(make_loss_config("reinforce"), aggregation=aggregation)
    _, pg_grad, _ = run_impl(pg, lp, old, adv, mask)
    torch.testing.assert_close(grad, pg_grad, rtol=1e-12, atol=1e-15)
    assert metrics["ratio_min"] == metrics["ratio_max"] == 1.0
    assert metrics["clip_frac_low"] == metrics["clip_frac_high"] == 0.0


def test_on_policy_grpo_gradient_detaches_behaviour():
    """GRPO: behaviour = policy.detach() (same tensor values) still gives the policy gradient."""
    cfg = make_loss_config("grpo", beta=0.0)
    lp, _, _, adv, mask = make_inputs(seed=11)
    leaf = lp.clone().requires_grad_(True)
    loss, _ = compute_loss(cfg, leaf, leaf.detach(), adv, mask)
    loss.backward()
    leaf2 = lp.clone().requires_grad_(True)
    pg = ((-(adv[:, None] * leaf2) * mask).sum(1) / mask.sum(1).clamp(min=1))[mask.any(1)].mean()
    pg.backward()
    torch.testing.assert_close(leaf.grad, leaf2.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", PG_LOSSES)
def test_all_zero_advantages(name):
    lp, old, ref, adv, mask = make_inputs(seed=5)
    zeros = torch.zeros_like(adv)
    cfg = dataclasses.replace(make_loss_config(name), beta=0.0)
    loss, grad, metrics = assert_matches_reference(cfg, lp, old, zeros, mask, ref)
    assert loss.item() == 0.0 and torch.all(grad == 0)
    if name in ("grpo", "dr_grpo", "dapo", "gspo"):  # objective clips need A != 0
        assert metrics["clip_frac_low"] == metrics["clip_frac_high"] == 0.0
    # with a KL term only the KL remains
    cfg = dataclasses.replace(cfg, beta=0.1)
    loss, grad, _ = assert_matches_reference(cfg, lp, old, zeros, mask, ref)
    kl = kl_estimate(lp, ref, cfg.kl_estimator)
    expected = 0.1 * aggregate(kl, mask, cfg.aggregation)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", PG_LOSSES)
def test_fully_masked_row_is_skipped(name):
    cfg = dataclasses.replace(make_loss_config(name), aggregation="seq_mean", beta=0.05)
    lp, old, ref, adv, mask = make_inputs(seed=9)
    assert not mask[2].any()
    loss, grad, _ = assert_matches_reference(cfg, lp, old, adv, mask, ref)
    keep = torch.tensor([i != 2 for i in range(lp.shape[0])])
    loss_wo, grad_wo, _ = run_impl(cfg, lp[keep], old[keep], adv[keep], mask[keep], ref[keep])
    torch.testing.assert_close(loss, loss_wo, rtol=1e-12, atol=1e-15)  # not diluted
    torch.testing.assert_close(grad[keep], grad_wo, rtol=1e-12, atol=1e-15)
    assert torch.all(grad[2] == 0)


@pytest.mark.parametrize("aggregation", L.AGGREGATIONS)
@pytest.mark.parametrize("name", PG_LOSSES)
def test_all_masked_batch_is_zero_not_nan(name, aggregation):
    cfg = dataclasses.replace(make_loss_config(name), aggregation=aggregation, beta=0.05)
    lp, old, ref, adv, _ = make_inputs(seed=1)
    mask = torch.zeros_like(lp, dtype=torch.bool)
    loss, grad, metrics = run_impl(cfg, lp, old, adv, mask, ref)
    assert loss.item() == 0.0 and torch.all(grad == 0)
    assert metrics["masked_frac"] == 1.0
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", PG_LOSSES)
def test_garbage_under_the_mask_does_not_leak(name):
    cfg = dataclasses.replace(make_loss_config(name), beta=0.05)
    lp, old, ref, adv, mask = make_inputs(seed=13, token_adv=True)
    loss, grad, metrics = run_impl(cfg, lp, old, adv, mask, ref)
    dirty = [x.clone() for x in (lp, old, ref, adv)]
    for x, v in zip(dirty, (-math.inf, math.nan, math.inf, math.nan)):
        x[~mask] = v
    loss2, grad2, metrics2 = run_impl(cfg, dirty[0], dirty[1], dirty[3], mask, dirty[2])
    assert torch.isfinite(loss2) and torch.isfinite(grad2).all()
    torch.testing.assert_close(loss2, loss, rtol=0, atol=0)
    torch.testing.assert_close(grad2, grad, rtol=0, atol=0)
    assert metrics2 == metrics


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", PG_LOSSES)
def test_low_precision_inputs_compute_in_fp32(name, in_dtype):
    cfg = dataclasses.replace(make_loss_config(name), beta=0.05)
    lp, old, ref, adv, mask = make_inputs(seed=17, B=8, T=64)
    low = [x.to(in_dtype) for x in (lp, old, ref, adv)]
    leaf = low[0].clone().requires_grad_(True)
    loss, metrics = compute_loss(cfg, leaf, low[1], low[3], mask, ref_logprobs=low[2])
    loss.backward()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert leaf.grad.dtype == in_dtype and torch.isfinite(leaf.grad.float()).all()
    # Same inputs (already rounded to bf16/fp16), exact float64 math: agree to fp32 accuracy,
    # far tighter than a bf16/fp16 computation could.
    up = [x.to(F64) for x in low]
    r_loss, r_grad, _ = run_ref(cfg, up[0], up[1], up[3], mask, up[2])
    assert loss.item() == pytest.approx(r_loss.item(), rel=2e-5, abs=1e-6)
    ref_leaf = up[0].clone().requires_grad_(True)
    f32_loss, _ = compute_loss(cfg, ref_leaf.float(), up[1].float(), up[3].float(), mask, ref_logprobs=up[2].float())
    assert loss.item() == f32_loss.item()  # bit-identical to feeding float32 in
    assert all(isinstance(v, float) for v in metrics.values())


def test_metrics_keys_and_types():
    lp, old, ref, adv, mask = make_inputs(seed=21)
    for name in PG_LOSSES:
        _, metrics = compute_loss(make_loss_config(name), lp, old, adv, mask, ref_logprobs=ref)
        assert set(METRIC_KEYS) <= set(metrics), name
        assert all(type(v) is float for v in metrics.values()), name
        assert metrics["masked_frac"] == pytest.approx(1 - mask.sum().item() / mask.numel())
        assert metrics["ratio_min"] <= metrics["ratio_mean"] <= metrics["ratio_max"]
    # no reference model: KL metrics are 0, loss needs beta == 0
    _, metrics = compute_loss(make_loss_config("dapo"), lp, old, adv, mask)
    assert metrics["kl_mean"] == metrics["kl_max"] == 0.0


# ============================================================================================
# Helpers: KL, aggregation, config handling, errors
# ============================================================================================


@pytest.mark.parametrize("est", L.KL_ESTIMATORS)
def test_kl_estimators_match_formulas(est):
    lp, _, ref, _, _ = make_inputs(seed=23)
    leaf = lp.clone().requires_grad_(True)
    kl = kl_estimate(leaf, ref, est)
    kl.sum().backward()
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            v, d = ref_kl(lp[i, t].item(), ref[i, t].item(), est)
            assert kl[i, t].item() == pytest.approx(v, rel=1e-9, abs=1e-13)
            assert leaf.grad[i, t].item() == pytest.approx(d, rel=1e-9, abs=1e-13)
    if est in ("k2", "k3"):
        assert (kl >= 0).all()
    assert kl_estimate(lp, lp, est).abs().max() == 0
    assert kl_estimate(lp.to(torch.bfloat16), ref.to(torch.bfloat16), est).dtype == torch.float32


def test_k1_k3_unbiased_on_samples():
    """E_{x~p}[k1] = E_{x~p}[k3] = KL(p||q) for categorical p, q (Schulman's blog)."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(50, generator=g, dtype=F64), 0)
    q = torch.softmax(torch.randn(50, generator=g, dtype=F64), 0)
    exact = (p * (p.log() - q.log())).sum()
    lp, lq = p.log()[None], q.log()[None]
    for est in ("k1", "k3"):
        expectation = (p * kl_estimate(lp, lq, est)[0]).sum()
        torch.testing.assert_close(expectation, exact, rtol=1e-12, atol=1e-14)


def test_aggregate_hand_example():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=F64)
    m = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 0, 1]])
    assert aggregate(x, m, "token_mean").item() == pytest.approx((1 + 2 + 9) / 3)
    assert aggregate(x, m, "seq_mean").item() == pytest.approx((1.5 + 9) / 2)  # empty row skipped
    assert aggregate(x, m, "fixed_horizon").item() == pytest.approx(12 / (3 * 3))
    assert aggregate(x, m, "fixed_horizon", horizon=8).item() == pytest.approx(12 / (3 * 8))
    zero = torch.zeros_like(m)
    for mode in L.AGGREGATIONS:
        assert aggregate(x, zero, mode).item() == 0.0


def test_loss_config_registry_and_defaults():
    for name, cls in LOSS_CONFIGS.items():
        cfg = cls()
        assert cfg.name == name and isinstance(cfg, L.LossConfig)
    assert set(LOSS_CONFIGS) == {"grpo", "dr_grpo", "dapo", "gspo", "cispo", "sapo", "reinforce", "sft"}
    g = L.GRPOLossConfig()
    assert (g.clip_low, g.clip_high, g.beta, g.aggregation, g.kl_estimator) == (0.2, 0.2, 0.04, "seq_mean", "k3")
    d = L.DAPOLossConfig()
    assert (d.clip_low, d.clip_high, d.dual_clip, d.aggregation, d.beta) == (0.2, 0.28, 3.0, "token_mean", 0.0)
    assert L.DrGRPOLossConfig().aggregation == "fixed_horizon" and L.DrGRPOLossConfig().beta == 0.0
    assert all((c().rollout_correction, c().correction_cap) == ("none", 2.0) for c in LOSS_CONFIGS.values())
    assert L.GSPOLossConfig().aggregation == "seq_mean"


@pytest.mark.parametrize("name", PG_LOSSES)
def test_dictconfig_gives_the_same_result(name):
    omegaconf = pytest.importorskip("omegaconf")
    lp, old, ref, adv, mask = make_inputs(seed=29)
    cfg = make_loss_config(name)
    structured = omegaconf.OmegaConf.structured(LOSS_CONFIGS[name])
    plain = omegaconf.OmegaConf.create(dataclasses.asdict(cfg))
    expected, _ = compute_loss(cfg, lp, old, adv, mask, ref_logprobs=ref)
    for dc in (structured, plain):
        loss, metrics = compute_loss(dc, lp, old, adv, mask, ref_logprobs=ref)
        assert loss.item() == expected.item() and set(METRIC_KEYS) <= set(metrics)
    # a CLI-style override reaches the loss
    over = omegaconf.OmegaConf.merge(structured, omegaconf.OmegaConf.from_dotlist(["aggregation=fixed_horizon"]))
    loss, _ = compute_loss(over, lp, old, adv, mask, ref_logprobs=ref)
    expected, _ = compute_loss(dataclasses.replace(cfg, aggregation="fixed_horizon"), lp, old, adv, mask, ref_logprobs=ref)
    assert loss.item() == expected.item()


def test_errors_name_the_bad_field():
    lp, old, ref, adv, mask = make_inputs(seed=31)
    cases = [
        (dataclasses.replace(make_loss_config("grpo"), name="ppo2"), "name"),
        (dataclasses.replace(make_loss_config("grpo"), kl_estimator="k4"), "kl_estimator"),
        (dataclasses.replace(make_loss_config("grpo"), aggregation="sum"), "aggregation"),
        (make_loss_config("dapo", dual_clip=0.5), "dual_clip"),
        (make_loss_config("sapo", tau_neg=0.0), "tau_neg"),
        (make_loss_config("grpo", rollout_correction="tis", correction_cap=-1.0), "correction_cap"),
        (make_loss_config("dapo", rollout_correction="is"), "rollout_correction"),
        (make_loss_config("sft", rollout_correction="tis"), "rollout_correction"),
        (make_loss_config("grpo", clip_low=-0.1), "clip_low"),
    ]
    for cfg, field in cases:
        with pytest.raises(ValueError, match=field):
            compute_loss(cfg, lp, old, adv, mask, ref_logprobs=ref)
    with pytest.raises(ValueError, match="name"):
        make_loss_config("ppo2")
    grpo = make_loss_config("grpo")  # beta = 0.04
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_loss(grpo, lp, old, adv, mask)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        compute_loss(grpo, lp, old[:, :-1], adv, mask, ref_logprobs=ref)
    with pytest.raises(ValueError, match="mask"):
        compute_loss(grpo, lp, old, adv, mask[:-1], ref_logprobs=ref)
    with pytest.raises(ValueError, match="advantages"):
        compute_loss(grpo, lp, old, adv[:-1], mask, ref_logprobs=ref)
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_loss(grpo, lp, old, adv, mask, ref_logprobs=ref.T)
    with pytest.raises(ValueError, match="logprobs"):
        compute_loss(grpo, lp[0], old[0], adv, mask[0], ref_logprobs=ref[0])
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(lp, ref, "k9")
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(lp, mask, "mean")
    with pytest.raises(ValueError, match="estimator"):
        group_advantages(torch.ones(2, 3), "gae")


# ============================================================================================
# Advantages
# ============================================================================================


def ref_group_advantages(rewards, estimator, eps):
    out, flags = [], []
    for row in rewards:
        g = len(row)
        mean = sum(row) / g
        zero_var = all(x == row[0] for x in row)
        flags.append(zero_var)
        if zero_var:
            out.append([0.0] * g)
        elif estimator == "zscore":
            std = math.sqrt(sum((x - mean) ** 2 for x in row) / (g - 1))
            out.append([(x - mean) / (std + eps) for x in row])
        elif estimator == "mean":
            out.append([x - mean for x in row])
        else:  # leave-one-out baseline
            out.append([x - (sum(row) - x) / (g - 1) for x in row])
    return out, flags


def test_advantages_hand_computed():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.5, 1.5, 2.5, 0.5]])
    adv, zv = group_advantages(rewards, "zscore", eps=0.0)
    assert adv.dtype == torch.float32 and zv.tolist() == [False, True, False]
    # row 0: mean 0.5, unbiased std sqrt(1/3)
    s = math.sqrt(1 / 3)
    torch.testing.assert_close(adv[0], torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s]))
    assert adv[1].tolist() == [0.0] * 4
    adv, _ = group_advantages(rewards, "mean")
    torch.testing.assert_close(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    torch.testing.assert_close(adv[2], torch.tensor([-0.75, 0.25, 1.25, -0.75]))
    adv, _ = group_advantages(rewards, "rloo")
    # 1 - (0+0+1)/3 = 2/3 ; 0 - (1+0+1)/3 = -2/3 ; 0.5 - (1.5+2.5+0.5)/3 = -1
    torch.testing.assert_close(adv[0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    torch.testing.assert_close(adv[2], torch.tensor([-1.0, 1 / 3, 5 / 3, -1.0]))
    assert adv[1].tolist() == [0.0] * 4


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_advantages_match_loop_reference(estimator):
    g = torch.Generator().manual_seed(41)
    rewards = torch.randn(7, 5, generator=g, dtype=F64)
    rewards[2] = 0.3  # zero variance (0.3 is inexact: the mean need not be 0.3 exactly)
    rewards[4] = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0], dtype=F64)
    adv, zv = group_advantages(rewards, estimator, eps=1e-6)
    r_adv, r_zv = ref_group_advantages(rewards.tolist(), estimator, 1e-6)
    assert zv.tolist() == r_zv == [False, False, True, False, False, False, False]
    torch.testing.assert_close(adv, torch.tensor(r_adv, dtype=torch.float32), rtol=1e-6, atol=1e-6)
    assert torch.all(adv[2] == 0)
    if estimator != "zscore":
        torch.testing.assert_close(adv.sum(1), torch.zeros(7), rtol=0, atol=1e-5)  # baselines centre


def test_compute_advantages_dynamic_sampling_filter():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.2, 0.7]])
    adv, keep, metrics = compute_advantages(rewards, AdvantageConfig(estimator="rloo", drop_zero_variance=True))
    assert keep.tolist() == [True, False, False, True]
    assert metrics == {"zero_variance_groups": 2.0, "zero_variance_frac": 0.5, "dropped_groups": 2.0}
    torch.testing.assert_close(adv[keep], torch.tensor([[1.0, -1.0], [-0.5, 0.5]]))
    _, keep, metrics = compute_advantages(rewards, AdvantageConfig())
    assert keep.all() and metrics["dropped_groups"] == 0.0 and metrics["zero_variance_groups"] == 2.0
    omegaconf = pytest.importorskip("omegaconf")
    _, keep, _ = compute_advantages(rewards, omegaconf.OmegaConf.structured(AdvantageConfig(drop_zero_variance=True)))
    assert keep.tolist() == [True, False, False, True]


def test_advantage_errors():
    with pytest.raises(ValueError, match="rloo"):
        group_advantages(torch.ones(3, 1), "rloo")
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(torch.ones(3), "zscore")
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([[1.0, math.nan]]), "mean")
    adv, zv = group_advantages(torch.tensor([[1.0], [2.0]]), "zscore")
    assert adv.tolist() == [[0.0], [0.0]] and zv.all()


def test_sft_loss_is_the_targets_mean_cross_entropy():
    """loss=sft: -mean over unmasked target tokens of logp, whatever the advantages and behaviour
    log-probs; its gradient is -1/N on each unmasked token; beta must be 0."""
    cfg = make_loss_config("sft")
    lp, old, _, adv, mask = make_inputs(seed=5)
    loss, grad, _ = run_impl(cfg, lp, old, adv, mask)
    m = mask.to(F64)
    torch.testing.assert_close(loss, -(lp * m).sum() / m.sum(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, -m / m.sum(), rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="beta must be 0 for sft"):
        compute_loss(make_loss_config("sft", beta=0.1), lp, old, adv, mask, lp)
