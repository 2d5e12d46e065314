"""Policy-gradient losses for RL post-training of LLMs, behind one interface.

``loss=<name>`` selects one of the configs in :data:`LOSS_CONFIGS` (its own parameters live under it)
and :func:`compute_loss` dispatches on ``cfg.name``; every loss takes the same [B, T] inputs (see
:func:`compute_loss`), all constants except ``logprobs``, and returns ``(loss, metrics)``.
Conventions of every function in this module:

* The loss is *minimised*: minus the paper's surrogate objective, plus ``beta * KL`` when
  ``beta > 0``, per token, reduced by :func:`aggregate`.
* Arithmetic is float32 (float64 when ``logprobs`` is float64): bf16/fp16 inputs are upcast first.
* Masked positions never leak into values or gradients, even holding ``-inf``/``nan``: inputs are
  replaced by 0 there *before* any ``exp``.
* A ratio exactly on a clip boundary is inside the trust region (full gradient, not counted in
  the clip fractions); strictly beyond it is clipped.
* r_t = pi_theta / pi_behaviour = exp(logprobs - behaviour_logprobs); A = advantage;
  sg(.) = stop-gradient (``.detach()``).

Each loss's paper is cited in its config's docstring, the KL estimators' source in :func:`kl_estimate`.
"""

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token_mean", "seq_mean", "fixed_horizon")
ROLLOUT_CORRECTIONS = ("none", "tis", "mis")
METRIC_KEYS = ("ratio_mean", "ratio_min", "ratio_max", "clip_frac_low", "clip_frac_high", "kl_mean", "kl_max",
               "mismatch_kl", "mismatch_max", "is_ratio_mean", "is_ratio_max", "is_corrected_frac", "masked_frac")
# Config fields use typing.Optional (not ``X | None``): OmegaConf.structured / Hydra's ConfigStore
# accept it on all supported OmegaConf versions. Subclasses restate only the fields they change.


@dataclass
class LossConfig:
    """Fields common to every loss; each algorithm subclasses it with its own parameters.

    Attributes:
        name: which loss :func:`compute_loss` runs; a key of :data:`LOSS_CONFIGS`.
        beta: coefficient of the per-token KL-to-reference penalty added to the loss (GRPO,
            arXiv:2402.03300, eq. 3). 0 disables it, and then ``ref_logprobs`` may be ``None``.
        kl_estimator: ``"k1" | "k2" | "k3"``, see :func:`kl_estimate`.
        aggregation: ``"token_mean" | "seq_mean" | "fixed_horizon"``, see :func:`aggregate`.
        horizon: the max length L used by ``fixed_horizon`` (loss = sum / (B * L)); ``None``
            means the padded width T of the batch. Ignored by the other aggregations.
        rollout_correction: ``"none" | "tis" | "mis"``, the token-level correction for the gap
            between the sampler's and the trainer's probabilities (train-inference mismatch: vLLM's
            kernels, FP8 weights or KV cache, or policy versions behind), see :func:`compute_loss`.
        correction_cap: the cap C of the importance weight (> 0; 2 in Yao et al. 2025).
    """

    name: str = "grpo"
    beta: float = 0.0
    kl_estimator: str = "k3"
    aggregation: str = "token_mean"
    horizon: Optional[int] = None
    rollout_correction: str = "none"
    correction_cap: float = 2.0


@dataclass
class GRPOLossConfig(LossConfig):
    """GRPO: PPO clipped surrogate with group-relative advantages (DeepSeekMath, arXiv:2402.03300).

    Per token (eq. 3 of arXiv:2402.03300, PPO's clip arXiv:1707.06347 with separate bounds)::

        loss_t = -min(r_t * A_t, clip(r_t, 1 - clip_low, 1 + clip_high) * A_t) + beta * KL_t

    aggregated with ``seq_mean`` (1/G sum_i 1/|o_i| sum_t, as in the paper); the paper's KL is k3 with
    beta = 0.04. ``dual_clip`` (None = off): dual-clip PPO (arXiv:1912.09729) as in :class:`DAPOLossConfig`.
    """

    name: str = "grpo"
    beta: float = 0.04
    aggregation: str = "seq_mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None


