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
