"""The reward of this recipe: 1 when the last number in the response is the answer.

A recipe's reward function takes the response text and the data row (its fields, plus ``target``:
the ``answer_field``'s value) and returns a float or a dict of named parts, summed into the reward
and logged apart as ``reward/<name>``; a part named ``correct`` decides accuracy and pass@k.
"""

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score(response: str, example: dict) -> dict:
    """``{"correct": 1.0 or 0.0}``: whether the last number written in ``response`` equals
    ``example["target"]`` (as a number: "8.0" counts as 8). A response without a number scores 0."""
    found = NUMBER.findall(response)
    return {"correct": float(bool(found) and float(found[-1]) == float(example["target"]))}
