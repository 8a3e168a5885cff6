"""Random-weight models at real Qwen2.5 shapes and mixture-of-experts ones (Qwen3-MoE, OLMoE), for GPU runs and
benchmarks where no hub can be reached (and tiny ones, for CPU smoke tests of the scripts that make those runs).

    python scripts/random_model.py --shape 0.5b --out /tmp/qwen0.5b
    torchrun --nproc_per_node 1 grpo.py --model /tmp/qwen0.5b --lr 1e-6 ...

The directory holds config, bf16 safetensors and a word-level tokenizer that covers the whole vocabulary: the
built-in task's words first (so grpo.py runs the built-in task on a model of real size and speed), then one
filler word per remaining id (so every sampled token decodes to something a reward function can see).
"""

import argparse
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

# Qwen2.5 architectures: hidden size, MLP size, layers, query heads, kv heads, vocabulary, tied embeddings.
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True),  # not a Qwen2.5 size
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
# Llama architectures: SmolLM2-135M's (benchmarks/bench_train.py trains it; scripts/plan.py's --shape smollm2).
LLAMA_SHAPES = {"135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                             num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=1e5)}
# Mixture-of-experts architectures (sharding/vllm_moe.py maps both into vLLM): experts, experts per token, and each
# expert's MLP size (moe_intermediate_size in Qwen3-MoE, intermediate_size in OLMoE). Parameters in all / active.
MOE_SHAPES = {
    "qwen3-moe-tiny": ("qwen3_moe", dict(hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                                         num_experts_per_tok=2, vocab_size=4096)),
    "olmoe-tiny": ("olmoe", dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, vocab_size=4096)),
    # OLMoE-1B-7B-0924's config: 6.9B / 1.3B.
    "olmoe-1b-7b": ("olmoe", dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                                  num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                                  num_experts_per_tok=8, vocab_size=50304, rope_theta=1e4,
                                  max_position_embeddings=4096)),
    # OLMoE-1B-7B with half its experts (top-8 of 32): 3.7B / 1.3B, whose full fine-tuning fits one H200 (fp32
    # master weights, gradients and Adam moments are 16 bytes a parameter: 111 GB at 6.9B, before anything else).
    "olmoe-1b-4b": ("olmoe", dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                                  num_attention_heads=16, num_key_value_heads=16, num_experts=32,
                                  num_experts_per_tok=8, vocab_size=50304, rope_theta=1e4,
                                  max_position_embeddings=4096)),
    # Qwen3-30B-A3B's config: 30.5B / 3.3B.
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                        head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                        vocab_size=151936, rope_theta=1e6, max_position_embeddings=40960)),
}


def qwen2_config(shape: str) -> Qwen2Config:
    return Qwen2Config(**SHAPES[shape], rope_theta=1e6, max_position_embeddings=32768)


def model_config(shape: str):
    """The transformers config of any --shape (untied embeddings for the MoE ones, as their checkpoints have)."""
    if shape in SHAPES:
        return qwen2_config(shape)
    model_type, sizes = MOE_SHAPES[shape]
    return AutoConfig.for_model(model_type, **sizes, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                                pad_token_id=None)  # save_random_model sets them from its tokenizer


def full_vocab_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from common.train.tiny_model import SPECIAL_TOKENS, WORDS
    words = SPECIAL_TOKENS + WORDS
    words += [f"w{i}" for i in range(len(words), vocab_size)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def save_random_model(shape: str, out: str, stop_every: int = 0) -> None:
    """stop_every N > 0: generation_config lists one filler token in N as an end-of-sequence token besides <eos>.
    A random model samples about uniformly, so its responses then end after about N tokens: geometric lengths,
    a long tail up to --max-response-len, as RL rollouts have."""
    config = model_config(shape)
    tokenizer = full_vocab_tokenizer(config.vocab_size)
    config.eos_token_id, config.pad_token_id, config.bos_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id, None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.cpu()  # drawn on a GPU (fast), saved from host memory: saving copies a MoE's experts (30B: over 80 GB)
    if stop_every:
        fillers = sorted(i for word, i in tokenizer.get_vocab().items() if word == f"w{i}")
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, *fillers[::stop_every]]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES) + sorted(MOE_SHAPES), default="0.5b")
    parser.add_argument("--out", required=True, help="directory to write")
    parser.add_argument("--stop-every", type=int, default=0,
                        help="make one token in N a stop token: responses of about N tokens, long-tailed (0: off)")
    args = parser.parse_args()
    save_random_model(args.shape, args.out, args.stop_every)
