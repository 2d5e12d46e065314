"""Environments for multi-turn, tool-using episodes, and the built-in tools.

The interface is skyrl-gym's ``BaseTextEnv`` (PyPI ``skyrl-gym``, MIT; a Gymnasium-style text
environment), taken as it is rather than invented here: an environment written for SkyRL runs
unchanged (``tests/test_environment.py`` runs skyrl-gym's own ``GSM8kMultiTurnEnv``). Its contract::

    env = EnvClass(env_config, extras)           # extras: the data row (below)
    messages, info = env.init(prompt_messages)   # the conversation the first model turn continues
    out = env.step(assistant_text)               # {"observations": [messages], "reward": float,
                                                 #  "done": bool, "metadata": dict}
    env.close()

Why this one: OpenEnv (``openenv-core``) serves each environment over HTTP (fastapi, uvicorn, gradio,
an MCP server), which is a process and a port per episode for what is a function call here;
TorchTitan RL's message environment is not packaged apart from a torchtitan newer than the one the
trainer pins. skyrl-gym's is a plain class with four light dependencies, and per-step rewards.

``extras`` is the row as SkyRL's datasets give it: ``{"reward_spec": {"ground_truth": target},
"extra_info": row, **row}``. An environment may offer tools: a ``tools`` attribute, a list of
OpenAI function specs, which the rollout renders with the tokenizer's chat template
(:mod:`forge_core.rollout`). Every step's reward is summed into the episode's ``env`` reward
component; ``reward.fn`` still scores the last model turn (``reward.fn: none`` leaves the
environment's reward alone).

:class:`ToolEnv` is the built-in environment (``env.fn: tools``): it parses each assistant turn's
tool calls in the model's own format (transformers' response parser, :func:`parse_tool_calls`),
runs them with the limits of ``env.*`` and answers with tool messages; a turn without a tool call
ends the episode. Built-in tools: ``calculator`` (arithmetic through an AST whitelist, no ``eval``)
and ``python`` (a subprocess per call in a bubblewrap sandbox, :mod:`forge_core.sandbox`).
A recipe adds its own tools by subclassing it (``env.fn: env.py:MyEnv``) and naming functions in
``TOOLS``; their specs come from their signatures and docstrings (``transformers.utils.get_json_schema``).
"""

from __future__ import annotations

import ast
import concurrent.futures
import json
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from forge_core import import_source
from forge_core.data import DataError


class EnvError(DataError):
    """``env.fn`` cannot be loaded or an environment cannot start from a data row; names the key,
    the file or class, and the row (``file:line``)."""


@dataclass
class EnvConfig:
    """Multi-turn episodes through an environment (``env`` section).

    Attributes:
        fn: ``""`` (single-turn: one prompt, one response), ``tools`` (the built-in
            :class:`ToolEnv`), ``env.py:ClassName`` (a file of the recipe folder, as ``reward.fn``) or
            ``package.module:ClassName``: a skyrl-gym ``BaseTextEnv`` subclass.
        max_turns: model turns per episode at most (> 0).
        max_turn_tokens: tokens one model turn may sample (0: what is left of the episode's budget,
            ``generator.max_response_tokens``, which counts every token after the prompt: model
            turns, tool messages and the template's tokens between them).
        tools: the built-in tools :class:`ToolEnv` offers (``calculator``, ``python``).
        tool_timeout_s: seconds one tool call may run; a slower call becomes an error message.
        max_tool_result_chars: a tool's result is cut to this many characters (counted as an error).
        tool_format: how tool calls are written and parsed: ``auto`` (the tokenizer's own response
            template when it has one, else ``hermes``), ``hermes`` (``<tool_call>{"name": ...,
            "arguments": {...}}</tool_call>``: Qwen3's format, and the documented one for ChatML
            models whose template does not render tools, such as SmolLM2) or ``llama3_json``
            (Llama 3.1's ``{"name": ..., "parameters": {...}}``).
        python_memory_mb, python_max_processes: the ``python`` tool's sandbox limits.
    """

    fn: str = ""
    max_turns: int = 4
    max_turn_tokens: int = 0
    tools: List[str] = field(default_factory=lambda: ["calculator"])
    tool_timeout_s: float = 5.0
    max_tool_result_chars: int = 1000
    tool_format: str = "auto"
    python_memory_mb: int = 512
    python_max_processes: int = 16


