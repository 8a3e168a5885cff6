"""Three-digit by two-digit multiplication, for the calculator tool: a task SmolLM2-135M-Instruct cannot do alone.

    python scripts/make_multiplication.py questions --rows 4000 --out /tmp/multiplication.jsonl
    python scripts/make_multiplication.py pairs --rows 1024 --out /tmp/calculator_pairs.jsonl

questions: rows {"question", "answer"} (grpo.py --tools calculator --prompt-key question). pairs: preference pairs
for a warm start with dpo.py: the prompt as grpo.py --tools calculator renders it for a chat template without tool
support (the tool described in a system message, common/rollout/episodes.py), the chosen response a call of the calculator
on the two numbers, the rejected one a direct answer with a wrong product. SmolLM2-135M-Instruct never writes a
tool call by itself (none in 36 samples, with the format and an example in the system prompt or in the question),
so GRPO alone would have nothing to reinforce; after the warm start it calls the tool, and GRPO teaches it to use
the result. Other rows than the questions' (another seed), so the held-out questions stay unseen.
"""

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root holds common/
from common.rollout.episodes import with_tools_described  # noqa: E402
from common.rollout.tools import calculator, tool_schema  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["questions", "pairs"])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=None, help="default: 0 for questions, 1 for pairs")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rng = random.Random(args.seed if args.seed is not None else int(args.kind == "pairs"))
    with open(args.out, "w") as f:
        for _ in range(args.rows):
            a, b = rng.randint(100, 999), rng.randint(10, 99)
            question = f"What is {a} * {b}?"
            if args.kind == "questions":
                row = {"question": question, "answer": str(a * b)}
            else:
                call = {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}
                wrong = a * b + rng.choice([-1, 1]) * rng.randint(1, a * b // 3)
                row = {"prompt": with_tools_described([{"role": "user", "content": question}],
                                                      [tool_schema(calculator)]),
                       "chosen": f"<tool_call>{json.dumps(call)}</tool_call>",
                       "rejected": f"{a} * {b} = {wrong}."}
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
