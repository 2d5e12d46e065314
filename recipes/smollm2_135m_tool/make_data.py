"""Writes data/train.jsonl and data/test.jsonl: "What is a * b?" for three-digit a and b (100..999),
drawn with a fixed seed: 2,000 training and 200 held-out problems, no (a, b) pair in both. A 135M model
cannot multiply three-digit numbers in its head; with the calculator tool it only has to call it
and copy the result. The question shows the call in the model's tool-call format (hermes), since
SmolLM2-135M-Instruct was not trained to call tools. Rows: {"question", "answer", "a", "b"}.
Deterministic: running it again writes the same bytes (a test checks the shipped files against it).
No licence issue: the problems are generated here.

    python recipes/smollm2_135m_tool/make_data.py
"""

import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
QUESTION = ('What is {a} * {b}?\nFirst call the calculator by writing <tool_call>{{"name": "calculator", '
            '"arguments": {{"expression": "{a} * {b}"}}}}</tool_call>, then write the result it returns.')


def problems(n: int, seed: int = 0) -> list[dict]:
    """``n`` distinct (a, b) pairs of three-digit numbers, in draw order."""
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if (a, b) not in seen:
            seen.add((a, b))
            out.append({"question": QUESTION.format(a=a, b=b), "answer": str(a * b), "a": a, "b": b})
    return out


def main() -> None:
    rows = problems(2200)
    os.makedirs(os.path.join(HERE, "data"), exist_ok=True)
    for name, part in (("train", rows[:2000]), ("test", rows[2000:])):
        with open(os.path.join(HERE, "data", f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        print(f"data/{name}.jsonl: {len(part)} problems")


if __name__ == "__main__":
    main()
