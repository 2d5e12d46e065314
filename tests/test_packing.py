"""forge_core.packing on CPU (fp32): packing layout, packed vs padded logprobs / loss / grads for
the three TorchTitan model shapes used here, chunked vs full logprobs, the flex mask (forward
only: CPU FlexAttention has no backward) and a bf16 autocast smoke test."""

import copy
import random
from types import SimpleNamespace

import pytest
import torch

from forge_core import titan
from forge_core.episode import collate
from forge_core.losses import compute_loss, make_loss_config
from forge_core.packing import (chunked_logprobs, enable_packed_attention, pack_batch, pack_episodes,
                                packed_attention_mask, packed_response_logprobs)

CPU = torch.device("cpu")


def _spec(kind):
    if kind == "tiny_llama":  # Qwen3Model without qk norms, tied embeddings, GQA
        return titan.titan_model_args("tiny_llama", max_seq_len=256)
    if kind == "qwen3":
        from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

        args = Qwen3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, head_dim=32,
                              hidden_dim=96, qk_norm=True, max_seq_len=256)
        return titan.TitanSpec("qwen3", args, {})
    from torchtitan.models.llama3.model.args import TransformerModelArgs

    args = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, multiple_of=32,
                                rope_theta=500000, max_seq_len=256)
    return titan.TitanSpec("llama3", args, {})


def _episodes(vocab, shapes, seed=0):
    g = random.Random(seed)
    return [SimpleNamespace(prompt_ids=[g.randrange(vocab) for _ in range(p)],
                            response_ids=[g.randrange(vocab) for _ in range(r)],
                            behaviour_logprobs=[-g.random() * 5 for _ in range(r)],
                            ref_logprobs=[-g.random() * 5 for _ in range(r)],
                            advantage=g.gauss(0, 1)) for p, r in shapes]


SHAPES = [(5, 1), (17, 9), (3, 20), (11, 4), (8, 13)]  # ragged, one response of length 1


def _models(kind):
    spec = _spec(kind)
    ref = titan.build_model(spec, CPU, seed=0)
    packed = copy.deepcopy(ref)
    assert enable_packed_attention(packed) == "sdpa"
    return spec, ref, packed


def test_pack_episodes_covers_every_index_within_budget():
    g = random.Random(1)
    for _ in range(50):
        lens = [g.randint(0, 100) for _ in range(g.randint(1, 40))]
        budget = g.randint(100, 300)
        bins = pack_episodes(lens, budget)
        assert sorted(i for b in bins for i in b) == list(range(len(lens)))
        assert all(sum(lens[i] for i in b) <= budget for b in bins)
        assert bins == pack_episodes(lens, budget)
    assert pack_episodes([6, 5, 4, 3, 2], 10) == [[0, 2], [1, 3, 4]]  # first-fit decreasing
    with pytest.raises(ValueError, match=r"episode 1 has 12 tokens.*trainer\.tokens_per_micro_batch=10"):
        pack_episodes([3, 12], 10)


def test_pack_batch_layout():
    eps = _episodes(50, [(2, 3), (3, 1)])
    mb = pack_batch(eps, 12, pad_id=7)
    toks = eps[0].prompt_ids + eps[0].response_ids + eps[1].prompt_ids + eps[1].response_ids + [7] * 3
    assert mb.tokens.tolist() == [toks]
    assert mb.positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0, 0]]
    assert mb.doc_ids.tolist() == [[0] * 5 + [1] * 4 + [2, 3, 4]]  # each padding token its own document
    assert mb.cu_seqlens.tolist() == [0, 5, 9, 12]
    assert mb.select.tolist() == [1, 2, 3, 7]
    assert mb.targets.tolist() == eps[0].response_ids + eps[1].response_ids
    assert (mb.rows.tolist(), mb.cols.tolist()) == ([0, 0, 0, 1], [0, 1, 2, 0])
    with pytest.raises(ValueError, match="trainer.tokens_per_micro_batch=8"):
        pack_batch(eps, 8)


