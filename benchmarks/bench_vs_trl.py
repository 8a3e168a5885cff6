"""Side by side with TRL: our script and TRL's trainer on the same model, data, reward, batch, learning rate and
lengths, with step time and learning curves of both.

    python benchmarks/bench_vs_trl.py grpo --model /tmp/smollm2 --data addition.jsonl --gpus 0,1 --seeds 1 2 3 --out OUT
    python benchmarks/bench_vs_trl.py dpo --model /tmp/smollm2 --data harmless-base-test.jsonl.gz --gpus 0 --out OUT
    python benchmarks/bench_vs_trl.py kto --model /tmp/smollm2 --data harmless-base-test.jsonl.gz --gpus 0 --out OUT

With two GPUs (--gpus 0,1) each seed runs ours on the first and TRL on the second at the same time, so both see
the same host load; with one, they run one after the other. Each side writes a metrics.jsonl with the same metric
names (time/step, reward/mean, eval/accuracy, eval/preference_accuracy), so `scripts/plot.py OUT/*` overlays them;
OUT/summary.json holds the medians and curves. TRL (1.16.0) is a benchmark dependency only: it is imported here,
in the TRL worker process, and nowhere else.

Matched: model, data rows and held-out rows (ours picks them; TRL gets the same), chat template, reward function,
prompts x samples per step, learning rate, response length, sampling temperature, steps; DPO: beta, pairs per
step, max length, one epoch; KTO (ours: dpo.py --loss-type kto; TRL: KTOTrainer): each training pair as a
desirable (chosen) and an undesirable (rejected) row, the very rows ours trains on in the order ours draws them (TRL
reads its rows in order, so its step k holds ours' step k's rows), beta, desirable and undesirable weights 1, rows
per step, max length, one epoch. Left at each trainer's own defaults, and so different (listed in the summary): the
precision, Adam's beta2, the schedule, TRL's importance-sampling correction and gradient checkpointing.
Held-out accuracy is greedy on both sides (ours: vLLM; TRL: the trained model's own generate, outside the timed
step); held-out preference accuracy is the share of held-out pairs whose chosen response gets the higher implicit
reward beta * log(pi / pi_ref), the reference being the initial model (a tie counts as wrong): DPO, TRL's own
evaluation; KTO, which TRL evaluates on unpaired rows only, this script's pass over ours' held-out pairs (token ids
as ours has them) with TRL's model, outside the timed step. Step time is the optimizer step's wall time without
evaluation on both sides.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from scripts.ablate import read_metrics  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("algo", choices=["grpo", "dpo", "kto"])
    p.add_argument("--model", required=True, help="HF directory of the policy (e.g. SmolLM2-135M-Instruct)")
    p.add_argument("--data", required=True, help="grpo: prompt/answer .jsonl; dpo, kto: preference pairs "
                   "(.jsonl.gz)")
    p.add_argument("--out", required=True, help="directory for both sides' runs and summary.json")
    p.add_argument("--gpus", default="0", help="one GPU: the sides run in turn; two (0,1): at the same time")
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--steps", type=int, default=None, help="grpo: 30; dpo: one epoch of the training pairs; kto: "
                   "one epoch of their rows")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-size", type=int, default=None, help="held-out rows: grpo 128, dpo and kto 312 pairs")
    p.add_argument("--lr", type=float, default=None, help="grpo: 1e-5; dpo, kto: 5e-6")
    # grpo
    p.add_argument("--prompt-key", default="question")
    p.add_argument("--answer-key", default="answer")
    p.add_argument("--reward-fn", default="gsm8k")
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-response-len", type=int, default=512)
    p.add_argument("--prompt-template", default=None)
    p.add_argument("--rollout-gpu-memory", type=float, default=0.3, help="fraction of the GPU for vLLM (both sides); "
                   "above 1: GiB of KV cache, for several runs on one GPU")
    # dpo and kto
    p.add_argument("--pairs-per-step", type=int, default=32, help="dpo: pairs per step; kto: rows per step (TRL's "
                   "effective batch: --trl-micro-batch x gradient accumulation)")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--trl-micro-batch", type=int, default=8, help="TRL's per-device batch of pairs (kto: rows; "
                   "gradient accumulation makes up the step); ours packs by tokens")
    p.add_argument("--ours-flags", default="", help='more flags for our script, e.g. "--compile '
                   '--max-tokens-per-micro-batch 65536" (recorded in summary.json)')
    p.add_argument("--only", choices=["ours", "trl"], default=None, help="run one side only")
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)  # the TRL side, in its own process
    p.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    grpo = args.algo == "grpo"
    args.eval_size = args.eval_size or (128 if grpo else 312)
    args.lr = args.lr or (1e-5 if grpo else 5e-6)
    if not grpo and args.pairs_per_step % min(args.trl_micro_batch, args.pairs_per_step):
        p.error(f"--pairs-per-step {args.pairs_per_step} must be a multiple of --trl-micro-batch "
                f"{args.trl_micro_batch}: TRL's step is its micro-batches times gradient accumulation")
    return args


# ----------------------------------------------------------------------------------------------------- our side
def ours_command(args, seed: int, out: str, port: int) -> list[str]:
    common = ["--model", args.model, "--dataset", args.data, "--eval-size", str(args.eval_size), "--lr", str(args.lr),
              "--eval-every", str(args.eval_every), "--seed", str(seed), "--output-dir", out, "--resume", "none"]
    if args.steps:
        common += ["--steps", str(args.steps)]
    if args.algo == "grpo":
        script = "grpo.py"
        common += ["--prompt-key", args.prompt_key, "--answer-key", args.answer_key, "--reward-fn", args.reward_fn,
                   "--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size),
                   "--max-response-len", str(args.max_response_len),
                   "--rollout-gpu-memory", str(args.rollout_gpu_memory)]
        if args.steps is None:
            common += ["--steps", "30"]
        if args.prompt_template:
            common += ["--prompt-template", args.prompt_template]
    else:
        script = "dpo.py"
        common += ["--beta", str(args.beta), "--pairs-per-step", str(args.pairs_per_step), "--max-len",
                   str(args.max_len), "--ref-cache", os.path.join(out, "ref_cache")]
        if args.algo == "kto":  # the pairs split into desirable and undesirable rows, each weighted 1
            common += ["--loss-type", "kto", "--kto-desirable-weight", "1", "--kto-undesirable-weight", "1"]
    return ["torchrun", "--nproc_per_node", "1", "--master-port", str(port), os.path.join(ROOT, script), *common,
            *shlex.split(args.ours_flags)]


# ----------------------------------------------------------------------------------------------------- TRL side
class MetricsWriter:
    """A TrainerCallback (duck-typed, so that this file imports TRL only in the worker) writing our metric names
    (`names`: more of TRL's names -> ours, for this trainer's own metrics)."""

    def __init__(self, path: str, loss_name: str, evaluate=None, eval_every: int = 0, names: dict | None = None):
        self.file, self.loss_name, self.evaluate, self.eval_every = open(path, "w"), loss_name, evaluate, eval_every
        self.step_start, self.row, self.names = 0.0, {}, names or {}

    def write(self, step: int, row: dict) -> None:
        self.file.write(json.dumps({"step": step, **row}) + "\n")
        self.file.flush()

    def on_step_begin(self, args, state, control, **kwargs):
        self.step_start = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.row["time/step"] = time.perf_counter() - self.step_start
        if self.evaluate and self.eval_every and state.global_step % self.eval_every == 0:
            self.row.update(self.evaluate(model))

    def on_log(self, args, state, control, logs=None, **kwargs):
        names = {"reward": "reward/mean", "rewards/accuracies": "rewards/accuracy", "loss": self.loss_name,
                 "eval_rewards/accuracies": "eval/preference_accuracy", "eval_loss": "eval/loss",
                 "completions/mean_length": "response/length_mean", **self.names}
        row = {names[k]: v for k, v in (logs or {}).items() if k in names}
        if row.get("eval/preference_accuracy") is not None or "time/step" in self.row:
            self.write(state.global_step, {**row, **self.row})
            self.row = {}

    def __getattr__(self, name):  # every other callback event: nothing to do
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)


def greedy_accuracy(model, tokenizer, rows, reward, max_new_tokens: int) -> dict:
    """Held-out greedy accuracy with the model's own generate (left-padded batches of 64)."""
    import torch

    was_training, tokenizer.padding_side = model.training, "left"
    model.eval()
    correct = 0.0
    for i in range(0, len(rows), 64):
        batch = rows[i:i + 64]
        texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in batch]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        for r, ids in zip(batch, out[:, enc["input_ids"].shape[1]:]):
            correct += reward("", tokenizer.decode(ids, skip_special_tokens=True), r["answer"])
    model.train(was_training)
    return {"eval/accuracy": correct / len(rows)}


