"""The built-in tiny model: a two-layer Llama of random weights and a word-level tokenizer with one token per word of
the built-in task (common/data/synthetic.py: "max 7 13 2 =", answered "13"), so that every script runs on a CPU with
no download. The task reads its numbers' range, NUM_VALUES, from here: each number is one token of the vocabulary.
"""

NUM_VALUES = 30  # numbers 0..29, each one token
SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
WORDS = ["max", "="] + [str(n) for n in range(NUM_VALUES)] + ["lookup", "?"]  # the last two: --env lookup


def build_tiny_tokenizer():
    """A PreTrainedTokenizerFast with one token per word (imported here: the reward processes need none of it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: token_id for token_id, word in enumerate(SPECIAL_TOKENS + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # without a decoder, decode joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def tiny_model_config(tokenizer):
    """A two-layer Llama of about 136k parameters. Llama rather than Qwen2: AutoTokenizer on a saved Qwen2 model
    always builds Qwen2's byte-level tokenizer, whatever tokenizer was saved with it, while for Llama it loads the
    saved one, so an exported tiny model loads back as it trained. head_dim 32 suits every vLLM attention backend."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.eos_token_id,  # no separate BOS token: none is prepended
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