@pytest.mark.parametrize("kind", ["tiny_llama", "qwen3", "llama3"])
def test_packed_matches_padded_logprobs_loss_and_grads(kind):
    spec, ref, packed = _models(kind)
    eps = _episodes(spec.args.vocab_size, SHAPES)
    batch = collate(eps, pad_id=0)
    R = batch.response_mask.shape[1]
    want = titan.response_logprobs(ref, eps, R, 0.8, CPU)
    got = packed_response_logprobs(packed, pack_batch(eps, 128), R, 0.8, chunk_size=16)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).abs().max() < 1e-5
    assert (got[batch.response_mask == 0] == 0).all()

    cfg = make_loss_config("grpo")  # beta > 0: the KL term is in the loss too
    torch.manual_seed(0)
    old = (want.detach() + 0.1 * torch.randn_like(want)) * batch.response_mask  # near on-policy: O(1) loss
    ref_lp = (want.detach() + 0.1 * torch.randn_like(want)) * batch.response_mask
    losses = []
    for m, lp in ((ref, want), (packed, got)):
        loss, _ = compute_loss(cfg, lp, old, batch.advantages, batch.response_mask, ref_lp)
        loss.backward()
        losses.append(loss)
    assert (losses[0] - losses[1]).abs() < 1e-5
    for (n, a), (_, b) in zip(ref.named_parameters(), packed.named_parameters()):
        assert (a.grad - b.grad).abs().max() < 1e-5 * max(1.0, a.grad.abs().max().item()), n


def test_several_micro_batches_and_a_single_episode():
    spec, ref, packed = _models("tiny_llama")
    eps = _episodes(spec.args.vocab_size, SHAPES + [(30, 2), (2, 30)], seed=3)
    R = collate(eps, 0).response_mask.shape[1]
    with torch.no_grad():
        want = titan.response_logprobs(ref, eps, R, 1.0, CPU)
        groups = pack_episodes([len(e.prompt_ids) + len(e.response_ids) for e in eps], 40)
        assert len(groups) > 1 and any(len(g) == 1 for g in groups)
        got = torch.zeros_like(want)
        for g in groups:
            got[g] = packed_response_logprobs(packed, pack_batch([eps[i] for i in g], 40), R, 1.0, chunk_size=7)
    assert (got - want).abs().max() < 1e-5


def test_activation_checkpointing_wrapper_keeps_packed_attention():
    spec, ref, packed = _models("qwen3")
    ac = titan.build_model(spec, CPU, seed=0, parallelize=titan.parallelize_fn(spec, 1, 1, ac=True, seq_len=128))
    enable_packed_attention(ac)
    eps = _episodes(spec.args.vocab_size, SHAPES)
    mb = pack_batch(eps, 128)
    for m in (packed, ac):
        packed_response_logprobs(m, mb, 32).sum().backward()
    grads = {titan.clean_name(n): p.grad for n, p in ac.named_parameters()}
    for n, p in packed.named_parameters():
        assert (p.grad - grads[n]).abs().max() < 1e-5, n


def test_flex_block_mask_matches_dense_mask(monkeypatch):
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    from torchtitan.models.attention import FlexAttentionWrapper

    monkeypatch.setattr(FlexAttentionWrapper, "_compiled_flex_attn", flex_attention)  # eager: CPU forward only
    spec, _, dense = _models("qwen3")
    flex = copy.deepcopy(dense)
    assert enable_packed_attention(flex, "flex") == "flex"
    eps = _episodes(spec.args.vocab_size, SHAPES)
    mb = pack_batch(eps, 100)
    assert isinstance(packed_attention_mask(flex, mb), BlockMask)
    with torch.no_grad():
        a = packed_response_logprobs(dense, mb, 32)
        b = packed_response_logprobs(flex, mb, 32)
    assert (a - b).abs().max() < 1e-5


def test_flex_padding_attends_only_to_itself():
    spec, _, flex = _models("qwen3")
    enable_packed_attention(flex, "flex")
    eps = _episodes(spec.args.vocab_size, SHAPES)
    mb = pack_batch(eps, 100)
    n = 100 - mb.n_pad
    q, kv = torch.arange(100)[:, None], torch.arange(100)[None]
    m = packed_attention_mask(flex, mb).mask_mod(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), q, kv)
    assert mb.n_pad > 0 and m[n:].equal(torch.eye(100, dtype=torch.bool)[n:])  # a diagonal, not a square
    assert not m[:n, n:].any() and m[:n, :n].equal(torch.ones(n, n, dtype=torch.bool).tril() & (mb.doc_ids[0, :n, None] == mb.doc_ids[0, None, :n]))


