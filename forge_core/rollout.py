"""The rollout of multi-turn episodes: token in, token out.

One episode, as :func:`rollout_episodes` runs it (every active episode of a batch advances one turn
per sampler call, so the engine sees a full batch each turn)::

    messages = env.init(system + the row's prompt)          prompt_ids = chat template(messages, tools)
    loop (at most env.max_turns model turns, and the episode's token budget):
        ids, logprobs = sample(prompt_ids + response_ids)    model turn: loss_mask 1, its logprobs
        out = env.step(text of ids)                         tool calls run, tool messages back
        stop when out.done, at the turn limit or out of tokens
        response_ids += bridge tokens                       template + tool messages: loss_mask 0

The bridge (:class:`ChatBridge`) renders the conversation with the tokenizer's own chat template and
tokenises only what comes after the last model turn: the sampled tokens are never decoded and
encoded again, so each turn's prompt is exactly the previous turn's tokens plus the new ones (the
"extension property"; checked for every episode by ``tests/test_rollout.py``).

A sampler is the backend's: transformers ``generate`` on a CPU (:func:`forge_core.actors.generator.hf_sample`)
or vLLM (``VllmGenerator``); it takes token prompts and per-prompt token budgets and returns, for
each, the sampled ids, their logprobs and whether the turn ended at EOS.

SFT on conversations (:func:`sft_conversation`) lays a data row's own conversation out the same way:
its assistant turns take the place of the sampled ones (loss_mask 1), its tool and user messages are
bridged as the environment's would be (loss_mask 0).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from forge_core.data import DataError, Problem, chat_messages
from forge_core.environment import EnvError, load_env_class, make_env
from forge_core.episode import Episode

PLACEHOLDER = "\uE000forge-turn\uE000"  # a private-use marker no template writes
# The tool description for chat templates that do not render ``tools=`` (SmolLM2's): the hermes
# format of Qwen's template, put at the end of the system message.
TOOLS_SYSTEM = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
                "</tools>\n\nFor each function call, return a json object with function name and arguments "
                "within <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, "
                "\"arguments\": <args-json-object>}}\n</tool_call>")


@dataclass
class Sampled:
    """One model turn as a sampler returns it: ``ids`` ``[T]`` (EOS included when it stopped
    there), ``logprobs`` ``[T]`` (of the tempered distribution sampled from) and ``eos``."""

    ids: list[int]
    logprobs: list[float]
    eos: bool


class ChatBridge:
    """Token ids of a conversation from the tokenizer's chat template, turn by turn.

    Args:
        tok: a Hugging Face tokenizer with a chat template.
        tools: OpenAI function specs the environment offers (None: none). When the template does
            not render ``tools=`` (SmolLM2's), they are described in the system message instead
            (:data:`TOOLS_SYSTEM`, the hermes format).
    """

    def __init__(self, tok: Any, tools: Optional[list] = None):
        self.tok, self.tools = tok, tools or None
        self.eos_text = tok.decode([tok.eos_token_id]) if tok.eos_token_id is not None else ""
        probe = [{"role": "user", "content": "x"}]
        self.renders_tools = bool(self.tools) and self._render(probe, self.tools, True) != self._render(probe, None, True)

    def _render(self, messages: list, tools: Optional[list], generation: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation)

    def _messages(self, messages: list) -> list:
        if not self.tools or self.renders_tools:
            return list(messages)
        desc = TOOLS_SYSTEM.format(tools="\n".join(json.dumps(t) for t in self.tools))
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": messages[0]["content"] + desc}] + list(messages[1:])
        return [{"role": "system", "content": desc.lstrip()}] + list(messages)

    def prompt(self, messages: list) -> list[int]:
        """The first model turn's prompt: ``messages`` rendered with the tools and the generation
        prompt, tokenised (``[P]`` ids)."""
        text = self._render(self._messages(messages), self.tools if self.renders_tools else None, True)
        return self.tok(text, add_special_tokens=False).input_ids

    def between_turns(self, history: list, new_messages: list, eos: bool) -> list[int]:
        """The tokens that follow a model turn: the template's close of that turn (less the EOS the
        model sampled, when ``eos``), ``new_messages`` (tool or user messages) and the next
        generation prompt. ``history``: the conversation up to and including the model turn (its
        content is not read: a placeholder stands in, so no sampled text is rendered again).

        Raises:
            EnvError: the chat template does not render an assistant turn's content verbatim.
        """
        msgs = self._messages(list(history[:-1]) + [{"role": "assistant", "content": PLACEHOLDER}] + list(new_messages))
        text = self._render(msgs, self.tools if self.renders_tools else None, True)
        at = text.rfind(PLACEHOLDER)
        if at < 0:
            raise EnvError(f"the chat template of {self.tok.name_or_path} does not render an assistant turn's content "
                           f"verbatim: the tokens between turns cannot be found without re-tokenising the model's text")
        tail = text[at + len(PLACEHOLDER):]
        if eos and self.eos_text and tail.startswith(self.eos_text):
            tail = tail[len(self.eos_text):]
        return self.tok(tail, add_special_tokens=False).input_ids


@dataclass
class _Live:
    """An episode being rolled out."""

    problem: Any
    env: Any
    bridge: ChatBridge
    history: list
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    text: str = ""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_s: float = 0.0
    env_reward: float = 0.0
    truncated: bool = False
    done: bool = False


def _start(cls: type, env_cfg: dict, problem: Any, messages: list) -> tuple[Any, list]:
    """An environment of class ``cls`` for ``problem``, started on ``messages``: ``(env, the
    messages it returns)``. Raises EnvError naming the row when its ``init`` fails."""
    env = make_env(cls, env_cfg, problem)
    try:
        return env, env.init(messages)[0]
    except Exception as e:
        raise EnvError(f"{problem.id}: {cls.__name__}.init failed on this row: {type(e).__name__}: {e}") from None


def rollout_episodes(problems: list, n: int, *, tok: Any, env_cfg: dict, system_prompt: str,
                     max_prompt_tokens: int, max_response_tokens: int, version: int,
                     sample: Callable[[list[list[int]], list[int]], list[Sampled]]) -> list[Episode]:
    """``n`` multi-turn episodes per problem (problem-major order) through the environment ``env_cfg``
    names (:class:`forge_core.environment.EnvConfig` as a dict, ``tool_format`` resolved).

    Every turn, the episodes still going are sampled together: ``sample(prompts, budgets)`` gets
    each one's tokens so far and how many it may add. An episode ends when the environment says
    done, after ``env.max_turns`` model turns, or when its ``max_response_tokens`` (all tokens after
    the prompt) leave no room for the next turn (then ``truncated``). Returns :class:`Episode`\\ s
    with ``loss_mask`` (1: sampled), behaviour logprobs (0.0 on masked tokens), ``text`` (the last
    model turn's), the tool counters and ``env_reward`` (the sum of the steps' rewards).

    Raises:
        EnvError: ``env.fn`` does not load, an environment cannot start from a row (names it), or the
            chat template cannot bridge turns.
    """
    cls, cap = load_env_class(env_cfg["fn"]), env_cfg.get("max_turn_tokens") or max_response_tokens
    live: list[_Live] = []
    bridges: dict[str, ChatBridge] = {}  # one per tool set: its probe renders the template twice
    for p in problems:
        for _ in range(n):
            env, messages = _start(cls, env_cfg, p, chat_messages(p, system_prompt))
            tools = getattr(env, "tools", None)
            key = json.dumps(tools, sort_keys=True)
            bridge = bridges.get(key) or bridges.setdefault(key, ChatBridge(tok, tools))
            live.append(_Live(p, env, bridge, list(messages), bridge.prompt(messages)[-max_prompt_tokens:]))
    for turn in range(env_cfg["max_turns"]):
        active = [e for e in live if not e.done]
        if not active:
            break
        budgets = [min(cap, max_response_tokens - len(e.response_ids)) for e in active]
        outs = sample([e.prompt_ids + e.response_ids for e in active], budgets)
        for e, o, budget in zip(active, outs, budgets):
            e.response_ids += o.ids
            e.logprobs += o.logprobs
            e.mask += [1] * len(o.ids)
            e.turns += 1
            e.text = tok.decode(o.ids, skip_special_tokens=True)
            t0 = time.perf_counter()
            out = e.env.step(e.text)
            meta = out.get("metadata") or {}
            e.tool_s += meta.get("tool_s", time.perf_counter() - t0)
            e.tool_calls += meta.get("tool_calls", 0)
            e.tool_errors += meta.get("tool_errors", 0)
            e.env_reward += float(out.get("reward") or 0.0)
            if not o.eos and len(o.ids) >= budget and len(e.response_ids) >= max_response_tokens:
                e.done = e.truncated = True  # out of tokens mid-turn
                continue
            if out["done"] or e.turns >= env_cfg["max_turns"]:
                e.done = True
                continue
            e.history.append({"role": "assistant", "content": e.text})
            new = e.bridge.between_turns(e.history, out["observations"], o.eos)
            e.history += out["observations"]
            if len(e.response_ids) + len(new) >= max_response_tokens:  # no room left for a model turn
                e.done = e.truncated = True
                continue
            e.response_ids += new
            e.logprobs += [0.0] * len(new)
            e.mask += [0] * len(new)
    episodes = []
    for i, e in enumerate(live):
        episodes.append(Episode(prompt_id=e.problem.id, group=i // n, target=e.problem.answer, example=e.problem.row,
                                prompt_ids=e.prompt_ids, response_ids=e.response_ids, behaviour_logprobs=e.logprobs,
                                text=e.text, policy_version=version, truncated=e.truncated, loss_mask=e.mask,
                                turns=e.turns, tool_calls=e.tool_calls, tool_errors=e.tool_errors, tool_s=e.tool_s,
                                env_reward=e.env_reward))
        e.env.close()
    return episodes


def resolve_tool_format(setting: str, tok: Any) -> str:
    """``env.tool_format`` resolved for ``tok``: ``auto`` is ``llama3_json`` for a Llama 3 chat
    template (``<|start_header_id|>``), else ``hermes``."""
    if setting != "auto":
        return setting
    template = getattr(tok, "chat_template", "") or ""
    return "llama3_json" if "<|start_header_id|>" in str(template) else "hermes"


def check_env(env_cfg: dict, problem: Any, system_prompt: str) -> None:
    """One reset and one step of the environment ``env_cfg`` names on ``problem`` (its target as the
    assistant's text), before a run starts (``make check`` and every launcher).

    Raises:
        EnvError: the class does not load, or its constructor, ``init`` or ``step`` fails or returns
            something other than skyrl-gym's shapes; the message names ``env.fn`` and the row.
    """
    cls = load_env_class(env_cfg["fn"])
    fmt = env_cfg.get("tool_format", "auto")
    env = make_env(cls, dict(env_cfg, tool_format="hermes" if fmt == "auto" else fmt), problem)  # no tokenizer here
    where = f"env.fn={env_cfg['fn']!r} on {problem.id}"
    try:
        messages, _ = env.init(chat_messages(problem, system_prompt))
        out = env.step(str(problem.answer))
    except Exception as e:
        raise EnvError(f"{where}: {type(e).__name__}: {e}") from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise EnvError(f"{where}: init returned {messages!r}: expected a list of chat messages")
    if not isinstance(out, dict) or not {"observations", "reward", "done"} <= set(out):
        raise EnvError(f"{where}: step returned {out!r}: expected a dict with observations, reward and done")
    env.close()


def sft_conversation(tok: Any, problem: Problem, system_prompt: str, env_cfg: Optional[dict],
                     max_prompt_tokens: int, max_response_tokens: int) -> Episode:
    """An SFT example from a conversation (a row's ``messages`` holding assistant turns, tool calls
    written in the model's format inside their text): the prompt is everything before the first
    assistant turn, rendered as a rollout's would be (through the environment's ``init`` and its
    tools when ``env_cfg`` names one); the response is the rest of the conversation, laid out as
    :func:`rollout_episodes` lays out an episode: each assistant turn's tokens plus EOS with
    ``loss_mask`` 1, the template and the following tool/user messages (:class:`ChatBridge`) with 0.
    Messages after the last assistant turn are dropped. The loss sees the assistant turns only, as
    TRL's ``assistant_only_loss``. Shapes: ``prompt_ids`` [P] (left-truncated to
    ``max_prompt_tokens``), ``response_ids`` and ``loss_mask`` [R] (cut to ``max_response_tokens``;
    then ``truncated``).

    Raises:
        DataError: the row has no assistant turn (names the row).
        EnvError: the environment cannot start from the row, or the template cannot bridge turns.
    """
    msgs = chat_messages(problem, system_prompt)
    first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
    if first is None:
        raise DataError(f"{problem.id}: no assistant turn in its messages: SFT on a conversation trains on its "
                        f"assistant turns")
    head, tools = msgs[:first], None
    if env_cfg:
        env, head = _start(load_env_class(env_cfg["fn"]), env_cfg, problem, head)
        tools = getattr(env, "tools", None)
        env.close()
    bridge = ChatBridge(tok, tools)
    prompt = bridge.prompt(head)[-max_prompt_tokens:]
    history, ids, mask, turns, i = list(head), [], [], 0, first
    while i < len(msgs):
        turn = tok(msgs[i]["content"], add_special_tokens=False).input_ids + [tok.eos_token_id]
        ids += turn
        mask += [1] * len(turn)
        turns += 1
        history.append({"role": "assistant", "content": msgs[i]["content"]})
        nxt = next((j for j in range(i + 1, len(msgs)) if msgs[j]["role"] == "assistant"), None)
        if nxt is None:
            break
        new = bridge.between_turns(history, msgs[i + 1:nxt], eos=True)
        ids += new
        mask += [0] * len(new)
        history += msgs[i + 1:nxt]
        i = nxt
    cut = min(len(ids), max_response_tokens)
    return Episode(prompt_id=problem.id, group=0, target=problem.answer, example=problem.row, prompt_ids=prompt,
                   response_ids=ids[:cut], behaviour_logprobs=[0.0] * cut, text=msgs[i]["content"], policy_version=0,
                   truncated=cut < len(ids), advantage=1.0, loss_mask=mask[:cut], turns=turns)
