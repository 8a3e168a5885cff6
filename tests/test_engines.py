"""The HF rollout engine: its sampling log-probs equal a teacher-forced forward pass on the same tokens."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from common.rollout.engines import HFRolloutEngine
from common.train.model import token_logprobs

EOS = 1


def tiny_model():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=24,
                                        eos_token_id=EOS, pad_token_id=0))


def test_rollout_logprobs_match_teacher_forcing():
    model = tiny_model()
    engine = HFRolloutEngine(model, stop_token_ids=[EOS], pad_token_id=0)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]  # different lengths: left padding must not leak in
    temperature = 0.7
    outputs = engine.generate(prompts, n=3, max_tokens=6, temperature=temperature, top_p=1.0, seed=3)
    assert [len(group) for group in outputs] == [3, 3, 3]
    checked = 0
    for prompt, group in zip(prompts, outputs):
        for c in group:
            assert len(c.response_ids) == len(c.logprobs) >= 1
            assert c.finished == (c.response_ids[-1] == EOS) and EOS not in c.response_ids[:-1]
            assert c.finished or len(c.response_ids) == 6
            ids = torch.tensor([prompt + c.response_ids])
            lp, _ = token_logprobs(model, ids, torch.ones_like(ids), temperature)
            expected = lp[0, len(prompt) - 1:]  # position t predicts token t + 1
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked == 9


def test_rollout_is_seeded_and_greedy_is_deterministic():
    model = tiny_model()
    engine = HFRolloutEngine(model, stop_token_ids=[EOS], pad_token_id=0)
    prompts = [[5, 6, 7], [8, 9]]
    sample = lambda seed: [c.response_ids for g in engine.generate(prompts, 4, 6, 1.0, 1.0, seed) for c in g]
    assert sample(1) == sample(1)
    assert sample(1) != sample(2)
    greedy = engine.generate(prompts, n=4, max_tokens=6, temperature=1.0, top_p=1.0, seed=0, greedy=True)
    assert [len(g) for g in greedy] == [1, 1]  # greedy: one response per prompt
    # Greedy picks the argmax at every step, so each log-prob is the max over the vocabulary.
    ids = torch.tensor([prompts[0] + greedy[0][0].response_ids])
    logits = model(ids).logits[0, len(prompts[0]) - 1:-1]
    assert logits.argmax(-1).tolist() == greedy[0][0].response_ids[:len(logits)]


def test_stop_tokens_include_the_generation_configs(tmp_path):
    from transformers import GenerationConfig

    from common.train.model import load_tokenizer, stop_token_ids
    tokenizer = load_tokenizer(None)
    assert stop_token_ids(None, tokenizer) == [tokenizer.eos_token_id]
    assert stop_token_ids(str(tmp_path), tokenizer) == [tokenizer.eos_token_id]  # no generation_config.json
    GenerationConfig(eos_token_id=[7, tokenizer.eos_token_id, 3]).save_pretrained(tmp_path)
    assert stop_token_ids(str(tmp_path), tokenizer) == sorted({3, 7, tokenizer.eos_token_id})
    GenerationConfig(eos_token_id=9).save_pretrained(tmp_path)
    assert stop_token_ids(str(tmp_path), tokenizer) == sorted({9, tokenizer.eos_token_id})


def test_logprobs_are_optional_and_do_not_change_the_samples():
    model = tiny_model()
    engine = HFRolloutEngine(model, stop_token_ids=[EOS], pad_token_id=0)
    prompts = [[5, 6, 7], [8, 9]]
    with_lp, without = (engine.generate(prompts, 3, 6, 1.0, 1.0, seed=2, logprobs=flag) for flag in (True, False))
    assert [[c.response_ids for c in g] for g in with_lp] == [[c.response_ids for c in g] for g in without]
    assert all(c.logprobs is not None for g in with_lp for c in g)
    assert all(c.logprobs is None for g in without for c in g)


def test_keys_too_narrow_for_vllms_cache_write_are_refused_before_it_starts(tmp_path):
    """vLLM 0.26.0's KV-cache write never returns when a rank's kv heads x head dim is below 32 (a warp): a tiny
    model of 2 kv heads of dimension 16 hung at --rollout-tp 2 (1 head, 16 values a token), and one of 1 kv head of 16
    hung on one GPU, while 2 heads of 16 ran (benchmarks/README.md, "Mixture of experts"). Refused in one line."""
    import grpo
    from transformers import Qwen3Config

    from common.rollout.vllm_memory import check_kv_width
    from scripts.random_model import save_random_model

    tiny = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)  # head dim 64 / 4 = 16
    check_kv_width(tiny, 1)  # 2 x 16 = 32: ran
    with pytest.raises(ValueError, match=r"--rollout-tp 2: each rank would hold 1 kv head\(s\) of dimension 16, 16 "):
        check_kv_width(tiny, 2)
    with pytest.raises(ValueError, match="1 kv head"):  # one head on one GPU: hung
        check_kv_width(Qwen3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16), 1)
    qwen_05b = Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2)  # 2 kv heads of 64: ran
    for tp in (1, 2, 4):  # at 4, vLLM copies a kv head onto the ranks that share it: still 64 values
        check_kv_width(qwen_05b, tp)
    check_kv_width(Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32), 2)  # 32
    # grpo.py says it at start-up, before any model is loaded; the HF engine has no such kernel
    save_random_model("tiny", str(tmp_path))  # the shape above
    args = dict(model=str(tmp_path), max_response_len=2, rollout_tp=2, prompts_per_step=2)
    with pytest.raises(ValueError, match="--rollout-tp 2: each rank would hold"):
        grpo.check_args(grpo.Args(rollout_engine="vllm", **args), 2)
    grpo.check_args(grpo.Args(rollout_engine="hf", **args), 2)


def test_default_kv_cache_holds_the_sequences_of_a_step():
    from common.rollout.vllm_memory import kv_cache_gib
    from common.run.gpus import default_sleep_level
    # Qwen2.5-0.5B: 24 layers, 2 kv heads of 64 dims. In bf16, keys and values take 2 * 24 * 2 * 64 * 2 = 12,288
    # bytes a token, so 256 sequences of 1,024 tokens take 3 GiB, and 3.3 GiB with the tenth added.
    config = Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, num_hidden_layers=24)
    gib = lambda tp=1, seqs=256, length=1024, dtype=torch.bfloat16: kv_cache_gib(config, dtype, tp, seqs, length, 80)
    assert gib() == pytest.approx(3.3)
    assert gib(dtype=torch.float32) == pytest.approx(6.6)
    assert gib(tp=2) == pytest.approx(1.65)  # one kv head per rank
    assert gib(tp=4) == pytest.approx(1.65)  # still one: vLLM copies a kv head onto the ranks that share it
    assert gib(length=1000) == pytest.approx(3.3 * 1008 / 1024)  # whole blocks of 16 tokens
    assert gib(seqs=1) == 0.5  # the floor
    assert gib(seqs=4096) == pytest.approx(0.4 * 80)  # the cap: 52.8 GiB asked
    # vLLM's weights stay on the GPU while they take at most 15% of it, else they are dropped while training.
    assert default_sleep_level(12 * 2**30, 80 * 2**30) == 0
    assert default_sleep_level(13 * 2**30, 80 * 2**30) == 2
