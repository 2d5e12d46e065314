"""GSM8K answer extraction (strict and flexible) and the reward function on hard cases."""

import pytest

from forge_core.rewards import RewardConfig, extract_answer, format_reward, gsm8k_reward, normalize_number

# (response text, strict answer, flexible answer)
CASES = [
    ("#### 72", "72", "72"),
    ("####72", "72", "72"),
    ("The answer is\n#### 1,234", "1234", "1234"),
    ("#### $1,234.00", "1234", "1234"),
    ("#### -5", "-5", "-5"),
    ("#### \u22127", "-7", "-7"),  # unicode minus
    ("#### 3.50", "3.5", "3.5"),
    ("#### 0.25.", "0.25", "0.25"),  # trailing period
    ("#### 18.", "18", "18"),
    ("#### +4", "4", "4"),
    ("#### €20", "20", "20"),
    ("#### £7.5", "7.5", "7.5"),
    ("#### 1,000,000", "1000000", "1000000"),
    ("She pays $12 for 3 items, so 12 / 3 = 4 each.", None, "4"),
    ("Total: 5 + 6 = 11 apples.", None, "11"),
    ("It costs $1,250.50 in the end.", None, "1250.5"),
    ("The temperature drops to -3 degrees.", None, "-3"),
    ("#### 10\nWait, actually 12.", "10", "12"),  # flexible takes the last number
    ("First #### 5 then #### 6", "6", "6"),  # strict takes the last marker
    ("#### forty", None, None),
    ("no numbers here", None, None),
    ("", None, None),
    ("#### ", None, None),
    ("#### .5", "0.5", "0.5"),
    ("The answer is 2,5.", None, "5"),  # '2,5' is not a thousands group: last number is 5
    ("We get 100. #### 100", "100", "100"),
    ("#### 007", "7", "7"),
    ("#### 12.000", "12", "12"),
    ("#### -0.50", "-0.5", "-0.5"),
    ("x = 3.14159 so #### 3.14", "3.14", "3.14"),
    ("#### 5 dollars", "5", "5"),
    ("She has 1,5000 coins", None, "5000"),  # malformed grouping: the well-formed tail wins
    ("answer: $ 45", None, "45"),
    ("#### 2/3", "2", "3"),  # fractions are not normalised to decimals
]


@pytest.mark.parametrize("text,strict,flexible", CASES)
def test_extraction(text, strict, flexible):
    assert extract_answer(text, "strict") == strict
    assert extract_answer(text, "flexible") == flexible


def test_at_least_thirty_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("raw,norm", [("1,234", "1234"), ("$5.00", "5"), ("-3.", "-3"), ("0.50", "0.5"),
                                      ("\u22122", "-2"), ("abc", None), ("", None), ("-", None),
                                      ("1e5000", None)])
def test_normalize(raw, norm):
    assert normalize_number(raw) == norm


def test_unknown_mode_names_field():
    with pytest.raises(ValueError, match="reward.mode"):
        extract_answer("#### 1", "loose")


def test_format_reward():
    assert format_reward("so\n#### 12") == 1.0
    assert format_reward("the answer is 12") == 0.0
    assert format_reward("#### twelve") == 0.0


def test_reward_parts():
    cfg = RewardConfig(mode="strict", correct=1.0, format_weight=0.2)
    s = gsm8k_reward("3 + 4 = 7\n#### 7", "7", cfg)
    assert (s.reward, s.correct, s.formatted) == (pytest.approx(1.2), True, True)
    s = gsm8k_reward("#### 8", "7", cfg)
    assert (s.reward, s.correct, s.formatted) == (pytest.approx(0.2), False, True)
    s = gsm8k_reward("it is 7", "7", cfg)  # strict: unformatted correct answers earn nothing
    assert (s.reward, s.correct, s.formatted) == (0.0, False, False)
    flex = RewardConfig(mode="flexible", correct=1.0, format_weight=0.0)
    assert gsm8k_reward("it is $7.00.", "7", flex).correct
    with pytest.raises(ValueError, match="not a number"):
        gsm8k_reward("#### 1", "seven", cfg)


