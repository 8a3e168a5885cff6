"""common/train/model.py: a --model that cannot be a model is one clear line, before transformers guesses at it; and the
HF export's check that its tokenizer loads back as the scripts load a --model (sharding/checkpoint.py)."""

import os

import launcher
import pytest
import torch
from gloo import finish_gloo, free_port, init_gloo

from common.train.model import check_model_source


def test_model_sources(tmp_path):
    check_model_source(None)  # the built-in tiny model
    check_model_source("Qwen/Qwen2.5-0.5B-Instruct")  # a hub id: transformers takes it from here
    with pytest.raises(FileNotFoundError, match="--model /missing/dir: no such directory"):
        check_model_source("/missing/dir")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        check_model_source("./runs/x/hf_step_3")
    with pytest.raises(FileNotFoundError, match="--critic-model ~/x: no such directory"):  # the flag it came from
        check_model_source("~/x", "--critic-model")
    with pytest.raises(ValueError, match="not an HF model directory \\(no config.json; it holds nothing\\)"):
        check_model_source(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no tokenizer"):
        check_model_source(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="no weights"):
        check_model_source(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    check_model_source(str(tmp_path))


def test_a_word_level_tokenizer_loads_back_as_saved(tmp_path):
    """The random-weight models of scripts/random_model.py have a qwen2 config and a word-level tokenizer:
    AutoTokenizer alone rebuilds it as Qwen2's BPE, which splits "w100" into digits."""
    from transformers import Qwen2Config

    from common.train.model import load_tokenizer
    from scripts.random_model import full_vocab_tokenizer

    Qwen2Config(vocab_size=1000).save_pretrained(tmp_path)
    full_vocab_tokenizer(1000).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # the source check wants weights; no model is loaded here
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer("w100 w200")["input_ids"] == [100, 200]


def test_export_tokenizer_check_reads_back_as_the_scripts_load(tmp_path):
    """An export of a random-weight model (qwen2 config, word-level tokenizer) passes the export's round-trip check
    (it failed every export of these models: the check read the tokenizer back with AutoTokenizer alone, as Qwen2's
    BPE); a saved tokenizer that encodes a probe differently still fails it."""
    from transformers import Qwen2Config

    from scripts.random_model import full_vocab_tokenizer
    from sharding.checkpoint import check_tokenizer_round_trip

    Qwen2Config(vocab_size=1000).save_pretrained(tmp_path)
    full_vocab_tokenizer(1000).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    check_tokenizer_round_trip(full_vocab_tokenizer(1000), str(tmp_path), ["w100 w700 w999"])
    full_vocab_tokenizer(500).save_pretrained(tmp_path)  # w700 is unknown to it
    with pytest.raises(ValueError, match="encodes 'w100 w700 w999' differently"):
        check_tokenizer_round_trip(full_vocab_tokenizer(1000), str(tmp_path), ["w100 w700 w999"])



class SavesAnotherTokenizer:
    """Encodes with one word-level tokenizer and saves another (w700 unknown to it): an export whose tokenizer does
    not read back."""

    def __init__(self):
        from scripts.random_model import full_vocab_tokenizer
        self.encodes, self.saves = full_vocab_tokenizer(1000), full_vocab_tokenizer(500)

    def __call__(self, text):
        return self.encodes(text)

    def save_pretrained(self, path):
        self.saves.save_pretrained(path)


def export_whose_tokenizer_does_not_read_back(rank, port, out_dir):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from sharding.checkpoint import save_hf_checkpoint

    init_gloo(rank, 2, port)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=1000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    try:
        save_hf_checkpoint(model, SavesAnotherTokenizer(), os.path.join(out_dir, "hf"), torch.float32,
                           probes=("w100 w700 w999",))
        stopped = "nothing"
    except Exception as e:  # noqa: BLE001 - which error each rank stops with is what the test looks at
        stopped = f"{type(e).__name__}: {e}"
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(stopped)
    finish_gloo()


def test_an_export_whose_tokenizer_does_not_read_back_stops_every_rank(tmp_path):
    """Only rank 0 writes and checks the export; every rank must stop with its error (a user error, so whichever rank
    reports it, the line is the same), or the others would wait in their next collective."""
    launcher.spawn(export_whose_tokenizer_does_not_read_back, args=(free_port(), str(tmp_path)), nprocs=2)
    stopped = [(tmp_path / f"rank{rank}").read_text() for rank in (0, 1)]
    assert stopped[0].startswith("ValueError: the tokenizer saved in ") and "differently" in stopped[0]
    assert stopped[1] == stopped[0]
    assert (tmp_path / "hf" / "config.json").exists()  # the export is in place all the same, for a look at it

def test_checkpoints_are_read_in_the_dtype_their_weights_are_kept_in():
    """read_dtypes: (the policy's, a frozen model's). On a GPU a frozen model is kept in the compute dtype, so it is
    read in it, and so is a LoRA run's base; a policy trained in full is read in fp32. On CPU everything is fp32."""
    from common.train.model import read_dtypes

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert read_dtypes(gpu, "bf16", 0) == (torch.float32, torch.bfloat16)
    assert read_dtypes(gpu, "bf16", 32) == (torch.bfloat16, torch.bfloat16)
    assert read_dtypes(gpu, "fp32", 32) == (torch.float32, torch.float32)
    assert read_dtypes(cpu, "bf16", 32) == (torch.float32, torch.float32)


def test_precision_auto_picks_fp32_below_0_3b_parameters(tmp_path):
    from transformers import Qwen2Config

    from common.train.model import pick_precision

    def shape(name, hidden, layers, vocab):  # pick_precision counts parameters on the meta device: no weights read
        path = tmp_path / name
        Qwen2Config(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers, vocab_size=vocab,
                    num_attention_heads=8, num_key_value_heads=8).save_pretrained(path)
        (path / "tokenizer.json").write_text("{}")  # what check_model_source looks for in a model directory
        (path / "model.safetensors").write_bytes(b"")
        return str(path)

    small = shape("small", 512, 8, 32000)  # 8 layers x 16 x 512^2 + 2 x 16.4M (embedding, head) = 66M
    large = shape("large", 1024, 24, 32000)  # 24 x 16 x 1024^2 + 2 x 32.8M = 468M
    assert pick_precision("auto", small) == "fp32" and pick_precision("auto", large) == "bf16"
    assert pick_precision("auto", None) == "fp32"  # the built-in tiny model
    assert pick_precision("bf16", small) == "bf16" and pick_precision("fp32", large) == "fp32"  # given: kept


# ---------------------------------------------------------------------------------------------------------------
# Hybrid sharding (--shard-size): FSDP2 over a 2-D mesh.

def hsdp_run(rank: int, world: int, shard_size, port: int, out: str, load_from: str | None):
    """Three GRPO updates (SGD with momentum: Adam would turn gradients of float noise, such as a key bias's, into
    full steps) on `world` ranks, models sharded within groups of `shard_size`; the weights, and a training state of
    them. With load_from: that state loaded instead, and the weights and momenta as loaded."""
    import grpo
    from common.run.resume import load_training_state, save_training_state
    from common.train.logprobs import compute_logprobs
    from common.train.model import init_sharding, shard_model
    from test_grpo import fixed_batch, tiny_model

    init_gloo(rank, world, port)
    cpu = torch.device("cpu")
    init_sharding(shard_size, cpu)
    model = shard_model(tiny_model(), cpu, packed_rows=True)
    optimizer, scheduler = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), None
    if load_from:
        load_training_state(load_from, model, optimizer, scheduler, None)
    else:
        samples = fixed_batch()[rank::world]
        args = grpo.Args(max_tokens_per_micro_batch=16, max_response_len=4)
        for _ in range(3):
            for s, lp in zip(samples, compute_logprobs(model, samples, 16, 1.0, cpu)):
                s["old_logprobs"] = lp - 0.05
            grpo.update_policy(model, optimizer, samples, args, world, cpu, generator=None)
        save_training_state(out, 3, model, optimizer, scheduler, None, {})
    state = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    moments = {n: optimizer.state[p]["momentum_buffer"].full_tensor().clone() for n, p in model.named_parameters()}
    if rank == 0:
        mesh = next(model.parameters()).device_mesh
        torch.save({"state": state, "moments": moments, "mesh": tuple(mesh.shape)},
                   os.path.join(out, f"result_{shard_size}_{bool(load_from)}.pt"))
    finish_gloo()


def test_hybrid_sharding_trains_as_full_sharding_and_its_states_load_either_way(tmp_path):
    """4 ranks: sharded within groups of 2 and replicated across the two groups, three updates end at the weights
    of sharding over all 4 (to float tolerance: the gradients are summed in another order); a state saved with groups
    of 2 loads exactly, weights and momenta, into a run sharded over all 4, and the other way round."""
    from test_grpo import tiny_model

    for shard_size in (2, None):
        (tmp_path / str(shard_size)).mkdir()
        launcher.spawn(hsdp_run, args=(4, shard_size, free_port(), str(tmp_path / str(shard_size)), None), nprocs=4)
    hybrid, full = (torch.load(tmp_path / str(k) / f"result_{k}_False.pt") for k in (2, None))
    assert hybrid["mesh"] == (2, 2) and full["mesh"] == (4,)  # replicated over 2 groups, sharded within each
    initial = dict(tiny_model().named_parameters())
    for name, weight in full["state"].items():
        assert not torch.allclose(weight, initial[name].detach()), name
        torch.testing.assert_close(hybrid["state"][name], weight, rtol=1e-4, atol=1e-6, msg=name)
    for saved, loader in [(2, None), (None, 2)]:
        state = tmp_path / str(saved) / "state_000003"
        launcher.spawn(hsdp_run, args=(4, loader, free_port(), str(tmp_path / str(saved)), str(state)), nprocs=4)
        written = torch.load(tmp_path / str(saved) / f"result_{saved}_False.pt")
        loaded = torch.load(tmp_path / str(saved) / f"result_{loader}_True.pt")
        for kind in ("state", "moments"):
            assert all(torch.equal(loaded[kind][n], t) for n, t in written[kind].items()), (saved, loader, kind)


def test_a_shard_size_that_does_not_divide_is_one_line(tmp_path):
    from test_grpo_e2e import assert_one_line_error, torchrun
    assert_one_line_error(torchrun(["--shard-size", "3", "--steps", "1"], tmp_path),
                          "--shard-size 3 must divide the 2 training ranks")


# ---------------------------------------------------------------------------------------------------------------
# A checkpoint is read by rank 0 alone (common/train/model.from_pretrained) and streamed into every rank's shards.

def load_on_ranks(rank: int, world: int, shard_size, port: int, path: str, out: str):
    """The policy (LoRA adapters on it, a MoE's router hooks), the critic and a reward model of `path`, each as
    grpo.py / ppo.py build them, sharded over `world` ranks (hybrid: within groups of shard_size): what each rank held
    before sharding (meta or not), and every parameter's full tensor and every buffer after it."""
    from types import SimpleNamespace

    from transformers import AutoModelForSequenceClassification

    from common.train.lora import add_lora
    from common.train.model import from_pretrained, init_sharding, load_model, shard_model
    from common.train.value_models import load_critic

    init_gloo(rank, world, port)
    cpu, result = torch.device("cpu"), {}
    init_sharding(shard_size, cpu)
    lora = SimpleNamespace(lora_rank=4, lora_alpha=8, lora_targets=None)
    for name, build in [("policy", lambda: add_lora(load_model(path, None, 0), lora, 3)),
                        ("bf16_base", lambda: add_lora(load_model(path, None, 0, dtype=torch.bfloat16), lora, 3)),
                        ("critic", lambda: load_critic(path, None, None, 0)),
                        ("reward", lambda: from_pretrained(AutoModelForSequenceClassification, path, num_labels=1))]:
        model = build()
        on_meta, dtypes = {p.is_meta for p in model.parameters()}, {p.dtype for p in model.parameters()}
        model = shard_model(model, cpu)
        generation = getattr(model, "generation_config", None)  # a causal LM's
        result[name] = {"meta": on_meta, "dtypes": dtypes, "generation": getattr(generation, "temperature", None),
                        "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
                        "buffers": {n: b.clone() for n, b in model.named_buffers()}}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finish_gloo()


@pytest.mark.parametrize("shape,world,shard_size", [("tiny", 2, None), ("qwen3-moe-tiny", 2, None), ("tiny", 4, 2)])
def test_a_checkpoint_is_read_by_rank_0_and_every_rank_holds_its_weights(tmp_path, shape, world, shard_size):
    """Only rank 0 materialises the checkpoint (the others build the model on the meta device: no host memory for a
    copy per rank), and after sharding every rank's weights and buffers (rotary frequencies, which no checkpoint
    holds, among them) are exactly those of one process loading it whole, LoRA adapters included (A drawn from the
    seed); also the critic's, its new value head zeroed, and a reward model's head, whose random initialisation on
    rank 0 is everyone's; the generation config is the checkpoint's on every rank; a LoRA base read in bf16 (as on a
    GPU) the same way. On 2 ranks, and on 4 with hybrid sharding (sharded within pairs, replicated across them)."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, GenerationConfig

    from common.train.lora import add_lora
    from scripts.random_model import full_vocab_tokenizer, model_config

    config = model_config(shape)
    config.vocab_size = 512
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    GenerationConfig(do_sample=True, temperature=0.7).save_pretrained(tmp_path / "model")
    full_vocab_tokenizer(512).save_pretrained(tmp_path / "model")
    launcher.spawn(load_on_ranks, args=(world, shard_size, free_port(), str(tmp_path / "model"), str(tmp_path)),
                   nprocs=world)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]

    whole = add_lora(AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32),
                     SimpleNamespace(lora_rank=4, lora_alpha=8, lora_targets=None), 3)
    expected = dict(whole.named_parameters())
    assert any("lora_A" in n for n in expected) and dict(whole.named_buffers())
    read_in_bf16 = add_lora(AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.bfloat16),
                            SimpleNamespace(lora_rank=4, lora_alpha=8, lora_targets=None), 3)
    for rank, result in enumerate(ranks):
        assert [result[name]["meta"] for name in ("policy", "bf16_base", "critic", "reward")] == [{rank > 0}] * 4
        # a base read in bf16 (read_dtypes on a GPU): rank 0 holds bf16 and no fp32 copy; after sharding, the same
        # values (on CPU in fp32) on every rank
        assert result["bf16_base"]["dtypes"] == {torch.bfloat16 if rank == 0 else torch.float32}
        for n, p in read_in_bf16.named_parameters():
            assert torch.equal(result["bf16_base"]["params"][n], p.detach().float()), (rank, n)
        policy = result["policy"]
        assert policy["params"].keys() == expected.keys() and policy["generation"] == 0.7
        for n, p in expected.items():
            assert torch.equal(policy["params"][n], p.detach()), (rank, n)
        for n, b in whole.named_buffers():
            assert torch.equal(policy["buffers"][n], b), (rank, n)
        assert not result["critic"]["params"]["score.weight"].any()
        for name in ("critic", "reward"):
            for n, p in ranks[0][name]["params"].items():
                assert torch.equal(result[name]["params"][n], p), (rank, name, n)
    body = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(ranks[1]["critic"]["params"][body], expected[body.replace(".weight", ".base_layer.weight")])


def load_in_bf16(rank: int, port: int, path: str, out: str):
    from common.train.model import load_model, shard_model

    init_gloo(rank, 2, port)
    model = shard_model(load_model(path, None, 0, dtype=torch.bfloat16), torch.device("cpu"), trainable=False)
    torch.save({"params": {n: p.full_tensor().clone() for n, p in model.named_parameters()},
                "buffers": {n: b.clone() for n, b in model.named_buffers()}}, os.path.join(out, f"rank{rank}.pt"))
    finish_gloo()


def test_a_model_read_in_bf16_keeps_rank_0s_buffer_dtypes(tmp_path):
    """A buffer built without a dtype takes the one the model is read in: Gemma's embed_scale is bf16 on rank 0, which
    read the checkpoint in bf16 (a frozen model on a GPU), and fp32 on the ranks that built the model on the meta
    device. They take rank 0's dtype and values, so the layout check passes and every rank holds one process's read."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from scripts.random_model import full_vocab_tokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Gemma3TextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=512, max_position_embeddings=64)).save_pretrained(tmp_path / "model")
    full_vocab_tokenizer(512).save_pretrained(tmp_path / "model")
    launcher.spawn(load_in_bf16, args=(free_port(), str(tmp_path / "model"), str(tmp_path)), nprocs=2)
    whole = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.bfloat16)
    assert whole.model.embed_tokens.embed_scale.dtype == torch.bfloat16  # what makes this case
    for rank in (0, 1):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        for n, p in whole.named_parameters():
            assert torch.equal(result["params"][n], p.detach().float()), (rank, n)  # CPU: fp32 after sharding
        for n, b in whole.named_buffers():
            assert result["buffers"][n].dtype == b.dtype and torch.equal(result["buffers"][n], b), (rank, n)


