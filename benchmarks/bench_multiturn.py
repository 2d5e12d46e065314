"""Multi-turn against single-turn generation on vLLM, the same total model tokens (a GPU machine).

    python -m benchmarks.bench_multiturn [RECIPE] [--prompts N] [--turns K] [--tokens T] [overrides ...]

One engine built as every generator replica builds it (:func:`forge_core.actors.vllm_generator.make_engine`,
dummy weights, the recipe's generator settings), N GSM8K questions as prompts:

- single-turn: one ``LLM.generate`` of N requests x T tokens (``ignore_eos``);
- multi-turn: the same N episodes through :func:`forge_core.rollout.rollout_episodes`, K model turns of
  T/K tokens each (``ignore_eos``), a tool message between turns (:class:`EchoEnv`), so the engine
  decodes the same T tokens per episode plus the tool messages' prefill.

tok/s counts model tokens (sampled) over wall seconds, which include the bridge and the environment.
Prints a table and writes ``$OUT/bench_multiturn.json`` when OUT is set. Repeats each twice (the first
call warms the engine's compile and CUDA graphs) and reports the second.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class EchoEnv(BaseTextEnv):
    """A fixed tool answer after every model turn until ``env.max_turns`` (a benchmark's environment)."""

    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.max_turns = dict(env_config or {}).get("max_turns", 3)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """A tool message ``{"result": 42}``; done at the turn limit."""
        self.turns += 1
        done = self.turns >= self.max_turns
        return BaseTextEnvStepOutput(observations=[] if done else [{"role": "tool", "content": '{"result": 42}'}],
                                     reward=0.0, done=done, metadata={})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe", nargs="?", default="smollm2_135m_gpu1")  # its data's held-out split: the prompts
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--tokens", type=int, default=384, help="model tokens per episode, over all its turns")
    p.add_argument("overrides", nargs="*")
    a = p.parse_intermixed_args(argv)

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from forge_core.actors.vllm_generator import make_engine, sampled_logprobs
    from forge_core.config import load_config
    from forge_core.data import chat_messages, load_split
    from forge_core.models import ModelConfig, load_tokenizer
    from forge_core.rollout import ChatBridge, Sampled, rollout_episodes

    cfg = load_config(a.recipe, a.overrides)
    tok = load_tokenizer(ModelConfig(**cfg.model))
    problems = load_split(cfg.data, "test")[:a.prompts]
    per_turn = a.tokens // a.turns
    max_len = cfg.generator.max_prompt_tokens + a.tokens + 64 * a.turns
    llm = make_engine(cfg.generator, cfg.model.name, max_len, seed=cfg.seed)
    sp = lambda n: SamplingParams(n=1, max_tokens=n, temperature=cfg.generator.temperature, logprobs=0,  # noqa: E731
                                  flat_logprobs=True, ignore_eos=True, detokenize=False)
    bridge = ChatBridge(tok, None)
    prompts = [bridge.prompt(chat_messages(q, cfg.data.system_prompt)) for q in problems]

    def single() -> tuple[float, int]:
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in prompts], sp(per_turn * a.turns), use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    def multi() -> tuple[float, int]:
        def sample(ps, budgets):
            outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ps], [sp(b) for b in budgets], use_tqdm=False)
            return [Sampled(list(o.outputs[0].token_ids), sampled_logprobs(o.outputs[0]), False) for o in outs]

        env = {"fn": "benchmarks.bench_multiturn:EchoEnv", "max_turns": a.turns, "max_turn_tokens": per_turn,
               "tool_format": "hermes"}
        t0 = time.perf_counter()
        eps = rollout_episodes(problems, 1, tok=tok, env_cfg=env, system_prompt=cfg.data.system_prompt,
                               max_prompt_tokens=cfg.generator.max_prompt_tokens,
                               max_response_tokens=a.tokens + 64 * a.turns, version=0, sample=sample)
        assert all(e.turns == a.turns for e in eps), "every episode runs every turn"
        return time.perf_counter() - t0, sum(e.model_tokens() for e in eps)

    rows = {}
    for name, fn in (("single-turn", single), ("multi-turn", multi)):
        fn()  # warm-up
        s, n = fn()
        rows[name] = {"s": s, "model_tokens": n, "tok_s": n / s}
    ratio = rows["multi-turn"]["tok_s"] / rows["single-turn"]["tok_s"]
    print(f"| {cfg.model.name}, {a.prompts} episodes x {a.tokens} model tokens | seconds | tok/s |\n|---|---|---|")
    for name, r in rows.items():
        print(f"| {name}{f' ({a.turns} turns)' if name == 'multi-turn' else ''} | {r['s']:.3f} | {r['tok_s']:,.0f} |")
    print(f"multi-turn / single-turn tok/s: {ratio:.3f}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_multiturn.json"), "w") as f:
            json.dump({"rows": rows, "ratio": ratio, "args": vars(a)}, f, indent=2)


if __name__ == "__main__":
    main()
