"""The trainer actor: the policy, AdamW, gradient clipping and the configured RL loss.

One :meth:`Trainer.train_step` is one optimizer step over a batch of episodes (split into
micro-batches of ``trainer.micro_batch_size`` sequences with gradient accumulation). After it,
:meth:`Trainer.publish` snapshots the weights for the generator (:mod:`forge_core.weight_sync`).
"""

from __future__ import annotations

import json
import os
import time

import torch
from monarch.actor import Actor, endpoint

from forge_core.actors import setup_process
from forge_core.episode import Episode, collate
from forge_core.losses import compute_loss
from forge_core.models import load_model, response_logprobs
from forge_core.weight_sync import FlatWeights, WeightHandle

_SUM_KEYS = ("train_tokens",)
_MAX_KEYS = ("ratio_max", "kl_max")
_MIN_KEYS = ("ratio_min",)


class Trainer(Actor):
    """Holds the policy (fp32 master weights) and its AdamW state.

    Args:
        cfg: the run's config as a plain dict.
    """

    def __init__(self, cfg: dict):
        from omegaconf import OmegaConf

        self.cfg = OmegaConf.create(cfg)
        setup_process(self.cfg.threads_per_actor, self.cfg.seed)
        self.model = load_model(self.cfg.model)
        self.model.train()
        t = self.cfg.trainer
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=tuple(t.betas),
                                     weight_decay=t.weight_decay)
        self.weights = FlatWeights(self.model, share=False, dtype=getattr(torch, self.cfg.generator.dtype))
        self.version = 0
        self.pad_id = 0
        loss = OmegaConf.to_container(self.cfg.loss)
        if loss["aggregation"] == "fixed_horizon" and loss.get("horizon") is None:
            loss["horizon"] = self.cfg.generator.max_response_tokens  # Dr. GRPO: the generation budget
        self.loss_cfg = OmegaConf.create(loss)
        self.autocast = t.compute_dtype == "bfloat16"

    def _rows_share(self, chunk_b, total_rows: int, total_tokens: float) -> float:
        if self.loss_cfg.aggregation == "token_mean":
            return float(chunk_b.response_mask.sum()) / max(total_tokens, 1.0)
        if self.loss_cfg.aggregation == "seq_mean":
            return float((chunk_b.response_mask.sum(-1) > 0).sum()) / max(total_rows, 1)
        return chunk_b.response_mask.shape[0] / max(total_rows, 1)

    @endpoint
    async def train_step(self, episodes: list[Episode]) -> dict:
        """One optimizer step on ``episodes`` (which carry advantages, behaviour and ref logprobs).

        Returns metrics: ``loss``, ``grad_norm``, ``kl_mean``, ``kl_max``, ``clip_frac`` (low + high),
        ``ratio_mean/min/max``, ``train_s`` (seconds), ``train_tokens``, ``version`` (after the step).
        Raises:
            FloatingPointError: if the loss or gradient norm is not finite (weights are not updated).
        """
        t0 = time.perf_counter()
        mb = self.cfg.trainer.micro_batch_size
        chunks = [episodes[i:i + mb] for i in range(0, len(episodes), mb)]
        total_rows = sum(1 for e in episodes if e.response_ids)
        total_tokens = float(sum(len(e.response_ids) for e in episodes))
        agg: dict[str, float] = {}
        self.opt.zero_grad(set_to_none=True)
        for chunk in chunks:
            b = collate(chunk, self.pad_id)
            share = self._rows_share(b, total_rows, total_tokens)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                lp = response_logprobs(self.model, b.input_ids, b.attention_mask, b.prompt_len,
                                       self.cfg.generator.temperature)
            loss, m = compute_loss(self.loss_cfg, lp, b.behaviour_logprobs, b.advantages, b.response_mask,
                                   b.ref_logprobs)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"trainer: non-finite loss {loss.item()} at policy version {self.version}")
            (loss * share).backward()
            m["loss"] = loss.item()
            m["train_tokens"] = float(b.response_mask.sum())
            for k, v in m.items():
                if k in _SUM_KEYS:
                    agg[k] = agg.get(k, 0.0) + v
                elif k in _MAX_KEYS:
                    agg[k] = max(agg.get(k, -float("inf")), v)
                elif k in _MIN_KEYS:
                    agg[k] = min(agg.get(k, float("inf")), v)
                else:
                    agg[k] = agg.get(k, 0.0) + share * v
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.max_grad_norm)
        if not torch.isfinite(grad_norm):
            self.opt.zero_grad(set_to_none=True)
            raise FloatingPointError(f"trainer: non-finite gradient norm at policy version {self.version}")
        self.opt.step()
        self.version += 1
        agg["clip_frac"] = agg.get("clip_frac_low", 0.0) + agg.get("clip_frac_high", 0.0)
        agg.update(grad_norm=float(grad_norm), train_s=time.perf_counter() - t0, version=self.version)
        return agg

    @endpoint
    async def publish(self) -> WeightHandle:
        """Snapshot the current weights into the staging buffer; a handle to the new version."""
        self.weights.snapshot()
        return self.weights.handle(self.version)

    @endpoint
    async def get_version(self) -> int:
        """Number of optimizer steps applied (the policy version)."""
        return self.version

    @endpoint
    async def weights_digest(self) -> str:
        """sha256 of the live weights (see :meth:`FlatWeights.digest`)."""
        return self.weights.digest()

    @endpoint
    async def state_dict(self) -> dict:
        """The live weights as ``{name: tensor}`` (for tests on small models)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @endpoint
    async def save(self, path: str, optimizer: bool = True) -> None:
        """Write the policy as HF safetensors (``save_pretrained``) into ``path``, plus
        ``optimizer.pt`` (AdamW state, torch RNG state) and ``trainer.json`` (version)."""
        os.makedirs(path, exist_ok=True)
        self.model.save_pretrained(path, safe_serialization=True)
        if optimizer:
            torch.save({"optimizer": self.opt.state_dict(), "rng": torch.get_rng_state()},
                       os.path.join(path, "optimizer.pt"))
        with open(os.path.join(path, "trainer.json"), "w") as f:
            json.dump({"version": self.version}, f)

    @endpoint
    async def load(self, path: str) -> int:
        """Restore weights, optimizer, RNG and version written by :meth:`save`. Returns the version.

        Raises:
            FileNotFoundError: naming the missing checkpoint file.
        """
        from safetensors.torch import load_file

        st = os.path.join(path, "model.safetensors")
        if not os.path.isfile(st):
            raise FileNotFoundError(f"checkpoint has no weights: {st}")
        missing, unexpected = self.model.load_state_dict(load_file(st), strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
        if missing or unexpected:
            raise ValueError(f"checkpoint {st} does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
        opt = torch.load(os.path.join(path, "optimizer.pt"), weights_only=False)
        self.opt.load_state_dict(opt["optimizer"])
        torch.set_rng_state(opt["rng"])
        with open(os.path.join(path, "trainer.json")) as f:
            self.version = json.load(f)["version"]
        return self.version
