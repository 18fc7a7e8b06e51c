"""Latent injection: placeholder prompts and embedding replacement (paper Appendix A.4, A.5; eqs. 7, 17, 18).

The teacher sees the composer's latents c_φ as ordinary context positions (eq. 7). They enter the backbone the way
the paper's engines put them in (A.4):

  1. A sentinel string <|LATENT_PH|> goes into the FIRST user message, between the A.5 framing texts. The chat
     template renders the prompt to text, the text is split on the sentinel, each half is tokenized on its own, and
     J·K placeholder ids (the tokenizer's pad id) are put between the halves (eq. 17):
         input_ids = [t_1 ... t_a, t_pad × J·K, t_a+1 ... t_L]        span start = a
  2. The backbone's embedding table embeds input_ids as usual, X (L, d); before the first layer the span is
     replaced by the latents, X[p_k] ← <e_k> (eq. 18), with torch.cat over slices, never in-place assignment, so
     autograd reaches the latents and through them the composer.

An equivalence check (tests/test_inject.py, A.4 "Equivalence verification") puts known token embeddings in the
span: the embedding path and the token-id path give the same logits and the same greedy tokens.

    python -m pytest tests/test_inject.py -q

Notation: B batch, L (or T) tokens, J experiences, K latents per experience, n = J·K latents in the span, d hidden.

THE TRAP (docs/design.md, "Correctness traps"). The placeholder id IS the pad id. Anything that infers the attention
mask from `input_ids != pad_token_id` (generate() without an `attention_mask`, a collator, a hand-written mask)
masks the placeholders too, and the teacher silently never sees its latents (docs/design.md).
Always pass an explicit attention_mask built from row LENGTHS (`engine.left_pad`, `length_mask`), never from ids.

Left padding. Generation pads on the left, so the span of row b starts at its unpadded start plus the number of
pad positions left of it (`span_starts`); each row has its own start.

Joining (our choice; the paper shows the framing texts but not the separators). The first user message becomes
    before + "\\n\\n" + <|LATENT_PH|> + "\\n\\n" + after + "\\n" + task_text
i.e. a blank line around the latent block, and the task on the line after "... (the environment is untouched):".

Deviations from the paper
-------------------------
1. Injection runs in Hugging Face transformers (inputs_embeds), not SGLang positional_embed_overrides or vLLM
   prompt_embeds; the mechanism (placeholder span, replacement before the first layer) is the same.
2. The separators between framing, latent block and task text are ours (see "Joining" above).
3. A prompt whose text already contains the sentinel (e.g. a task text quoting it) is refused with ValueError
   instead of splitting in the wrong place.
4. The toy world uses a short framing (`TOY_FRAMING`); real models get A.5's word for word.
"""
from __future__ import annotations

import torch

# ----------------------------------------------------------------------------------------------------------------
# A.5 framing text, word for word (en dash in "SEPARATE session – in", em dashes around "end of reference")
# ----------------------------------------------------------------------------------------------------------------
LATENT_PH = "<|LATENT_PH|>"

AGENTIC_FRAMING = (
    "The following is a REFERENCE EXAMPLE of how a DIFFERENT, already-solved task was handled, shown only to "
    "illustrate the general approach. It was performed in a SEPARATE session \u2013 in YOUR task below, NOTHING has "
    "been done yet and the environment is in its initial state. You must perform every step yourself by calling "
    "the tools and reading their actual results; do NOT assume any step is already complete.",
    "\u2014 end of reference example \u2014\n\n"
    "Now complete YOUR task below, starting from scratch (the environment is untouched):",
)
CODING_FRAMING = (
    "The following is a reference from a similar programming problem. Study the approach and algorithm, then "
    "solve YOUR problem below.",
    "\u2014 end of reference \u2014",
)
# The toy backbone's framing (our deviation 4): the A.5 text is 186 toy tokens, longer than a whole toy episode,
# and a 0.5 M-parameter model reads none of it. Like tool_world.TOY_SYSTEM_PROMPT, the toy world uses this short one;
# real models get the A.5 text above (each environment names its framing: `ToolWorld.framing`).
TOY_FRAMING = ("Reference, a different solved task:", "End of reference. Your task:")


# ----------------------------------------------------------------------------------------------------------------
# Prompt side (eq. 17): sentinel → rendered chat text → two halves → placeholder span
# ----------------------------------------------------------------------------------------------------------------
def latent_user_content(task_text: str, framing=AGENTIC_FRAMING) -> str:
    """The first user message with the latent block: before, sentinel, after, then the task (see "Joining")."""
    before, after = framing
    return before + "\n\n" + LATENT_PH + "\n\n" + after + "\n" + task_text


def placeholder_id(tokenizer) -> int:
    """The id that fills the span: the pad token (A.4), or end-of-sequence when the tokenizer has no pad."""
    pid = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pid is None:
        raise ValueError("tokenizer has neither a pad nor an eos token to use as the latent placeholder id")
    return pid


def latent_messages(messages, framing=AGENTIC_FRAMING) -> list[dict]:
    """A copy of `messages` whose first user message carries the framing and the sentinel (eq. 17's prompt, before the
    chat template renders it)."""
    out, done = [], False
    for m in messages:
        if not done and m.get("role") == "user":
            m, done = {**m, "content": latent_user_content(m["content"], framing)}, True
        out.append(m)
    if not done:
        raise ValueError("latent_messages: the messages have no user message to carry the latent context")
    return out


