"""The environment interface and the built-in tools: the calculator's AST whitelist, tool-call
parsing in the model's format, the tool environment's limits and errors, loading ``env.fn`` (and its
bad input), and an environment written for skyrl-gym running unchanged."""

import time

import pytest

from forge_core.data import Problem
from forge_core.environment import (EnvConfig, EnvError, ToolEnv, calculator, load_env_class, make_env,
                                    parse_tool_calls)


def call(name, **args):
    import json
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def test_calculator_evaluates_arithmetic_and_nothing_else():
    assert calculator("347 * 829") == "287663"
    assert calculator("(12 + 3) * 4.5") == "67.5"
    assert calculator("2 ** 10 - 7 // 2 % 2") == "1023"
    assert calculator("-3 / 4") == "-0.75"
    for bad in ("__import__('os').system('true')", "x + 1", "open('/etc/passwd')", "(1).__class__",
                "[1, 2]", "lambda: 1", "'a' * 3", "9 ** 9 ** 9", "10 ** 200", "1 / 0", "2 ** 0.5 ** -9999",
                "1" * 300):
        with pytest.raises(ValueError):
            calculator(bad)


def test_tool_calls_are_parsed_in_the_models_format():
    calls, err = parse_tool_calls("I will compute.\n" + call("calculator", expression="1+2") + call("python", code="print(1)"),
                                  "hermes")
    assert err is None and calls == [{"name": "calculator", "arguments": {"expression": "1+2"}},
                                     {"name": "python", "arguments": {"code": "print(1)"}}]
    assert parse_tool_calls("The answer is 3.", "hermes") == ([], None)
    calls, err = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {oops}}</tool_call>', "hermes")
    assert calls == [] and err.startswith("malformed tool call")
    calls, err = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>', "hermes")
    assert err == "malformed tool call: no function name"
    calls, err = parse_tool_calls('{"name": "calculator", "parameters": {"expression": "6*7"}}', "llama3_json")
    assert err is None and calls == [{"name": "calculator", "arguments": {"expression": "6*7"}}]