def load_unlike_rank_0(rank: int, port: int, path: str, out: str):
    from common.train.model import load_model, shard_model

    init_gloo(rank, 2, port)
    model = load_model(path, None, 0)
    if rank == 1:  # as a quantized checkpoint would: rank 0's loaded layers unlike those its config builds
        model.model.norm.register_parameter("scale", torch.nn.Parameter(torch.ones(4, device="meta")))
    try:
        shard_model(model, torch.device("cpu"))
        stopped = "nothing"
    except ValueError as e:
        stopped = str(e)
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(stopped)
    finish_gloo()


def test_a_rank_that_built_another_model_than_rank_0_loaded_stops_every_rank(tmp_path):
    """The weights stream parameter by parameter, by name: a rank whose model differs from the one rank 0 loaded
    stops every rank with the same line, before any weight moves (not a collective left waiting, or a buffer sent
    into another one)."""
    from transformers import AutoModelForCausalLM

    from scripts.random_model import full_vocab_tokenizer, model_config

    config = model_config("tiny")
    config.vocab_size = 512
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    full_vocab_tokenizer(512).save_pretrained(tmp_path / "model")
    launcher.spawn(load_unlike_rank_0, args=(free_port(), str(tmp_path / "model"), str(tmp_path)), nprocs=2)
    stopped = [(tmp_path / f"rank{rank}").read_text() for rank in (0, 1)]
    assert stopped[0] == stopped[1]
    assert stopped[0] == ("rank 1 built the model from the checkpoint's config unlike the one rank 0 loaded (a "
                          "quantized checkpoint?): only rank 0 has nothing else, only rank 1 ['model.norm.scale [4] "
                          "float32']"), stopped[0]


def test_bench_load_reports_the_whole_model_read_by_rank_0(tmp_path):
    """benchmarks/bench_load.py on 2 CPU ranks: its parameter count is the checkpoint's plus LoRA's adapters (derived
    from the shapes: r x (in + out) for each of the 7 projections of each layer), read in fp32 on CPU."""
    import json
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from scripts.random_model import full_vocab_tokenizer, model_config

    config = model_config("tiny")
    config.vocab_size = 512
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "model")
    full_vocab_tokenizer(512).save_pretrained(tmp_path / "model")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             os.path.join(root, "benchmarks", "bench_load.py"), "--model", str(tmp_path / "model"),
                             "--lora-rank", "4", "--out", str(tmp_path / "load.json")],
                            capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "load.json").read_text())
    h, mlp, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = h // config.num_attention_heads
    q, kv = h, config.num_key_value_heads * head_dim
    adapters = 4 * layers * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + mlp) + (mlp + h))
    assert report["parameters"] == model.num_parameters() + adapters
    assert report["read_dtype"] == "torch.float32" and [r["rank"] for r in report["ranks"]] == [0, 1]