TOOL_FORMATS = ("auto", "hermes", "llama3_json")

# transformers' declarative response templates (transformers >= 5.13, ``tokenizer.parse_response``).
RESPONSE_TEMPLATES = {
    "hermes": {"start_anchor": "<|im_start|>assistant\n",
               "fields": {"content": {"content": "text"},
                          "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json",
                                         "repeats": True, "transform": {"type": "function", "function": "{content}"}}}},
    "llama3_json": {"start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
                    "fields": {"content": {"content": "text"},
                               "tool_calls": {"open_pattern": r"^\s*(?:<\|python_tag\|>)?(?=\{)",
                                              "close_pattern": r"(?<=\})\s*(?:<\|eom_id\|>|<\|eot_id\|>|$)",
                                              "content": "json", "repeats": True,
                                              "transform": {"type": "function", "function": {
                                                  "name": "{content.name}", "arguments": "{content.parameters}"}}}}},
}


def parse_tool_calls(text: str, tool_format: str) -> tuple[list[dict], Optional[str]]:
    """The tool calls of one assistant turn, parsed by transformers' response parser with the
    ``tool_format``'s response template (:data:`RESPONSE_TEMPLATES`). Returns ``(calls, error)``:
    ``calls`` is a list of ``{"name": str, "arguments": dict}``; ``error`` a one-line reason when a
    call is malformed (not JSON, no name, arguments not an object), else None. No call: ``([], None)``."""
    from transformers.utils.chat_parsing import parse_response

    try:
        msg = parse_response(text, RESPONSE_TEMPLATES[tool_format], prefix="")
    except ValueError as e:
        return [], f"malformed tool call: {str(e).splitlines()[0]}"
    calls = []
    for c in msg.get("tool_calls") or []:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            return calls, "malformed tool call: no function name"
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return calls, f"malformed tool call to {fn['name']}: arguments are not a JSON object"
        if not isinstance(args, dict):
            return calls, f"malformed tool call to {fn['name']}: arguments are not a JSON object"
        calls.append({"name": fn["name"], "arguments": args})
    return calls, None


# ---- built-in tools ------------------------------------------------------------------------------
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS, MAX_DIGITS = 200, 100


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as (12 + 3) * 4.5 and return the result.

    Walks Python's AST of ``expression`` and allows only number literals, the operators below and
    parentheses: no names, calls, attributes or ``eval``. Powers are capped (exponent at most 1,000,
    results at most 100 digits) so that no call runs long or fills memory. The tool spec the model
    sees is this docstring's first line and the argument below (:func:`tool_spec`).

    Args:
        expression: numbers with + - * / // % ** and parentheses.

    Raises:
        ValueError: anything else in the expression, a division by zero, or a result too large.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(b) > 1000 or abs(a) > 1e6 and abs(b) > 16):
                raise ValueError("power too large")
            try:
                out = _BINARY[type(node.op)](a, b)
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
            if isinstance(out, complex) or isinstance(out, float) and not math.isfinite(out) or \
                    isinstance(out, int) and len(str(abs(out))) > MAX_DIGITS:
                raise ValueError("result too large or not a real number")
            return out
        raise ValueError(f"{type(node).__name__} is not allowed: numbers, + - * / // % ** and parentheses only")

    out = ev(tree)
    return str(int(out)) if isinstance(out, float) and out.is_integer() and abs(out) < 1e15 else str(out)


