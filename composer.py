"""The latent composer Φ_φ = Comp_χ ∘ Enc_ψ and its cold-start objective (paper §3.2, A.1, A.2; eqs. 4-6, 14).

For a task x and its J retrieved experiences m_1..m_J (retrieval.py), the composer builds the teacher's
privileged context c_φ, J·K continuous tokens that inject.py puts into the teacher's prompt (eq. 7):

    (5)  H_j = Enc_ψ(x, m_j) ∈ R^{T_j×d}     the FROZEN backbone θ̄ plus a LoRA adapter ψ named "composer", on
                                              "Task to solve: \\n{x}\\n\\nReference past trajectory: \\n{m_j}"
    (6)  E_j = Comp_χ(H_j; Q_χ) ∈ R^{K×d}    a QFormer: K learned queries cross-attend to H_j, 8 shared layers
    (4,7) c_φ = E_1 ⊕ ... ⊕ E_J ∈ R^{J·K×d}  concatenated in retrieval order
    (14) L_init(φ) = −E[log π_θ̄(y* | s, c_φ)] next-token NLL of a successful trajectory's assistant tokens (ω),
                                              through the frozen base with the LoRA DISABLED; gradients reach ψ, χ
                                              only through the activations (the prefix-tuning mechanism, A.2)

One backbone, three uses (docs/design.md, "Roles and memory"). The LoRA is injected into the backbone object itself
(PEFT), so the same weights are the encoder (adapter on) and the teacher θ̄ (adapter off). The adapter is active ONLY
while encoding: every other forward of that backbone, the teacher's scoring and any generation behind latents, must
run inside `composer.adapter_disabled()` (or use `base_forward` / `teacher_logits`, which do it), A.4 "Encoder LoRA
isolation".

    python -m pytest tests/test_composer.py -q

Notation: B batch (tasks), T tokens, J experiences per task, K latents per experience, d hidden, V vocabulary.

Choices the paper leaves open
-----------------------------
- Hidden states: the base model's `last_hidden_state`, i.e. the last layer's output AFTER the final RMSNorm (the
  same tensor as `hidden_states[-1]` of a forward with output_hidden_states=True), without computing the (T, V)
  logits. Encoder inputs are right-padded (a real token never attends to a pad and keeps its position id) and
  truncated to `max_exp_tokens` from the right, so the task text at the front survives and the trajectory's tail
  is cut.
- Encoder text: "Task to solve: \\n" + x + "\\n\\nReference past trajectory: \\n" + m_j. A.5 prints
  "Task to solve: \\n $x$ \\n\\nReference past trajectory: \\n $m_j$ "; we read the spaces around $x$ and $m_j$ as
  math-rendering artefacts and keep the space after each colon, which is inside the quoted literal.
- Query init: A.1 writes Q_χ ~ N(0, 1/√d). We read the second argument as the standard deviation (randn / √d),
  so the queries start with the scale of a unit-variance vector's 1/√d projection; under the N(μ, σ²) convention
  it would be the variance (std d^-1/4).
- Output scale: the QFormer ends with an RMSNorm (learnable gain, init 1) times a FIXED buffer `emb_rms`, the RMS
  of all entries of the frozen input-embedding table computed at build time. A latent then starts with the same
  per-vector RMS as an average real token embedding, instead of the residual stream's scale, so the frozen teacher
  sees inputs in the range its first layer was trained on; the gain can still move it during training.

Deviations from the paper and the official code
-----------------------------------------------
1. The cross-attention is multi-head attention with nn.MultiheadAttention's weights (pre-norm, residual; pre-norm
   ×4 GELU FFN, residual), one block applied n_layers times; the official block's exact layout is not reproduced.
   Since the block is shared and the keys are the same encoder states in every layer, keys and values are
   projected once per forward, not once per layer (tested equal to nn.MultiheadAttention applied per layer).
2. Key-padding mask: pad positions of the encoder input are never attended to, so an experience compresses to
   the same latents alone or in a padded batch (the official code passes no mask).
3. Output scale matched to the token embeddings (above); the paper does not say how latents are scaled.
4. The composer runs with autocast switched off, whatever its caller's: the encoder in the backbone's own dtype
   (bf16 weights, the LoRA in fp32 as PEFT keeps it), the QFormer in fp32 (encoder states are upcast); latents
   are cast to the backbone's dtype at the end. So the cold start (no autocast), the anchor's cached c_φ0 and
   c_φ in joint training (under devices.precision's bf16 autocast on CUDA) are one function: at step 0 the anchor
   ||c_φ − sg c_φ0||² is exactly zero, not bf16 rounding noise.
5. Optional, and the toy world's default (train.py --composer-input reference): `task_conditional=False` drops
   the current task from the encoder input, so the encoder reads "Reference past trajectory: \n{m_j}" alone.
   Why: in the toy world the task names its shop, and a task-conditional composer learned each shop's conventions
   from that name during the cold start, and the world check (eval.world_check) could not tell it from a composer
   given no reference (docs/toy-world.md, "What each failed design taught"). Without the task, whatever the latents
   carry comes from the experience. Real models keep A.2's format.
6. The QFormer's weights are fp32; the official code holds them in bf16, where an AdamW step of lr 1e-5 leaves
   most entries unchanged (below half a bf16 ulp; tests/test_official_settings.py). `train.py --qformer-dtype
   bfloat16` holds them in bf16 in the joint stage (scripts/experiments.py absorb measures what that changes).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

import inject
import losses
from runtime import models

ENCODER_TEMPLATE = "Task to solve: \n{task}\n\nReference past trajectory: \n{experience}"   # A.5
REFERENCE_TEMPLATE = "Reference past trajectory: \n{experience}"   # task_conditional=False (deviation, see above)


@dataclass
class ComposerConfig:
    n_latents: int = 32
    """K, latent tokens per retrieved experience (A.1, Figure 5: K = 32)."""
    task_conditional: bool = True
    """A.2's task-conditional compression: the encoder reads the current task before each experience. False: the
    experience alone, so that the latents can carry nothing but what the reference says."""
    n_layers: int = 8
    """QFormer cross-attention layers; all share one set of weights (A.1)."""
    ffn_mult: int = 4
    """QFormer feed-forward width as a multiple of d (A.1)."""
    lora_r: int = 8
    """Encoder LoRA rank (A.1)."""
    lora_alpha: int = 16
    """Encoder LoRA α; the update is scaled by α / r (A.1)."""
    lora_dropout: float = 0.0
    """Encoder LoRA dropout (A.1)."""
    lora_targets: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                        "gate_proj", "up_proj", "down_proj"])
    """The seven linear projections of every transformer block that get the LoRA (A.1)."""
    max_exp_tokens: int = 512
    """Each encoder input (task + experience) is truncated to this many tokens, keeping the front."""
    encode_batch_size: int = 0
    """Encode at most this many experiences per backbone forward (0 = all B·J at once); bounds memory."""
    adapter_name: str = "composer"
    """PEFT adapter name; saved in the sub-folder `dir/<adapter_name>`."""


# ----------------------------------------------------------------------------------------------------------------
# Comp_χ (eq. 6): K learned queries, one shared pre-norm cross-attention block applied n_layers times
# ----------------------------------------------------------------------------------------------------------------
class CrossAttentionBlock(nn.Module):
    """q ← q + Attn(LN(q), kv); q ← q + FFN(LN(q)). kv arrives already normalised.

    The weights are nn.MultiheadAttention's (so saved QFormers keep their keys), but the attention is written out:
    the block is shared by all layers and every layer reads the same encoder states, so the keys and values are
    projected once per forward (`project_kv`) instead of once per layer. Same numbers, 8× fewer (T, d) projections.
    """

    def __init__(self, d: int, n_heads: int, ffn_mult: int):
        super().__init__()
        self.norm_q = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, n_heads, batch_first=True)   # its in_proj (3d, d) rows are q | k | v
        self.norm_ff = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, ffn_mult * d), nn.GELU(), nn.Linear(ffn_mult * d, d))

    def _project(self, x, i: int):
        """Head-split i-th third of the in-projection (0 q, 1 k, 2 v): x (N, L, d) -> (N, h, L, d/h)."""
        d, h = x.shape[-1], self.attn.num_heads
        w = self.attn.in_proj_weight[i * d:(i + 1) * d]                                   # (d, d)
        b = self.attn.in_proj_bias[i * d:(i + 1) * d]                                     # (d,)
        return F.linear(x, w, b).unflatten(-1, (h, d // h)).transpose(1, 2)             # (N, h, L, d/h)

    def project_kv(self, kv):
        """kv (N, T, d) -> keys, values, each (N, h, T, d/h)."""
        return self._project(kv, 1), self._project(kv, 2)

    def forward(self, q, keys, values, pad):
        """q (N, K, d), keys/values (N, h, T, d/h) from `project_kv`, pad (N, T) bool True at padding -> (N, K, d)."""
        qh = self._project(self.norm_q(q), 0)                                             # (N, h, K, d/h)
        # softmax(q kᵀ / √(d/h)) v over the real (unpadded) keys only
        a = F.scaled_dot_product_attention(qh, keys, values, attn_mask=~pad[:, None, None, :])   # (N, h, K, d/h)
        q = q + self.attn.out_proj(a.transpose(1, 2).flatten(2))                          # (N, K, d)
        return q + self.ffn(self.norm_ff(q))                                               # (N, K, d)


class QFormer(nn.Module):
    """E = Comp_χ(H; Q_χ) (eq. 6), scaled to the backbone's token embeddings (see the module docstring)."""

    def __init__(self, d: int, n_heads: int, n_latents: int, n_layers: int, ffn_mult: int, emb_rms: float):
        super().__init__()
        # A.1: Q_χ ∈ R^{K×d}, Q_χ ~ N(0, 1/√d), read as standard deviation 1/√d
        self.queries = nn.Parameter(torch.randn(n_latents, d) / math.sqrt(d))             # (K, d)
        self.norm_kv = nn.LayerNorm(d)
        self.block = CrossAttentionBlock(d, n_heads, ffn_mult)                             # shared by all layers
        self.n_layers = n_layers
        self.norm_out = nn.RMSNorm(d, eps=1e-6)
        self.register_buffer("emb_rms", torch.tensor(float(emb_rms)))                      # () fixed scale

    def forward(self, hidden, pad):
        """hidden (N, T, d) fp32 encoder states, pad (N, T) bool True at padding -> (N, K, d) fp32."""
        kv = self.norm_kv(hidden)                                                          # (N, T, d)
        keys, values = self.block.project_kv(kv)                                         # (N, h, T, d/h) each
        q = self.queries.expand(hidden.shape[0], -1, -1)                                  # (N, K, d)
        for _ in range(self.n_layers):
            q = self.block(q, keys, values, pad)                                           # (N, K, d)
        return self.norm_out(q) * self.emb_rms                                             # (N, K, d)


