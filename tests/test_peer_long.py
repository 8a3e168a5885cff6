"""scripts/peer_long.py: verl's reward is the long mode's reward (without math-verify), verl's prompts are grpo.py's
in grpo.py's order with grpo.py's token ids, verl's copy of the model loads its tokenizer back as grpo.py's, and the
summary's medians leave out step 1. (verl's side of these, in its own environment, is `peer_long.py check-verl`.)"""

import json
import sys
import zlib
from pathlib import Path

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_async  # noqa: E402
import peer_long  # noqa: E402
from random_model import save_random_model  # noqa: E402

import grpo  # noqa: E402
from common.data.prompts import PromptSampler, load_prompts  # noqa: E402
from common.train.model import load_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("peer_long") / "tiny"
    save_random_model("tiny", str(path), stop_every=2000)
    return str(path)


def long_mode_reward(tmp_path):
    """bench_async.REWARD, the file gpu_checks.sh long writes and grpo.py loads with --reward-fn."""
    namespace = {}
    exec(compile(bench_async.REWARD, str(tmp_path / "long_reward.py"), "exec"), namespace)
    return namespace["reward"]


def test_verl_reward_equals_the_long_mode_reward(tmp_path):
    reward = long_mode_reward(tmp_path)
    texts = [" ".join(f"w{(7919 * i + 104729 * j) % 151936}" for j in range(i % 7 + 1)) for i in range(40_000)]
    # The rare responses that the math-verify part scores 1 (c = 0 and b = 2a: about 1 in 2,500), those one step
    # off it either way (b = 2a with c > 0; c = 0 with b = 2a +- 1), and some others.
    parts = {t: ((h := zlib.crc32(t.encode())) % 97 + 1, h % 89 + 2, h % 13) for t in texts}
    equal = [t for t, (a, b, c) in parts.items() if c == 0 and b == 2 * a]
    near = ([t for t, (a, b, c) in parts.items() if c > 0 and b == 2 * a][:20]
            + [t for t, (a, b, c) in parts.items() if c == 0 and abs(b - 2 * a) == 1][:20])
    chosen = equal + near + texts[:100]
    assert len(equal) >= 5 and len(near) == 40
    assert [peer_long.compute_score("nanorl_builtin", t, "0") for t in chosen] == [reward("", t, "") for t in chosen]
    assert {peer_long.long_reward(t) for t in equal} <= {1.0, 2.0}
    assert {peer_long.long_reward(t) for t in near} <= {0.0, 1.0}


def test_verl_data_holds_grpo_prompts_in_grpo_order(model_dir, tmp_path):
    peer_long.verl_data(model_dir, str(tmp_path), seed=1, batches=3)
    rows = Dataset.from_parquet(str(tmp_path / "train.parquet"))
    # What grpo.py draws at steps 1-3 of the long mode (one rank, or one rollout rank): its own loading and sampler.
    args = grpo.Args(model=model_dir, eval_size=16, max_response_len=8192)
    train_rows, eval_rows, _ = load_prompts(args, load_tokenizer(model_dir))
    sampler = PromptSampler(train_rows, args.prompts_per_step, 0, 1, args.seed)
    drawn = [row for _ in range(3) for row in sampler.next_batch()]
    assert args.prompts_per_step == 16 and len(rows) == 48
    assert [r["prompt"][0]["content"] for r in rows] == [r["prompt"] for r in drawn]
    assert [r["extra_info"]["prompt_ids"] for r in rows] == [r["prompt_ids"] for r in drawn]
    assert [r["prompt"][0]["content"] for r in Dataset.from_parquet(str(tmp_path / "val.parquet"))] == \
        [r["prompt"] for r in eval_rows]


def test_verl_model_loads_its_tokenizer_as_grpo_does(model_dir, tmp_path):
    out = tmp_path / "verl_model"
    peer_long.verl_model(model_dir, str(out))
    ours, theirs = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(out)  # verl's and vLLM's loader
    assert type(theirs).__name__ == "TokenizersBackend"  # not Qwen2Tokenizer's BPE, which a qwen2 config asks for
    for prompt in ["max 7 14 15 =", "max 0 29 3 ="]:
        rendered = theirs.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
        assert rendered == ours(prompt)["input_ids"]
    assert len(theirs.encode("\n", add_special_tokens=False)) == 1 and theirs.convert_tokens_to_ids("<|im_end|>")
    responses = [[(31 * i + 7 * j) % ours.vocab_size for j in range(i % 30 + 1)] for i in range(50)]
    assert [theirs.decode(r, skip_special_tokens=True) for r in responses] == \
        [ours.decode(r, skip_special_tokens=True) for r in responses]
    assert (out / "model.safetensors").resolve() == (Path(model_dir) / "model.safetensors").resolve()


def test_summary_takes_medians_from_step_2(tmp_path, capsys):
    nanorl = [{"step": s, "time/step": t, "perf/tokens_per_s": 1000.0 / t, "response/length_mean": 2000.0,
               "response/truncated_frac": 0.02} for s, t in [(1, 90.0), (2, 30.0), (3, 34.0), (4, 32.0)]]
    verl = [{"step": s, "timing_s/step": t, "perf/total_num_tokens": 250_000.0, "response_length/mean": 1900.0}
            for s, t in [(1, 200.0), (2, 60.0), (3, 70.0), (4, 64.0)]]
    for name, rows in (("nanorl_metrics.jsonl", nanorl), ("verl_steps.jsonl", verl)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "setup.json").write_text(json.dumps({"pair": "async"}))
    (tmp_path / "mem_verl.csv").write_text("1, 1000\n1, 95367\n1, [N/A]\n")  # nvidia-smi's MiB: 95367 = 100.0 GB
    peer_long.summary(str(tmp_path), str(tmp_path / "peer_long.json"))
    result = json.loads((tmp_path / "peer_long.json").read_text())
    assert result["nanorl"]["step_s"] == 32.0 and result["verl"]["step_s"] == 64.0
    assert result["verl"]["tokens_per_s"] == pytest.approx(250_000 / 64, abs=1e-3)
    assert result["verl_over_nanorl_step_time"] == 2.0 and result["nanorl"]["steps_measured"] == [2, 3, 4]
    assert result["verl"]["gpu_memory_peak_gb"] == 100.0 and result["nanorl"]["gpu_memory_peak_gb"] is None
    assert capsys.readouterr().out.startswith("PEERLONG async: nanorl median step 32.00 s (steps 2-4)")
