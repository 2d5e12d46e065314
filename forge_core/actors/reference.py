"""The reference model actor: the frozen initial policy, giving reference logprobs for the KL term."""

from __future__ import annotations

import time

import torch
from monarch.actor import Actor, endpoint

from forge_core.actors import setup_process
from forge_core.episode import Episode, collate
from forge_core.models import load_model, response_logprobs
from forge_core.weight_sync import FlatWeights, WeightHandle


class Reference(Actor):
    """Frozen copy of the initial policy. It takes version 0 from the trainer once
    (:meth:`load_initial`), so it equals the policy the run started from bit for bit."""

    def __init__(self, cfg: dict):
        from omegaconf import OmegaConf

        self.cfg = OmegaConf.create(cfg)
        setup_process(self.cfg.threads_per_actor, self.cfg.seed)
        self.model = load_model(self.cfg.model, dtype=getattr(torch, self.cfg.generator.dtype))
        self.model.requires_grad_(False)
        self.weights = FlatWeights(self.model, share=True)
        self.pad_id = 0

    @endpoint
    async def load_initial(self, handle: WeightHandle) -> float:
        """Pull the trainer's version-0 weights. Returns seconds."""
        if handle.version != 0:
            raise ValueError(f"reference model must be the initial policy (version 0), got version {handle.version}")
        return await self.weights.pull(handle)

    @endpoint
    async def logprobs(self, episodes: list[Episode]) -> tuple[list[Episode], float]:
        """Fill ``ref_logprobs`` (``[R_i]`` per episode); also returns the seconds spent."""
        t0 = time.perf_counter()
        mb = self.cfg.trainer.micro_batch_size
        with torch.no_grad():
            for i in range(0, len(episodes), mb):
                chunk = episodes[i:i + mb]
                b = collate(chunk, self.pad_id)
                lp = response_logprobs(self.model, b.input_ids, b.attention_mask, b.prompt_len,
                                       self.cfg.generator.temperature)
                for e, row in zip(chunk, lp):
                    e.ref_logprobs = row[:len(e.response_ids)].tolist()
        return episodes, time.perf_counter() - t0