class Slow(ToolEnv):
    """Test tools: one that sleeps, one that raises, one that prints too much."""

    @staticmethod
    def sleep(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: how long.
        """
        time.sleep(seconds)
        return "woke"

    @staticmethod
    def boom(x: int) -> str:
        """Raise.

        Args:
            x: ignored.
        """
        raise KeyError("no such thing")

    @staticmethod
    def flood(n: int) -> str:
        """Return n characters.

        Args:
            n: how many.
        """
        return "x" * n

    TOOLS = {"sleep": sleep, "boom": boom, "flood": flood}


def tool_env(cls=ToolEnv, **cfg):
    cfg = {"tool_format": "hermes", "tool_timeout_s": 0.5, "max_tool_result_chars": 100, **cfg}
    return make_env(cls, cfg, Problem(id="f.jsonl:1", prompt="q", answer="7", row={"q": 1}))


def test_tool_env_answers_calls_and_turns_every_failure_into_a_message():
    env = tool_env(Slow)
    assert [t["function"]["name"] for t in env.tools] == ["calculator", "sleep", "boom", "flood"]
    out = env.step("Let me see. " + call("calculator", expression="6*7"))
    assert out["observations"] == [{"role": "tool", "content": "42"}] and not out["done"]
    assert out["metadata"]["tool_calls"] == 1 and out["metadata"]["tool_errors"] == 0
    cases = {call("nope"): "unknown tool 'nope'", call("calculator", expr="1"): "bad arguments for calculator",
             call("boom", x=1): "KeyError", call("sleep", seconds=5): "sleep timed out after 0.5 s",
             call("calculator", expression="import os"): "not an arithmetic expression",
             '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>': "arguments are not a JSON object",
             "<tool_call>{not json</tool_call>": "malformed tool call"}
    t0 = time.perf_counter()
    for text, expected in cases.items():
        out = tool_env(Slow).step(text)
        assert out["metadata"]["tool_errors"] == 1, text
        assert out["observations"][0]["content"].startswith("Error") and expected in out["observations"][0]["content"]
        assert not out["done"]
    assert time.perf_counter() - t0 < 4  # the sleeping tool was not waited for
    out = tool_env(Slow).step(call("flood", n=10**7))
    body = out["observations"][0]["content"]
    assert len(body) < 200 and "[cut: 9999900 more characters]" in body and out["metadata"]["tool_errors"] == 1
    out = tool_env(Slow).step("The answer is 42.")
    assert out["done"] and out["observations"] == [] and out["metadata"]["tool_calls"] == 0


def test_the_turn_limit_ends_the_episode():
    env = tool_env(max_turns=2)
    assert not env.step(call("calculator", expression="1+1"))["done"]
    assert env.step(call("calculator", expression="1+1"))["done"]


def test_env_fn_bad_input_names_the_file_and_class(tmp_path):
    with pytest.raises(EnvError, match="no file"):
        load_env_class(f"{tmp_path}/missing.py:Env")
    (tmp_path / "env.py").write_text("class NotAnEnv:\n    pass\nclass Broken:\n    def init(self, p): pass\n"
                                     "    def step(self, a): pass\n    def __init__(self, c, e): raise KeyError('question')\n")
    with pytest.raises(EnvError, match=r"has no class 'Nope' \(its classes: \['Broken', 'NotAnEnv'\]\)"):
        load_env_class(f"{tmp_path}/env.py:Nope")
    with pytest.raises(EnvError, match="has no method init or step"):
        load_env_class(f"{tmp_path}/env.py:NotAnEnv")
    with pytest.raises(EnvError, match="expected 'tools'"):
        load_env_class("nothing")
    cls = load_env_class(f"{tmp_path}/env.py:Broken")
    with pytest.raises(EnvError, match=r"data/x.jsonl:12: Broken cannot start an episode from this row: KeyError"):
        make_env(cls, {}, Problem(id="data/x.jsonl:12", prompt="q", answer="1"))


def test_config_refuses_bad_env_settings():
    from forge_core.config import ConfigError, load_config

    for override, key in (("env.max_turns=0", "env.max_turns must be > 0"),
                          ("env.fn=env.py:Nope", "has no class 'Nope'"),
                          ("env.tools=[calculator,shell]", "['shell'] not among the built-in tools"),
                          ("env.tool_format=xml", "env.tool_format='xml' must be one of")):
        with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
            load_config("smollm2_135m_tool", [override])
    cfg = load_config("smollm2_135m_tool", [])
    assert cfg.env.fn.endswith("recipes/smollm2_135m_tool/env.py:MultiplyEnv")  # folder-relative, resolved


def test_skyrl_gym_environment_runs_unchanged():
    """skyrl-gym's own multi-turn GSM8K environment, imported from the package, through our rollout:
    per-turn rewards are summed into the episode's environment reward."""
    from forge_core.models import ModelConfig, load_tokenizer
    from forge_core.rollout import Sampled, rollout_episodes

    tok = load_tokenizer(ModelConfig(name="smollm2_135m"))
    answers = iter(["I think #### 3", "Then #### 5"])  # wrong, then right

    def sample(prompts, budgets):
        return [Sampled(tok(next(answers), add_special_tokens=False).input_ids + [tok.eos_token_id], [-0.5] * 99, True)
                for _ in prompts]

    fix = lambda s: Sampled(s.ids, s.logprobs[:len(s.ids)], s.eos)  # noqa: E731
    p = Problem(id="gsm8k/train[0]", prompt="What is 2 + 3?", answer="5", row={"max_turns": 3})
    env_cfg = dict(EnvConfig(fn="skyrl_gym.envs.gsm8k.multi_turn_env:GSM8kMultiTurnEnv", max_turns=3).__dict__,
                   tool_format="hermes")
    (ep,) = rollout_episodes([p], 1, tok=tok, env_cfg=env_cfg, system_prompt="", max_prompt_tokens=256,
                             max_response_tokens=256, version=3,
                             sample=lambda pr, b: [fix(s) for s in sample(pr, b)])
    assert ep.turns == 2 and ep.env_reward == pytest.approx(0.2 / 3 + 1.0)  # format score, then correct
    assert "#### 5" in ep.text and ep.policy_version == 3
    between = tok.decode([t for t, m in zip(ep.response_ids, ep.loss_mask) if not m])
    assert "<|im_start|>user\nPlease provide your step-by-step reasoning" in between  # skyrl's observation


def test_make_eval_runs_episodes_through_the_environment():
    """``make eval`` of a recipe with an environment evaluates multi-turn episodes through it (the
    base model on two held-out problems) and reports the multi-turn metrics."""
    import json

    from helpers import cli_here

    r = cli_here("eval", "smollm2_135m_tool", "eval.num_questions=2", "eval.max_response_tokens=40")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout[r.stdout.index("{"):])
    assert res["questions"] == 2 and res["engine"] == "hf" and "reward/env" in res
    assert res["turns_mean"] >= 1.0 and "tool_calls_mean" in res and "tool_error_rate" in res


def test_the_python_tool_runs_in_the_sandbox_and_its_failures_are_messages():
    """``env.tools: [python]``: a call runs in the sandbox with ``env.*``'s limits (the model's spec
    shows ``code`` only); reading the run's files, an endless loop and a flood of output come back
    as error messages, and the episode goes on."""
    from forge_core.sandbox import SandboxUnavailable, check_sandbox

    try:
        check_sandbox()
    except SandboxUnavailable as e:
        pytest.skip(str(e))
    env = tool_env(tools=["python"], tool_timeout_s=2.0, max_tool_result_chars=200)
    assert env.tools[0]["function"]["parameters"]["required"] == ["code"]
    assert env.step(call("python", code="print(6 * 7)"))["observations"] == [{"role": "tool", "content": "42\n"}]
    for code, says in (("print(open('/work/main/README.md').read())", "No such file or directory"),
                       ("while True: pass", "timed out"), ("print('x' * 10**6)", "output cut")):
        out = tool_env(tools=["python"], tool_timeout_s=2.0, max_tool_result_chars=200).step(call("python", code=code))
        assert out["metadata"]["tool_errors"] == 1 and says in out["observations"][0]["content"], out
        assert not out["done"]