def latent_prompt_ids(tokenizer, text: str, n_latents: int) -> tuple[list[int], int]:
    """Prompt ids with a span of `n_latents` placeholder ids (eq. 17), and the span's start index, from the rendered
    chat text of `latent_messages` (engine.latent_prompt_ids renders it): the text is split on the sentinel and each
    half tokenized on its own. Returns (ids, start): ids[start:start + n_latents] are the placeholders."""
    count = text.count(LATENT_PH)
    if count != 1:
        raise ValueError(f"the rendered prompt holds the sentinel {LATENT_PH!r} {count} times, expected exactly "
                         "once (does a message or the system prompt already contain it?)")
    head, tail = text.split(LATENT_PH)
    # eq. (17): [t_1 ... t_a, t_pad × n, t_a+1 ... t_L], each half tokenized on its own
    before = tokenizer(head, add_special_tokens=False)["input_ids"]
    after = tokenizer(tail, add_special_tokens=False)["input_ids"]
    return before + [placeholder_id(tokenizer)] * n_latents + after, len(before)


def length_mask(lengths, total: int, left: bool = True) -> torch.Tensor:
    """Attention mask from row LENGTHS (never from ids: the placeholders are pad ids). Left- or right-padded.

    lengths (B,) ints -> (B, total) long, 1 on the real tokens of each row.
    """
    lengths = torch.as_tensor(lengths, dtype=torch.long)                    # (B,)
    pos = torch.arange(total)[None, :]                                      # (1, total)
    if left:
        return (pos >= total - lengths[:, None]).long()                     # (B, total)
    return (pos < lengths[:, None]).long()                                  # (B, total)


def span_starts(attention_mask, starts_unpadded) -> torch.Tensor:
    """Absolute span starts in a left-padded batch: unpadded start + pad positions on the left of the row.

    attention_mask (B, L), starts_unpadded (B,) -> (B,) long on the mask's device.
    """
    n_left = (attention_mask.long().cumsum(1) == 0).sum(1)                  # (B,) pads before the first token
    starts = torch.as_tensor(starts_unpadded, dtype=torch.long, device=attention_mask.device)  # (B,)
    return starts + n_left                                                  # (B,)


def _check_spans(embeds, latents, starts, span_len):
    B, L, d = embeds.shape
    if latents.dim() != 3 or latents.shape[0] != B or latents.shape[2] != d:
        raise ValueError(f"latents must be (B={B}, n, d={d}), got {tuple(latents.shape)}")
    n = latents.shape[1]
    if span_len is not None and span_len != n:
        raise ValueError(f"the placeholder span holds {span_len} positions but {n} latents were given per row "
                         "(n_latents in the prompt must equal J·K of the composer)")
    starts = [int(s) for s in torch.as_tensor(starts).reshape(-1).tolist()]
    if len(starts) != B:
        raise ValueError(f"starts must have one entry per row ({B}), got {len(starts)}")
    for b, s in enumerate(starts):
        if s < 0 or s + n > L:
            raise ValueError(f"row {b}: latent span [{s}, {s + n}) runs outside the sequence of length {L}")
    return starts, n


def inject(embeds, latents, starts, span_len: int | None = None) -> torch.Tensor:
    """Replace each row's placeholder span by its latents (eq. 18), differentiably.

    embeds (B, L, d) token embeddings; latents (B, n, d), cast to embeds' dtype; starts (B,) absolute span start
    per row (left padding included, see `span_starts`); span_len: the span length the prompt was built with,
    checked against n when given. Returns (B, L, d); neither input is modified.
    """
    starts, n = _check_spans(embeds, latents, starts, span_len)
    latents = latents.to(embeds.dtype)                                       # (B, n, d)
    rows = []
    for b, s in enumerate(starts):
        # eq. (18): X[p_k] ← <e_k>, k = 1..n, as [X[:s]; E; X[s+n:]]
        rows.append(torch.cat([embeds[b, :s], latents[b], embeds[b, s + n:]], dim=0))  # (L, d)
    return torch.stack(rows, dim=0)                                          # (B, L, d)


def embed_with_latents(model, input_ids, latents, starts, span_len: int | None = None) -> torch.Tensor:
    """inputs_embeds for `model`: its own input embeddings of input_ids (B, L), span replaced by latents (B, n, d).

    Returns (B, L, d). Pass it with an explicit attention_mask (see THE TRAP in the module docstring)."""
    embeds = model.get_input_embeddings()(input_ids)                        # (B, L, d)
    return inject(embeds, latents, starts, span_len)                        # (B, L, d)


def make_embed_fn(model, latents_per_task, start_per_task):
    """An `embed_fn(ids, attention_mask, rows) -> inputs_embeds` for `engine.rollout` / `engine.generate_replies`.

    latents_per_task (N, n, d): the latents of every task of the rollout; start_per_task (N,): each task's span
    start in its UNPADDED prompt (from `latent_prompt_ids`); rows index both. ids and attention_mask are the
    left-padded batch (B, L) that generate() receives; the attention mask must come from lengths (THE TRAP).
    If the backbone carries the composer's LoRA, generate inside `Composer.adapter_disabled()` (A.4).
    """
    start_per_task = torch.as_tensor(start_per_task, dtype=torch.long)     # (N,)

    def embed_fn(ids, attention_mask, rows):
        idx = torch.as_tensor(list(rows), dtype=torch.long)                 # (B,)
        latents = latents_per_task[idx.to(latents_per_task.device)].to(ids.device)  # (B, n, d)
        starts = span_starts(attention_mask, start_per_task[idx])           # (B,)
        return embed_with_latents(model, ids, latents, starts)             # (B, L, d)

    return embed_fn
