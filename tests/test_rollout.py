"""Multi-turn rollouts, token in and token out: every turn's prompt is exactly the previous turn's
tokens plus the new ones (the extension property, for every episode), the loss mask covers the
sampled tokens only, the limits hold, and masked sequences train as the loss's float64 reference says."""

import dataclasses
import json

import pytest
import torch

from forge_core.data import Problem
from forge_core.environment import EnvConfig
from forge_core.episode import Episode, collate
from forge_core.rollout import ChatBridge, Sampled, rollout_episodes

# A ChatML template that renders ``tools=`` and the ``tool`` role the way Qwen3's does (tool results
# as a user turn in <tool_response> tags), to test a template that knows tools beside SmolLM2's own.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}\n<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>{%- elif m.role != 'system' %}\n<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{ '\\n<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def tok():
    from forge_core.models import ModelConfig, load_tokenizer

    return load_tokenizer(ModelConfig(name="smollm2_135m"))


class Scripted:
    """A sampler that writes scripted turns (text, tokenised here: the model's own tokens) and
    records every prompt it was given."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.prompts, self.outs = tok, turns, [], []

    def __call__(self, prompts, budgets):
        out = []
        for i, (p, b) in enumerate(zip(prompts, budgets)):
            text = self.turns[len(self.prompts)][i % len(self.turns[len(self.prompts)])]
            ids = (self.tok(text, add_special_tokens=False).input_ids + [self.tok.eos_token_id])[:b]
            out.append(Sampled(ids, [-0.25 - 0.01 * j for j in range(len(ids))], ids[-1] == self.tok.eos_token_id))
        self.prompts.append([list(p) for p in prompts])
        self.outs.append(out)
        return out


def call(expr):
    return 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>' % expr


def env_cfg(**kw):
    return dict(dataclasses.asdict(EnvConfig(fn="tools", **kw)), tool_format="hermes")


PROBLEMS = [Problem(id=f"f.jsonl:{i}", prompt=f"What is {a} * {b}?", answer=str(a * b), row={})
            for i, (a, b) in enumerate([(347, 829), (12, 12)])]


@pytest.mark.parametrize("template", ["smollm2", "tools_template"])
def test_every_turn_extends_the_last_exactly(tok, template):
    """For every episode, each turn's prompt is the previous prompt + the sampled turn + the bridge
    tokens; the final sequence is the last prompt + the last turn; the mask is 1 exactly on sampled
    tokens, whose behaviour logprobs are the sampler's; the bridge tokens hold the tool's result."""
    if template == "tools_template":
        tok = tok.__class__.from_pretrained(tok.name_or_path)
        tok.chat_template = TOOLS_TEMPLATE
    script = Scripted(tok, [[call("347 * 829"), "No tool needed: 144."],  # turn 1: call / answer
                            [call("287663 + 0")],                          # turn 2: one more call
                            ["The answer is 287663."]])                    # turn 3
    eps = rollout_episodes(PROBLEMS, 2, tok=tok, env_cfg=env_cfg(max_turns=4), system_prompt="", max_prompt_tokens=512,
                           max_response_tokens=400, version=7, sample=script)
    assert [e.turns for e in eps] == [3, 1, 3, 1]
    assert [e.tool_calls for e in eps] == [2, 0, 2, 0] and all(e.tool_errors == 0 for e in eps)
    live = list(range(4))
    for t, (prompts, outs) in enumerate(zip(script.prompts, script.outs)):
        assert len(prompts) == len(live)
        going = [i for i in live if eps[i].turns > t + 1]
        for i, prompt, out in zip(live, prompts, outs):
            e = eps[i]
            full = e.prompt_ids + e.response_ids
            assert full[:len(prompt)] == prompt  # the episode's tokens begin with this turn's prompt
            assert full[len(prompt):len(prompt) + len(out.ids)] == out.ids  # then the sampled turn, as sampled
            off = len(prompt) - len(e.prompt_ids)
            assert e.loss_mask[off:off + len(out.ids)] == [1] * len(out.ids)
            assert e.behaviour_logprobs[off:off + len(out.ids)] == out.logprobs
            if i in going:
                nxt = script.prompts[t + 1][going.index(i)]
                assert nxt[:len(prompt) + len(out.ids)] == prompt + out.ids  # the next prompt extends this one
                between = nxt[len(prompt) + len(out.ids):]
                assert e.loss_mask[off + len(out.ids):off + len(out.ids) + len(between)] == [0] * len(between)
                text = tok.decode(between)
                assert "287663" in text and text.endswith("<|im_start|>assistant\n")  # the tool's result
        live = going
    for e in eps:
        assert len(e.loss_mask) == len(e.response_ids) == len(e.behaviour_logprobs)
        assert all(lp == 0.0 for lp, m in zip(e.behaviour_logprobs, e.loss_mask) if not m)
        assert e.response_ids[-1] == tok.eos_token_id and not e.truncated
    assert eps[0].text == "The answer is 287663." and eps[1].text == "No tool needed: 144."
    if template == "tools_template":  # the template's own tool rendering, not the system-message description
        assert "<tool_response>\n287663\n</tool_response>" in tok.decode(eps[0].response_ids)
        assert tok.decode(eps[0].prompt_ids).startswith("<|im_start|>system\n# Tools\n<tools>")
    else:
        assert "<|im_start|>tool\n287663<|im_end|>" in tok.decode(eps[0].response_ids)
        assert "<tool_call>" in tok.decode(eps[0].prompt_ids) and '"calculator"' in tok.decode(eps[0].prompt_ids)


def test_token_budget_and_turn_limit(tok):
    """The budget counts every token after the prompt; an episode that cannot fit another model turn
    ends truncated. ``env.max_turns`` ends an episode that keeps calling tools."""
    script = Scripted(tok, [[call("1 + 1")]] * 5)
    eps = rollout_episodes(PROBLEMS[:1], 1, tok=tok, env_cfg=env_cfg(max_turns=3), system_prompt="",
                           max_prompt_tokens=512, max_response_tokens=1000, version=0, sample=script)
    assert eps[0].turns == 3 and eps[0].tool_calls == 3 and not eps[0].truncated
    budget = 60
    script = Scripted(tok, [[call("1 + 1")]] * 5)
    eps = rollout_episodes(PROBLEMS[:1], 1, tok=tok, env_cfg=env_cfg(max_turns=5), system_prompt="",
                           max_prompt_tokens=512, max_response_tokens=budget, version=0, sample=script)
    assert eps[0].truncated and len(eps[0].response_ids) <= budget
    per_turn = Scripted(tok, [[call("1 + 1")]] * 5)
    eps = rollout_episodes(PROBLEMS[:1], 1, tok=tok, env_cfg=env_cfg(max_turns=2, max_turn_tokens=10),
                           system_prompt="", max_prompt_tokens=512, max_response_tokens=400, version=0, sample=per_turn)
    assert all(len(o.ids) <= 10 for outs in per_turn.outs for o in outs)


def test_bridge_keeps_the_sampled_eos_once(tok):
    """After a turn that ended with EOS, the bridge does not write the template's EOS again; after a
    cut turn (no EOS) it closes the turn itself."""
    b = ChatBridge(tok, None)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ignored"}]
    new = [{"role": "user", "content": "more"}]
    with_eos, without = b.between_turns(history, new, True), b.between_turns(history, new, False)
    assert without == [tok.eos_token_id] + with_eos
    assert tok.decode(with_eos) == "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"


def test_collate_masks_tool_tokens():
    e = Episode(prompt_id="a", group=0, target="", prompt_ids=[5, 6], response_ids=[1, 2, 3, 4, 5],
                behaviour_logprobs=[-1.0, 0.0, 0.0, -2.0, -3.0], text="", policy_version=0, loss_mask=[1, 0, 0, 1, 1])
    single = Episode(prompt_id="b", group=0, target="", prompt_ids=[7], response_ids=[9, 9], behaviour_logprobs=[-1.0, -1.0],
                     text="", policy_version=0)
    b = collate([e, single], pad_id=0, pad_to=8)
    assert b.response_mask[0, :6].tolist() == [1, 0, 0, 1, 1, 0] and b.response_mask[1, :3].tolist() == [1, 1, 0]
    assert e.model_tokens() == 3 and single.model_tokens() == 2


def test_losses_match_the_float64_reference_on_multi_turn_masks():
    """Every loss, estimator and aggregation on masks shaped like multi-turn episodes (model turn,
    tool block, model turn, tool block, model turn; one episode with a single turn): loss and
    gradient equal the loop reference, and masked tokens get no gradient; ``sft`` on the same masks
    is the assistant turns' mean cross-entropy."""
    import dataclasses as dc

    import test_losses as T
    from forge_core import losses as L

    B, W = 6, 14
    mask = torch.zeros(B, W, dtype=torch.bool)
    for i, spans in enumerate([[(0, 3), (6, 8), (11, 14)], [(0, 5), (9, 12)], [(0, 14)], [(2, 4), (7, 9), (12, 13)],
                               [(0, 1), (5, 6)], [(0, 7)]]):
        for a, z in spans:
            mask[i, a:z] = True
    for v, (name, over) in enumerate(T.VARIANTS):
        for agg in L.AGGREGATIONS:
            cfg = dc.replace(T.make_loss_config(name, **over), aggregation=agg, beta=0.05,
                             kl_estimator=L.KL_ESTIMATORS[v % 3])
            lp, old, ref, adv, _ = T.make_inputs(seed=900 + v, B=B, T=W)
            loss, grad, _ = T.assert_matches_reference(cfg, lp, old, adv, mask, ref)
            assert torch.all(grad[~mask] == 0) and grad.abs().sum() > 0
    lp, old, _, adv, _ = T.make_inputs(seed=999, B=B, T=W)  # sft: the assistant turns' mean cross-entropy
    loss, grad, _ = T.run_impl(T.make_loss_config("sft"), lp, old, adv, mask)
    m = mask.to(torch.float64)
    torch.testing.assert_close(loss, -(lp * m).sum() / m.sum(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, -m / m.sum(), rtol=1e-12, atol=1e-15)


def test_rollout_refuses_a_row_the_environment_cannot_start_from(tok, tmp_path):
    from forge_core.environment import EnvError

    (tmp_path / "env.py").write_text(
        "from forge_core.environment import ToolEnv\n"
        "class NeedsField(ToolEnv):\n"
        "    def init(self, prompt):\n"
        "        return prompt + [{'role': 'user', 'content': self.extras['extra_info']['hint']}], {}\n")
    cfg = dict(env_cfg(), fn=f"{tmp_path}/env.py:NeedsField")
    with pytest.raises(EnvError, match=r"f.jsonl:0: NeedsField.init failed on this row: KeyError: 'hint'"):
        rollout_episodes(PROBLEMS[:1], 1, tok=tok, env_cfg=cfg, system_prompt="", max_prompt_tokens=64,
                         max_response_tokens=64, version=0, sample=Scripted(tok, [["x"]]))
    ok = [Problem(id="f.jsonl:3", prompt="q", answer="1", row={"hint": "use the tool"})]
    (ep,) = rollout_episodes(ok, 1, tok=tok, env_cfg=cfg, system_prompt="", max_prompt_tokens=512,
                             max_response_tokens=64, version=0, sample=Scripted(tok, [["done"]]))
    assert "use the tool" in tok.decode(ep.prompt_ids) and json.dumps(ep.loss_mask) == json.dumps([1] * len(ep.response_ids))


@pytest.mark.parametrize("template", ["smollm2", "tools_template"])
def test_sft_on_a_conversation_is_laid_out_as_its_rollout(tok, template):
    """An SFT row holding a whole conversation (assistant turns with tool calls, the tools' answers)
    becomes the same tokens and mask as the rollout that produced it: SFT trains on exactly the
    token layout GRPO later samples (loss on assistant turns only); a row without an assistant turn
    is refused by name."""
    from forge_core.actors.generator import sft_episode
    from forge_core.data import DataError

    if template == "tools_template":
        tok = tok.__class__.from_pretrained(tok.name_or_path)
        tok.chat_template = TOOLS_TEMPLATE
    turns = [call("347 * 829"), call("287663 + 0"), "The answer is 287663."]
    env = env_cfg(max_turns=4)
    rolled = rollout_episodes(PROBLEMS[:1], 1, tok=tok, env_cfg=env, system_prompt="Be brief.", max_prompt_tokens=512,
                              max_response_tokens=400, version=0, sample=Scripted(tok, [[t] for t in turns]))[0]
    messages = ({"role": "user", "content": PROBLEMS[0].prompt}, {"role": "assistant", "content": turns[0]},
                {"role": "tool", "content": "287663"}, {"role": "assistant", "content": turns[1]},
                {"role": "tool", "content": "287663"}, {"role": "assistant", "content": turns[2]})
    row = dataclasses.replace(PROBLEMS[0], prompt="", messages=messages)
    sft = sft_episode(tok, row, "", "Be brief.", 512, 400, env)
    assert (sft.prompt_ids, sft.response_ids, sft.loss_mask) == (rolled.prompt_ids, rolled.response_ids, rolled.loss_mask)
    assert sft.turns == 3 and sft.text == turns[2] and not sft.truncated
    cut = sft_episode(tok, row, "", "Be brief.", 512, 30, env)
    assert cut.truncated and cut.response_ids == sft.response_ids[:30] and cut.loss_mask == sft.loss_mask[:30]
    with pytest.raises(DataError, match="f.jsonl:0: no assistant turn"):
        sft_episode(tok, PROBLEMS[0], "", "", 512, 400, env)
