"""Policy models: load one (hub id, local directory or the built-in tiny model), shard it with FSDP2,
and compute the log-probs of given tokens, the quantity every RL loss here is built from."""

import os

import torch
import torch.nn.functional as F
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from common.train.logprobs import use_packed_attention
from common.train.moe import install_router_hooks
from common.train.sequence_parallel import check_heads, sequence_parallel_size
from common.train.tiny_model import build_tiny_tokenizer, tiny_model_config
from sharding.checkpoint import load_saved_tokenizer


def check_model_source(model: str | None, flag: str = "--model") -> None:
    """One clear line, naming the flag, for a model path that cannot be a model: a local path that is missing or not
    an HF model directory (transformers would otherwise read it as a hub id, or ask for a tokenizer package)."""
    if model is None:
        return
    local = os.path.exists(model) or model.startswith((".", "/", "~")) or model.count("/") > 1
    if not local:
        return  # a hub id: transformers says what is wrong with it
    if not os.path.isdir(model):
        raise FileNotFoundError(f"{flag} {model}: no such directory")
    present = sorted(os.listdir(model))
    if "config.json" not in present:
        raise ValueError(f"{flag} {model}: not an HF model directory (no config.json; it holds "
                         f"{present[:8] or 'nothing'})")
    if not {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"} & set(present):
        raise ValueError(f"{flag} {model}: the directory has no tokenizer (tokenizer.json or tokenizer_config.json)")
    if not any(name.endswith((".safetensors", ".bin", ".safetensors.index.json")) for name in present):
        raise ValueError(f"{flag} {model}: the directory has no weights (*.safetensors)")


def load_tokenizer(model: str | None):
    check_model_source(model)
    if model is None:
        tokenizer = build_tiny_tokenizer()
    else:
        try:
            tokenizer = load_saved_tokenizer(model)  # as the HF export checks that its tokenizer reads back
        except (OSError, ValueError) as e:  # hub unreachable, unknown id: transformers' message runs to pages
            raise ValueError(f"--model {model}: could not load its tokenizer "
                             f"({' '.join(str(e).split())[:240]})") from e
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_token_ids(model: str | None, tokenizer) -> list[int]:
    """Tokens that end a response: the tokenizer's EOS and every EOS the checkpoint's generation_config.json lists
    (chat models end a turn with their own token, e.g. Qwen2.5-Instruct's <|im_end|> besides <|endoftext|>)."""
    ids = {tokenizer.eos_token_id}
    if model is not None:
        try:
            eos = GenerationConfig.from_pretrained(model).eos_token_id
        except OSError:  # the checkpoint has no generation_config.json
            eos = None
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return sorted(ids)


def load_model(model: str | None, tokenizer, seed: int, every_rank: bool = False,
               dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The model for shard_model: a checkpoint read by rank 0 alone (see from_pretrained), or the built-in tiny
    model built from the seed on every rank. every_rank: the whole model on every rank (one that is not sharded).
    dtype: see read_dtypes."""
    if model is None:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(tiny_model_config(tokenizer), dtype=torch.float32)
    return from_pretrained(AutoModelForCausalLM, model, every_rank, dtype)


def read_dtypes(device: torch.device, precision: str, lora_rank: int) -> tuple[torch.dtype, torch.dtype]:
    """(the policy's, a frozen model's) dtype to read a checkpoint in. A frozen model (a reference, a reward model, a
    LoRA run's base) is read in the dtype shard_model keeps it in: the compute dtype on a GPU, fp32 on CPU. Read in
    fp32 and cast later, rank 0 would first hold twice the memory: a 30B LoRA run's host peaked at 239 GB of 270 that
    way, against 61.8 GB read in bf16 (benchmarks/bench_load.py). A policy trained in full is read in fp32, its master
    weights' dtype."""
    frozen = compute_dtype(precision) if device.type == "cuda" else torch.float32
    return frozen if lora_rank else torch.float32, frozen


def from_pretrained(model_class, path: str, every_rank: bool = False, dtype: torch.dtype = torch.float32,
                    **config_overrides) -> torch.nn.Module:
    """model_class.from_pretrained(path) in `dtype` on CPU, on rank 0 only: the other ranks build the same model on
    the meta device (no memory) and shard_model streams rank 0's weights into their shards. Were every rank to read
    the whole checkpoint, the host would hold one copy per rank: 2 ranks of a 30B model in fp32 asked 244 GB of a
    256 GiB host, and one was killed while loading. every_rank: read on every rank."""
    shared = not every_rank and dist.is_initialized() and dist.get_world_size() > 1
    if not shared or dist.get_rank() == 0:
        net = model_class.from_pretrained(path, dtype=dtype, **config_overrides)
    else:
        net = meta_model(path, model_class, **config_overrides)  # (shard_model casts it as rank 0's)
    if shared and net.can_generate():  # rank 0's sampling defaults, which generate() applies
        config = [net.generation_config.to_dict()]
        dist.broadcast_object_list(config, 0)
        net.generation_config = GenerationConfig.from_dict(config[0])
    net.weights_from_rank0 = shared
    return net


def meta_model(path: str, model_class=AutoModelForCausalLM, **config_overrides) -> torch.nn.Module:
    """The model of a checkpoint's config on the meta device: its names, shapes and parameter count, no memory."""
    with torch.device("meta"):
        return model_class.from_config(AutoConfig.from_pretrained(path, **config_overrides), dtype=torch.float32)


@torch.no_grad()
def receive_weights(model: torch.nn.Module, full: dict[str, torch.Tensor] | None, device: torch.device) -> None:
    """Collective over the training ranks, after fully_shard: every parameter's shards from rank 0's full tensors
    (`full`, its model's parameters before sharding, on CPU; None elsewhere, where the model is on the meta device),
    one parameter at a time (distribute_tensor sends each rank its shard); then the buffers, which include the ones no
    checkpoint holds (rotary frequencies). First every rank checks that it built what rank 0 loaded."""
    # A buffer made without a dtype takes the one the model was read in (Gemma's embed_scale): rank 0's are the truth
    dtypes = [{name: b.dtype for name, b in model.named_buffers()}]
    dist.broadcast_object_list(dtypes, 0)
    for name, buffer in list(model.named_buffers()):
        if full is None and dtypes[0].get(name, buffer.dtype) != buffer.dtype:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = buffer.to(dtypes[0][name])
    layout = [(name, tuple(t.shape), t.dtype) for name, t in [*model.named_parameters(), *model.named_buffers()]]
    layouts = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, layout)
    if differing := next((i for i, other in enumerate(layouts) if other != layouts[0]), None):
        only = [[f"{n} {list(shape)} {str(dtype).removeprefix('torch.')}" for n, shape, dtype in a if (n, shape, dtype)
                 not in b][:3] for a, b in [(layouts[0], layouts[differing]), (layouts[differing], layouts[0])]]
        raise ValueError(f"rank {differing} built the model from the checkpoint's config unlike the one rank 0 loaded "
                         f"(a quantized checkpoint?): only rank 0 has {only[0] or 'nothing else'}, only rank "
                         f"{differing} {only[1] or 'nothing else'}")
    if full is None:
        model.to_empty(device=device)  # uninitialised memory for this rank's shards and the buffers
    for name, param in model.named_parameters():
        source = full.pop(name).to(device, param.dtype) if full is not None else \
            torch.empty(param.shape, dtype=param.dtype, device=device)  # (rank 0's host copy freed as it goes)
        param.to_local().copy_(distribute_tensor(source, param.device_mesh, param.placements).to_local())
    for buffer in model.buffers():
        dist.broadcast(buffer, 0)


def model_config(model: str | None, tokenizer=None):
    """The transformers config of `model`, or of the built-in tiny model (sized to `tokenizer`, else the built-in one)."""
    if model is None:
        return tiny_model_config(tokenizer or load_tokenizer(None))
    check_model_source(model)  # a bad path: one line naming --model
    return AutoConfig.from_pretrained(model)


def save_model_config(model: str | None, tokenizer, path: str) -> str:
    """Writes config + tokenizer (no weights) where a rollout engine can read the architecture; returns the path."""
    os.makedirs(path, exist_ok=True)
    model_config(model, tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])  # e.g. {"Qwen2DecoderLayer"}
    # By the class or its base: fully_shard swaps a module's class for an FSDP subclass (FSDPQwen2DecoderLayer).
    layers = [m for m in model.modules() if any(c.__name__ in layer_classes for c in type(m).__mro__)]
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (_no_split_modules is empty)")
    return layers


def compile_model(model: torch.nn.Module, head: bool = True) -> None:
    """torch.compile each decoder layer's forward, with dynamic shapes (a packed row's length changes every
    micro-batch). Only the forward: FSDP2's gather and reshard hooks around it stay eager, and parameter names do
    not change. With head, also the LM head's per-chunk log-prob math (common/train/logprobs.py: fused passes over the
    [chunk, vocab] logits). Small models gain most, their layers being many short kernels. Calling it again only
    changes head."""
    for layer in decoder_layers(model):
        if not getattr(layer, "compiled", False):
            layer.forward, layer.compiled = torch.compile(layer.forward, dynamic=True), True
    model.compiled_head = head


def pick_precision(precision: str, model: str | None) -> str:
    """--precision auto: fp32 for models under 0.3B parameters (the built-in one included), else bf16. On
    SmolLM2-135M, GRPO in fp32 (trainer and vLLM: their log-probs then agree to 0.002 per token, against 0.04 in bf16)
    reached 0.84 held-out accuracy on addition in 30 steps against 0.68 in bf16 (same seeds), at 1.5x the step time
    (benchmarks/README.md). Larger models stay in bf16: fp32 matmuls (no TF32) cost far more there, unmeasured."""
    if precision != "auto":
        return precision
    if model is None:
        return "fp32"
    check_model_source(model)  # the first to read the model: a bad path is one line naming it
    return "fp32" if sum(p.numel() for p in meta_model(model).parameters()) < 0.3e9 else "bf16"


def compute_dtype(precision: str) -> torch.dtype:
    """The GPU arithmetic of a --precision: the trainer's compute dtype and vLLM's."""
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]


