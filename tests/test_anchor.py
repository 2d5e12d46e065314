"""The trainer's anchor (benchmarks/anchor.py) on the CPU: its rows hold exactly the trainer's packed
tokens and loss positions, TorchTitan's block-causal FlexAttention mask keeps documents apart (a
packed row's logits equal each document's alone, on a tiny model, eager flex attention, fp32), both
sides' FLOPs come from one formula, and the ratio is printed truncated, never rounded up."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from benchmarks import anchor
from forge_core import titan
from forge_core.actors.trainer import micro_batches
from forge_core.packing import pack_batch


@dataclass
class Ep:
    prompt_ids: list
    response_ids: list


def episodes(n: int, seed: int = 0, vocab: int = 49152, prompt=(3, 9), response=(0, 12)) -> list:
    """``n`` episodes of random ids; some responses empty (``response[0]`` 0) as the trainer may get."""
    rnd = random.Random(seed)
    return [Ep([rnd.randrange(3, vocab) for _ in range(rnd.randint(*prompt))],
               [rnd.randrange(3, vocab) for _ in range(rnd.randint(*response))]) for _ in range(n)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_anchor_rows_are_the_trainers_packed_rows(world):
    eps, budget = episodes(23), 40
    total_loss = total_tokens = 0
    for rank in range(world):
        rows = anchor.anchor_rows(eps, budget, rank, world)
        plan = micro_batches(eps, rank, world, 1, budget)
        assert len(rows) == len(plan)
        for row, (idx, dummy) in zip(rows, plan):
            mb = pack_batch([eps[i] for i in idx], budget)
            assert row.dummy == dummy
            assert torch.equal(row.tokens, mb.tokens) and torch.equal(row.positions, mb.positions)
            assert row.tokens.shape == (1, budget)
            loss_at = (row.labels[0] != anchor.IGNORE_INDEX).nonzero().flatten()
            assert torch.equal(loss_at, mb.select.sort().values)  # the trainer's loss positions, no others
            assert torch.equal(row.labels[0, mb.select], mb.targets)
            assert torch.equal(row.labels[0, mb.select], row.tokens[0, mb.select + 1])  # next-token labels
            assert row.n_pad == mb.n_pad and sum(row.doc_lengths()) == budget
            if not dummy:
                total_loss += row.n_loss
                total_tokens += row.n_tokens
                assert row.n_loss == mb.select.numel()
    assert total_loss == sum(len(e.response_ids) for e in eps)
    assert total_tokens == sum(len(e.prompt_ids) + len(e.response_ids) for e in eps)


def test_anchor_rows_refuse_what_the_trainer_refuses():
    with pytest.raises(ValueError, match="tokens_per_micro_batch"):
        anchor.anchor_rows(episodes(3), 0)
    with pytest.raises(ValueError, match="tokens_per_micro_batch"):
        anchor.anchor_rows([Ep([5] * 30, [6] * 30)], 40)


def test_torchtitans_block_causal_mask_is_the_trainers_document_mask():
    eps, budget = episodes(9, seed=1), 32
    for row in anchor.anchor_rows(eps, budget):
        doc = [i for i, n in enumerate(row.doc_lengths()) for _ in range(n)]  # document of every position
        mb_doc = torch.tensor(doc)
        q, kv = torch.arange(budget)[:, None], torch.arange(budget)[None, :]
        got = anchor.document_mask_mod(row.ends)(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long),
                                                 q, kv)
        want = (q >= kv) & (mb_doc[q] == mb_doc[kv])
        assert torch.equal(got, want)
    # the documents are the trainer's: episodes, then each padding token alone
    idx, _ = micro_batches(eps, 0, 1, 1, budget)[0]
    mb = pack_batch([eps[i] for i in idx], budget)
    row = anchor.anchor_rows(eps, budget)[0]
    lengths = [len(eps[i].prompt_ids) + len(eps[i].response_ids) for i in idx] + [1] * mb.n_pad
    assert row.doc_lengths() == lengths


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_packed_row_gives_each_document_its_logits_alone(monkeypatch):
    """TorchTitan's own model with attn_type=flex and block_causal: logits of a packed row (eager flex
    attention, fp32, CPU) equal those of each document run alone (SDPA causal); a causal mask
    without the document mask does not (the check can fail)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.attention import FlexAttentionWrapper, get_causal_mask_mod

    monkeypatch.setattr(FlexAttentionWrapper, "_compiled_flex_attn", staticmethod(flex_attention))  # eager on CPU
    spec = titan.titan_model_args("tiny_llama")
    packed = titan.build_model(anchor.flex_spec(spec), torch.device("cpu"), 0).eval()
    alone = titan.build_model(spec, torch.device("cpu"), 0).eval()
    assert isinstance(packed.layers["0"].attention.inner_attention, FlexAttentionWrapper)
    eps, budget = episodes(3, seed=2, prompt=(4, 6), response=(3, 5)), 32
    row = anchor.anchor_rows(eps, budget)[0]
    assert row.n_pad > 0 and len(row.doc_lengths()) > 3
    with torch.no_grad():
        out = packed(row.tokens, attention_masks=anchor.attention_mask(packed, row.ends), positions=row.positions)
        causal = packed(row.tokens, attention_masks=create_block_mask(get_causal_mask_mod(), 1, None, budget, budget,
                                                                      device="cpu"), positions=row.positions)
    idx, _ = micro_batches(eps, 0, 1, 1, budget)[0]
    o, leaked = 0, 0.0
    for i in idx:
        ids = torch.tensor([eps[i].prompt_ids + eps[i].response_ids])
        with torch.no_grad():
            ref = alone(ids)[0]
        n = ids.shape[1]
        torch.testing.assert_close(out[0, o:o + n], ref, rtol=1e-4, atol=1e-4)
        leaked = max(leaked, float((causal[0, o:o + n] - ref).abs().max()))
        o += n
    assert leaked > 1e-3  # without the document mask the later documents see the earlier ones


