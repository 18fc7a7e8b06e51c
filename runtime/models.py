"""Engineering, not the paper: the student θ (a full fp32 copy, or a LoRA adapter), PEFT's adapter switches,
gradient checkpointing, the LM head bypassed for the chunked losses, and a backbone's config and tokenizer.

The paper's student is a full copy of the backbone trained in fp32 (`full_student`, built when the joint stage
starts, from θ̄'s own tensors); `--student-lora` makes it a second LoRA adapter on θ̄ (`LoraStudent`), which fits
one 80 GB card. `lm_head_bypassed` returns hidden states from a forward so that losses.py applies the head in
chunks: memory bounded by tokens, not by tokens x vocabulary.

    python train.py --student-lora --steps 2
    python -m pytest tests/test_real_path.py tests/test_method.py -q

Deviation: --student-lora is an option beside the paper's full student (docs/real-models.md).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
import types
from contextlib import contextmanager

import torch
import torch.utils.checkpoint

from runtime import parallel
from runtime.devices import UserError


# ----------------------------------------------------------------------------------------------------------------
# PEFT's adapter switches: one backbone, three uses (composer.py), and the flags PEFT rewrites on every switch
# ----------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def keep_grad_flags(peft):
    """Restore every LoRA parameter's requires_grad on exit. peft rewrites them whenever adapters are switched or
    re-enabled: set_adapter and the exit of disable_adapter() mark only the active adapter trainable, which would
    freeze a LoRA student after every teacher forward (and unfreeze a frozen composer; measured)."""
    flags = [(p, p.requires_grad) for n, p in peft.named_parameters() if "lora_" in n]
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


@contextlib.contextmanager
def active_adapter(peft, name: str):
    """Make the PEFT adapter `name` the active one inside the block; requires_grad flags stay as they were."""
    prev = peft.active_adapter
    if prev == name:
        yield
        return
    with keep_grad_flags(peft):              # restores them after switching back
        with keep_grad_flags(peft):          # restores them right after the switch
            peft.set_adapter(name)
        try:
            yield
        finally:
            peft.set_adapter(prev)


def adapter_state(module) -> list:
    """What decides a forward of `module` under PEFT: each LoRA layer inside it, whether its adapters are off
    (`disable_adapter`) and which are active (`set_adapter`). A checkpointed layer's recompute restores it
    (`restored_adapter_state`; `checkpointing`), since the backward runs after adapter_disabled() and
    active_adapter() have closed."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    return [(m, m._disable_adapters, m._active_adapter) for m in module.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def restored_adapter_state(state):
    """Inside the block each LoRA layer is as `adapter_state` saw it; after it, as it was. requires_grad flags are
    not touched (peft's own switches rewrite them, which would change what a recompute differentiates)."""
    now = [(m, m._disable_adapters, m._active_adapter) for m, _, _ in state]
    try:
        for m, off, active in state:
            m._disable_adapters, m._active_adapter = off, active
        yield
    finally:
        for m, off, active in now:
            m._disable_adapters, m._active_adapter = off, active


# ----------------------------------------------------------------------------------------------------------------
# The student θ: a full fp32 copy (the paper) or a LoRA adapter; gradient checkpointing
# ----------------------------------------------------------------------------------------------------------------
def student_source(model) -> dict:
    """What a full student θ is built from, taken from θ̄ before the composer's LoRA goes in: its class, config,
    generation config, device and tensors by name. Nothing is copied: PEFT wraps θ̄'s modules but keeps their
    weights, the same tensors, and θ̄ is frozen."""
    tensors = {**dict(model.named_buffers()), **model.state_dict()}    # persistent and non-persistent buffers too
    return dict(cls=type(model), config=model.config, generation_config=model.generation_config, tensors=tensors,
                device=next(model.parameters()).device)