@pytest.mark.parametrize("chunk", [1, 7, 37, 64])
def test_chunked_matches_full_logprobs_and_grads(chunk):
    torch.manual_seed(0)
    N, D, V, T = 37, 16, 101, 0.7
    h = torch.randn(N, D, requires_grad=True)
    w = (0.3 * torch.randn(V, D)).requires_grad_()  # logprobs down to about -ln(V) * 2.5, as in LLMs
    y = torch.randint(V, (N,))
    up = torch.randn(N)
    full = torch.log_softmax((h @ w.T) / T, dim=-1).gather(1, y[:, None]).squeeze(1)
    gh, gw = torch.autograd.grad((full * up).sum(), (h, w))
    got = chunked_logprobs(h, w, y, T, chunk)
    ch, cw = torch.autograd.grad((got * up).sum(), (h, w))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ch, gh, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cw, gw, rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_chunks_match_the_eager_chunks(dtype):
    """The compiled element-wise path (CUDA's default) against the eager one: the same logprobs and
    gradients up to float32 reduction order, on a last chunk shorter than the others (dynamic shape)."""
    torch.manual_seed(0)
    N, D, V, T = 37, 16, 101, 0.7
    h = torch.randn(N, D, dtype=dtype, requires_grad=True)
    w = (0.3 * torch.randn(V, D)).to(dtype).requires_grad_()
    y, up = torch.randint(V, (N,)), torch.randn(N)
    for chunk in (16, 7):
        ref = chunked_logprobs(h, w, y, T, chunk, fused=False)
        rh, rw = torch.autograd.grad((ref * up).sum(), (h, w))
        got = chunked_logprobs(h, w, y, T, chunk, fused=True)
        gh, gw = torch.autograd.grad((got * up).sum(), (h, w))
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gh, rh, **tol)
        torch.testing.assert_close(gw, rw, **tol)