def python(code: str, limits: Any = None) -> str:
    """Run a Python program and return what it prints (stdout).

    Runs in a bubblewrap sandbox (:func:`forge_core.sandbox.run_python`): no network, no access to the
    run's files or environment, its own temporary directory, and wall-time, memory, process-count
    and output limits (``limits``, a :class:`forge_core.sandbox.PythonLimits`; :class:`ToolEnv` sets
    them from ``env.*``; the model sees only ``code``).

    Args:
        code: the program's source; print the values you want back.
        limits: the sandbox's limits (set by the environment, not shown to the model).

    Raises:
        RuntimeError: the program failed, timed out or was killed (the reason, one line).
    """
    from forge_core import sandbox

    r = sandbox.run_python(code, limits or sandbox.PythonLimits())
    if r.error():
        raise RuntimeError(r.error())
    return r.stdout


BUILTIN_TOOLS: dict[str, Callable[..., str]] = {"calculator": calculator, "python": python}


def tool_spec(fn: Callable) -> dict:
    """The OpenAI function spec of ``fn`` (``{"type": "function", "function": {"name", "description",
    "parameters"}}``) from its type hints and Google-style docstring (``transformers.utils.get_json_schema``):
    the docstring's first paragraph is the description, its ``Args:`` the parameters' descriptions."""
    from transformers.utils import get_json_schema

    spec = get_json_schema(fn)
    spec["function"].pop("return", None)  # not part of the OpenAI spec
    params = spec["function"]["parameters"]
    params["properties"].pop("limits", None)  # set by the environment, not by the model (python)
    params["required"] = [r for r in params.get("required", []) if r != "limits"]
    spec["function"]["description"] = spec["function"]["description"].split("\n\n")[0]
    return spec


class ToolEnv(BaseTextEnv):
    """The built-in tool environment (``env.fn: tools``), a skyrl-gym ``BaseTextEnv``.

    Each :meth:`step` parses the assistant turn's tool calls (:func:`parse_tool_calls`); a turn with
    none ends the episode (reward 0 here: ``reward.fn`` scores the final answer). Every call runs with
    ``env.tool_timeout_s``; its result (or error) goes back as one ``tool`` message, cut to
    ``env.max_tool_result_chars``. A call that raises, times out, returns too much, names an unknown
    tool or is malformed becomes an error message the model sees, and is counted in the step's
    ``metadata["tool_errors"]``; the episode goes on.

    Args:
        env_config: the ``env`` section as a dict (:class:`EnvConfig`), plus ``tool_format`` resolved.
        extras: the data row (see the module docstring).

    Class attribute ``TOOLS``: ``{name: function}`` a subclass adds to the built-ins it names in
    ``env.tools``.
    """

    TOOLS: dict[str, Callable[..., str]] = {}

    def __init__(self, env_config: Any = None, extras: Optional[dict] = None):
        super().__init__()
        c = EnvConfig(**{k: v for k, v in dict(env_config or {}).items() if k in EnvConfig.__dataclass_fields__})
        self.cfg, self.extras, self.max_turns = c, extras or {}, c.max_turns
        self.fns = {n: BUILTIN_TOOLS[n] for n in c.tools}
        self.fns.update(type(self).TOOLS)
        self.tools = [tool_spec(f) for f in self.fns.values()]
        if self.fns.get("python") is python:
            from forge_core.sandbox import PythonLimits
            limits = PythonLimits(wall_s=c.tool_timeout_s, memory_mb=c.python_memory_mb,
                                  max_processes=c.python_max_processes, max_output_bytes=4 * c.max_tool_result_chars)
            self.fns["python"] = lambda code: python(code, limits)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """Run the tool calls in ``action`` (the assistant turn's text). Returns the tool messages as
        ``observations``, reward 0, ``done`` when the turn has no tool call (or the turn limit is
        reached), and ``metadata`` ``{"tool_calls", "tool_errors", "tool_s"}``."""
        self.turns += 1
        calls, error = parse_tool_calls(action, self.cfg.tool_format or "hermes")
        obs, errors, t0 = [], 0, time.perf_counter()
        if error:
            obs.append({"role": "tool", "content": f"Error: {error}"})
            errors += 1
        for c in calls:
            text, failed = self.run_tool(c["name"], c["arguments"])
            obs.append({"role": "tool", "content": text})
            errors += failed
        done = not obs or self.turns >= self.max_turns
        return BaseTextEnvStepOutput(observations=[] if done else obs, reward=0.0, done=done,
                                     metadata={"tool_calls": len(calls) + bool(error), "tool_errors": errors,
                                               "tool_s": time.perf_counter() - t0})

    def run_tool(self, name: str, arguments: dict) -> tuple[str, bool]:
        """``(message, failed)``: the tool's result, or ``"Error: ..."`` for an unknown tool, bad
        arguments, an exception, a timeout (``env.tool_timeout_s``) or a result cut at
        ``env.max_tool_result_chars``."""
        fn, cap = self.fns.get(name), self.cfg.max_tool_result_chars
        if fn is None:
            return f"Error: unknown tool {name!r}; the tools are {sorted(self.fns)}", True
        pool = concurrent.futures.ThreadPoolExecutor(1)
        try:
            out = str(pool.submit(fn, **arguments).result(timeout=self.cfg.tool_timeout_s))
        except concurrent.futures.TimeoutError:
            return f"Error: {name} timed out after {self.cfg.tool_timeout_s:g} s", True
        except TypeError as e:
            return f"Error: bad arguments for {name}: {e}", True
        except Exception as e:
            return f"Error: {type(e).__name__}: {str(e)[:cap]}", True
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        if len(out) > cap:
            return out[:cap] + f"\n[cut: {len(out) - cap} more characters]", True
        return out, False


