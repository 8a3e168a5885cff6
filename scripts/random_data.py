"""Synthetic data of known token lengths for throughput runs on scripts/random_model.py's models (.jsonl).

    python scripts/random_data.py prompts --rows 1296 --prompt-len 1024 --out /tmp/prompts.jsonl  # ppo.py, grpo.py
    python scripts/random_data.py pairs --rows 1344 --out /tmp/pairs.jsonl                         # dpo.py (offline)

prompts: rows {"prompt", "answer"}, every prompt exactly --prompt-len tokens (the answer is a placeholder: these runs
score responses with a hash reward, as tests/tools/gpu_checks.sh writes one). pairs: rows {"prompt", "chosen",
"rejected"} whose token lengths are drawn like HH-RLHF harmless-base's, the pairs dpo.py trains on in the dpo-hh
recipe. Measured on its 2,308 usable test pairs with SmolLM2's tokenizer, as dpo.py tokenizes them (the prompt is the
dialogue up to the last "Assistant:", each response ends in EOS, which dpo.py appends when absent), percentiles:

    percentile  0  5 10 15 20 25 30 35 40 45 50  55  60  65  70  75  80  85  90  95  98  99 100   mean
    prompt     12 17 19 22 25 34 48 62 74 85 98 111 123 138 152 170 193 227 273 349 445 543 835  125.3
    chosen      2  7  9 11 13 16 18 20 22 25 28  31  35  40  46  53  62  74  89 118 153 193 270   40.8
    rejected    2  7 10 13 16 18 21 24 28 32 36  41  47  52  58  66  76  88 109 144 193 250 557   51.0

A pair packs 2 x prompt + chosen + rejected tokens: 342.5 on average (median 275.5), none over 1,024 per side.
Lengths are drawn independently, linearly between those percentiles (means within 3% of the measured ones); the
measured correlations (chosen with rejected 0.26, prompt with chosen 0.28) are left out.

The text is single digits separated by spaces: each digit is one token under random_model.py's word-level tokenizer
(and under Qwen2's BPE, should a model directory's tokenizer be rebuilt as that), with no BOS added, so a prompt of N
digits is N tokens.
"""

import argparse
import json
import random

import numpy as np

DIGITS = "0123456789"
# HH-RLHF harmless-base token lengths at these percentiles (the table above).
PERCENTILES = [0, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, 65, 70, 75, 80, 85, 90, 95, 98, 99, 100]
HH_LENGTHS = {
    "prompt": [12, 17, 19, 22, 25, 34, 48, 62, 74, 85, 98, 111, 123, 138, 152, 170, 193, 227, 273, 349, 445, 543, 835],
    "chosen": [2, 7, 9, 11, 13, 16, 18, 20, 22, 25, 28, 31, 35, 40, 46, 53, 62, 74, 89, 118, 153, 193, 270],
    "rejected": [2, 7, 10, 13, 16, 18, 21, 24, 28, 32, 36, 41, 47, 52, 58, 66, 76, 88, 109, 144, 193, 250, 557],
}


def digit_text(rng: random.Random, num_tokens: int) -> str:
    return " ".join(rng.choice(DIGITS) for _ in range(num_tokens))


def prompt_rows(rows: int, prompt_len: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": digit_text(rng, prompt_len), "answer": "0"} for _ in range(rows)]


def hh_like_length(rng: random.Random, column: str) -> int:
    """One token length drawn from HH-RLHF's distribution of `column` (inverse CDF, linear between percentiles)."""
    return int(round(np.interp(rng.random() * 100, PERCENTILES, HH_LENGTHS[column])))


def pair_rows(rows: int, seed: int) -> list[dict]:
    """Each response is its drawn length minus one digits: dpo.py appends the EOS that makes up the length."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        prompt = digit_text(rng, hh_like_length(rng, "prompt"))
        chosen = digit_text(rng, hh_like_length(rng, "chosen") - 1)
        rejected = chosen
        while rejected == chosen:  # a pair with nothing to prefer would be dropped (short responses can tie)
            rejected = digit_text(rng, hh_like_length(rng, "rejected") - 1)
        out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["prompts", "pairs"])
    parser.add_argument("--rows", type=int, required=True, help="rows to write (training and held-out together)")
    parser.add_argument("--prompt-len", type=int, default=1024, help="prompts: tokens per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help=".jsonl file to write")
    args = parser.parse_args()
    if args.kind == "prompts":
        rows = prompt_rows(args.rows, args.prompt_len, args.seed)
    else:
        rows = pair_rows(args.rows, args.seed)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