_mesh = None  # the training ranks' device mesh for FSDP2: None shards over them all; 2-D for hybrid sharding


def init_sharding(shard_size: int | None, device: torch.device) -> None:
    """Collective over the training ranks. shard_size K (hybrid sharding, HSDP): FSDP2 over a 2-D mesh, every model
    sharded within groups of K consecutive ranks (a node: the parameter all-gathers of each layer stay on its fast
    links) and replicated across the groups (only the gradients' reduction crosses them, once per update). None, or
    every rank: sharded over all of them."""
    global _mesh
    world = dist.get_world_size()
    if shard_size is None or shard_size == world:
        _mesh = None
        return
    if shard_size < 1 or world % shard_size:
        raise ValueError(f"--shard-size {shard_size} must divide the {world} training ranks")
    from torch.distributed.device_mesh import init_device_mesh
    _mesh = init_device_mesh(device.type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


def sharding_mesh():
    """The 2-D mesh of hybrid sharding, or None (every model sharded over every training rank)."""
    return _mesh


def shard_model(model: torch.nn.Module, device: torch.device, *, activation_checkpointing: bool = False,
                trainable: bool = True, compile_layers: bool = False, precision: str = "bf16",
                packed_rows: bool = False, router_aux_loss_coef: float = 0.0) -> torch.nn.Module:
    """FSDP2: each decoder layer is its own all-gather unit, then the root (embeddings, final norm, head), over every
    training rank or, with hybrid sharding (init_sharding), within groups of them.

    On GPU the compute runs in bf16 (precision "fp32": fp32) while the sharded master weights stay fp32 and gradients
    are reduced in fp32; on CPU everything is fp32. fully_shard moves the shards to `device`. Frozen parameters (a
    model that does not train, a LoRA model's base) are kept in the compute dtype: they need no fp32 master copy
    (read_dtypes reads them in it).
    trainable=False freezes the whole model; True keeps each parameter's requires_grad (common/train/lora.py sets them).
    compile_layers: see compile_model. packed_rows: the model only ever runs packed rows (use_packed_attention): any
    model but a policy that also generates with HF's generate (common/rollout/engines.py switches that one itself).
    A mixture-of-experts model gets hooks on its routers (common/train/moe.py: metrics, routing replay, and the
    load-balancing loss weighted router_aux_loss_coef).
    """
    if sequence_parallel_size() > 1:
        check_heads(model.config, sequence_parallel_size())
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not trainable:
        model.requires_grad_(False)
    policy = MixedPrecisionPolicy()  # CPU: fp32 throughout
    if device.type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype(precision), reduce_dtype=torch.float32)
    _, frozen = read_dtypes(device, precision, 0)
    for param in model.parameters():  # fp32 master weights for what trains (adapters on a base read in bf16 are bf16)
        param.data = param.data.to(torch.float32 if param.requires_grad else frozen)
    install_router_hooks(model, decoder_layers(model), router_aux_loss_coef)  # None for a dense model
    from_rank0 = getattr(model, "weights_from_rank0", False)  # from_pretrained: only rank 0 holds the weights
    # Detached: fully_shard moves each Parameter's data to the GPU in place, and `full` must keep the CPU copy,
    # not hold the whole model on GPU 0 until every shard is sent.
    full = {n: p.detach() for n, p in model.named_parameters()} if from_rank0 and dist.get_rank() == 0 else None
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=_mesh, mp_policy=policy)
    if compile_layers:
        compile_model(model)
    fully_shard(model, mesh=_mesh, mp_policy=policy)  # also moves the shards and buffers onto `device`
    if from_rank0:
        receive_weights(model, full, device)
    if trainable and sequence_parallel_size() > 1:
        # Each rank of a sequence-parallel group computes a share of the same samples' gradient (its tokens), and
        # every sum over ranks counts those samples once per rank: dividing the summed gradients by the number of
        # groups instead of ranks gives the update of the same samples without sequence parallelism.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(dist.get_world_size() / sequence_parallel_size())
                module.set_force_sum_reduction_for_comms(device.type == "cpu")  # gloo has no pre-multiplied sum
    model.train(trainable)
    if packed_rows:
        use_packed_attention(model, device)
    return model


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of input_ids[:, 1:] given everything before them, under logits / temperature.

    input_ids, attention_mask: [batch, seq], right-padded. Returns [batch, seq - 1] log-probs (and entropies).
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    logits = logits.float() / temperature  # [batch, seq - 1, vocab]
    logprobs = F.log_softmax(logits, dim=-1)
    token_lp = logprobs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():  # a metric only: keep it out of the autograd graph
            entropy = -(logprobs.exp() * logprobs).sum(-1)
    return token_lp, entropy