@dataclass
class DrGRPOLossConfig(LossConfig):
    """Dr. GRPO, "Understanding R1-Zero-Like Training: A Critical Perspective" (arXiv:2503.20783).

    GRPO's per-token clipped surrogate without the per-response length normalisation: ``fixed_horizon``
    aggregation (sum over tokens / (B * max length)), no KL (beta = 0). Pair it with
    ``forge_core.advantages.AdvantageConfig(estimator="mean")`` (no division by the group std).
    """

    name: str = "dr_grpo"
    aggregation: str = "fixed_horizon"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None


@dataclass
class DAPOLossConfig(LossConfig):
    """DAPO (arXiv:2503.14476): clip-higher, token-level mean, no KL; plus dual clip. Per token::

        obj_t = min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)   # clip-higher, eq. 8
        obj_t = max(obj_t, dual_clip * A_t)   if A_t < 0                    # arXiv:1912.09729
        loss_t = -obj_t

    aggregated with ``token_mean`` (1 / sum_i |o_i| sum_i sum_t). ``dual_clip`` (c > 1; None =
    off) bounds the loss of a negative-advantage token whose ratio has blown up (r > c).
    Dynamic sampling is :class:`forge_core.advantages.AdvantageConfig`'s ``drop_zero_variance``.
    """

    name: str = "dapo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: Optional[float] = 3.0


@dataclass
class GSPOLossConfig(LossConfig):
    """GSPO, Group Sequence Policy Optimization (arXiv:2507.18071).

    Sequence-level ratio s_i = exp(1/|y_i| sum_t (logp_t - logp_behaviour_t)), clipped with its
    own small range (the paper uses 3e-4 / 4e-4)::

        loss_i = -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)

    aggregated with ``seq_mean`` (1/G sum_i, the paper's eq. 5). Implemented in the GSPO-token
    form (paper, sec. 4.3) so that [B, T] advantages also work; for [B] advantages it has the
    same value and gradient as the sequence-level form under every aggregation.
    """

    name: str = "gspo"
    aggregation: str = "seq_mean"
    clip_low: float = 3e-4
    clip_high: float = 4e-4


@dataclass
class CISPOLossConfig(LossConfig):
    """CISPO, clipped IS-weight policy optimisation (MiniMax-M1, arXiv:2506.13585, eq. 4-5). Per token::

        loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * logp_t

    aggregated with ``token_mean``. Every token keeps a gradient; only its weight is clipped.
    The paper imposes no lower bound ("we set eps_low to a large value"): clip_low = 1.0 makes
    the lower bound 0; clip_high = 0.28.
    """

    name: str = "cispo"
    clip_low: float = 1.0
    clip_high: float = 0.28


@dataclass
class SAPOLossConfig(LossConfig):
    """SAPO, Soft Adaptive Policy Optimization (arXiv:2511.20347): a soft gate, no hard clip. Per token::

        f(r) = sigmoid(tau * (r - 1)) * 4 / tau,   tau = tau_pos if A_t > 0 else tau_neg
        loss_t = -f(r_t) * A_t

    aggregated with ``seq_mean`` (1/G sum_i 1/|y_i| sum_t, as in the paper's objective). The
    gradient weight is f'(r) r = 4 sigmoid(u)(1 - sigmoid(u)) r with u = tau (r - 1): 1 on
    policy (so SAPO reduces to the plain policy gradient there), decaying smoothly off policy,
    faster for larger tau. Defaults tau_pos = 1.0, tau_neg = 1.05 (tau_neg > tau_pos, the
    paper's recommendation: negative-advantage tokens are damped faster).
    """

    name: str = "sapo"
    aggregation: str = "seq_mean"
    tau_pos: float = 1.0
    tau_neg: float = 1.05


@dataclass
class ReinforceLossConfig(LossConfig):
    """REINFORCE (Williams, 1992, "Simple statistical gradient-following algorithms for connectionist
    reinforcement learning", Machine Learning 8:229-256). Per token::

        loss_t = -A_t * logp_t

    aggregated with ``token_mean``. With ``rollout_correction=tis`` this is the truncated importance
    sampling REINFORCE of Yao et al. 2025 (-sg(min(r_t, C)) A_t logp_t), see :func:`compute_loss`.
    """

    name: str = "reinforce"


