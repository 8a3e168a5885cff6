"""Three-digit by two-digit multiplication questions (.jsonl rows {"question", "answer"}), for the calculator tool:
a task SmolLM2-135M-Instruct cannot do alone (about 1% greedy accuracy) and can with the tool.

    python scripts/make_multiplication.py --rows 4000 --out /tmp/multiplication.jsonl
"""

import argparse
import json
import random


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "w") as f:
        for _ in range(args.rows):
            a, b = rng.randint(100, 999), rng.randint(10, 99)
            f.write(json.dumps({"question": f"What is {a} * {b}?", "answer": str(a * b)}) + "\n")


if __name__ == "__main__":
    main()