# ---- loading ---------------------------------------------------------------------------------
def load_env_class(spec: str) -> type:
    """The environment class ``env.fn`` names (see :class:`EnvConfig`). A ``.py`` path must be
    absolute here (the config loader resolves a recipe-relative one).

    Raises:
        EnvError: the file, module or class does not exist, or it has no ``init``/``step`` methods.
    """
    if spec == "tools":
        return ToolEnv
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise EnvError(f"env.fn={spec!r}: expected 'tools', 'file.py:ClassName' or 'package.module:ClassName'")
    try:
        mod = import_source(where, "forge_env_")
    except FileNotFoundError:
        raise EnvError(f"env.fn={spec!r}: no file {where}") from None
    except Exception as e:
        raise EnvError(f"env.fn={spec!r}: cannot import {where}: {type(e).__name__}: {e}") from None
    cls = getattr(mod, name, None)
    if not isinstance(cls, type):
        have = sorted(n for n, v in vars(mod).items() if isinstance(v, type) and not n.startswith("_"))
        raise EnvError(f"env.fn={spec!r}: {where} has no class {name!r} (its classes: {have})")
    missing = [m for m in ("init", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvError(f"env.fn={spec!r}: {name} has no method {' or '.join(missing)} (a skyrl-gym BaseTextEnv "
                       f"has init(prompt) and step(action))")
    return cls


def env_extras(problem: Any) -> dict:
    """The ``extras`` a skyrl-gym environment is built with, from a :class:`forge_core.data.Problem`:
    ``{"reward_spec": {"method": "rule", "ground_truth": answer}, "extra_info": row, **row}``."""
    return {**problem.row, "reward_spec": {"method": "rule", "ground_truth": problem.answer},
            "extra_info": dict(problem.row), "data_source": problem.id}


def make_env(cls: type, env_config: dict, problem: Any) -> Any:
    """An environment of class ``cls`` for one episode of ``problem``. Raises EnvError naming the
    row (``problem.id``: ``file:line``) when the constructor fails."""
    try:
        return cls(env_config, env_extras(problem))
    except Exception as e:
        raise EnvError(f"{problem.id}: {cls.__name__} cannot start an episode from this row: "
                       f"{type(e).__name__}: {e}") from None
