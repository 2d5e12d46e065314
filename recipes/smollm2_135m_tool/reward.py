"""The reward of this recipe: 1 when the last number of the final answer is the product.

With ``env.fn`` set, ``reward.fn`` reads the last model turn (after the tool's answer); the
environment's own reward (env.py: 0.2 for a well-formed calculator call) is added as ``env``.
"""

import re

NUMBER = re.compile(r"-?\d[\d,]*")


def score(response: str, example: dict) -> dict:
    """``{"correct": 1.0 or 0.0}``: whether the last number in ``response`` (commas dropped) equals
    ``example["target"]``. A response without a number scores 0."""
    found = NUMBER.findall(response)
    return {"correct": float(bool(found) and found[-1].replace(",", "") == example["target"])}
