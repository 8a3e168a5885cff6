"""Log-probs on packed rows (common/train/logprobs.py): packed == padded, no attention across sequences, and the chunked LM
head == the full one, in values and gradients; on GPU, the varlen attention == padded, and in fp32 == exact attention
per sequence, in values and gradients."""

import pytest
import torch
import torch.nn.functional as F

from common.train.batching import pack_sequences, plan_micro_batches, restore_order
from common.train.logprobs import chunked_token_logprobs, packed_token_logprobs, use_packed_attention
from common.train.model import token_logprobs
from test_batching import random_seqs, tiny_model


def padded_reference(model, seqs, device=torch.device("cpu")) -> list[torch.Tensor]:
    """Per-sequence log-probs of tokens 1.. from the existing padded path (one right-padded batch)."""
    length = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (length - len(s)) for s in seqs], device=device)
    mask = torch.tensor([[1] * len(s) + [0] * (length - len(s)) for s in seqs], device=device)
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, mask, temperature=0.7)
    return [lp[i, :len(s) - 1] for i, s in enumerate(seqs)]


@pytest.mark.parametrize("attn", ["sdpa", "eager", "nanorl_varlen"])
def test_packed_logprobs_equal_padded_in_original_order(attn):
    """transformers' attentions read the packing from position ids; ours (on CPU: sdpa per length) from cu_seqlens."""
    model = tiny_model("sdpa").eval()
    seqs = random_seqs(9)
    expected = padded_reference(model, seqs)
    if attn == "nanorl_varlen":
        use_packed_attention(model, torch.device("cpu"))
    else:
        model.set_attn_implementation(attn)
    # A small budget reorders and splits the samples; results must land back on their own samples.
    plan = plan_micro_batches([len(s) for s in seqs], max_tokens=40)
    assert len(plan) > 1 and [i for mb in plan for i in mb] != list(range(len(seqs)))
    results = []
    with torch.no_grad():
        for mb in plan:
            packed = pack_sequences([seqs[i] for i in mb])
            lp, _ = packed_token_logprobs(model, packed, temperature=0.7, chunk_tokens=16)
            results.append(list(torch.split(lp, packed["num_scored"])))
    for got, want in zip(restore_order(plan, results), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed_attention", [False, True])
def test_packing_does_not_leak_across_sequences(packed_attention):
    # The same sequence scores the same alone or after another one: attention stops at the boundary.
    model = tiny_model().eval()
    if packed_attention:
        use_packed_attention(model, torch.device("cpu"))
    a, b = random_seqs(2, seed=3)
    with torch.no_grad():
        alone, _ = packed_token_logprobs(model, pack_sequences([b]), 1.0)
        after, _ = packed_token_logprobs(model, pack_sequences([a, b]), 1.0)
    torch.testing.assert_close(after[len(a) - 1:], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("temperature, chunk", [(1.0, 7), (0.6, 64)])
def test_chunked_logprobs_match_full_logits(temperature, chunk, fused):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = (0.5 * torch.randn(300, 16, generator=g, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 300, (50,), generator=g)
    upstream = torch.randn(50, generator=g, dtype=torch.float64)  # any loss: a weighted sum

    log_softmax = F.log_softmax(hidden @ weight.T / temperature, dim=-1)
    want = log_softmax.gather(-1, targets[:, None]).squeeze(-1)
    want_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    want_grads = torch.autograd.grad((want * upstream).sum(), (hidden, weight))

    got, entropy = chunked_token_logprobs(hidden, weight, targets, temperature, chunk_tokens=chunk, with_entropy=True,
                                          fused=fused)
    got_grads = torch.autograd.grad((got * upstream.float()).sum(), (hidden, weight))
    # The chunks compute in float32 (as on GPU, where the head runs in bf16): float32 tolerances.
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy, want_entropy.float(), rtol=1e-5, atol=1e-6)
    for g_got, g_want in zip(got_grads, want_grads):
        torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the varlen attention kernel on packed rows == padded sdpa, up to bf16 rounding.

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attn", ["nanorl_varlen", "flex_attention"])
def test_packed_attention_on_gpu_matches_padded(attn):
    from common.train.logprobs import use_packed_attention

    device = torch.device("cuda")
    seqs = random_seqs(12, seed=11) + [list(range(3, 40)) * 8]  # one long sequence among short ones
    # head_dim 16: flex attention's kernels need at least 16
    expected = padded_reference(tiny_model(hidden_size=64).to(device).eval(), seqs, device)  # fp32, padded, sdpa
    model = tiny_model(hidden_size=64).to(device, torch.bfloat16).eval()
    if attn == "nanorl_varlen":
        assert use_packed_attention(model, device) == attn
    else:
        model.set_attn_implementation(attn)
    with torch.no_grad():
        packed = pack_sequences(seqs)
        lp, _ = packed_token_logprobs(model, packed, temperature=0.7)
        alone, _ = packed_token_logprobs(model, pack_sequences(seqs[-1:]), temperature=0.7)
    # The same bf16 weights through the padded sdpa path: how far bf16 rounding alone takes this model from fp32.
    bf16_padded = padded_reference(tiny_model(hidden_size=64).to(device, torch.bfloat16).eval(), seqs, device)
    rounding = (torch.cat(bf16_padded) - torch.cat(expected)).abs().mean()
    # Packed is no further from fp32 than padded bf16 is; attending across a boundary would be off by O(1).
    diff = (lp - torch.cat(expected)).abs()
    # The same kernel on the long sequence alone and packed after 12 others: the same numbers, up to rounding.
    leak = (lp[-len(alone):] - alone).abs()
    print(f"{attn}: mean |packed - fp32| {diff.mean():.4f} (max {diff.max():.4f}), |padded bf16 - fp32| "
          f"{rounding:.4f}, |packed - alone| {leak.mean():.4f} (max {leak.max():.4f})")
    assert diff.mean() < 2 * rounding + 0.01, f"mean {diff.mean():.4f} against bf16 rounding {rounding:.4f}"
    assert leak.mean() < rounding + 0.01, f"mean {leak.mean():.4f} against bf16 rounding {rounding:.4f}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp32_packed_attention_on_gpu_matches_exact_attention_per_sequence(compiled):
    """fp32 goes through the memory-efficient kernel on the whole packed row (with grouped-query heads): against
    causal softmax attention computed per sequence in float64, forward and backward."""
    from common.train.logprobs import varlen_attention_forward

    device, g = torch.device("cuda"), torch.Generator().manual_seed(0)
    lengths, heads, kv_heads, head_dim, scale = [37, 5, 130, 64, 1, 77], 6, 2, 64, 0.11
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q, k, v = (torch.randn(1, h, sum(lengths), head_dim, generator=g).to(device).requires_grad_()
               for h in (heads, kv_heads, kv_heads))  # [1, heads, total, head_dim], as transformers passes them
    upstream = torch.randn(sum(lengths), heads, head_dim, generator=g).to(device)
    attention = torch.compile(varlen_attention_forward, dynamic=True) if compiled else varlen_attention_forward
    out, _ = attention(None, q, k, v, None, scaling=scale, cu_seq_lens_q=cu, max_length_q=max(lengths))
    grads = torch.autograd.grad((out[0] * upstream).sum(), (q, k, v))

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = []
    for start, length in zip(cu[:-1].tolist(), lengths):
        qs, ks, vs = (x[0, :, start:start + length] for x in (q64, k64.repeat_interleave(3, 1),
                                                               v64.repeat_interleave(3, 1)))
        scores = (qs @ ks.transpose(-1, -2)) * scale  # [heads, length, length]
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool, device=device).triu(1), -torch.inf)
        want.append((scores.softmax(-1) @ vs).transpose(0, 1))  # [length, heads, head_dim]
    want = torch.cat(want)
    want_grads = torch.autograd.grad((want * upstream.double()).sum(), (q64, k64, v64))
    torch.testing.assert_close(out[0].double(), want, rtol=1e-4, atol=1e-5)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)