def test_gsm8k_components_sum_to_the_gsm8k_reward_bit_for_bit():
    """The built-in ``gsm8k`` reward as components: their sum is today's reward exactly."""
    from forge_core.rewards import gsm8k_components, total

    cfg = RewardConfig(mode="strict", correct=1.0, format_weight=0.2)
    for text in ("3 + 4 = 7\n#### 7", "#### 8", "it is 7", ""):
        c = gsm8k_components(text, {"target": "7"}, cfg)
        assert total(c) == gsm8k_reward(text, "7", cfg).reward and set(c) == {"correct", "format"}
    assert gsm8k_components("#### 72", {"target": "Natalia sold 48/2 = 24 clips.\n#### 72"}, cfg)["correct"] == 1.0


# (response, target, correct): the built-in `math` reward through math-verify
MATH_CASES = [
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", True),
    ("So the result is \\boxed{0.5}", "\\frac{1}{2}", True),  # symbolic equality
    ("Thus $x = \\boxed{2}$.", "2", True),
    ("\\boxed{2}", "We get $x=\\boxed{2}$.", True),  # a MATH solution as the target: its boxed answer
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", True),
    ("The answer is $\\boxed{3}$.", "\\frac{1}{2}", False),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", True),
    ("\\boxed{x^2+1}", "(x+1)^2", False),
    ("I am not sure.", "5", False),
    ("\\boxed{10}", "\\$10", True),
    ("\\boxed{(1,2)}", "(1,2)", True),
    ("\\boxed{(2,1)}", "(1,2)", False),
]


@pytest.mark.parametrize("response,target,correct", MATH_CASES)
def test_math_reward_matches_equal_answers_and_only_them(response, target, correct):
    from forge_core.rewards import math_components

    c = math_components(response, {"target": target}, RewardConfig(correct=1.0, format_weight=0.1))
    assert c["correct"] == (1.0 if correct else 0.0), (response, target, c)
    assert c["format"] == (0.1 if "\\boxed" in response else 0.0)


def _reward_file(tmp_path, body: str) -> str:
    f = tmp_path / "reward.py"
    f.write_text(body)
    return str(f)


def test_a_recipes_reward_function_from_a_file_and_its_errors(tmp_path):
    """``reward.fn=reward.py:score``: loaded from the file; a float or named components; errors name the
    function, the example and the value (a string, NaN), or what is missing (file, function, signature)."""
    from forge_core.rewards import RewardError, is_correct, load_reward_fn, reward_components, total

    path = _reward_file(tmp_path, "def score(response, example):\n"
                                  "    return {'correct': float(response == example['target']), 'brevity': -0.01}\n"
                                  "def plain(response, example):\n    return 0.5\n"
                                  "def text(response, example):\n    return 'high'\n"
                                  "def nan(response, example):\n    return {'x': float('nan')}\n"
                                  "def boom(response, example):\n    raise KeyError('answer')\n"
                                  "def one_arg(response):\n    return 1.0\n")
    fn = load_reward_fn(RewardConfig(fn=f"{path}:score"))
    c = reward_components(fn, "score", "42", {"target": "42"}, "ex:1")
    assert c == {"correct": 1.0, "brevity": -0.01} and total(c) == 0.99 and is_correct(c)
    assert not is_correct(reward_components(fn, "score", "41", {"target": "42"}, "ex:1"))
    c = reward_components(load_reward_fn(RewardConfig(fn=f"{path}:plain")), "plain", "", {}, "ex:1")
    assert total(c) == 0.5 and is_correct(c)
    for name, says in (("text", r"returned 'high' on example data.jsonl:7: expected a finite float"),
                       ("nan", r"returned \{'x': nan\} on example data.jsonl:7"),
                       ("boom", r"raised KeyError: 'answer' on example data.jsonl:7")):
        with pytest.raises(RewardError, match=rf"reward.fn='{name}' {says}"):
            reward_components(load_reward_fn(RewardConfig(fn=f"{path}:{name}")), name, "r", {}, "example data.jsonl:7")
    with pytest.raises(RewardError, match=r"one_arg\(response\) cannot be called as one_arg\(response: str, example"):
        load_reward_fn(RewardConfig(fn=f"{path}:one_arg"))
    with pytest.raises(RewardError, match=r"has no function 'scor' \(its functions: \['boom', 'nan', 'one_arg', "
                                          r"'plain', 'score', 'text'\]\)"):
        load_reward_fn(RewardConfig(fn=f"{path}:scor"))
    with pytest.raises(RewardError, match=r"no file .*nope\.py"):
        load_reward_fn(RewardConfig(fn=f"{tmp_path}/nope.py:score"))
    with pytest.raises(RewardError, match=r"cannot import no_such\.module"):
        load_reward_fn(RewardConfig(fn="no_such.module:fn"))
    with pytest.raises(RewardError, match=r"expected a built-in \['gsm8k', 'math', 'none'\]"):
        load_reward_fn(RewardConfig(fn="gsm9k"))