@dataclass
class SFTLossConfig(LossConfig):
    """Supervised fine-tuning: the cross-entropy of the target tokens (a worked solution after the
    prompt), the maximum-likelihood objective of SFT (e.g. InstructGPT's supervised stage,
    arXiv:2203.02155 sec. 3.5). Per token::

        loss_t = -logp_t            (logp_t = log pi_theta(y_t | x, y_<t), y the target)

    aggregated with ``token_mean`` (every target token weighs the same). Advantages and behaviour
    log-probs are not used; no KL (``beta`` must be 0). ``loss=sft`` makes a recipe an SFT run
    (:meth:`forge_core.controller.Controller.run`: the trainer on the data's targets, no rollouts).
    """

    name: str = "sft"


LOSS_CONFIGS: dict[str, type[LossConfig]] = {c.name: c for c in (
    GRPOLossConfig, DrGRPOLossConfig, DAPOLossConfig, GSPOLossConfig, CISPOLossConfig, SAPOLossConfig,
    ReinforceLossConfig, SFTLossConfig)}
"""Loss name (the value of ``cfg.name``, and the Hydra option ``loss=<name>``) -> its config."""


def make_loss_config(name: str, **overrides: Any) -> LossConfig:
    """The default config of loss ``name`` (a key of :data:`LOSS_CONFIGS`) with ``overrides``
    (field values, e.g. ``clip_high=0.3``) applied.

    Raises:
        ValueError: unknown ``name`` (message names the field ``name``).
        TypeError: an override that is not a field of that config.
    """
    if name not in LOSS_CONFIGS:
        raise ValueError(f"unknown loss name={name!r}; expected one of {sorted(LOSS_CONFIGS)}")
    return LOSS_CONFIGS[name](**overrides)


