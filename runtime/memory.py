"""Engineering, not the paper: the memory plan, made from the machine a run uses before any weight is read.

train.prepare plans twice: on θ̄ built on the meta device from --model's config alone (a few KB), before the weights
are fetched, so that a run that cannot fit stops before the download in one line naming what does fit (each
suggestion planned again); then beside the loaded backbone, for the budgets (tokens a forward/backward, the
conversations that generate together, gradient checkpointing). Every term is bytes a token, a row or a parameter,
each side of a step in its own dtype mix (`Mix`), checked against measurements by `python -m scripts.bench
--check-plan` (docs/real-models.md, "Memory at the paper's budgets"); `python -m scripts.bench --where` prints
what it decides for Qwen3-4B and -8B on one and eight cards.

    python train.py --model Qwen/Qwen3-4B --memory 80      # plans for 80 GB before the download
    python -m pytest tests/test_plan.py tests/test_scale.py -q

No deviation from the paper lives here.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import dataclasses
from dataclasses import dataclass

import torch

from runtime import models, parallel, serving
from runtime.devices import UserError, say


# ----------------------------------------------------------------------------------------------------------------
# The memory plan: every budget from the machine it runs on, decided before any weight is read
# ----------------------------------------------------------------------------------------------------------------
# train.prepare plans twice. First on θ̄ built on the meta device from --model's config alone (a few KB), before the
# weights are fetched or loaded: a run that cannot fit stops there, in one line that names what does fit, each
# suggestion planned again (`advice`). Then on the loaded backbone (`fit_memory`), from the memory measured free
# beside it, for the budgets: the token budget of every forward/backward, the conversations that generate
# together, gradient checkpointing. Both plans are `memory_plan` on a `Planning`.
HEADROOM = 0.85     # the share of the memory beside the backbone a plan fills; the rest is for what it does not count
CPU_TOKENS = 2048   # a CPU's forward/backward is no faster a token past this many (docs/real-models.md): the cap there
EXPERIENCE_TOKENS = 512   # tokens of one retrieved experience in the composer's encoder (an observation-lite trace)
OBSERVATION_TOKENS = 512  # what one environment step adds to a conversation beside its reply (a tool's result, a
                          # program's test report, the template's turn markers): an upper estimate, see the docs
PROMPT_TOKENS = 4096      # the first prompt where no tokenizer can be read before the weights (a folder with only
                          # config.json, a hub id not in the cache): a system prompt and its tool schemas, rounded up
VLLM_MAX_SEQS = 256       # --engine vllm: the engine's max_num_seqs (vLLM's CPU default), given so the plan knows it
MOST_GPUS = 64            # the most GPUs a refusal's advice considers under torchrun
GB = 1e9


def device_memory(device) -> tuple[int, int]:
    """(total, free) bytes of the device a run uses: CUDA's card; on the CPU (and MPS, which shares the host's
    memory) the host's MemTotal and MemAvailable, and under an address-space cap (`ulimit -v`) what the cap leaves
    above the process's size."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, free
    info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in open("/proc/meminfo")}
    total, free = info.get("MemTotal", 0), info.get("MemAvailable", info.get("MemFree", 0))
    import resource
    cap = resource.getrlimit(resource.RLIMIT_AS)[0]
    if cap != resource.RLIM_INFINITY:
        size = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize"))
        total, free = min(total, cap), min(free, cap - size)
    return total, max(0, free)


def free_memory(device) -> int:
    """Bytes this process may still fill on `device` (`device_memory`)."""
    return device_memory(device)[1]


def disk_free(out: str) -> int:
    """Bytes a run may write under `out`: what its filesystem has free (the nearest folder that exists), plus what
    OUT/ckpt already holds (a resumed run's checkpoint is replaced by the next one)."""
    where = os.path.abspath(out)
    while not os.path.isdir(where):
        where = os.path.dirname(where)
    held = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(os.path.join(out, "ckpt"))
               for f in files)
    return shutil.disk_usage(where).free + held


@dataclass
class Machine:
    """What a plan is made for: the device the run uses and the disk --out is on, in bytes."""
    type: str          # cuda | cpu | mps
    total: int         # the device's memory
    free: int          # free on it when measured (before the backbone loads, or beside it)
    limit: int         # what the run may fill, the backbone included: --memory GB, else what was free before it
    given: bool        # the limit is --memory's
    disk: int          # free for --out (`disk_free`)


def machine(args, device, loaded: int = 0) -> Machine:
    """The device `device` and --out's disk, measured now; `loaded`: bytes of the backbone already on the device
    (0 before it loads), so that what was free before it is `free + loaded`."""
    total, free = device_memory(device)
    limit = int(args.memory * GB) if args.memory else free + loaded
    return Machine(torch.device(device).type, total, free, limit, bool(args.memory), disk_free(args.out))


@dataclass
class Footprint:
    """What a run's settings hold on each rank beside its activations, counted on θ̄ (train.footprint)."""
    backbone: int      # bytes of θ̄ on the device: the teacher and the composer's encoder
    trained: int       # parameters trained on this rank (its shard of the student, the composer): 16 bytes each
    gathered: tuple    # parameters of an FSDP2 student gathered whole on a rank (while training, while generating)
    checkpoint: int    # bytes one checkpoint writes (rank 0: the whole student and its AdamW states, the composer)


@dataclass
class Trains:
    """What the joint stage trains beside the student, from the method and the composer (train.trains)."""
    targets: tuple     # the projections a LoRA adapts: the composer's, and a LoRA student's
    lora_r: int        # the composer's LoRA rank
    qformer: int       # the composer's QFormer parameters
    ema: bool          # the method keeps an EMA copy of a full student (SDPO, SDFT)
    per_task: int      # rollouts per task (GRPO's groups): a step's tasks split over the ranks whole