# ----------------------------------------------------------------------------------------------------------------
# Φ_φ: LoRA encoder on the shared frozen backbone + QFormer
# ----------------------------------------------------------------------------------------------------------------
def _attach_lora(model, cfg: ComposerConfig, adapter_path: str | None):
    """Inject the composer's LoRA into `model` (a plain HF model or a PeftModel), fresh or loaded from disk."""
    name = cfg.adapter_name
    if adapter_path is not None and isinstance(model, PeftModel):
        model.load_adapter(adapter_path, adapter_name=name, is_trainable=True)
    elif adapter_path is not None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = PeftModel.from_pretrained(model, adapter_path, adapter_name=name, is_trainable=True)
    else:
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=list(cfg.lora_targets), bias="none", task_type="CAUSAL_LM")
        if isinstance(model, PeftModel):
            model.add_adapter(name, lora)
        else:
            with warnings.catch_warnings():   # peft 0.21 reads a property transformers 5 deprecates; harmless
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
                model = get_peft_model(model, lora, adapter_name=name)
    for n, p in model.named_parameters():          # the backbone stays frozen; our LoRA trains
        if "lora_" not in n:
            p.requires_grad_(False)
        elif f".{name}." in n:
            p.requires_grad_(True)
    return model


class Composer(nn.Module):
    """Φ_φ(x, E) -> c_φ (B, J·K, d). Holds the backbone (as a PeftModel) and the QFormer.

    `model` is θ̄ (a plain HF model, or a PeftModel that already holds other adapters): every non-LoRA weight of
    it is set to requires_grad=False here, and the LoRA is injected into that same object, so the caller's
    reference to it now carries the adapter: run it inside `adapter_disabled()` wherever θ̄ alone is meant.
    `trainable_parameters()` (LoRA ψ + QFormer χ) is what an optimizer gets; the backbone is registered here so
    that `.to()` moves it, but none of its weights require grad.
    """

    def __init__(self, model, tokenizer, cfg: ComposerConfig | None = None, adapter_path: str | None = None):
        super().__init__()
        self.cfg = cfg or ComposerConfig()
        self.tokenizer = tokenizer
        self.peft = _attach_lora(model, self.cfg, adapter_path)
        # a new PeftModel says training=True whatever the backbone's mode, and engine.rollout restores the flag it
        # finds: the frozen backbone would leave every evaluation in training mode (dropout on for the teacher)
        self.peft.train(self.backbone.training)
        conf = self.backbone.config
        emb = self.peft.get_input_embeddings().weight                                     # (V, d)
        emb_rms = emb.detach().float().pow(2).mean().sqrt().item()
        self.qformer = QFormer(conf.hidden_size, conf.num_attention_heads, self.cfg.n_latents, self.cfg.n_layers,
                               self.cfg.ffn_mult, emb_rms).to(emb.device)
        self._disabled = 0

    # -- the backbone's two roles ---------------------------------------------------------------------------------
    @property
    def backbone(self):
        """The HF model (θ̄) the LoRA lives in; same object the caller passed in."""
        return self.peft.get_base_model()

    @contextlib.contextmanager
    def adapter_disabled(self):
        """Run θ̄ alone: the composer's LoRA is off inside (teacher forwards, generation behind latents; A.4)."""
        self._disabled += 1
        try:
            with models.keep_grad_flags(self.peft), self.peft.disable_adapter():
                yield
        finally:
            self._disabled -= 1

    def base_forward(self, **kwargs):
        """A forward of the frozen base θ̄ with every adapter off (this LoRA and a --student-lora student's); kwargs as
        for the HF model (input_ids/inputs_embeds). The teacher of LOPD, and OPSD's frozen teacher as a callable."""
        with self.adapter_disabled():
            return self.peft(**kwargs)

    def teacher_logits(self, input_ids, attention_mask, latents, starts, keep: int = 0, position_ids=None):
        """π_θ̄(· | [s; c_φ]) (eq. 7): latents (B, n, d) injected at starts (B,), LoRA off -> logits (B, T, V).

        attention_mask (B, T) must come from lengths (inject.py, THE TRAP): the span holds pad ids.
        keep > 0: logits of the last `keep` positions only, (B, keep, V) (HF's logits_to_keep; 0 = all).
        position_ids (B, T): for left-padded rows (engine.pack); None lets the model count from 0."""
        embeds = inject.embed_with_latents(self.peft, input_ids, latents, starts)        # (B, T, d)
        return self.base_forward(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
                                 logits_to_keep=keep, use_cache=False).logits            # (B, T or keep, V)

    def trainable_parameters(self):
        """φ = (ψ, χ): this composer's LoRA and the QFormer (not another adapter that shares the backbone)."""
        lora = [p for n, p in self.peft.named_parameters() if f".{self.cfg.adapter_name}." in n and p.requires_grad]
        return lora + list(self.qformer.parameters())

    # -- Enc_ψ (eq. 5) --------------------------------------------------------------------------------------------
    def encode(self, texts: list[str]):
        """Final hidden states of the LoRA encoder. -> hidden (N, T, d), attention mask (N, T), right-padded."""
        if self._disabled:
            raise RuntimeError("Composer.encode called inside adapter_disabled(): the encoder needs its LoRA")
        # another adapter (a LoRA student) may be active
        with models.active_adapter(self.peft, self.cfg.adapter_name):
            return self._encode(texts)

    def _encode(self, texts: list[str]):
        device = self.qformer.queries.device
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.cfg.max_exp_tokens,
                               padding_side="right", add_special_tokens=False, return_tensors="pt").to(device)
        encoder = self.backbone.base_model                          # e.g. Qwen3ForCausalLM.model; LoRA inside
        # eq. (5): H_j = Enc_ψ(x, m_j), the final-norm hidden states of θ̄ + ψ
        out = encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        return out.last_hidden_state, batch["attention_mask"]       # (N, T, d), (N, T)

    def compress(self, texts: list[str]) -> torch.Tensor:
        """E_j for each text (eqs. 5-6): -> (N, K, d) fp32.

        Autocast is off inside, whatever the caller's (deviation 4): the anchor's c_φ0 is cached without it and
        c_φ computed under devices.precision's bf16 autocast on CUDA, and they must be one function."""
        step = self.cfg.encode_batch_size or len(texts)
        # chunks of similar length pad less (right padding never changes a real token's state); order restored below
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        chunks = []
        with torch.autocast(self.qformer.queries.device.type, enabled=False):
            for i in range(0, len(texts), step):
                hidden, att = self.encode([texts[j] for j in order[i:i + step]])   # (n, T, d), (n, T)
                # eq. (6): E_j = Comp_χ(H_j; Q_χ), pads masked out of the keys
                q_dtype = self.qformer.queries.dtype                # fp32 (a bf16 QFormer: --qformer-dtype)
                chunks.append(self.qformer(hidden.to(q_dtype), att == 0).float())  # (n, K, d)
        E = torch.cat(chunks, 0)                                    # (N, K, d) in length order
        return E[torch.argsort(torch.tensor(order, device=E.device))]   # (N, K, d) in the order of `texts`

    def forward(self, tasks: list[str], experiences: list[list[str]]) -> torch.Tensor:
        """c_φ(x, E) for a batch: tasks B strings, experiences B lists of J strings -> (B, J·K, d), backbone dtype."""
        J = len(experiences[0]) if experiences else 0
        if len(experiences) != len(tasks) or J == 0 or any(len(e) != J for e in experiences):
            raise ValueError("experiences must be one non-empty list per task, all of the same length J")
        template = ENCODER_TEMPLATE if self.cfg.task_conditional else REFERENCE_TEMPLATE
        texts = [template.format(task=x, experience=m) for x, ms in zip(tasks, experiences) for m in ms]
        # each distinct text is encoded once (similar tasks often retrieve the same experiences); indexing copies
        # E_j to every row that uses it, and its gradient sums over them, as before
        unique = list(dict.fromkeys(texts))
        slot = {t: i for i, t in enumerate(unique)}
        where = torch.tensor([slot[t] for t in texts], device=self.qformer.queries.device)   # (B·J,)
        E = self.compress(unique)[where]                            # (B·J, K, d) fp32
        # eqs. (4), (7): c_φ = ⊕_j (<e_j,1> ⊕ ... ⊕ <e_j,K>), in retrieval order
        c = E.reshape(len(tasks), J * self.cfg.n_latents, E.shape[-1])                     # (B, J·K, d)
        return c.to(self.peft.get_input_embeddings().weight.dtype)                          # (B, J·K, d)

    # -- persistence ---------------------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """Write `path/<adapter>/` (PEFT), `path/qformer.safetensors`, `path/composer.json`; atomically replaced."""
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".composer-", dir=parent)
        try:
            self.peft.save_pretrained(tmp, selected_adapters=[self.cfg.adapter_name], save_embedding_layers=False)
            state = {k: v.detach().cpu().contiguous() for k, v in self.qformer.state_dict().items()}
            save_file(state, os.path.join(tmp, "qformer.safetensors"))
            with open(os.path.join(tmp, "composer.json"), "w") as f:
                json.dump(asdict(self.cfg), f, indent=1)
            old = None
            if os.path.exists(path):
                old = tempfile.mkdtemp(prefix=".composer-old-", dir=parent)
                os.replace(path, os.path.join(old, "x"))
            os.replace(tmp, path)
            if old:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @classmethod
    def load(cls, path: str, model, tokenizer) -> "Composer":
        """Restore a saved composer onto `model`, a base model with the same weights as at save time."""
        with open(os.path.join(path, "composer.json")) as f:
            raw = json.load(f)
        cfg = ComposerConfig(**{k: v for k, v in raw.items() if k in {f.name for f in fields(ComposerConfig)}})
        comp = cls(model, tokenizer, cfg, adapter_path=os.path.join(path, cfg.adapter_name))
        state = load_file(os.path.join(path, "qformer.safetensors"), device=str(comp.qformer.queries.device))
        comp.qformer.load_state_dict(state)
        return comp