def _check_2d(name: str, x: torch.Tensor, shape: Optional[torch.Size] = None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be [B, T], got shape {tuple(x.shape)}")
    if shape is not None and x.shape != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)} ([B, T])")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from the sampled tokens' log-probs.

    Schulman (2020), "Approximating KL divergence", http://joschu.net/blog/kl-approx.html, with
    x = logprobs - ref_logprobs (the tokens are sampled from pi_theta, or close to it):

    * ``k1 = x``                              unbiased, high variance, can be negative;
    * ``k2 = x**2 / 2``                       biased, low variance, >= 0;
    * ``k3 = exp(-x) - 1 + x``                unbiased, low variance, >= 0 (GRPO's choice,
      arXiv:2402.03300 eq. 4: pi_ref/pi_theta - log(pi_ref/pi_theta) - 1).

    ``logprobs`` and ``ref_logprobs``: [B, T] (any shape, the same); returns that shape, elementwise
    (apply the mask afterwards), in float32 (float64 for float64 inputs). Gradients flow into
    ``logprobs`` only.

    Raises:
        ValueError: unknown ``estimator`` (names the field ``kl_estimator``) or shape mismatch.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator={estimator!r}; expected one of {KL_ESTIMATORS}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"ref_logprobs has shape {tuple(ref_logprobs.shape)}, expected {tuple(logprobs.shape)}")
    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    x = logprobs.to(dtype) - ref_logprobs.detach().to(dtype)
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x * x
    # exp(-x) - 1 + x, with expm1 for precision near x = 0.
    return torch.expm1(-x) + x


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean",
              horizon: Optional[int] = None) -> torch.Tensor:
    """Reduce per-token losses ``per_token`` [B, T] (float) to a 0-dim tensor of its dtype over the
    tokens where ``mask`` ([B, T], bool or 0/1) is set.

    With m = mask, n_i = sum_t m_it and l = per_token:

    * ``token_mean``    sum_it m l / sum_it m  (DAPO's token-level loss, arXiv:2503.14476 eq. 12;
      every token weighs the same, long answers weigh more);
    * ``seq_mean``      1/B' sum_{i: n_i > 0} (1/n_i) sum_t m l  (GRPO, arXiv:2402.03300 eq. 3:
      mean per sequence, then mean over sequences). Fully masked rows are *skipped*: they are
      left out of the average and of B' (the number of rows with n_i > 0), rather than counted
      as zeros, so padding rows or dropped samples do not dilute the loss;
    * ``fixed_horizon`` sum_it m l / (B * L)  (Dr. GRPO, arXiv:2503.20783: a constant
      normaliser, no length bias), with B = all rows (masked ones included) and L = ``horizon``
      or, when ``None``, the padded width T.

    If no token is unmasked, every mode returns 0 (never NaN), with gradient 0. Masked positions
    may hold non-finite values: they are selected away, not multiplied by 0.

    Raises:
        ValueError: unknown ``mode`` (names the field ``aggregation``), non-positive
            ``horizon``, or shape mismatch.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation={mode!r}; expected one of {AGGREGATIONS}")
    _check_2d("per_token", per_token)
    _check_2d("mask", mask, per_token.shape)
    m, dtype = mask != 0, per_token.dtype
    masked = torch.where(m, per_token, 0.0)
    if mode == "token_mean":
        return masked.sum() / m.sum().clamp(min=1).to(dtype)
    if mode == "seq_mean":
        n = m.sum(dim=1)
        per_seq = masked.sum(dim=1) / n.clamp(min=1).to(dtype)
        return per_seq.sum() / (n > 0).sum().clamp(min=1).to(dtype)
    length = per_token.shape[1] if horizon is None else int(horizon)
    if length <= 0:
        raise ValueError(f"horizon must be a positive int or None, got {horizon!r}")
    return masked.sum() / float(per_token.shape[0] * length)


class _PolicyTerm(NamedTuple):
    loss: torch.Tensor  # [B, T] per-token loss (minus the per-token objective)
    ratio: torch.Tensor  # [B, T] the importance ratio the loss uses (detached), for metrics
    clipped_low: Optional[torch.Tensor]  # [B, T] bool, low-side clip active (None: never)
    clipped_high: Optional[torch.Tensor]  # [B, T] bool, high-side clip active (None: never)
    extra: dict  # loss-specific metrics: name -> [B, T] tensor to average over unmasked tokens


def _policy_term(cfg: Any, lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, m: torch.Tensor) -> _PolicyTerm:
    """Per-token policy term of loss ``cfg.name`` (formula and paper in its config's docstring).

    Gets [B, T] inputs already upcast and masked (masked positions hold 0, so ratio 1).
    """
    name = cfg.name
    if name == "gspo":
        # GSPO-token (arXiv:2507.18071 sec. 4.3): s_it = sg(s_i) * pi_t / sg(pi_t) equals s_i in value and
        # d s_it / d logp_t = s_i: with one advantage per sequence, this is the gradient of the sequence-level
        # objective, s_i A_i * mean_t grad logp_t, under every aggregation.
        seq_log_ratio = (lp - old).sum(dim=1) / m.sum(dim=1).clamp(min=1).to(lp.dtype)  # masked: 0
        ratio = torch.exp(seq_log_ratio.detach().unsqueeze(1) + lp - lp.detach())
    else:
        ratio = torch.exp(lp - old)
    r = ratio.detach()
    if name == "sapo":  # arXiv:2511.20347: -sigmoid(tau (r - 1)) * 4 / tau * A, tau by the sign of A
        tau = torch.where(adv > 0, torch.full_like(adv, float(cfg.tau_pos)), torch.full_like(adv, float(cfg.tau_neg)))
        sig = torch.sigmoid(tau * (ratio - 1.0))
        with torch.no_grad():  # the soft gate's gradient weight f'(r) r, 1 on policy
            grad_weight = 4.0 * sig * (1.0 - sig) * ratio
        return _PolicyTerm(-(sig * (4.0 / tau) * adv), r, None, None, {"sapo_grad_weight_mean": grad_weight})
    if name == "cispo":  # arXiv:2506.13585 eq. 4-5: -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp
        lo, hi = 1.0 - float(cfg.clip_low), 1.0 + float(cfg.clip_high)
        return _PolicyTerm(-(r.clamp(min=lo, max=hi) * adv * lp), r, r < lo, r > hi, {})
    if name == "sft":  # cross-entropy of the target tokens
        return _PolicyTerm(-lp, r, None, None, {})
    if name == "reinforce":  # Williams 1992: -A * logp
        return _PolicyTerm(-(adv * lp), r, None, None, {})
    # GRPO / Dr. GRPO / DAPO / GSPO: PPO's clipped surrogate min(r A, clip(r) A) (arXiv:1707.06347),
    # written with explicit branch masks instead of min/clamp so the gradient at a tie is well
    # defined (on the boundary: inside). The clipped value is picked only when clipping lowers the
    # objective: A > 0 and r > 1 + clip_high, or A < 0 and r < 1 - clip_low.
    lo, hi = 1.0 - float(cfg.clip_low), 1.0 + float(cfg.clip_high)
    clipped_high = (adv > 0) & (ratio > hi)
    clipped_low = (adv < 0) & (ratio < lo)
    obj = torch.where(clipped_high, hi * adv, ratio * adv)
    obj = torch.where(clipped_low, lo * adv, obj)
    extra = {}
    if name != "gspo" and cfg.dual_clip is not None:
        # max(min(rA, clip(r)A), cA) for A < 0 (arXiv:1912.09729 eq. 4): the lower bound cA is taken
        # when the clipped objective falls strictly below it (for c > 1 + clip_high: exactly r > c).
        c = float(cfg.dual_clip)
        extra["clip_frac_dual"] = dual = (adv < 0) & (obj < c * adv)
        obj = torch.where(dual, c * adv, obj)
    return _PolicyTerm(-obj, r, clipped_low, clipped_high, extra)


def validate_loss(cfg: Any) -> None:
    """Check a loss config (dataclass or DictConfig; ``make check`` calls it too).
    Raises ValueError naming the field."""
    name = cfg.name
    if name not in LOSS_CONFIGS:
        raise ValueError(f"unknown loss name={name!r}; expected one of {sorted(LOSS_CONFIGS)}")
    if cfg.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator={cfg.kl_estimator!r}; expected one of {KL_ESTIMATORS}")
    if cfg.aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation={cfg.aggregation!r}; expected one of {AGGREGATIONS}")
    clips = ("clip_low", "clip_high") if name in ("grpo", "dr_grpo", "dapo", "gspo", "cispo") else ()
    for field in ("beta", *clips):
        if not float(getattr(cfg, field)) >= 0.0:
            raise ValueError(f"{field} must be >= 0, got {getattr(cfg, field)!r}")
    if clips and not cfg.clip_low <= 1:  # the ratio's lower bound is 1 - clip_low (1: none, as CISPO's default)
        raise ValueError(f"clip_low must be <= 1 (the ratio is clipped below at 1 - clip_low), got {cfg.clip_low!r}")
    if cfg.horizon is not None and not cfg.horizon > 0:
        raise ValueError(f"horizon must be > 0 (or None: the batch's longest response), got {cfg.horizon!r}")
    if name in ("grpo", "dr_grpo", "dapo") and cfg.dual_clip is not None and not float(cfg.dual_clip) > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {cfg.dual_clip!r}")
    if name == "sapo":
        for field in ("tau_pos", "tau_neg"):
            if not float(getattr(cfg, field)) > 0.0:
                raise ValueError(f"{field} must be > 0, got {getattr(cfg, field)!r}")
    if name == "sft" and float(cfg.beta) != 0.0:
        raise ValueError(f"beta must be 0 for sft (an SFT run has no reference model), got {cfg.beta!r}")
    correction = cfg.rollout_correction
    if correction not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout_correction={correction!r}; expected one of {ROLLOUT_CORRECTIONS}")
    if correction != "none" and not float(cfg.correction_cap) > 0.0:
        raise ValueError(f"correction_cap must be > 0, got {cfg.correction_cap!r}")
    if name == "sft" and correction != "none":
        raise ValueError(f"rollout_correction must be none for sft (its targets are not sampled), got {correction!r}")


def compute_loss(cfg: Any, logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, ref_logprobs: Optional[torch.Tensor] = None, lazy: bool = False
                 ) -> tuple[torch.Tensor, Any]:
    """The loss selected by ``cfg.name`` and its metrics; each loss's formula and paper are in its
    config's docstring (:data:`LOSS_CONFIGS`). ``beta * kl_estimate(logprobs, ref_logprobs, kl_estimator)``
    is added to every per-token loss when ``beta > 0``; the sum is reduced by :func:`aggregate` with
    ``cfg.aggregation``.

    Args:
        cfg: a :class:`LossConfig` subclass instance, or an OmegaConf DictConfig with its fields.
        logprobs: [B, T] log pi_theta(y_t | x, y_<t) of the sampled tokens under the policy being
            trained; the only input that receives gradients. Any float dtype.
        behaviour_logprobs: [B, T] the same tokens' log-probs under the generator (pi_old, e.g. vLLM).
        advantages: [B] (one per sequence, broadcast over its tokens) or [B, T].
        mask: [B, T] bool or 0/1; True/1 on response tokens that count (not prompt or padding).
        ref_logprobs: [B, T] log-probs under the frozen reference model, or None. Required when
            ``cfg.beta > 0``; when given with beta = 0 it only feeds the KL metrics.
        lazy: return, instead of the metrics, a function that returns them: their one
            device->host copy (a GPU sync) waits until it is called, so a trainer can queue
            every micro-batch's work first.

    Returns:
        ``(loss, metrics)``: ``loss`` is a 0-dim float32 tensor (float64 for float64 inputs) to
        minimise. ``metrics`` maps to python floats, all over unmasked tokens:
        ``ratio_mean/min/max`` (the ratio the loss uses: r_t, or s_i for GSPO),
        ``clip_frac_low/high`` (share of tokens whose low/high clip is active, i.e. the
        clipped branch was taken; CISPO: weight clipped; REINFORCE: weight truncated, high
        only; SAPO has no hard clip: 0), ``kl_mean/max`` (of the chosen estimator; 0 without
        ``ref_logprobs``) and ``masked_frac`` (share of the B*T positions that are masked).
        Some losses add keys: ``clip_frac_dual`` (dual clip active), ``sapo_grad_weight_mean``.
        The train-inference mismatch, with rho_t = exp(sg(logprobs_t) - behaviour_logprobs_t) the
        trainer's probability of the sampled token over the sampler's: ``mismatch_kl`` = mean of
        rho - 1 - log rho (k3 estimate of KL(sampler || trainer), Schulman 2020; prime-rl's
        ``mismatch_kl``), ``mismatch_max`` = max |log rho|, ``is_ratio_mean/max`` (rho) and
        ``is_corrected_frac`` (share of tokens with rho > ``correction_cap``: truncated by ``tis``,
        masked by ``mis``, and counted under ``none`` too); 0 (ratios 1) for ``sft``.
        With no unmasked token, ratios read 1.0 and the other token metrics 0.0.

    Rollout correction (``cfg.rollout_correction``; Yao et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl; Liu et
    al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
    Mismatch", https://yingru.notion.site/When-Speed-Kills-Stability): ``none`` is each loss as its
    paper writes it, with pi_old = the sampler's log-probs. ``tis`` and ``mis`` take pi_old = the
    trainer's own log-probs sg(logprobs) (so the loss's ratio r_t is 1 in value: one optimizer step
    per batch) and weight every token's loss by w_t = min(rho_t, C) (``tis``, truncated) or
    w_t = rho_t * 1[rho_t <= C] (``mis``, masked), C = ``correction_cap``: the decoupled objective of
    AReaL (Fu et al. 2025, arXiv:2505.24298) with the current policy as the proximal one, as verl's
    ``rollout_correction`` computes it. For an episode generated by the current version rho_t is
    the kernels' and precisions' mismatch alone; for a stale one it also holds the policy's drift.

    Raises:
        ValueError: unknown ``cfg.name`` / ``kl_estimator`` / ``aggregation`` (the message
            names the field), bad parameter values, shapes that do not match [B, T] (or [B]
            for advantages), an empty batch, or ``beta > 0`` without ``ref_logprobs``.
        TypeError: inputs that are not tensors.
    """
    validate_loss(cfg)
    _check_2d("logprobs", logprobs)
    shape = logprobs.shape
    _check_2d("behaviour_logprobs", behaviour_logprobs, shape)
    _check_2d("mask", mask, shape)
    if ref_logprobs is not None:
        _check_2d("ref_logprobs", ref_logprobs, shape)
    if not isinstance(advantages, torch.Tensor):
        raise TypeError(f"advantages must be a torch.Tensor, got {type(advantages).__name__}")
    if advantages.shape not in (shape, shape[:1]):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected [B]={tuple(shape[:1])} "
                         f"or [B, T]={tuple(shape)}")
    if logprobs.numel() == 0:
        raise ValueError(f"empty batch: logprobs has shape {tuple(shape)}")
    beta = float(cfg.beta)
    if beta > 0 and ref_logprobs is None:
        raise ValueError(f"beta={beta} > 0 needs ref_logprobs (got None); set beta=0 to disable the KL term")
    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32  # bf16, fp16, ints: float32
    m = mask != 0
    # Zero every input on masked positions before any arithmetic: no inf/nan can leak.
    lp = torch.where(m, logprobs.to(dtype), 0.0)
    old = torch.where(m, behaviour_logprobs.detach().to(dtype), 0.0)
    adv = advantages.detach().to(dtype)
    adv = torch.where(m, adv.unsqueeze(1).expand(shape) if adv.dim() == 1 else adv, 0.0)
    # Train-inference mismatch: the trainer's own log-probs of the sampled tokens (sg(logprobs): this
    # version's weights, which generated the episode unless it is stale) against the sampler's.
    gap = torch.where(m, lp.detach() - old, 0.0)  # log rho_t
    rho = torch.exp(gap)
    correction, cap = cfg.rollout_correction, float(cfg.correction_cap)
    term = _policy_term(cfg, lp, old if correction == "none" else lp.detach(), adv, m)
    per_token = term.loss
    if correction == "tis":
        per_token = per_token * rho.clamp(max=cap)
    elif correction == "mis":
        per_token = per_token * torch.where(rho <= cap, rho, 0.0)
    kl = None
    if ref_logprobs is not None:
        kl = kl_estimate(lp, torch.where(m, ref_logprobs.detach().to(dtype), 0.0), cfg.kl_estimator)
        if beta > 0:
            per_token = per_token + beta * kl
    loss = aggregate(per_token, m, cfg.aggregation, cfg.horizon)
    metrics = _metrics(term, kl, None if cfg.name == "sft" else (gap, rho, cap), m)
    return loss, metrics if lazy else metrics()


def _metrics(term: _PolicyTerm, kl: Optional[torch.Tensor], mismatch: Optional[tuple], m: torch.Tensor
             ) -> Callable[[], dict[str, float]]:
    """Reduce the per-token statistics to the metrics of :func:`compute_loss` on their device; the
    returned function copies them to the host (one copy) and names them."""
    with torch.no_grad():
        dtype = term.ratio.dtype
        n = m.sum()
        denom = n.clamp(min=1).to(dtype)
        zero = torch.zeros((), dtype=dtype, device=m.device)

        def mean(x: torch.Tensor) -> torch.Tensor:
            return torch.where(m, x, zero).sum() / denom

        def frac(flags: Optional[torch.Tensor]) -> torch.Tensor:
            return zero if flags is None else (flags & m).sum().to(dtype) / denom

        r = term.ratio
        stats = [n.to(dtype), mean(r), torch.where(m, r, float("inf")).amin(), torch.where(m, r, -float("inf")).amax(),
                 frac(term.clipped_low), frac(term.clipped_high)]
        stats += [zero, zero] if kl is None else [mean(kl), torch.where(m, kl, -float("inf")).amax()]
        if mismatch is None:  # SFT: no sampler
            stats += [zero, zero, zero + 1, zero + 1, zero]
        else:
            gap, rho, cap = mismatch
            stats += [mean(torch.expm1(gap) - gap), torch.where(m, gap.abs(), zero).amax(), mean(rho),
                      torch.where(m, rho, zero).amax(), frac(rho > cap)]
        stats += [frac(v) if v.dtype == torch.bool else mean(v.to(dtype)) for v in term.extra.values()]
        stats = torch.stack(stats)
    keys, numel = METRIC_KEYS[:-1] + tuple(term.extra), m.numel()

    def host() -> dict[str, float]:
        count, *values = stats.tolist()
        out = dict(zip(keys, values))
        if count == 0:  # nothing unmasked: neutral values instead of +-inf / NaN
            out = {k: 1.0 if k.startswith(("ratio_", "is_ratio_")) else 0.0 for k in out}
        out["masked_frac"] = 1.0 - count / numel
        return out

    return host