def full_student(args, source: dict, frozen: bool = False):
    """θ as a full copy of θ̄ (the paper's default), built when the joint stage first needs it. Its weights are fp32
    (bf16 forwards under autocast, `precision`): AdamW steps of lr 1e-5 vanish in bf16 weights.
    It is made on the meta device (no memory), sharded under torchrun (FSDP2, `shard_student`; `frozen` as there),
    then materialised: each rank allocates only its shard of the fp32 weights and fills it from θ̄'s tensors. In
    one process the result equals copy.deepcopy(θ̄).float() exactly (tests/test_scale.py)."""
    with torch.device("meta"):
        student = source["cls"](copy.deepcopy(source["config"]))        # fp32 parameters, no storage yet
    student.generation_config = copy.deepcopy(source["generation_config"])
    if parallel.world() > 1:
        parallel.shard_student(student, frozen)
    student.to_empty(device=source["device"])
    student.tie_weights()                # to_empty gives each module its own tensor: the tied head shares again
    fill_from(student, source["tensors"])
    student.requires_grad_(not frozen)
    if args.grad_ckpt and not frozen:
        checkpointing(student)
    return student


@torch.no_grad()
def fill_from(student, tensors: dict):
    """Copy θ̄'s tensors into the student's (cast to their dtype): the whole tensor in one process, this rank's shard
    of it under FSDP2 (set_model_state_dict slices each full tensor locally: every rank holds θ̄). Buffers are never
    sharded."""
    from torch.distributed.fsdp import FSDPModule
    if isinstance(student, FSDPModule):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        keys = student.state_dict().keys()
        set_model_state_dict(student, {k: tensors[k] for k in keys},
                             options=StateDictOptions(full_state_dict=True, strict=True))
    else:
        for name, t in student.state_dict(keep_vars=True).items():
            t.copy_(tensors[name])
    for name, b in student.named_buffers():
        b.copy_(tensors[name])