def kto_rows(args, tokenizer) -> tuple[list[dict], list[dict], int]:
    """(TRL's training rows, ours' held-out pairs, steps) for KTO, from dpo.py's own loader at dpo.py's defaults.

    Ours trains on the pairs its tokenizer keeps (a pair the cut leaves without a response, or with two equal ones,
    is dropped), each split into a desirable and an undesirable row, drawn `--pairs-per-step` rows a step by a
    seeded sampler. TRL's KTOTrainer reads its rows in order (it rotates completions within a micro-batch for its
    KL estimate), so it gets those rows' text, in the order ours' sampler draws them, one epoch: its step k trains
    on ours' step k's rows. The held-out pairs are ours' token ids, for `pair_logps`."""
    from types import SimpleNamespace

    from common.data.preferences import load_pairs, load_preference_rows, tokenize_pairs, unpair
    from common.data.prompts import PromptSampler
    from common.train.model import stop_token_ids

    # dpo.py's flags as the bench passes them, the others at dpo.py's defaults (tests/test_bench_vs_trl_kto.py
    # checks them against dpo.Args).
    ours = SimpleNamespace(loss_type="kto", dataset=args.data, dataset_config=None, prompt_key="prompt",
                           chosen_key="chosen", rejected_key="rejected", completion_key="completion", label_key="label",
                           eval_split="test", eval_size=args.eval_size, eval_dataset=None, eval_dataset_config=None,
                           eval_dataset_split="test", max_len=args.max_len,
                           max_prompt_len=args.max_len // 2, chat_template=None, seed=args.seed)
    stop_ids = stop_token_ids(args.model, tokenizer)
    rows, held_out, _ = load_preference_rows(ours, tokenizer, stop_ids)
    kept, tokenized = [], []
    for pair in load_pairs(args.data)[0][:-args.eval_size]:
        try:  # one pair at a time, to know which ones ours keeps
            tokenized += tokenize_pairs([pair], tokenizer, ours.max_len, ours.chat_template, ours.max_prompt_len,
                                        stop_ids)[0]
            kept.append(pair)
        except ValueError:  # "all 1 pairs were dropped"
            pass
    if [(r["prompt_ids"], r["completion_ids"], r["label"]) for r in unpair(tokenized)] != \
            [(r["prompt_ids"], r["completion_ids"], r["label"]) for r in rows]:
        raise SystemExit("error: the pairs kept here are not the rows dpo.py loads: has common/data/preferences.py's "
                         "load_preference_rows changed? (kto_rows reproduces it)")
    text = [{"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen"}
            for pair in kept for side in ("chosen", "rejected")]  # unpair's order: rows[i] is text[i]
    steps = args.steps or max(1, len(rows) // args.pairs_per_step)
    sampler = PromptSampler(text, args.pairs_per_step, 0, 1, args.seed)  # as dpo.py's DatasetExamples on one rank
    return [row for _ in range(steps) for row in sampler.next_batch()], held_out, steps


def pair_logps(model, pairs: list[dict], micro_batch: int):
    """[pairs, 2]: summed log-probs of each pair's chosen and rejected response after its prompt (token ids, as
    ours tokenized them), by the model's own forward on right-padded micro-batches, in bf16 autocast on a GPU (as
    TRL trains) and without gradients."""
    import torch

    was_training, device = model.training, model.device
    model.eval()
    sequences = [(p["prompt_ids"], p[side]) for p in pairs for side in ("chosen_ids", "rejected_ids")]
    sums = []
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        for i in range(0, len(sequences), micro_batch):
            batch = sequences[i:i + micro_batch]
            width = max(len(prompt) + len(response) for prompt, response in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)  # labels: the response's tokens only
            for j, (prompt, response) in enumerate(batch):
                end = len(prompt) + len(response)
                ids[j, :end], mask[j, :end] = torch.tensor(prompt + response), 1
                labels[j, len(prompt):end] = torch.tensor(response)
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
            targets = labels[:, 1:].to(device)  # [batch, seq - 1]: token t + 1 is predicted at t
            logps = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, targets.clamp(min=0).unsqueeze(-1))
            sums.append((logps.squeeze(-1) * (targets != -100)).sum(-1).cpu())
    model.train(was_training)
    return torch.cat(sums).view(-1, 2)


def preference_metrics(logratios, beta: float) -> dict:
    """Held-out metrics as ours names them, from log pi/pi_ref of each pair's responses [pairs, 2]: the share of
    pairs whose chosen response gets the higher implicit reward beta * log-ratio (a tie counts as wrong), the mean
    reward margin and DPO's loss on it (ours reports DPO's loss on held-out pairs under KTO too)."""
    import torch.nn.functional as F

    margins = beta * (logratios[:, 0] - logratios[:, 1])
    return {"eval/preference_accuracy": (margins > 0).float().mean().item(), "eval/margin": margins.mean().item(),
            "eval/loss": -F.logsigmoid(margins).mean().item()}


def trl_worker(args) -> None:
    import torch
    from datasets import Dataset

    from common.train.model import load_tokenizer

    out = args.out
    os.makedirs(out, exist_ok=True)
    tokenizer = load_tokenizer(args.model)  # as ours loads it (AutoTokenizer, or a word-level test model's own)
    bf16 = torch.cuda.is_available()
    common = dict(output_dir=os.path.join(out, "trl"), learning_rate=args.lr, bf16=bf16, use_cpu=not bf16,
                  logging_steps=1, save_strategy="no", report_to="none", seed=args.seed)
    if args.algo == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        from common.data.prompts import formatted_conversation, load_train_eval
        from common.rollout.reward_fns import load_reward_fn

        train_rows, eval_rows = load_train_eval(args.data, args.prompt_key, args.answer_key, eval_size=args.eval_size,
                                                seed=args.seed)
        for r in train_rows + eval_rows:  # as ours formats them (chat template applied by TRL)
            r["prompt"] = formatted_conversation(r, args.prompt_template, None)
        reward = load_reward_fn(args.reward_fn)

        def reward_fn(prompts, completions, answer, **kwargs):
            return [reward("", c[0]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]

        if args.rollout_gpu_memory > 1:  # GiB of KV cache, as --rollout-gpu-memory takes it on our side
            import trl.generation.vllm_generation as generation

            llm = generation.LLM
            generation.LLM = lambda **kw: llm(**{**kw, "gpu_memory_utilization": 0.01,
                                                 "kv_cache_memory_bytes": int(args.rollout_gpu_memory * 2**30)})
        samples = args.prompts_per_step * args.group_size
        micro = min(samples, 64)
        config = GRPOConfig(**common, max_steps=args.steps or 30, num_generations=args.group_size,
                            per_device_train_batch_size=micro, gradient_accumulation_steps=samples // micro,
                            max_completion_length=args.max_response_len, temperature=1.0,
                            use_vllm=bf16, vllm_mode="colocate", vllm_gpu_memory_utilization=args.rollout_gpu_memory)
        trainer = GRPOTrainer(model=args.model, reward_funcs=reward_fn, args=config, processing_class=tokenizer,
                              train_dataset=Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]}
                                                               for r in train_rows]))

        def evaluate(model):
            return greedy_accuracy(model, tokenizer, eval_rows, reward, args.max_response_len)

        writer = MetricsWriter(os.path.join(out, "metrics.jsonl"), "loss/policy", evaluate, args.eval_every)
        writer.write(0, evaluate(trainer.model))
    elif args.algo == "dpo":
        from trl import DPOConfig, DPOTrainer

        from common.data.preferences import load_pairs

        pairs, _ = load_pairs(args.data)
        train, held_out = pairs[:-args.eval_size], pairs[-args.eval_size:]
        micro = min(args.trl_micro_batch, args.pairs_per_step)
        config = DPOConfig(**common, beta=args.beta, max_length=args.max_len, num_train_epochs=1,
                           max_steps=args.steps or -1, per_device_train_batch_size=micro,
                           per_device_eval_batch_size=micro, gradient_accumulation_steps=args.pairs_per_step // micro,
                           eval_strategy="steps", eval_steps=args.eval_every)
        trainer = DPOTrainer(model=args.model, args=config, processing_class=tokenizer,
                             train_dataset=Dataset.from_list(train), eval_dataset=Dataset.from_list(held_out))
        writer = MetricsWriter(os.path.join(out, "metrics.jsonl"), "loss/preference")
        metrics = trainer.evaluate()
        writer.write(0, {"eval/preference_accuracy": metrics["eval_rewards/accuracies"],
                         "eval/loss": metrics["eval_loss"]})
    else:
        from trl import KTOConfig, KTOTrainer

        rows, held_out, steps = kto_rows(args, tokenizer)
        micro = min(args.trl_micro_batch, args.pairs_per_step)
        config = KTOConfig(**common, beta=args.beta, desirable_weight=1.0, undesirable_weight=1.0,
                           max_length=args.max_len, num_train_epochs=1, max_steps=steps,
                           per_device_train_batch_size=micro, gradient_accumulation_steps=args.pairs_per_step // micro)
        trainer = KTOTrainer(model=args.model, args=config, processing_class=tokenizer,
                             train_dataset=Dataset.from_list(rows))
        print(f"TRL KTO: {len(trainer.train_dataset)} of {len(rows)} rows kept ({steps} steps of "
              f"{args.pairs_per_step}; a row whose prompt alone fills --max-len is dropped and shifts later steps)",
              flush=True)
        reference = pair_logps(trainer.model, held_out, micro)  # the initial model: pi_ref of every implicit reward

        def evaluate(model):
            return preference_metrics(pair_logps(model, held_out, micro) - reference, args.beta)

        writer = MetricsWriter(os.path.join(out, "metrics.jsonl"), "loss/preference", evaluate, args.eval_every,
                               names={"kl": "kto/kl", "rewards/chosen": "rewards/desirable",
                                      "rewards/rejected": "rewards/undesirable", "logps/chosen": "logps/desirable",
                                      "logps/rejected": "logps/undesirable"})
        writer.write(0, evaluate(trainer.model))
    trainer.add_callback(writer)
    trainer.train()
    if trainer.state.global_step % args.eval_every:  # the last step, which no evaluation every --eval-every reached
        if args.algo == "dpo":
            metrics = trainer.evaluate()
            writer.write(trainer.state.global_step, {"eval/preference_accuracy": metrics["eval_rewards/accuracies"]})
        else:
            writer.write(trainer.state.global_step, evaluate(trainer.model))


def trl_command(args, seed: int, out: str) -> list[str]:
    """This file again, as the TRL worker of one seed, with the same settings."""
    flags = []
    for key, value in vars(args).items():
        if key in ("out", "seeds", "gpus", "only", "trl_worker", "seed", "algo") or value is None:
            continue
        flags += [f"--{key.replace('_', '-')}", str(value)]
    return [sys.executable, os.path.abspath(__file__), args.algo, *flags, "--out", out, "--seed", str(seed),
            "--trl-worker"]


# ------------------------------------------------------------------------------------------------------- report
def summarise(rows: list[dict]) -> dict:
    steps = [r["time/step"] for r in rows if "time/step" in r and r["step"] > 1]  # step 1 holds compile warm-ups
    curves = {k: [(r["step"], r[k]) for r in rows if k in r]
              for k in ("eval/accuracy", "eval/preference_accuracy", "reward/mean")}
    curves = {k: v for k, v in curves.items() if v}
    return {"median_step_s": statistics.median(steps) if steps else None, "steps": max(r["step"] for r in rows),
            **{f"{k} first -> last": (v[0][1], v[-1][1]) for k, v in curves.items()}, "curves": curves}


DIFFERENCES = {
    "grpo": "precision: ours --precision auto (fp32 on both sides below 0.3B parameters, else bf16), TRL bf16 "
            "autocast; loss normaliser: the same by default since 2026-11-24 (all tokens of the batch); Adam beta2 "
            "0.99 (ours) vs 0.999; schedule: ours constant, TRL linear decay to 0; TRL applies its vLLM "
            "importance-sampling correction by default, ours only with --tis-cap; TRL checkpoints activations by "
            "default (gradient_checkpointing=True) and keeps vLLM awake (no sleep mode)",
    "dpo": "truncation: ours cuts the prompt from the left, then the responses; TRL keeps the start; ours packs "
           "pairs by tokens and computes reference log-probs once (cached), TRL pads micro-batches of "
           "--trl-micro-batch pairs and runs a reference model every step; schedule: ours 5 warmup steps then "
           "constant, TRL linear decay to 0; TRL checkpoints activations by default",
    "kto": "reference point z0 (the KL estimate from mismatched prompt/completion pairs): ours one per step over all "
           "its rows, each row's partner fixed for the run (a seeded draw among rows to other prompts); TRL one per "
           "micro-batch of --trl-micro-batch rows, each row's partner the previous row's completion in that "
           "micro-batch (the same prompt when a pair's two rows sit next to each other); reference log-probs: ours "
           "computed once before training (cached), TRL runs a reference model every step (two extra forwards: "
           "completions and KL partners); tokenization: ours the prompt and the completion apart, TRL prompt + "
           "completion as one text (the completion from where they differ), both end it with EOS; truncation: ours "
           "cuts the prompt from the left (keeping at least --max-len / 2 of its end) then the completion, TRL keeps "
           "the start of prompt + completion and drops rows whose prompt alone fills --max-len (rows kept: in "
           "trl_s*.log); ours packs rows by tokens, TRL pads micro-batches; precision: ours bf16 over fp32 master "
           "weights (offline --precision auto), TRL bf16 autocast over fp32 weights; Adam beta2 0.99 (ours) vs "
           "0.999; schedule: ours 5 warmup steps then constant, TRL linear decay to 0; TRL checkpoints activations "
           "by default; held-out preference accuracy: ours from its packed evaluation against its cached reference, "
           "TRL's model through this script's padded forward against the same model's log-probs before step 1",
}


def main() -> None:
    args = parse_args()
    if args.trl_worker:
        return trl_worker(args)
    gpus = args.gpus.split(",")
    os.makedirs(args.out, exist_ok=True)
    summary = {"algo": args.algo, "args": {k: v for k, v in vars(args).items() if k != "trl_worker"},
               "differences": DIFFERENCES[args.algo], "runs": {}}
    for seed in args.seeds:
        dirs = {"ours": os.path.join(args.out, f"ours_s{seed}"), "trl": os.path.join(args.out, f"trl_s{seed}")}
        commands = {"ours": ours_command(args, seed, dirs["ours"], 29500 + seed), "trl": trl_command(args, seed,
                                                                                                     dirs["trl"])}
        sides = [s for s in ("ours", "trl") if args.only in (None, s)]
        procs = {}
        for i, side in enumerate(sides):
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus[i % len(gpus)], "PYTHONPATH": ROOT + os.pathsep +
                   os.environ.get("PYTHONPATH", "")}
            os.makedirs(dirs[side], exist_ok=True)
            log = open(os.path.join(args.out, f"{side}_s{seed}.log"), "w")
            print(f"seed {seed}, {side} on GPU {env['CUDA_VISIBLE_DEVICES']}: {' '.join(commands[side])}", flush=True)
            procs[side] = subprocess.Popen(commands[side], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            if len(gpus) == 1:  # one GPU: one side at a time
                procs[side].wait()
        for side, proc in procs.items():
            if proc.wait() != 0:
                raise SystemExit(f"error: {side} (seed {seed}) exited with {proc.returncode}: see "
                                 f"{os.path.join(args.out, f'{side}_s{seed}.log')}")
            summary["runs"][f"{side}_s{seed}"] = summarise(read_metrics(dirs[side]))
        if len(procs) == 2:
            ours, trl = summary["runs"][f"ours_s{seed}"], summary["runs"][f"trl_s{seed}"]
            summary["runs"][f"ratio_s{seed}"] = ours["median_step_s"] / trl["median_step_s"]
            print(f"seed {seed}: step time ours {ours['median_step_s']:.2f} s, TRL {trl['median_step_s']:.2f} s, "
                  f"ratio {summary['runs'][f'ratio_s{seed}']:.2f}", flush=True)
        for name in (f"ours_s{seed}", f"trl_s{seed}"):
            if name in summary["runs"]:
                print(name, {k: v for k, v in summary["runs"][name].items() if k != "curves"}, flush=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