# ----------------------------------------------------------------------------------------------------------------
# Cold start (A.2, eq. 14)
# ----------------------------------------------------------------------------------------------------------------
def cold_start_loss(composer: Composer, batch, latents, n_tokens=None, head=None, chunk: int = 1024):
    """eq. (14): L_init(φ) = −log π_θ̄(y* | s, c_φ), averaged over the ω tokens of the batch.

    batch = (ids, attention_mask, omega, starts) from `cold_start_batch`: ids (B, T) right-padded latent-prompt
    conversations (placeholder span inside), attention_mask (B, T) from lengths, omega (B, T) assistant-token mask,
    starts (B,) span starts; latents (B, J·K, d) = composer(...).
    n_tokens: the divisor when this batch is one slice of a larger one (train.py under torchrun; default Σ ω).
    The base runs with the LoRA disabled; gradients reach ψ and χ through the latents only.
    head (weight, bias): the caller has bypassed the LM head (models.lm_head_bypassed, train.py --loss-chunk), so
    the forward returns hidden states and the NLL applies the head `chunk` rows at a time (memory bounded by tokens).
    """
    ids, attention_mask, omega, starts = (x.to(latents.device) for x in batch)
    # logits are needed only from the position before the batch's first supervised token (the prompt, latents
    # included, is never a target)
    T, first = ids.shape[1], max(int(omega.argmax(1).min()), 1)
    # eq. (14): π_θ̄(· | s, c_φ) is the frozen base (LoRA off) on the latent-augmented input
    logits = composer.teacher_logits(ids, attention_mask, latents, starts, keep=T - first + 1)  # (B, T−first+1, V)
    if head is None:
        return losses.masked_nll(logits[:, :-1], ids[:, first:], omega[:, first:], n_tokens)   # logits t -> t+1
    logp = losses.token_logprobs_from_hidden(logits[:, :-1], head, ids[:, first:], omega[:, first:], chunk)
    return losses.nll(logp, omega[:, first:], n_tokens)                                     # as masked_nll


