"""grpo.py beside verl 0.9.1 on nanorl's long-tailed 1.5B workload: what scripts/peer_long.sh needs besides the two
launches. The workload is `tests/tools/gpu_checks.sh long`'s: scripts/random_model.py's 1.5B shape with
`--stop-every 2000` (responses of about 2k tokens, geometric, capped at 8,192), the built-in task's prompts, 16 x 8 a
step, and benchmarks/bench_async.py's reward (a hash of the response, checked by math-verify, plus its parity).

    python scripts/peer_long.py verl-data MODEL OUT_DIR           # the prompts as verl's parquet, in grpo.py's order
    python scripts/peer_long.py verl-model MODEL OUT_DIR         # MODEL as verl reads it (see verl_model)
    python scripts/peer_long.py check-verl VERL_MODEL DATA_DIR   # in verl's environment: same prompt ids, same reward
    python scripts/peer_long.py summary WORK_DIR OUT.json        # both runs' medians and the ratio: one line, a JSON
    verl: reward.custom_reward_function.path=scripts/peer_long.py reward.custom_reward_function.name=compute_score

verl imports this file as its reward module inside its own Ray workers and environment (transformers 5.9, no
math-verify: its ANTLR runtime cannot sit beside the one verl's Hydra needs), so only the standard library is
imported at the top; each command imports what it needs (torch, nanorl, datasets, transformers or verl) itself.
"""

import argparse
import json
import statistics
import sys
import zlib
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
PROMPTS_PER_STEP = 16  # gpu_checks.sh long's --prompts-per-step (and --eval-size)
# The prompt as it is: grpo.py sends a tokenizer without a chat template the plain text (common/data/prompts.py).
PROMPT_ONLY_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def long_reward(completion: str) -> float:
    """bench_async.REWARD's value without math-verify: that reward asks math-verify whether
    \\frac{a}{b} + c equals \\frac{1}{2}, for a, b, c taken from the response's CRC-32, then adds its parity. Equal
    exactly when c = 0 and b = 2a, which Fraction decides (tests/test_peer_long.py checks them against each other)."""
    h = zlib.crc32(completion.encode())
    a, b, c = h % 97 + 1, h % 89 + 2, h % 13
    return float(Fraction(a, b) + c == Fraction(1, 2)) + h % 2


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl's custom reward (verl decodes the response with skip_special_tokens, as grpo.py does)."""
    return long_reward(solution_str)


def verl_data(model: str, out_dir: str, seed: int = 1, batches: int = 100) -> None:
    """train.parquet: the first `batches` x 16 of the built-in task's training prompts in the order grpo.py draws
    them with --seed `seed` (its PromptSampler, one rank, or one rollout rank; verl reads them with
    data.shuffle=False), each with the ids grpo.py tokenizes it to under MODEL's tokenizer in extra_info;
    val.parquet: the 16 held-out prompts of --eval-size 16 (verl needs the file; these runs do not validate)."""
    sys.path.insert(0, str(ROOT))
    from datasets import Dataset

    from common.data.prompts import PromptSampler, load_train_eval, tokenize_prompts
    from common.train.model import load_tokenizer

    tokenizer = load_tokenizer(model)
    train, held_out = load_train_eval(None, "prompt", "answer", eval_size=PROMPTS_PER_STEP, seed=seed)
    sampler = PromptSampler(train, PROMPTS_PER_STEP, 0, 1, seed)
    ordered = [row for _ in range(batches) for row in sampler.next_batch()]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", ordered), ("val", held_out)):
        rows, dropped = tokenize_prompts(rows, tokenizer, max_prompt_len=256)  # grpo.py's --max-prompt-len
        assert dropped == 0
        records = [{"data_source": "nanorl_builtin", "prompt": [{"role": "user", "content": row["prompt"]}],
                    "ability": "max", "reward_model": {"style": "rule", "ground_truth": row["answer"]},
                    "extra_info": {"split": split, "index": i, "prompt_ids": row["prompt_ids"]}}
                   for i, row in enumerate(rows)]
        Dataset.from_list(records).to_parquet(f"{out_dir}/{split}.parquet")
        print(f"{split}: {len(records)} prompts -> {out_dir}/{split}.parquet; first {rows[0]['prompt']!r} = "
              f"{rows[0]['prompt_ids']}")