def _harness_responses(references: list[str]) -> list[str]:
    """200 responses in the forms models write (and the forms that trip answer extraction), seeded."""
    import random

    rng = random.Random(0)
    forms = ["{w}\n#### {n}", "#### {n}", "####{n}", "####  {n}", "#### ${c}", "#### {c}.", "The answer is {n}.",
             "{w} so {n} apples", "It costs ${c} in total.", "#### {n}\nWait, it is {m}.", "about {m} or {n}?",
             "#### -{n}", "{n}.00 dollars", "no answer", "#### {n} #### {m}", "{w}\nAnswer: {m}", ".5 of {n}",
             "#### {n},", "The result: {n}.\n", "1,{n}"]
    out = []
    for i in range(200):
        gold = references[i % len(references)].rpartition("####")[2].strip().replace(",", "")
        n = gold if rng.random() < 0.7 else str(int(float(gold)) + rng.choice([-1, 1, 10]))
        c = f"{int(float(n)):,}" if n.lstrip("-").replace(".", "").isdigit() else n
        out.append(rng.choice(forms).format(n=n, c=c, m=rng.randint(0, 999), w="Step: 2 + 3 = 5."))
    return out


def test_harness_gsm8k_scoring_agrees_with_lm_evaluation_harness():
    """Our strict-match / flexible-extract extraction and exact_match equal lm-evaluation-harness's own
    (its RegexFilter and take_first filters and exact_match metric with the gsm8k task's settings,
    from the lm-eval 0.4.13 package) on 200 responses against GSM8K references."""
    import os

    lm_eval = pytest.importorskip("lm_eval.filters.extraction", reason="lm-eval (make venv-extras installs it)")
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.selection import TakeFirstFilter

    from forge_core.data import load_jsonl
    from forge_core.rewards import harness_exact_match, harness_extract

    refs = [p.row["answer"] for p in load_jsonl(os.path.join(os.environ["GSM8K_DIR"], "test.jsonl"))[:200]]
    responses = _harness_responses(refs)
    ignore = [",", "\\$", "(?s).*#### ", "\\.$"]  # lm_eval/tasks/gsm8k/gsm8k.yaml
    for name, flt in (("strict-match", lm_eval.RegexFilter(regex_pattern=r"#### (\-?[0-9\.\,]+)")),
                      ("flexible-extract", lm_eval.RegexFilter(regex_pattern=r"(-?[$0-9.,]{2,})|(-?[0-9]+)",
                                                               group_select=-1))):
        theirs = list(TakeFirstFilter().apply(flt.apply([[r] for r in responses], [{}] * 200), [{}] * 200))
        ours = [harness_extract(r, name) for r in responses]
        assert ours == theirs, name
        for o, ref in zip(ours, refs * 2):
            em = exact_match_hf_evaluate([o], [ref], regexes_to_ignore=ignore, ignore_case=True,
                                         ignore_punctuation=False)["exact_match"]
            assert harness_exact_match(o, ref) == bool(em), (o, ref)
        assert 0 < sum(harness_exact_match(o, r) for o, r in zip(ours, refs * 2)) < 200  # both outcomes occur
