"""CPU evidence for the eval disagreement: (1) final/'s tokenizer round trip gives the same prompt ids;
(2) the fp32 -> bf16 cast of a checkpoint equals the published cast; (3) greedy decoding's batch
variance: whether the same weights and prompts in batches of 48 and of 8 give the same responses."""
import json, os, sys, tempfile, time, hashlib
import torch
from forge_core.config import load_config
from forge_core.data import chat_prompt, eval_subset, load_split
from forge_core.models import ModelConfig, load_tokenizer, tokenizer_files, load_model
from forge_core.actors.generator import hf_generate
from forge_core.rewards import extract_answer
cfg = load_config("smollm2_135m_gpu1", ["device=cpu", "generator.backend=hf"])
tok = load_tokenizer(cfg.model)
probs = eval_subset(load_split(cfg.data, "test"), 1319, cfg.eval.seed)
d = tempfile.mkdtemp()
for n, b in tokenizer_files(tok).items():
    open(os.path.join(d, n), "wb").write(b)
tok2 = load_tokenizer(ModelConfig(name="smollm2_135m", path=d))
a = [tok(chat_prompt(tok, p, cfg.data.system_prompt), add_special_tokens=False).input_ids for p in probs]
b = [tok2(chat_prompt(tok2, p, cfg.data.system_prompt), add_special_tokens=False).input_ids for p in probs]
print("tokenizer round trip: identical prompt ids for", sum(x == y for x, y in zip(a, b)), "of", len(a), "questions;",
      "eos", tok.eos_token_id, tok2.eos_token_id, flush=True)
w = torch.randn(1000, 1000) * 0.05
t = torch.empty(1000, 1000, dtype=torch.bfloat16); t.copy_(w)
print("fp32->bf16: .to() equals copy_() into a bf16 tensor:", torch.equal(t, w.to(torch.bfloat16)), flush=True)
torch.set_num_threads(2)
model = load_model(cfg.model, dtype=torch.bfloat16)
N, T = int(sys.argv[1]), int(sys.argv[2])
texts = [chat_prompt(tok, p, cfg.data.system_prompt) for p in probs[:N]]
res = {}
for bs in (N, 8):
    t0 = time.time(); out = []
    for i in range(0, N, bs):
        out += hf_generate(model, tok, texts[i:i + bs], 1, T, 256, greedy=True, stop_after_answer=False)
    res[bs] = out
    print(f"batch {bs}: {time.time() - t0:.0f} s", flush=True)
diff = sum(x["response_ids"] != y["response_ids"] for x, y in zip(res[N], res[8]))
acc = {bs: sum(extract_answer(o["text"], "strict") == p.answer for o, p in zip(res[bs], probs)) for bs in res}
print(f"bf16 greedy, {N} questions, {T} tokens: responses differing between batches of {N} and 8: {diff}; correct {acc}", flush=True)