def verl_model(model: str, out_dir: str) -> None:
    """MODEL's weights and config (symlinked) with a tokenizer verl 0.9.1 can build prompts with, loading as grpo.py
    loads it. Three changes to the tokenizer files: a chat template that is the prompt itself (verl renders every
    prompt through one; grpo.py, with none, sends the text); the two tokens verl's Qwen prompt builder looks up for
    any qwen2 model ("\\n" as one token, <|im_end|>), added past the model's vocabulary, where no prompt holds them
    and the model cannot sample them; and an auto_map, without which transformers 5's AutoTokenizer (verl's and
    vLLM's loader) rebuilds a qwen2 model's word-level tokenizer as Qwen2Tokenizer's BPE, which splits these words
    into characters (grpo.py loads the saved pipeline itself: sharding/checkpoint.py's load_saved_tokenizer)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model)  # the word-level pipeline as saved
    tokenizer.add_tokens(["\n", "<|im_end|>"], special_tokens=True)
    tokenizer.chat_template = PROMPT_ONLY_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "PreTrainedTokenizerFast"]}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    for path in Path(model).resolve().iterdir():
        if not (out / path.name).exists():
            (out / path.name).symlink_to(path)
    print(f"{out}: {model}'s weights, its tokenizer ({len(tokenizer)} tokens) with the prompt-only chat template")


def check_verl(verl_model_dir: str, data_dir: str) -> None:
    """In verl's environment, before any GPU time is spent on it: verl's own prompt builder (the one its agent loop
    uses, picked by the model's type) gives every prompt the ids grpo.py gives it, and its reward loader reads
    compute_score from this file."""
    import datasets
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    tokenizer = AutoTokenizer.from_pretrained(verl_model_dir)  # as verl's hf_tokenizer and vLLM load it
    plain = PreTrainedTokenizerFast.from_pretrained(verl_model_dir)
    assert type(tokenizer).__name__ == type(plain).__name__ == "TokenizersBackend", type(tokenizer).__name__
    model_type = AutoConfig.from_pretrained(verl_model_dir).model_type
    builder = create_continuous_token_builder(tokenizer, hf_model_type=model_type)
    rows = datasets.Dataset.from_parquet(f"{data_dir}/train.parquet").select(range(256))
    wrong = [row["prompt"] for row in rows
             if builder.build_initial_tokens(row["prompt"]) != row["extra_info"]["prompt_ids"]]
    assert not wrong, f"{len(wrong)} of {len(rows)} prompts get other ids under verl than under grpo.py: {wrong[:3]}"
    responses = [[(7919 * i + 31 * j) % tokenizer.vocab_size for j in range(i % 50 + 1)] for i in range(100)]
    assert [tokenizer.decode(r, skip_special_tokens=True) for r in responses] == \
        [plain.decode(r, skip_special_tokens=True) for r in responses]
    reward_config = {"custom_reward_function": {"path": __file__, "name": "compute_score", "reward_kwargs": {}}}
    score = get_custom_reward_fn(SimpleNamespace(reward=reward_config))  # as verl's reward workers load it
    texts = [" ".join(f"w{(7919 * i + j) % 150000 + 100}" for j in range(i % 40 + 1)) for i in range(200)]
    scored = [score(data_source="nanorl_builtin", solution_str=text, ground_truth="0") for text in texts]
    assert scored == [long_reward(text) for text in texts]
    print(f"verl check ok: {type(builder).__name__} ({model_type}) gives {len(rows)} prompts grpo.py's ids "
          f"(first {rows[0]['extra_info']['prompt_ids']}); reward loaded from {__file__}")


def median_over(rows: list[dict], key: str):
    values = [r[key] for r in rows if key in r]
    return round(statistics.median(values), 3) if values else None


def peak_over(rows: list[dict], key: str):
    return max((r[key] for r in rows if key in r), default=None)


def nanorl_figures(rows: list[dict]) -> dict:
    measured = [r for r in rows if "time/step" in r and r["step"] >= 2]  # step 1 warms up (compiles, allocates)
    stages = {"rollout_s": "time/rollout", "reward_s": "time/reward", "update_s": "time/update",
              "sync_s": "time/sync"}
    return {"steps_measured": [r["step"] for r in measured], "step_s": median_over(measured, "time/step"),
            "tokens_per_s": median_over(measured, "perf/tokens_per_s"),
            "response_len": median_over(measured, "response/length_mean"),
            "truncated_frac": median_over(measured, "response/truncated_frac"),
            **{name: median_over(measured, key) for name, key in stages.items()},
            "peak_memory_gb": peak_over(rows, "perf/peak_memory_gb")}


def verl_figures(rows: list[dict]) -> dict:
    measured = [dict(r, tokens_per_s=r["perf/total_num_tokens"] / r["timing_s/step"]) for r in rows
                if "timing_s/step" in r and "perf/total_num_tokens" in r and r["step"] >= 2]
    stages = {"gen_s": "timing_s/gen", "reward_s": "timing_s/reward", "old_log_prob_s": "timing_s/old_log_prob",
              "update_s": "timing_s/update_actor", "sync_s": "timing_s/update_weights"}
    return {"steps_measured": [r["step"] for r in measured], "step_s": median_over(measured, "timing_s/step"),
            "tokens_per_s": median_over(measured, "tokens_per_s"),
            "response_len": median_over(measured, "response_length/mean"),
            "truncated_frac": median_over(measured, "response_length/clip_ratio"),
            **{name: median_over(measured, key) for name, key in stages.items()},
            "trainer_peak_memory_gb": peak_over(rows, "actor/perf/max_memory_reserved_gb")}  # vLLM's not included


def smi_peak_gb(path: Path):
    """The most memory any of a run's GPUs held, from nvidia-smi's samples once a second ("index, MiB" lines)."""
    samples = [int(line.split(",")[1]) for line in path.open() if line.count(",") == 1 and
               line.split(",")[1].strip().isdigit()] if path.exists() else []
    return round(max(samples) * 2**20 / 1e9, 1) if samples else None


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.open() if line.strip()] if path.exists() else []


def summary(work_dir: str, out_json: str) -> None:
    """WORK_DIR holds nanorl_metrics.jsonl (grpo.py's metrics.jsonl), verl_steps.jsonl (verl's console lines, parsed
    by the verl kit's verl_log_summary.py), mem_nanorl.csv and mem_verl.csv (nvidia-smi) and setup.json (what
    peer_long.sh ran); medians of steps 2 on."""
    work = Path(work_dir)
    setup = json.loads((work / "setup.json").read_text()) if (work / "setup.json").exists() else {}
    nanorl = nanorl_figures(read_jsonl(work / "nanorl_metrics.jsonl"))
    verl = verl_figures(read_jsonl(work / "verl_steps.jsonl"))
    nanorl["gpu_memory_peak_gb"], verl["gpu_memory_peak_gb"] = smi_peak_gb(work / "mem_nanorl.csv"), \
        smi_peak_gb(work / "mem_verl.csv")
    both = nanorl["step_s"] and verl["step_s"]
    result = {**setup, "nanorl": nanorl, "verl": verl,
              "verl_over_nanorl_step_time": round(verl["step_s"] / nanorl["step_s"], 3) if both else None,
              "nanorl_over_verl_tokens_per_s": round(nanorl["tokens_per_s"] / verl["tokens_per_s"], 3) if both
              else None}
    Path(out_json).write_text(json.dumps(result, indent=1) + "\n")

    def side(name, f):
        if not f["step_s"]:
            return f"{name}: no step after the first"
        return (f"{name} median step {f['step_s']:.2f} s (steps {f['steps_measured'][0]}-{f['steps_measured'][-1]}), "
                f"{f['tokens_per_s']:.0f} tokens/s, mean response {f['response_len']:.0f} tokens")

    ratio = (f" | step time verl/nanorl {result['verl_over_nanorl_step_time']:.2f}x, tokens/s nanorl/verl "
             f"{result['nanorl_over_verl_tokens_per_s']:.2f}x" if both else "")
    print(f"PEERLONG {setup.get('pair', '?')}: {side('nanorl', nanorl)} | {side('verl', verl)}{ratio} -> {out_json}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    data = commands.add_parser("verl-data")
    data.add_argument("model")
    data.add_argument("out_dir")
    data.add_argument("--seed", type=int, default=1, help="grpo.py's --seed (its prompt order)")
    data.add_argument("--batches", type=int, default=100, help="steps' worth of prompts to write (of 16)")
    model = commands.add_parser("verl-model")
    model.add_argument("model")
    model.add_argument("out_dir")
    check = commands.add_parser("check-verl")
    check.add_argument("verl_model")
    check.add_argument("data_dir")
    report = commands.add_parser("summary")
    report.add_argument("work_dir")
    report.add_argument("out_json")
    args = parser.parse_args()
    if args.command == "verl-data":
        verl_data(args.model, args.out_dir, args.seed, args.batches)
    elif args.command == "verl-model":
        verl_model(args.model, args.out_dir)
    elif args.command == "check-verl":
        check_verl(args.verl_model, args.data_dir)
    else:
        summary(args.work_dir, args.out_json)


if __name__ == "__main__":
    main()