def test_both_sides_flops_come_from_one_formula():
    spec = titan.titan_model_args("tiny_llama")  # tied embeddings
    h = spec.hf
    D, V = h["hidden_size"], h["vocab_size"]
    L, H = h["num_hidden_layers"], h["num_attention_heads"]
    n_all = sum(k for *_, k in titan.hf_layout(h))  # tied: the embedding once, it is also the head
    for n in (1, 17, 300):  # one document, logits everywhere: TorchTitan's 6 N + 12 L H hd T per token
        per_token = 6 * (n_all - V * D) + 6 * D * V + 12 * L * H * (D // H) * n
        assert titan.step_flops(spec, [n], n) == pytest.approx(n * per_token, rel=1e-12)
        assert titan.step_flops(spec, [n], n, frozen=True) == pytest.approx(
            n * (4 * (n_all - V * D) + 4 * D * V + 12 * L * H * (D // H) * n), rel=1e-12)
    eps, budget = episodes(23), 40
    for world in (1, 2):
        fl = anchor.plan_flops(spec, eps, budget, world)
        rows = [r for k in range(world) for r in anchor.anchor_rows(eps, budget, k, world)]
        positions = sum(r.tokens.shape[1] for r in rows)
        assert fl["tokens"] == sum(len(e.prompt_ids) + len(e.response_ids) for e in eps)
        assert fl["loss_tokens"] == sum(len(e.response_ids) for e in eps)
        # the two executed counts differ only by where the output layer runs
        ours_logits = sum(int((r.labels != anchor.IGNORE_INDEX).sum()) for r in rows)
        assert fl["anchor"] - fl["ours"] == pytest.approx(6.0 * D * V * (positions - ours_logits), rel=1e-9)
        assert fl["useful"] <= fl["ours"] < fl["anchor"]
        # the useful FLOPs: every episode as a document, its response positions in the loss
        lens = [len(e.prompt_ids) + len(e.response_ids) for e in eps]
        assert fl["useful"] == titan.step_flops(spec, lens, fl["loss_tokens"])
    assert anchor.mfu(2e15, 2.0, 1000.0, 1) == pytest.approx(1.0)
    assert anchor.mfu(1e15, 1.0, 1000.0, 2) == pytest.approx(0.5)
    assert anchor.mfu(1e15, 1.0, 0.0) == 0.0


def test_the_bench_counts_both_sides_with_the_same_function():
    import inspect

    from benchmarks import bench_gpu

    src = inspect.getsource(bench_gpu.section_train)
    assert "plan_flops(" in src and 'for k in ("ours", "useful")' in src  # ours' MFU from plan_flops too
    assert "ratio_text(" in src and ":.0%} of the anchor" not in src
    run_src = inspect.getsource(anchor.run)
    assert "plan_flops(" in run_src


@pytest.mark.parametrize("x,text", [(0.8999, "0.899"), (0.9, "0.900"), (0.57, "0.570"), (0.12345, "0.123"),
                                    (0.9999, "0.999"), (1.0049, "1.00"), (1.0, "1.00"), (12.999, "12.9"),
                                    (123.9, "123"), (0.0012349, "0.00123"), (0.0, "0")])
def test_the_ratio_is_truncated_to_three_significant_digits(x, text):
    assert anchor.ratio_text(x) == text


def test_episodes_travel_to_the_anchor_process_unchanged(tmp_path):
    eps = episodes(5)
    path = str(tmp_path / "eps.json")
    anchor.save_episodes(eps, path)
    back = anchor.load_episodes(path)
    assert [(e.prompt_ids, e.response_ids) for e in back] == [(e.prompt_ids, e.response_ids) for e in eps]
    (tmp_path / "bad.json").write_text("[[1, 2]]")
    with pytest.raises(ValueError, match="entry 0"):
        anchor.load_episodes(str(tmp_path / "bad.json"))