def schema_balanced_sampler(bank, rng: random.Random):
    """Draw bank entries with every schema (task family) equally likely, then uniformly within it.

    docs/design.md, "What a prototype measured": with a plain uniform draw the cold start learns only the families
    the base already solves often. Entries without a schema (real environments) form one family."""
    groups = {}
    for e in bank:
        groups.setdefault(e.get("meta", {}).get("schema", ""), []).append(e)
    keys = sorted(groups)
    return lambda n: [rng.choice(groups[rng.choice(keys)]) for _ in range(n)]


def cold_start_batch(chat, episodes, n_latents: int):
    """Right-padded tensors for `cold_start_loss`: each episode's prompt is swapped for its latent prompt
    (chat: engine.Chat, whose `latent_prompt` renders it from the episode's task, `begin`).

    episodes: `engine.Episode`s whose ids after `prompt_len` (replies and observations) and ω are kept as they are,
    never re-tokenized. Returns ids (B, T), attention_mask (B, T), omega (B, T) float, starts (B,).
    """
    rows, omegas, starts = [], [], []
    for ep in episodes:
        prompt, s = chat.latent_prompt(*chat.begin(ep.task), n_latents)
        rows.append(prompt + list(ep.ids[ep.prompt_len:]))
        omegas.append([0] * len(prompt) + list(ep.mask[ep.prompt_len:]))
        starts.append(s)
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), inject.placeholder_id(chat.tokenizer), dtype=torch.long)   # (B, T)
    omega = torch.zeros((len(rows), T))                                                     # (B, T)
    for i, (r, o) in enumerate(zip(rows, omegas)):
        ids[i, :len(r)], omega[i, :len(r)] = torch.tensor(r), torch.tensor(o, dtype=torch.float)
    att = inject.length_mask([len(r) for r in rows], T, left=False)                        # (B, T)
    return ids, att, omega, torch.tensor(starts)