def test_chunked_logprobs_errors_and_empty():
    w = torch.randn(5, 3)
    assert chunked_logprobs(torch.zeros(0, 3), w, torch.zeros(0, dtype=torch.long)).shape == (0,)
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs(torch.randn(2, 3), w, torch.zeros(2, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        chunked_logprobs(torch.randn(2, 4), w, torch.zeros(2, dtype=torch.long))


def test_packed_errors():
    spec, ref, packed = _models("llama3")
    eps = _episodes(spec.args.vocab_size, SHAPES)
    with pytest.raises(ValueError, match="enable_packed_attention"):
        packed_response_logprobs(ref, pack_batch(eps, 128), 32)
    with pytest.raises(ValueError, match="R=8"):
        packed_response_logprobs(packed, pack_batch(eps, 128), 8)
    with pytest.raises(ValueError, match="empty prompt"):
        pack_batch(_episodes(10, [(0, 3)]), 16)


def test_bf16_autocast_smoke():
    spec, _, packed = _models("tiny_llama")
    eps = _episodes(spec.args.vocab_size, SHAPES)
    mb = pack_batch(eps, 128)
    fp32 = packed_response_logprobs(packed, mb, 32, chunk_size=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = packed_response_logprobs(packed, mb, 32, chunk_size=16)
    assert bf16.dtype == torch.float32 and torch.isfinite(bf16).all()
    assert (bf16 - fp32).abs().max() < 0.15
    bf16.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in packed.parameters() if p.grad is not None)


def _sharded_worker(rank, cases, init_file):
    """One of 2 gloo ranks, for each ``(kind, tp)`` of ``cases`` in turn: TorchTitan's own parallelize
    (FSDP2 when tp=1, TP when tp=2, fp32 params) vs an unsharded copy of the same weights; packed
    logprobs and grads must agree."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as pdm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    pdm.device_type = "cpu"  # TorchTitan assumes CUDA when no accelerator is found
    for kind, tp in cases:
        _sharded_case(kind, tp)
    dist.destroy_process_group()


def _sharded_case(kind: str, tp: int) -> None:
    """:func:`_sharded_worker`'s check for one model kind and TP degree (the process group is up)."""
    import torchtitan.distributed.parallel_dims as pdm
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import distribute_tensor

    spec = _spec(kind)
    jc = titan.job_config(128, ac=False, tp=tp)
    jc.training.mixed_precision_param = "float32"
    pd = pdm.ParallelDims(dp_replicate=1, dp_shard=2 // tp, cp=1, tp=tp, pp=1, ep=1, etp=1, world_size=2)
    pd.build_mesh()
    if spec.family == "llama3":
        from torchtitan.models.llama3.infra.parallelize import parallelize_llama as fn
    else:
        from torchtitan.models.qwen3.infra.parallelize import parallelize_qwen3 as fn
    ref = titan.build_model(spec, CPU, seed=0)
    m = titan.build_model(spec, CPU, seed=0, parallelize=lambda mm: fn(mm, pd, jc))
    sd = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.to_local().copy_(distribute_tensor(sd[titan.clean_name(n)], p.device_mesh, p.placements).to_local())
    for mod in m.modules():
        if isinstance(mod, FSDPModule):
            mod.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    for model in (ref, m):
        enable_packed_attention(model)
    mb = pack_batch(_episodes(spec.args.vocab_size, SHAPES), 128)
    up = torch.randn(len(SHAPES), 32, generator=torch.Generator().manual_seed(0))
    a, b = (packed_response_logprobs(x, mb, 32, 0.8, chunk_size=16) for x in (ref, m))
    (a * up).sum().backward()
    (b * up).sum().backward()
    assert (a - b).abs().max() < 1e-5
    for n, p in m.named_parameters():
        g = p.grad.full_tensor() / (2 // tp)  # FSDP summed the two ranks' identical grads
        assert (g - sd[titan.clean_name(n)].grad).abs().max() < 1e-5, n


def test_fsdp2_and_tp_fallback_on_two_gloo_ranks(tmp_path):
    """FSDP2 (Qwen3, tp=1): chunked logprobs run inside ``model.output`` with the unsharded weight;
    TP (Llama 3, tp=2): the DTensor full-logits fallback; both in one pair of rank processes. (TP with
    Qwen3 hands DTensors to the CPU dense attention: not covered; TorchTitan's tied-embedding FSDP
    fails in parallelize on torch 2.13.)"""
    torch.multiprocessing.spawn(_sharded_worker, args=([("qwen3", 1), ("llama3", 2)], str(tmp_path / "init")),
                                nprocs=2)


# ---- GPU (marker ``gpu``; skipped without CUDA): the flex path as the trainer runs it --------------


@pytest.mark.parametrize("kind", ["qwen3", "llama3"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compiled_flex_with_ac_matches_padded(kind):
    """TorchTitan's compiled flex attention (per-block ``torch.compile`` + full AC, as
    ``titan.parallelize_fn``) vs the padded SDPA path, fp32; then two more micro-batches of other
    layouts must not recompile anything."""
    dev = torch.device("cuda")
    spec = _spec(kind)
    ref = titan.build_model(spec, dev, seed=0)
    m = titan.build_model(spec, dev, seed=0, parallelize=titan.parallelize_fn(spec, 1, 1, ac=True, seq_len=256,
                                                                              compile=True))
    sd = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(sd[titan.clean_name(n)])
    assert enable_packed_attention(m) == "flex"
    eps = _episodes(spec.args.vocab_size, SHAPES)
    want = titan.response_logprobs(ref, eps, 32, 0.8, dev)
    got = packed_response_logprobs(m, pack_batch(eps, 256).to(dev), 32, 0.8, chunk_size=16)
    assert (got - want).abs().max() < 1e-3
    up = torch.randn(want.shape, device=dev)
    (want * up).sum().backward()
    (got * up).sum().backward()
    for n, p in m.named_parameters():
        g = sd[titan.clean_name(n)].grad
        assert (p.grad - g).abs().max() < 1e-3 * max(1.0, g.abs().max().item()), n
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (1, 2):
            other = _episodes(spec.args.vocab_size, [(p + seed, r) for p, r in reversed(SHAPES)], seed)
            packed_response_logprobs(m, pack_batch(other, 256).to(dev), 32).sum().backward()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_chunked_logprobs_bf16_memory_at_qwen3_1_7b_vocab():
    """Qwen3-1.7B's output shape, 8192 response tokens, bf16: close to the fp32 full-logits
    result, and the extra memory far below the 5 GB of fp32 ``[N, V]`` logits."""
    dev = torch.device("cuda")
    N, D, V = 8192, 2048, 151936
    torch.manual_seed(0)
    h = (torch.randn(N, D, device=dev) / 2).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, D, device=dev) * D ** -0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(V, (N,), device=dev)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp = chunked_logprobs(h, w, y, 1.0, 1024)
    lp.sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 0.5 * N * V * 4, f"{extra / 2**30:.2f} GiB"
    hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    full = torch.log_softmax(hf @ wf.T, dim=-1).gather(1, y[:, None]).squeeze(1)
    full.sum().backward()
    assert torch.isfinite(lp).all() and (lp - full).abs().max() < 0.1
    cos = torch.nn.functional.cosine_similarity
    assert cos(h.grad.float().flatten(), hf.grad.flatten(), dim=0) > 0.999
    assert cos(w.grad.float().flatten(), wf.grad.flatten(), dim=0) > 0.999


def test_chunked_logprobs_grad_of_one_input_only():
    h, w, y = torch.randn(9, 4), torch.randn(11, 4), torch.randint(11, (9,))
    full = lambda h, w: torch.log_softmax(h @ w.T, -1).gather(1, y[:, None]).squeeze(1).sum()
    for hr, wr in ((True, False), (False, True)):
        a, b = h.clone().requires_grad_(hr), w.clone().requires_grad_(wr)
        (g,) = torch.autograd.grad(chunked_logprobs(a, b, y, 1.0, 4).sum(), [a if hr else b])
        (r,) = torch.autograd.grad(full(a, b), [a if hr else b])
        torch.testing.assert_close(g, r)


def test_micro_batch_losses_weighted_by_share_give_the_full_batch_gradient():
    """GRPO (``seq_mean``): each micro-batch's loss times its share of the step's sequences sums
    to the padded full-batch loss, and so do the gradients (the trainer's accumulation rule)."""
    spec, ref, packed = _models("qwen3")
    eps = _episodes(spec.args.vocab_size, SHAPES + [(30, 2), (2, 30)], seed=5)
    batch = collate(eps, 0)
    R, cfg = batch.response_mask.shape[1], make_loss_config("grpo")
    want = titan.response_logprobs(ref, eps, R, 1.0, CPU)
    old = (want.detach() + 0.1 * torch.randn_like(want)) * batch.response_mask
    full, _ = compute_loss(cfg, want, old, batch.advantages, batch.response_mask, old)
    full.backward()
    total = 0.0
    for idx in pack_episodes([len(e.prompt_ids) + len(e.response_ids) for e in eps], 48):
        lp = packed_response_logprobs(packed, pack_batch([eps[i] for i in idx], 48), R)
        loss, _ = compute_loss(cfg, lp, old[idx], batch.advantages[idx], batch.response_mask[idx], old[idx])
        share = len(idx) / len(eps)  # seq_mean: sequences (all have responses); token_mean: tokens
        (loss * share).backward()
        total += loss.item() * share
    assert abs(total - full.item()) < 1e-5
    for (n, a), (_, b) in zip(ref.named_parameters(), packed.named_parameters()):
        assert (a.grad - b.grad).abs().max() < 1e-5 * max(1.0, a.grad.abs().max().item()), n


def test_padded_micro_batches_group_similar_lengths():
    """Without packing, each rank's share is cut longest first: every episode exactly once, each
    micro-batch's indices sorted, and less padding than cutting in arrival order."""
    from forge_core.actors.trainer import micro_batches

    lens = [10, 200, 12, 190, 11, 180, 13, 170]
    eps = [SimpleNamespace(prompt_ids=[1] * (n - 1), response_ids=[2]) for n in lens]
    for world in (1, 2):
        seen = []
        for rank in range(world):
            for idx, dummy in micro_batches(eps, rank, world, 2):
                assert not dummy and idx == sorted(idx)
                seen += idx
        assert sorted(seen) == list(range(len(lens)))
    mbs = [idx for idx, _ in micro_batches(eps, 0, 1, 2)]
    padded = sum(len(i) * max(lens[j] for j in i) for i in mbs)
    assert mbs[0] == [1, 3] and padded < sum(2 * max(lens[k], lens[k + 1]) for k in range(0, 8, 2))


@pytest.mark.parametrize("kind", ["tiny_llama", "qwen3"])
def test_sft_loss_equals_a_float64_reference_packed_and_padded(kind):
    """loss=sft: the masked mean over target tokens of -log softmax(logits)[target], as the trainer
    computes it (padded and packed, float32), against the same model in float64 with every logit
    materialised; the gradients of packed and padded agree."""
    spec, ref, packed = _models(kind)
    eps = _episodes(spec.args.vocab_size, SHAPES, seed=3)
    batch = collate(eps, pad_id=0)
    R, cfg = batch.response_mask.shape[1], make_loss_config("sft")
    zeros = torch.zeros_like(batch.response_mask)
    got = []
    for model, lp in ((ref, titan.response_logprobs(ref, eps, R, 1.0, CPU)),
                      (packed, packed_response_logprobs(packed, pack_batch(eps, 128), R, 1.0, chunk_size=16))):
        loss, _ = compute_loss(cfg, lp, zeros, batch.advantages, batch.response_mask)
        loss.backward()
        got.append(loss.item())
    f64 = copy.deepcopy(ref).double()
    nll, n = 0.0, 0
    with torch.no_grad():
        for e in eps:
            ids = torch.tensor([e.prompt_ids + e.response_ids])
            logits = f64(ids)[0, len(e.prompt_ids) - 1:-1]  # position t predicts token t + 1
            lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(e.response_ids)[:, None])
            nll, n = nll - lp.sum().item(), n + len(e.response_ids)
    want = nll / n
    assert abs(got[0] - want) < 1e-5 * want and abs(got[1] - want) < 1e-5 * want, (got, want)
    for (name, a), (_, b) in zip(ref.named_parameters(), packed.named_parameters()):
        assert (a.grad - b.grad).abs().max() < 1e-5 * max(1.0, a.grad.abs().max().item()), name