def footprint(args, model, trains: Trains, ranks: int = 0) -> Footprint | None:
    """What the settings `args` hold on each of `ranks` ranks (0: this job's) beside their activations, counted on θ̄
    (loaded or on the meta device): the parameters trained on a rank (the student, a full copy sharded by FSDP2 or
    a LoRA of rank --student-lora-r, an EMA teacher counted with it; the composer, replicated), what FSDP2 gathers
    of a full student, one checkpoint's bytes (fp32 weights and AdamW m and v of all that is trained, an EMA
    teacher's weights), θ̄'s bytes. None where the settings cannot run there: an EMA method with --student-lora, or
    batches that do not split evenly over the ranks (`check_world`)."""
    ranks = ranks or parallel.world()
    if (trains.ema and args.student_lora) or parallel.uneven(args, ranks, trains.per_task):
        return None
    lora = sum(m.in_features + m.out_features for n, m in model.named_modules()      # a LoRA's, per unit of rank
               if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in trains.targets)
    layers = [m for m in model.modules() if type(m).__name__ in (model._no_split_modules or [])]
    layer = sum(t.numel() for t in layers[0].parameters()) if layers else 0
    total = sum(t.numel() for t in model.parameters())
    student = lora * args.student_lora_r if args.student_lora else total
    composer = lora * trains.lora_r + trains.qformer
    sharded = ranks > 1 and not args.student_lora
    root = total - layer * len(layers)                                   # embeddings, head, final norm
    return Footprint(backbone=backbone_bytes(model),
                     trained=(student // ranks if sharded else student) * (2 if trains.ema else 1) + composer,
                     gathered=(root + 2 * layer, total) if sharded else (0, 0),
                     checkpoint=12 * (student + composer) + (4 * student if trains.ema else 0))


def decoding_copy_bytes(args, model, elem: int) -> int:
    """The bf16 copy `models.decoding_copy` makes of a full fp32 student while it generates (not under --student-lora,
    nor torchrun, nor --engine vllm, nor fp32): 2 bytes a Linear parameter of `model` (the backbone θ̄)."""
    if args.student_lora or parallel.world() > 1 or args.engine != "hf" or elem == 4:
        return 0
    return 2 * sum(t.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
                   for t in m.parameters(recurse=False))


def prompt_tokens(chat, tasks: list, latents: int) -> int:
    """The tokens a plan prices a prompt at: the longest of the world's first eight prompts as `chat` (engine.Chat,
    with --model's tokenizer) renders them, plus the teacher's `latents` positions; PROMPT_TOKENS where no chat with
    a template could be made before the weights."""
    if chat is None or not tasks or not chat.tokenizer.chat_template:
        return PROMPT_TOKENS + latents
    return max(len(chat.prompt(*chat.begin(task))) for task in tasks[:8]) + latents


def backbone_bytes(model) -> int:
    """θ̄'s bytes on its device: its parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def conversation_tokens(args, prompt: int) -> int:
    """The tokens one conversation is priced at, in training and in generation: its episode's own budget, `prompt`
    then --max-env-steps replies of --max-new-tokens each followed by an observation (OBSERVATION_TOKENS), and
    never more than --max-len, where the engine ends every episode."""
    return min(args.max_len, prompt + args.max_env_steps * (args.max_new_tokens + OBSERVATION_TOKENS))


@dataclass(frozen=True)
class Mix:
    """The dtypes of one side of a training step (a forward that is back-propagated) and what trains in it, which fix
    what autograd saves a token (`layer_activation_bytes`)."""
    stream: int        # bytes of an element of the residual stream and the norms' outputs: the weights' dtype
    compute: int       # of a linear's output and what SDPA reads: bf16 (2) under autocast, else the stream's
    trains: str        # all (a full student) | lora (adapters on the seven projections, a frozen base) | none (the
                       # teacher: gradients reach only its inputs, the latents)
    cast: int = 0      # bytes of the copy of its input each linear (or adapter) makes for itself: bf16 (2) under
                       # autocast over fp32 weights, fp32 (4) where peft casts a bf16 input to its fp32 adapter
                       # without autocast; 0: the linears that read one tensor share it
    lora_r: int = 0


def step_mixes(elem: int, student_lora_r: int = 0, composer_r: int = 8, sharded: bool = False) -> tuple:
    """(student, teacher, encoder) `Mix`es of a run whose backbone θ̄ has `elem`-byte weights. bf16 (CUDA, or CPU's
    --dtype bfloat16): a full student is fp32 under bf16 autocast (`precision`), a LoRA student fp32 adapters on
    the bf16 base under it; the encoder runs θ̄ and the composer's fp32 LoRA with autocast off (composer.py). fp32
    (the CPU): everything fp32, no autocast, nothing cast. A full student FSDP2 shards (`sharded`, torchrun) computes
    in the weights' dtype it gathers (parallel.shard_student: bf16 on CUDA), with nothing cast."""
    half = elem == 2
    student = (Mix(2, 2, "lora", 2 if half else 0, student_lora_r) if student_lora_r else
               Mix(elem, elem, "all") if sharded else Mix(4, 2 if half else 4, "all", 2 if half else 0))
    return student, Mix(elem, elem, "none"), Mix(elem, elem, "lora", 4 if half else 0, composer_r)


def _widths(config) -> tuple:
    """(d, q width, k/v width, MLP width, heads, k/v heads, head_dim) of a decoder's config."""
    d, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return d, heads * head_dim, kv_heads * head_dim, config.intermediate_size, heads, kv_heads, head_dim


def layer_activation_bytes(config, elem: int = 2, mix: Mix | None = None) -> int:
    """What one decoder layer (HF's Qwen3/Llama, SDPA) saves for its backward, per token, in `mix` (default: every
    weight trains in `elem` bytes, no autocast). Traced tensor by tensor on HF's Qwen3 (bench.check_plan measures
    it per mix); the sum of `_norm_bytes`, SDPA and the MLP, and `_linear_input_bytes`."""
    mix = mix or Mix(elem, elem, "all")
    d, q, kv, I, h, _, _ = _widths(config)
    c = mix.compute
    # SDPA: q, k, v and its output in the compute dtype, its log-sum-exp fp32 a head; the MLP: gate's output (SiLU's
    # input), SiLU's output and up's output
    core = c * (2 * q + 2 * kv) + 4 * h + 3 * c * I
    lora = 7 * mix.lora_r * (mix.cast or c) if mix.trains == "lora" else 0      # each adapter's A output, r wide
    return _norm_bytes(config, mix) + core + _linear_input_bytes(config, mix) + lora


def _norm_bytes(config, mix: Mix) -> int:
    """A layer's four RMSNorms (two over d, q_norm, k_norm), per token: each keeps its input upcast to fp32 (4 bytes
    an element, whatever the dtype: HF's norms compute in fp32) and 1/rms (4 bytes a row, a row a head for q/k);
    a trained norm weight also keeps its normalized input, in the input's dtype (the stream's for the d-wide
    norms, the compute dtype for q and k)."""
    d, q, kv, _, h, kvh, _ = _widths(config)
    weights = 2 * mix.stream * d + mix.compute * (q + kv) if mix.trains == "all" else 0
    return 4 * (2 * d + q + kv) + 4 * (2 + h + kvh) + weights


def _linear_input_bytes(config, mix: Mix) -> int:
    """The inputs a layer's linears keep for their weights' (or adapters') gradients, per token. Shared (`mix.cast`
    0): the two norms' outputs (q/k/v read one, gate/up the other; o reads SDPA's output, kept already) and down's
    input. Cast: five d-wide copies (q, k, v, gate, up each cast its own), and under a LoRA o's and down's own;
    a full student's o and down read bf16 already (autocast's cast is then the tensor itself)."""
    d, q, _, I, _, _, _ = _widths(config)
    if mix.trains == "none":
        return 0                                        # frozen weights: a linear keeps only its weight
    if not mix.cast:
        return 2 * mix.stream * d + mix.compute * I
    own = mix.cast * (q + I) if mix.trains == "lora" else mix.compute * I
    return 5 * mix.cast * d + own


def activation_bytes_per_token(config, checkpointing: bool, elem: int = 2, mix: Mix | None = None) -> int:
    """The activations of one token through the decoder in `mix` (default as `layer_activation_bytes`): every layer's
    without recomputation, with checkpointing each layer's input (the residual stream) and one layer's while it is
    recomputed; outside the layers the final norm (`_norm_bytes`' terms over d), a trained embedding's ids, and
    without checkpointing RoPE's cos and sin (the stream's dtype; a checkpointed layer keeps its inputs, not them)."""
    mix = mix or Mix(elem, elem, "all")
    d, L, hd = config.hidden_size, config.num_hidden_layers, _widths(config)[6]
    # final norm: fp32 input and 1/rms, a trained weight's normalized input; ids int64
    outside = 4 * d + 4 + (mix.stream * d + 8 if mix.trains == "all" else 0)
    layer = layer_activation_bytes(config, elem, mix)
    if checkpointing:
        return outside + mix.stream * d * L + layer                   # each layer's input (T, d), one layer again
    return outside + 2 * hd * mix.stream + layer * L                  # cos, sin (T, head_dim) each


def backward_bytes_per_token(config, mix: Mix) -> int:
    """What a backward holds beside the saved activations while one layer back-propagates, per token: the gradients
    of its MLP's three (T, MLP width) intermediates in the compute dtype and of the residual stream into and out of
    it in the stream's. A layer at a time, so it is counted once, not per layer. Measured with the saved terms as a
    forward and backward's peak (bench.check_plan's step peaks)."""
    return 3 * config.intermediate_size * mix.compute + 2 * config.hidden_size * mix.stream


def loss_bytes_per_row(config) -> int:
    """The chunked loss's peak per row of its chunk: ~6 fp32 (V,) tensors (both sides' logits and log-probs, a
    gradient). `bench.check_plan` measures it."""
    return 6 * 4 * config.vocab_size


def kv_bytes_per_token(config, elem: int = 2, mix: Mix | None = None) -> int:
    """Generation's KV cache: keys and values of every layer. Qwen3-4B in bf16: 2·36·8·128·2 = 147 KB a token. In
    `mix`: keys leave k_norm in the promotion of its weight's dtype (the stream's) and the compute dtype, values
    leave v_proj in the compute dtype: a full student under autocast caches fp32 keys and bf16 values."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    key, value = (max(mix.stream, mix.compute), mix.compute) if mix else (elem, elem)
    return config.num_hidden_layers * kv * (key + value)


def weight_cast_bytes(model, mix: Mix, sharded: bool = False) -> dict:
    """{checkpointing: bytes} a full student under autocast keeps beside its activations: with the autocast cache off
    (`precision`) every linear casts its fp32 weight to bf16 at each forward, and the cast is saved for the input's
    gradient until the backward, 2 bytes a decoder-layer linear weight (one layer's while it is recomputed). None
    for a `sharded` student: FSDP2 gathers its layers in bf16 (`footprint`'s gathered)."""
    if mix.trains != "all" or not mix.cast or sharded:
        return {False: 0, True: 0}
    layers = [m for m in model.modules() if type(m).__name__ in (model._no_split_modules or [])]
    per_layer = sum(m.weight.numel() for m in layers[0].modules() if isinstance(m, torch.nn.Linear)) if layers else 0
    return {False: mix.cast * per_layer * len(layers), True: mix.cast * per_layer}


def kv_budget_batch(config, budget_gb: float, max_len: int, elem: int = 2, mix: Mix | None = None) -> int:
    """How many conversations of max_len tokens generate together within budget_gb of KV cache (at least one), each
    token's keys and values in the generating model's `mix` (`kv_bytes_per_token`)."""
    return max(1, int(budget_gb * GB // (kv_bytes_per_token(config, elem, mix) * max_len)))


def vllm_batch(kv_tokens: int, in_flight: int) -> tuple[int, str]:
    """--engine vllm: how many conversations generate together, and the bound that chose it (the plan's line).
    vLLM pages its KV cache: a conversation holds blocks for the tokens it has, not a whole --max-len; a prompt
    prefix the batch shares is cached once; the scheduler admits a request when its blocks fit and preempts (then
    recomputes) one when they run out. So the batch is as many conversations as `kv_tokens` hold at `in_flight`
    tokens each (what their replies may add: --max-env-steps × --max-new-tokens, at most --max-len), and at most
    VLLM_MAX_SEQS, the engine's max_num_seqs: its scheduler runs no more at once."""
    fit = kv_tokens // max(1, in_flight)
    cache = f"{kv_tokens} tokens, {in_flight} a conversation's replies"
    if fit >= VLLM_MAX_SEQS:
        return VLLM_MAX_SEQS, f"vLLM's max_num_seqs; its paged cache: {cache}"
    return max(1, fit), f"vLLM's paged cache: {cache}"


@dataclass
class Costs:
    """What one run costs in memory beyond the loaded backbone, in bytes (`step_costs`)."""
    resident: int        # allocated for the whole joint stage: the trained weights, their gradients and AdamW states
    per_token: dict      # {checkpointing: bytes} of one supervised token of a micro-batch (student and teacher)
    per_row: dict        # {checkpointing: bytes} of one rollout of a micro-batch (its J experiences in the encoder)
    fixed: int           # of any training step: the loss's chunk of rows (and an FSDP2 student's gathered layers)
    per_conversation: int   # of one priced conversation generating: its KV cache
    kv_token: int = 0       # of one token of a generating conversation
    generating: int = 0     # held only while generating: an FSDP2 student gathered whole
    engine_batch: tuple | None = None   # --engine vllm: (conversations, bound) of `vllm_batch`; its cache is resident
    decoder: int = 0     # while the student generates: its bf16 copy (`models.decoding_copy`), beside the KV caches
    casts: dict = dataclasses.field(default_factory=lambda: {False: 0, True: 0})   # {checkpointing: bytes} of a
                         # training step whatever its tokens: the full student's bf16 weight casts (`weight_cast_bytes`)
    optimizer: int = 0   # AdamW's step, after the backward freed the activations: its temporary (`OPTIMIZER_TEMP`)

    def training(self, tokens: int, ckpt: bool) -> int:
        """Bytes of a training step of `tokens` tokens: the resident states, then the larger of the backward's peak
        (the fixed terms, the weight casts, a rollout's experiences, the tokens' activations) and AdamW's temporary,
        which comes once the backward has freed the activations."""
        backward = self.fixed + self.casts[ckpt] + self.per_row[ckpt] + tokens * self.per_token[ckpt]
        return self.resident + max(backward, self.optimizer)


# torch.optim.AdamW as train.py builds it (foreach left to torch: on with CUDA tensors, off on the CPU) allocates a
# temporary of all its parameters' size at every step on CUDA (torch._foreach_sqrt of v, then divided in place), 4
# bytes a trained fp32 parameter; on the CPU its per-parameter loop holds one parameter's. Measured on the CPU with
# foreach=True forced (bench.check_plan: 100 M parameters, +400 MB at each step). Counted rather than removed
# (fused=True has none, but is untested here on FSDP2's DTensors): the plan counts 4 bytes a trained parameter.
OPTIMIZER_TEMP = 4

# A forward of several rows pads them to the longest (engine.pack), and SDPA then takes a (B, 1, T, T) mask and leaves
# its fused kernels for one that reads it: on CUDA the bool mask and a bias of the compute dtype made of it (2 rows of
# 38k tokens: 2.9 GB and 5.8 GB); on the CPU its math path, which keeps scores a head (measured: 3.8 bytes a B·T²
# element for fp32, 3 heads, 4 layers, checkpointing; 14.6 without). A forward of one row is not padded and takes
# none. So a row longer than SHARED_FORWARD_TOKENS goes through a forward of its own (engine.micro_batches, where the
# plan sets a token budget), and the shorter rows that share one are priced at their mask's bound: rows·T ≤ the token
# budget and T ≤ SHARED_FORWARD_TOKENS, so rows·T² ≤ budget × SHARED_FORWARD_TOKENS elements of (1 + elem) bytes:
# a per-token term (`mask_bytes_per_token`). The CPU's math path is above that bound; there a forward is capped at
# CPU_TOKENS, and the bound is checked by bench.check_plan.
SHARED_FORWARD_TOKENS = 2048


def mask_bytes_per_token(elem: int) -> int:
    """The padded mask's bound per token of a forward's budget: SHARED_FORWARD_TOKENS elements of a bool and an
    `elem`-byte bias (see above)."""
    return (1 + elem) * SHARED_FORWARD_TOKENS


def step_costs(config, elem: int, trained: int, n_ret: int, loss_chunk: int, max_len: int,
               mixes: tuple | None = None) -> Costs:
    """The terms of the plan for a backbone of `config` with `elem`-byte weights and `trained` trained parameters
    on this rank (its shard of the student, and the composer): 16 bytes each (fp32 weight, gradient, AdamW m and
    v), and AdamW's temporary; every supervised token, with the padded mask's share (`mask_bytes_per_token`) and a
    layer's backward (`backward_bytes_per_token`), goes through the student and the teacher, each rollout's J
    experiences through the encoder, each side in its own `Mix` (`mixes`: (student, teacher, encoder), default
    `step_mixes(elem)`); the loss is C rows × ~6 fp32 (V,) tensors chunked, both sides' (T, V) logits in full; a
    generating conversation of `max_len` priced tokens (`conversation_tokens`) holds the student's KV cache."""
    student, teacher, encoder = mixes or step_mixes(elem)
    side = lambda mix, ck: activation_bytes_per_token(config, ck, elem, mix)              # noqa: E731
    sides = {ck: side(student, ck) + side(teacher, ck) for ck in (False, True)}
    backward = max(backward_bytes_per_token(config, m) for m in (student, teacher))   # one layer's, at a time
    full_logits = 0 if loss_chunk else 2 * config.vocab_size * (elem + 8)        # logits, log-probs, a gradient
    kv = kv_bytes_per_token(config, elem, student)
    return Costs(resident=16 * trained,
                 per_token={ck: b + backward + full_logits + mask_bytes_per_token(elem) for ck, b in sides.items()},
                 per_row={ck: n_ret * EXPERIENCE_TOKENS * side(encoder, ck) for ck in (False, True)},
                 fixed=loss_bytes_per_row(config) * loss_chunk,
                 per_conversation=max_len * kv, kv_token=kv, optimizer=OPTIMIZER_TEMP * trained)


class NoFit(UserError):
    """The plan's refusal (`plan_memory`): why, the longest conversation that would fit (0: none), and the bytes one
    priced conversation needs beside the backbone to `what` (train or generate) (`_check_one_fits`)."""

    def __init__(self, why: str, largest: int, free: int, need: int = 0, what: str = ""):
        super().__init__(f"memory plan: {why} ({_size(HEADROOM * free)} planned of {_size(free)} free)")
        self.why, self.largest, self.need, self.what = why, largest, need, what


@dataclass
class MemoryPlan:
    free: int              # bytes the plan may fill beside the backbone (HEADROOM of them are planned)
    grad_ckpt: bool
    token_budget: int      # padded tokens per forward/backward
    gen_batch: int         # conversations that generate together
    longest: int           # bytes a training step of one priced conversation needs, at the plan's checkpointing
    chosen: tuple          # which of grad_ckpt, token_budget, gen_batch the plan chose (the others were given)
    gen_bound: str = ""    # what bounded a chosen gen_batch where it is not the KV caches (--engine vllm)
    conversation: int = 0  # the tokens a conversation is priced at (`conversation_tokens`)
    notes: tuple = ()      # a given budget that will not fit, one line each (`fit_memory` says them)
    machine: Machine | None = None     # what it was made for (`memory_plan`), and what it holds there:
    backbone: int = 0                  # θ̄'s bytes on the device
    checkpoint: int = 0                # one checkpoint's bytes; two are on disk while the next is written
    engine: object = None              # --engine vllm: the engine's share (serving.EngineShare), said in the line

    def line(self) -> str:
        made = lambda k: "" if k in self.chosen else " (given)"                        # noqa: E731
        bound = f" ({self.gen_bound}; --gen-batch to set)" if self.gen_bound and "gen_batch" in self.chosen else ""
        budget = f"{self.token_budget} tokens" if self.token_budget else "--micro-batch rollouts"
        return (f"memory plan: {self.room_words()}; gradient checkpointing {'on' if self.grad_ckpt else 'off'}"
                f"{made('grad_ckpt')}; {budget} a forward/backward{made('token_budget')} (one "
                f"{self.conversation}-token conversation trains in {_size(self.longest)}); {self.gen_batch} "
                f"conversations generate together{made('gen_batch')}{bound}{self.engine_words()}{self.disk_words()}")

    def engine_words(self) -> str:
        """--engine vllm: the engine's share of the memory (`serving.EngineShare.words`)."""
        return f"; {self.engine.words()}" if self.engine else ""

    def room_words(self) -> str:
        """Where the plan's bytes come from: the device's total and free, what the run may fill, the backbone."""
        if self.machine is None:
            return f"{_size(HEADROOM * self.free)} planned of {_size(self.free)} free"
        return budget_words(self.machine, self.backbone)

    def disk_words(self) -> str:
        """The checkpoints' room: two on disk while the next is written (`check_disk`)."""
        if self.machine is None or not self.checkpoint:
            return ""
        return f"; checkpoints 2 × {_size(self.checkpoint)} on --out's disk ({_size(self.machine.disk)} free)"


def budget_words(m: Machine, backbone: int) -> str:
    """The device's total and free, what a run may fill there (--memory or what is free), the backbone's share and
    what the plan fills beside it: the plan's line and a refusal say them alike."""
    beside = m.limit - backbone
    limit = "--memory" if m.given else "what is free; --memory to set"
    return (f"{m.type} {_size(m.total)} total, {_size(m.free)} free; the run fills at most {_size(m.limit)} ({limit}),"
            f" the {_size(backbone)} backbone included: {_size(HEADROOM * beside)} planned of the {_size(beside)} "
            "beside it")


def _size(b: float) -> str:
    """Bytes as GB, or as MB below a tenth of a GB."""
    return f"{b / GB:.1f} GB" if b >= 0.1 * GB else f"{b / 1e6:.1f} MB"


def plan_memory(costs: Costs, free: int, max_len: int, given: dict, cap: int | None = None) -> MemoryPlan:
    """The budgets that fit `free` bytes beside the backbone (HEADROOM of them) for conversations priced at `max_len`
    tokens: checkpointing only if one conversation does not train without it; the token budget that fills what is
    left beside the resident weights, at most `cap` (on a CPU a longer forward is no faster a token: train.py caps
    it there at CPU_TOKENS, and a micro-batch still holds at least one episode); as many generating conversations
    as their KV caches fit beside the student's decoding copy (under --engine vllm, `costs.engine_batch`: the
    engine's cache is resident, and pages).
    `given` holds grad_ckpt, token_budget and gen_batch, each kept unless None. A NoFit (a UserError) when one
    conversation cannot train, or generate, even alone; a note when a given budget will not fit."""
    grad_ckpt, token_budget, gen_batch = given["grad_ckpt"], given["token_budget"], given["gen_batch"]
    room = int(HEADROOM * free) - costs.resident - costs.fixed
    # the optimizer's temporary comes after the backward has freed the step's activations: either may be the peak
    tokens = {ck: (room - costs.per_row[ck] - costs.casts[ck]) // costs.per_token[ck] if
              costs.optimizer <= room + costs.fixed else -1 for ck in (False, True)}
    ckpt = grad_ckpt if grad_ckpt is not None else tokens[False] < max_len
    longest = costs.training(max_len, ckpt)
    generating = room + costs.fixed - costs.generating - costs.decoder   # the loss's chunk freed, the copy made
    _check_one_fits(costs, free, max_len, tokens[ckpt], generating)
    where = f"{_size(HEADROOM * free)} planned of {_size(free)} free"
    budget = token_budget if token_budget is not None else int(min(tokens[ckpt], cap or tokens[ckpt]))
    notes = []
    if token_budget and token_budget > tokens[ckpt]:
        notes.append(f"memory plan: --token-budget {token_budget} will not fit ({where}: {int(tokens[ckpt])} "
                     "tokens do)")
    fit, bound = costs.engine_batch or (int(generating // max(1, costs.per_conversation)), "")
    batch = gen_batch if gen_batch is not None else max(1, fit)
    if gen_batch and gen_batch > fit and not bound:                 # vLLM queues or preempts what does not fit
        notes.append(f"memory plan: --gen-batch {gen_batch} will not fit ({where}: {max(0, fit)} conversations do)")
    chosen = tuple(k for k, v in (("grad_ckpt", grad_ckpt), ("token_budget", token_budget),
                                  ("gen_batch", gen_batch)) if v is None)
    return MemoryPlan(free, ckpt, budget, batch, longest, chosen, bound, max_len, tuple(notes))


def _check_one_fits(costs: Costs, free: int, n: int, tokens: int, generating: int):
    """A NoFit unless one conversation of n tokens trains (`tokens` fit a step) and generates (its KV cache within
    `generating` bytes); its `largest`: the longest conversation that does both (0: the resident terms alone do
    not leave room for one)."""
    kv_tokens = generating // max(1, costs.kv_token) if costs.engine_batch is None else tokens
    largest = int(max(0, min(tokens, kv_tokens)))
    if n <= largest:
        return
    states = f"the trained weights, their gradients and AdamW states ({_size(costs.resident)})"
    train = costs.training(n, True)
    generate = costs.resident + costs.generating + n * costs.kv_token
    if tokens < 1:
        raise NoFit(f"{states}, a step's fixed terms ({_size(costs.fixed + costs.casts[True])}), AdamW's temporary "
                    f"({_size(costs.optimizer)}) and a rollout's experiences in the encoder "
                    f"({_size(costs.per_row[True])}) leave no room for one conversation: no --max-len fits",
                    0, free, train, "train")
    if largest == 0:
        raise NoFit(f"{states} and the student gathered whole to generate ({_size(costs.generating)}) leave no room "
                    "for one conversation's KV cache: no --max-len fits", 0, free, generate, "generate")
    what = "train" if tokens < n else "generate"
    need = train if what == "train" else generate
    raise NoFit(f"one {n}-token conversation needs {_size(need)} to {what}; at most {largest} tokens fit", largest,
                free, need, what)


@dataclass
class Planning:
    """What a plan is made from (`memory_plan`): a run's settings, its backbone, the machine, what the method trains
    and the prompt, so that a refusal can plan its suggestions again (`footprint_of`)."""
    args: object           # train.Args
    model: object          # θ̄, loaded or built on the meta device from its config
    machine: Machine
    trains: Trains
    prompt: int            # tokens of the world's first prompts, the teacher's latent positions included

    def footprint_of(self, args, ranks: int = 0) -> Footprint | None:
        return footprint(args, self.model, self.trains, ranks)


def memory_plan(p: Planning, ranks: int = 0) -> MemoryPlan:
    """The plan of `p` on each of `ranks` ranks (0: this job's). A UserError in one line when it cannot fit: one
    conversation that cannot train or generate, followed by what fits (`advice`); two checkpoints that do not fit
    --out's disk (`check_disk`)."""
    if p.footprint_of(p.args, ranks) is None:         # train._check and check_world refuse these settings first
        raise UserError(f"memory plan: these settings cannot run on {ranks or parallel.world()} ranks")
    try:
        plan = _plan(p, ranks)
    except NoFit as err:
        where = budget_words(p.machine, p.footprint_of(p.args, ranks).backbone)
        raise UserError(f"memory plan: {where}: {err.why}. {advice(p, err, ranks)}") from None
    check_disk(p, plan)
    return plan


def _plan(p: Planning, ranks: int = 0) -> MemoryPlan:
    """`plan_memory` on the costs of `p` (a NoFit where one conversation does not fit)."""
    args, config, foot = p.args, p.model.config, p.footprint_of(p.args, ranks)
    elem = next(p.model.parameters()).element_size()        # the precision forwards run in: bf16 2, fp32 4
    n, free = conversation_tokens(args, p.prompt), p.machine.limit - foot.backbone
    mixes = step_mixes(elem, args.student_lora_r if args.student_lora else 0, p.trains.lora_r, bool(foot.gathered[0]))
    costs = step_costs(config, elem, foot.trained, args.n_ret, args.loss_chunk, n, mixes)
    decoder = 0 if ranks > 1 else decoding_copy_bytes(args, p.model, elem)     # torchrun's ranks decode sharded
    costs = dataclasses.replace(costs, fixed=costs.fixed + elem * foot.gathered[0],
                                generating=elem * foot.gathered[1], decoder=decoder,
                                casts=weight_cast_bytes(p.model, mixes[0], sharded=bool(foot.gathered[0])))
    engine, refused = None, None
    if args.engine == "vllm":           # the engine's weights and KV cache: while generating, or for the whole run
        costs, engine, refused = engine_costs(p, costs, free)
    given = {k: getattr(args, k) for k in ("grad_ckpt", "token_budget", "gen_batch")}
    if args.kv_budget and given["gen_batch"] is None and args.engine == "hf":     # vLLM's cache pages: above
        given["gen_batch"] = kv_budget_batch(config, args.kv_budget, n, elem, mixes[0])   # the student's cache
    cap = CPU_TOKENS if p.machine.type == "cpu" else None    # a longer forward is no faster there
    plan = plan_memory(costs, free, n, given, cap=cap)
    if refused:                         # the engine's refusal after training's: what does not train is said first
        raise refused
    checkpoint = foot.checkpoint if args.steps else 0       # --steps 0: no joint stage, no checkpoint
    return dataclasses.replace(plan, machine=p.machine, backbone=foot.backbone, checkpoint=checkpoint, engine=engine)


def engine_costs(p: Planning, costs: Costs, free: int) -> tuple:
    """--engine vllm: `costs` with the engine's share (`serving.engine_share`) where it is held: where it sleeps
    while the trainer steps (CUDA) only while generating, beside the trainer's resident states (and a sharded
    student gathered whole), so a plan's peak is the larger of training without it and generating with it;
    elsewhere resident for the whole run. Its generation batch pages its cache (`vllm_batch`). A NoFit ("generate")
    where its cache holds less than one --max-len conversation, or it does not fit beside the trainer: returned, for
    `_plan` to raise once training fits. -> (costs, the share, that NoFit or None)."""
    args, params = p.args, sum(t.numel() for t in p.model.parameters())
    beside = int(HEADROOM * free) - costs.resident - costs.generating - costs.decoder     # what generating leaves
    share = serving.engine_share(args, p.model.config, params, p.machine.type, beside, free)
    one, room, refused = args.max_len * share.kv_token, beside - share.weights - share.runtime, None
    if share.kv < one or (share.sleeps and share.total > beside):
        largest = max(0, min(share.kv, room) if share.sleeps else share.kv) // share.kv_token
        need = costs.resident + (costs.generating if share.sleeps else 0) + share.weights + share.runtime + one
        refused = NoFit(f"the vLLM engine's {share.dtype} weights ({_size(share.weights)}), its runtime "
                        f"({_size(share.runtime)}) and a KV cache of one {args.max_len}-token conversation "
                        f"({_size(one)}) need {_size(need)} to generate beside the trained states; its cache holds "
                        f"{largest} tokens{' (--kv-budget)' if args.kv_budget else ''}", largest, free, need,
                        "generate")
    batch = vllm_batch(share.kv // share.kv_token, serving.in_flight(args))
    held = ({"generating": costs.generating + share.total} if share.sleeps else
            {"resident": costs.resident + share.total})
    return dataclasses.replace(costs, engine_batch=batch, **held), share, refused


def fits(p: Planning, ranks: int = 0) -> bool:
    """Whether the plan of `p` on `ranks` ranks fits (memory only), for settings that can run there."""
    if p.footprint_of(p.args, ranks) is None:
        return False
    try:
        _plan(p, ranks)
    except NoFit:
        return False
    return True


def refusal(p: Planning, ranks: int = 0) -> NoFit | None:
    """The plan's refusal of `p` on `ranks` ranks (a NoFit: its `need` and `what`), None where it fits (memory only,
    for settings that can run there): `memory_plan` says the same in its line."""
    try:
        _plan(p, ranks)
    except NoFit as err:
        return err
    return None


def advice(p: Planning, err: NoFit, ranks: int = 0) -> str:
    """What fits instead of the refused settings on `ranks` ranks (0: this job's), each planned again there before it
    is named: the longest --max-len (only where one conversation leaves room), --grad-ckpt where it was turned off,
    --student-lora (said whether it fits), more GPUs under torchrun (FSDP2 shards a full student; a GPU a rank, so not on a CPU, whose ranks
    share its memory), a larger device. Never a flag that cannot help."""
    args, out = p.args, []
    if (n := usable_max_len(p, err.largest)) and fits(_with(p, max_len=n, max_new_tokens=min(args.max_new_tokens,
                                                                                             n // 2)), ranks):
        out.append(f"--max-len {n}")
    if args.grad_ckpt is False and fits(_with(p, grad_ckpt=True), ranks):
        out.append("--grad-ckpt")
    lora = None if args.student_lora else lora_advice(_with(p, student_lora=True), ranks)
    if lora:
        out.append(lora)
    gpus = fewest_gpus(p, ranks) if p.machine.type == "cuda" and not args.student_lora else 0  # CPU ranks share one
    if gpus:                                                                                    # memory: none there
        out.append(f"torchrun --nproc-per-node {gpus} (FSDP2 shards the student)" if gpus <= 8 else
                   f"torchrun on {gpus} GPUs (FSDP2 shards the student; --nnodes × --nproc-per-node)")
    if limit := smallest_limit(p, ranks):
        out.append(f"a {'card' if p.machine.type == 'cuda' else 'machine'} with {_size_up(limit)} free")
    said = "What fits: " + "; ".join(out) if out else "Nothing the plan knows fits"
    return said + (" (--student-lora does not fit either)" if lora == "" else "")


def _with(p: Planning, **settings) -> Planning:
    return dataclasses.replace(p, args=dataclasses.replace(p.args, **settings))


def usable_max_len(p: Planning, largest: int) -> int:
    """`largest`, the longest conversation that fits, as a --max-len, if the prompt and one reply fit in it (a reply
    of at most half of it: `fit_context`); else 0."""
    return largest if largest >= p.prompt + min(p.args.max_new_tokens, largest // 2) else 0


def lora_advice(p: Planning, ranks: int = 0) -> str | None:
    """--student-lora (in `p`), planned: as given, or with the longest --max-len it leaves; "" where neither fits,
    None where the method cannot take it."""
    if p.footprint_of(p.args, ranks) is None:
        return None
    try:
        _plan(p, ranks)
        return "--student-lora"
    except NoFit as err:
        n = usable_max_len(p, err.largest)
        if n and fits(_with(p, max_len=n, max_new_tokens=min(p.args.max_new_tokens, n // 2)), ranks):
            return f"--student-lora --max-len {n}"
        return ""


def fewest_gpus(p: Planning, ranks: int = 0) -> int:
    """The fewest ranks, more than this job's, on which each rank's plan fits (0: none up to MOST_GPUS)."""
    return next((n for n in range(max(2, (ranks or parallel.world()) + 1), MOST_GPUS + 1) if fits(p, n)), 0)


def smallest_limit(p: Planning, ranks: int = 0) -> int:
    """The fewest bytes, in whole MB, the run must be able to fill (the backbone included) for its plan to fit (0:
    not even 100 TB): a bisection over `fits`, which only grows with the memory."""
    grow = lambda mb: fits(dataclasses.replace(p, machine=dataclasses.replace(p.machine, limit=mb * 10**6)),  # noqa
                           ranks)
    lo, hi = p.machine.limit // 10**6, 10**8
    if not grow(hi):
        return 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if grow(mid) else (mid, hi)
    return hi * 10**6


def _size_up(b: float) -> str:
    """Bytes as GB rounded up to a tenth, or as MB rounded up below a tenth of a GB: what a suggestion needs."""
    return f"{math.ceil(b / GB * 10) / 10:.1f} GB" if b >= 0.1 * GB else f"{math.ceil(b / 1e6):.0f} MB"


def check_disk(p: Planning, plan: MemoryPlan):
    """A UserError unless two checkpoints fit --out's disk (the next one is written before the last is deleted,
    `publish`), naming what fits: a LoRA student's checkpoints, a disk with the room."""
    need, disk = 2 * plan.checkpoint, p.machine.disk
    if need <= disk:
        return
    out = []
    lora = _with(p, student_lora=True)
    if not p.args.student_lora and fits(lora) and 2 * (small := p.footprint_of(lora.args, 0).checkpoint) <= disk:
        out.append(f"--student-lora (its checkpoints: {_size(small)} each)")
    out.append(f"--out on a disk with {_size_up(need)} free")
    raise UserError(f"disk plan: a checkpoint of the run is {_size(plan.checkpoint)} (fp32 weights and AdamW m, v of "
                    f"all it trains), and two are on disk while the next is written: {_size(need)}, more than the "
                    f"{_size(disk)} free for --out {p.args.out!r}. What fits: {'; '.join(out)}")


def fit_memory(p: Planning) -> MemoryPlan:
    """The memory plan of a run on its loaded backbone (train.fit_to_model calls it, with `p.machine` measured
    beside it): the token budget of every forward/backward, the conversations that generate together and gradient
    checkpointing, where the command line gave none (written into `p.args`; one line says what it chose). The
    same refusal as before loading (`memory_plan`) if the memory measured now leaves less than was planned."""
    plan = memory_plan(p)
    args = p.args
    args.grad_ckpt, args.token_budget, args.gen_batch = plan.grad_ckpt, plan.token_budget, plan.gen_batch
    for note in plan.notes:
        say(note)
    say(plan.line())
    if args.grad_ckpt:
        models.checkpointing(p.model)
    return plan


# ----------------------------------------------------------------------------------------------------------------
# Context lengths, and what a run's plan chose read back
# ----------------------------------------------------------------------------------------------------------------
def fit_context(max_len, max_new_tokens, n_ctx) -> tuple:
    """--max-len no longer than the model's context n_ctx (config.max_position_embeddings), and a reply no longer
    than half of a conversation, each change said in one line. -> (max_len, max_new_tokens)."""
    if n_ctx and (max_len or 0) > n_ctx:
        say(f"--max-len {max_len} is longer than the model's context: episodes end within its {n_ctx} tokens")
        max_len = n_ctx
    if max_len and (max_new_tokens or 0) > max_len // 2:   # a reply leaves room for a prompt
        say(f"--max-new-tokens {max_new_tokens} does not fit --max-len {max_len} with its prompt: "
            f"{max_len // 2} a reply")
        max_new_tokens = max_len // 2
    return max_len, max_new_tokens


# An evaluation on a CPU (eval.py --tasks): B.3's budgets, a real model's defaults (10,000 tokens a reply, 30 steps),
# take hours a task there; these caps take minutes (docs/real-models.md, "A real pretrained model on CPU", measures
# them). A run's smaller budgets stay, the command's own flags win, and a GPU keeps B.3's.
CPU_EVAL = {"max_new_tokens": 128, "max_env_steps": 3}


def eval_budgets(args, cpu: bool, n_ctx, given=()) -> tuple:
    """An evaluation's budgets, decided before the model loads: on a CPU (`cpu`) at most CPU_EVAL where the command
    set none (`given`: the settings it set), and --max-len within the model's context n_ctx (`fit_context`).
    -> (the settings, where each of CPU_EVAL's and --max-len comes from, in words for the budget line)."""
    sized = {k: v for k, v in CPU_EVAL.items() if k not in given and getattr(args, k) > v} if cpu else {}
    max_len, max_new = fit_context(args.max_len, sized.get("max_new_tokens", args.max_new_tokens), n_ctx)
    whence = {k: "CPU-sized" if k in sized else "given" if k in given else "the run's" for k in CPU_EVAL}
    whence["max_len"] = "the model's context" if n_ctx and max_len == n_ctx else "given" if "max_len" in given \
        else "the run's"
    return dataclasses.replace(args, **{**sized, "max_len": max_len, "max_new_tokens": max_new}), whence


def replan(args):
    """A run read back: what its memory plan chose (OUT/memory_plan.json) is chosen again for this machine."""
    path = os.path.join(args.out, "memory_plan.json")
    for name in json.load(open(path))["chosen"] if os.path.isfile(path) else ():
        setattr(args, name, None)