class LoraStudent(torch.nn.Module):
    """θ as a second LoRA adapter ("student") on the frozen backbone that the teacher and the composer's encoder
    already share (--student-lora): one copy of the weights serves all three roles. To lopd.py it is a causal LM:
    forward and generate (with its adapter active), parameters() (its LoRA only), train/eval, save_pretrained."""

    def __init__(self, peft, r: int):
        from peft import LoraConfig
        super().__init__()
        self.__dict__["peft"] = peft          # not a submodule: parameters() must be the student's LoRA only
        first = next(iter(peft.peft_config.values()))                       # the composer's encoder LoRA
        targets = sorted(first.target_modules)                              # the same projections as its
        peft.add_adapter("student", LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                               lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
        self.params = [p for n, p in peft.named_parameters() if ".student." in n]
        for p in self.params:
            p.requires_grad_(True)
        self.initial = [p.detach().clone() for p in self.params]

    def parameters(self, recurse: bool = True):
        return iter(self.params)

    def _run(self, fn, *a, **kw):
        with active_adapter(self.peft, "student"):
            return fn(*a, **kw)

    def forward(self, *a, **kw):
        return self._run(self.peft.__call__, *a, **kw)

    def generate(self, *a, **kw):
        return self._run(self.peft.generate, *a, **kw)

    def train(self, mode: bool = True):
        self.training = mode
        return self

    def get_output_embeddings(self):
        return self.peft.get_output_embeddings()

    @property
    def dtype(self):
        return self.params[0].dtype

    def reset(self):
        """Back to the adapter's initial weights (B = 0: θ = θ̄), for the ablations' next variant."""
        with torch.no_grad():
            for p, p0 in zip(self.params, self.initial):
                p.copy_(p0)
        return self

    def save_pretrained(self, path: str):
        self.peft.save_pretrained(path, selected_adapters=["student"], save_embedding_layers=False)

    def load(self, path: str):
        from peft import set_peft_model_state_dict
        from peft.utils import load_peft_weights
        set_peft_model_state_dict(self.peft, load_peft_weights(os.path.join(path, "student")), "student")


def lora_student(peft, r: int) -> "LoraStudent":
    """A LoRA student of rank r in the backbone `peft` (the composer's), the same initial adapter on every rank
    (torchrun: rank 0's), its initial weights kept (`LoraStudent.reset`)."""
    student = LoraStudent(peft, r)
    parallel.broadcast_params(student.params)
    student.initial = [p.detach().clone() for p in student.params]
    return student


def saved_student(path: str, dtype, base=None):
    """The student a checkpoint saved at `path` (CKPT/student), as a model: a full HF folder read in `dtype`, or,
    given the frozen `base` (--student-lora), the base with the saved LoRA adapter on it. eval.py evaluates it;
    `load_student_weights` copies a full one into a live student (a live LoRA student loads its adapter itself)."""
    if base is None:
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    from peft import PeftModel
    nested = os.path.join(path, "student")                      # save_pretrained of a named adapter nests it
    adapter = path if os.path.isfile(os.path.join(path, "adapter_config.json")) else nested
    return PeftModel.from_pretrained(base, adapter)


def load_student_weights(student, path: str):
    """Put the student saved at `path` (an HF folder, or a LoRA adapter folder) into the live `student`."""
    if isinstance(student, LoraStudent):
        return student.load(path)
    from torch.distributed.fsdp import FSDPModule
    saved = saved_student(path, student.dtype)
    if isinstance(student, FSDPModule):       # torchrun: each rank keeps its shard of the full weights
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        return set_model_state_dict(student, saved.state_dict(), options=StateDictOptions(full_state_dict=True))
    student.load_state_dict(saved.state_dict())


def checkpointing(model):
    """--grad-ckpt: every decoder layer of `model` keeps only its inputs in the forward and is recomputed in the
    backward (non-reentrant torch.utils.checkpoint; the teacher's inputs are latents that need gradients).

    Our own wrapper, not HF's gradient_checkpointing_enable, for two reasons:
    - HF checkpoints a layer only in training mode, and the frozen backbone (teacher and encoder) is in eval mode
      (a frozen teacher must not run dropout). Here a layer is checkpointed whenever autograd records.
    - The backward runs after adapter_disabled() (the teacher) and active_adapter() (encoder, LoRA student) have
      closed, so a plain recompute would run the teacher's layers with the LoRA on (a CheckpointError, or wrong
      gradients). The recompute restores the adapter state of its forward (`restored_adapter_state`).
    Idempotent, and kept by copy.deepcopy (the full student is a copy of the backbone)."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer) and "forward" not in vars(layer):
            layer.forward = types.MethodType(_checkpointed_forward, layer)


def _checkpointed_forward(layer, *args, **kwargs):
    """A decoder layer's forward, checkpointed when autograd records (see `checkpointing`)."""
    forward = functools.partial(type(layer).forward, layer)
    if not torch.is_grad_enabled():          # generation and no-grad scoring: as is, KV cache included
        return forward(*args, **kwargs)
    for name in ("cache", "past_key_values", "past_key_value", "layer_past"):   # its name across transformers 5.x:
        if kwargs.get(name) is not None:     # the recompute would append its keys to the KV cache a second time
            kwargs[name] = None
    state = adapter_state(layer)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs,
                                             context_fn=lambda: (contextlib.nullcontext(),
                                                                 restored_adapter_state(state)))


def decoding_copy(model):
    """What `model` generates from: under bf16 autocast (`precision`) a fp32 model, the full student, becomes a copy
    whose Linear weights are cast to bf16 once, its other tensors the model's own (shared, not copied); any other
    model is returned as it is (a bf16 backbone, a LoRA student on one, fp32 without autocast: the CPU, under
    torchrun a sharded student, which FSDP2 gathers in bf16 already).

    Autocast casts every fp32 Linear weight to bf16 at every forward: a decode step reads the fp32 student and
    writes its bf16 cast at each token. engine.rollout makes this copy once a rollout, after the optimizer step
    that changed the weights, and drops it after. It computes the same numbers: autocast runs the same bf16
    matmul on the same cast of each weight, and what it does not cast (embeddings, norms) reads the shared fp32
    tensors (tests/test_decode.py, on CPU's bf16 autocast). The memory plan counts the copy while the student
    generates (`memory.decoding_copy_bytes`). The copy shares the model's tensors: moving or casting it (`.to`) would
    change the model. What only a GPU shows: the time a decode step saves on CUDA."""
    p = next(model.parameters())
    kind = p.device.type
    if p.dtype != torch.float32 or not torch.is_autocast_enabled(kind) or parallel.world() > 1 or \
            isinstance(model, LoraStudent) or torch.get_autocast_dtype(kind) == torch.float32:
        return model
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}      # deepcopy reuses these, copies none
    copy_ = copy.deepcopy(model, memo=shared)
    with torch.no_grad():
        for m in copy_.modules():
            if isinstance(m, torch.nn.Linear):
                for name, t in list(m.named_parameters(recurse=False)):      # weight, bias
                    setattr(m, name, torch.nn.Parameter(t.to(torch.get_autocast_dtype(kind)), requires_grad=False))
    return copy_.eval()


