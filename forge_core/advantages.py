"""Group-relative advantages: how the rewards of a prompt's G samples become one advantage each.

The estimators (z-score, mean-only, RLOO) and DAPO's dynamic-sampling filter, with the papers'
equations cited at each function; the losses that consume these live in :mod:`forge_core.losses`.
"""

from dataclasses import dataclass
from typing import Any

import torch

ADVANTAGE_ESTIMATORS = ("zscore", "mean", "rloo")


@dataclass
class AdvantageConfig:
    """How rewards of a group of samples of one prompt become advantages.

    Attributes:
        estimator: ``"zscore"`` (GRPO), ``"mean"`` (Dr. GRPO: no std normalisation) or ``"rloo"``
            (leave-one-out baseline); :func:`group_advantages` gives each formula and its paper.
        eps: added to the group std by ``zscore``.
        drop_zero_variance: DAPO's dynamic sampling (arXiv:2503.14476 eq. 11, Sec. 3.2): drop
            groups whose rewards are all equal (they carry no signal, see
            :func:`compute_advantages`) and sample new prompts in their place, so a step still
            trains on ``prompts_per_step`` groups.
        max_refills: with ``drop_zero_variance``, rounds of new prompts for the groups one batch
            lost; the groups still lost after them are kept (advantage 0: no policy gradient).
    """

    estimator: str = "zscore"
    eps: float = 1e-6
    drop_zero_variance: bool = False
    max_refills: int = 4


def group_advantages(rewards: torch.Tensor, estimator: str = "zscore", eps: float = 1e-6
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages of ``rewards`` [N, G] (N prompts with G samples each; any real dtype,
    finite): ``(advantages [N, G] float32, zero_variance [N] bool)``, on ``rewards``' device.

    For a group of G rewards R_1..R_G of one prompt, mean m and *unbiased* std s (Bessel's
    G - 1, as ``torch.std``):

    * ``zscore``: A_i = (R_i - m) / (s + eps)        GRPO, arXiv:2402.03300 sec. 4.1.2;
    * ``mean``:   A_i = R_i - m                       Dr. GRPO, arXiv:2503.20783 sec. 3.2;
    * ``rloo``:   A_i = R_i - 1/(G-1) sum_{j!=i} R_j = G/(G-1) (R_i - m)
      (REINFORCE leave-one-out, arXiv:2402.14740 eq. 5; Kool et al. 2019).

    A group whose rewards are all exactly equal is flagged ``zero_variance`` and gets
    advantages exactly 0 with every estimator (DAPO, arXiv:2503.14476: such groups give no
    gradient). Computed in float64. With G = 1, ``zscore`` and ``mean`` return 0 (every group is
    flagged).

    Raises:
        ValueError: unknown ``estimator`` (names the field), rewards not 2-D or not finite,
            ``rloo`` with G < 2, or negative ``eps``.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown estimator={estimator!r}; expected one of {ADVANTAGE_ESTIMATORS}")
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 2:
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a [N, G] tensor, got {shape}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    n_groups, group = rewards.shape
    r = rewards.detach().to(torch.float64)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite (found nan or inf)")
    if group == 0:
        return r.float(), torch.zeros(n_groups, dtype=torch.bool, device=r.device)
    zero_variance = (r == r[:, :1]).all(dim=1)
    centred = r - r.mean(dim=1, keepdim=True)
    if estimator == "zscore":
        adv = centred / (r.std(dim=1, keepdim=True) + eps) if group > 1 else torch.zeros_like(r)
    elif estimator == "mean":
        adv = centred
    else:
        if group < 2:
            raise ValueError(f"estimator='rloo' needs at least 2 samples per group, got G={group}")
        adv = centred * (group / (group - 1))
    adv = torch.where(zero_variance.unsqueeze(1), torch.zeros_like(adv), adv)
    return adv.float(), zero_variance


def compute_advantages(rewards: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Advantages of ``rewards`` [N, G] (N prompts x G samples) per ``cfg`` (an :class:`AdvantageConfig`
    or a DictConfig with its fields), with DAPO's dynamic-sampling filter.

    Returns:
        ``(advantages [N, G] float32, keep [N] bool, metrics)``. ``keep`` is False for the
        groups to drop (zero-variance groups when ``cfg.drop_zero_variance``, else all True):
        train on ``advantages[keep]``. ``metrics``: ``zero_variance_groups`` (count),
        ``zero_variance_frac`` and ``dropped_groups`` (count), as python floats.

    Raises:
        ValueError: as :func:`group_advantages`.
    """
    adv, zero_variance = group_advantages(rewards, cfg.estimator, float(cfg.eps))
    keep = ~zero_variance if bool(cfg.drop_zero_variance) else torch.ones_like(zero_variance)
    n_zero, n = int(zero_variance.sum()), max(zero_variance.numel(), 1)
    return adv, keep, {"zero_variance_groups": float(n_zero), "zero_variance_frac": n_zero / n,
                       "dropped_groups": float(int((~keep).sum()))}

