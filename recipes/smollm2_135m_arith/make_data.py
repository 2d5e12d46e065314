"""Writes data/train.jsonl and data/test.jsonl: every single-digit arithmetic fact "What is a op b?"
with a, b in 2..9 and op one of + - x / (subtraction and division asked as (a+b) - b and (a*b) / a,
so every answer is a whole number from 2 to 81): 256 problems, 64 per operation. A quarter of the
(unordered operands, operation) pairs is held out, drawn with a fixed seed, so no test fact is a
training fact with its operands swapped. Rows: {"question", "answer", "op"}. Deterministic: running
it again writes the same bytes (a test checks the shipped files against it). No licence issue: the
facts are generated here.

    python recipes/smollm2_135m_arith/make_data.py
"""

import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
SUFFIX = " Answer with just the number."


def problems() -> list[dict]:
    """The 256 facts, in a fixed order."""
    out = []
    for op in "+-x/":
        for a in range(2, 10):
            for b in range(2, 10):
                q, ans = {"+": (f"{a} + {b}", a + b), "-": (f"{a + b} - {b}", a),
                          "x": (f"{a} x {b}", a * b), "/": (f"{a * b} / {a}", b)}[op]
                out.append({"question": f"What is {q}?{SUFFIX}", "answer": str(ans), "op": op,
                            "pair": f"{op}{min(a, b)}{max(a, b)}"})
    return out


def split(rows: list[dict], held_out: float = 0.25, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, test): ``held_out`` of the unordered (operands, operation) pairs go to test."""
    pairs = sorted({r["pair"] for r in rows})
    test_pairs = set(random.Random(seed).sample(pairs, round(held_out * len(pairs))))
    strip = lambda r: {k: v for k, v in r.items() if k != "pair"}  # noqa: E731
    return ([strip(r) for r in rows if r["pair"] not in test_pairs],
            [strip(r) for r in rows if r["pair"] in test_pairs])


def main() -> None:
    os.makedirs(os.path.join(HERE, "data"), exist_ok=True)
    for name, rows in zip(("train", "test"), split(problems())):
        with open(os.path.join(HERE, "data", f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"data/{name}.jsonl: {len(rows)} problems")


if __name__ == "__main__":
    main()