# ----------------------------------------------------------------------------------------------------------------
# Memory bounded by tokens: hidden states out of the forward, the LM head applied by the loss in chunks
# ----------------------------------------------------------------------------------------------------------------
@contextmanager
def lm_head_bypassed(*models):
    """Inside, each model's forward returns its final hidden states (B, T, d) where its logits (B, T, V) would be:
    its LM head is the identity for a while. The loss then applies the head itself, a chunk of rows at a time
    (losses.lopd_objective_from_hidden). Reentrant: a LoRA student and the teacher share one head."""
    for m in models:
        lm_head(m)                                # refuses a head whose logits are more than a linear map
    heads, saved = [m.get_output_embeddings() for m in models], []
    for h in heads:                               # one after the other: the same head may come twice
        saved.append(h.__dict__.get("forward"))
        h.forward = _identity
    try:
        yield
    finally:
        for h, f in reversed(list(zip(heads, saved))):
            if f is None:
                del h.forward
            else:
                h.forward = f


def _identity(x):
    return x


def lm_head(model_or_head) -> tuple:
    """(weight (V, d), bias or None) of an LM head, or of a model's (get_output_embeddings()). A tied head is the
    embedding matrix itself, so its gradient reaches the embeddings. A ValueError for a head that is not one
    nn.Linear (the loss would apply the wrong map): use --loss-chunk 0 there."""
    head = model_or_head if isinstance(model_or_head, torch.nn.Linear) else model_or_head.get_output_embeddings()
    config = getattr(model_or_head, "config", None)
    if not isinstance(head, torch.nn.Linear) or getattr(config, "final_logit_softcapping", None):
        raise ValueError(f"{type(model_or_head).__name__}: its logits are not one linear map of its hidden states; "
                         "the chunked loss needs that (use --loss-chunk 0)")
    return head.weight, head.bias


# ----------------------------------------------------------------------------------------------------------------
# A backbone's config and tokenizer, and θ̄ on the meta device for the plan
# ----------------------------------------------------------------------------------------------------------------
# A folder made from other weights than the released ones says so in this file (one line: what they are); the rows
# of a model scored as it is (eval.py --model) are named by it, else "as released"
SOURCE_FILE = "weights_source.txt"


def provenance(path: str) -> str:
    """What a model folder's weights are, for the rows that score it: its SOURCE_FILE's line, else "as released"."""
    where = os.path.join(path, SOURCE_FILE)
    if not os.path.isfile(where):
        return "as released"
    with open(where, encoding="utf-8") as f:
        return f.readline().strip() or "as released"


def check_causal_lm(path: str):
    """`path`'s model config (a folder or hub id: config.json alone is read); a UserError unless it is a causal LM
    architecture."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise UserError(f"--model {path!r}: no model config could be read ({str(err).splitlines()[0]}); give a "
                        "folder with config.json and weights, or a hub id such as Qwen/Qwen3-4B") from None
    heads = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
    saved_as = config.architectures or []          # an encoder checkpoint (e.g. BertModel) of a decoder-capable type
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (saved_as and not any(
            a.endswith(heads) for a in saved_as)):
        raise UserError(f"--model {path!r}: a {config.model_type!r} model ({', '.join(saved_as) or 'no head'}) is not "
                        "a causal LM; give a decoder checkpoint such as Qwen/Qwen3-4B")
    return config


def load_tokenizer(path: str, chat_template: str = ""):
    """`path`'s tokenizer (a folder or hub id), with the Jinja template of the file `chat_template` where given."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    if chat_template:
        tok.chat_template = open(chat_template).read()
    return tok


def meta_backbone(config, dtype):
    """θ̄ of `config` on the meta device in `dtype`: its shapes and parameter counts for the plan, no memory, no
    weight read."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
