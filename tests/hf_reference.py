"""The HF transformers reference for response logprobs: what the TorchTitan path (forge_core.titan) is checked against."""

import torch


def response_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                      temperature: float = 1.0) -> torch.Tensor:
    """Per-token logprobs of the response tokens under ``model``.

    The batch is laid out as the generator lays it out: prompts left-padded to ``prompt_len``
    columns, responses right-padded after them.

    Args:
        input_ids: ``[B, P + R]`` token ids (int64), ``P = prompt_len``.
        attention_mask: ``[B, P + R]`` 1 for real tokens, 0 for padding.
        prompt_len: ``P``.
        temperature: the sampling temperature; logits are divided by it (as the sampler did).
    Returns:
        ``[B, R]`` float32 logprobs of ``input_ids[:, P:]``; values under padding are meaningless.
    The lm head runs only on the ``R`` response positions, not the prompt (saves ~P/(P+R) of it).
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    logits = model.lm_head(hidden[:, prompt_len - 1:-1]).float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, prompt_len:]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
