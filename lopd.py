"""LOPD, Algorithm 1: one iteration, and the rollouts and scoring it rests on (paper §3.1, §3.3, Alg. 1).

    rollout / Episode          roll the student out on-policy from the task alone (eq. 1), keeping the exact
                               sampled token ids, the assistant-token mask ω and the sampling-time log-probs
    retrieve / compose         Ret(x) (eq. 16) and c_φ = Φ_φ(x, E) (eqs. 4-7)
    teacher_rollout            "base + composer": the frozen base acting behind latents (evaluation)
    student_logits /           p_S and p_T on the SAME sampled ids, the teacher behind its latent prompt with the
      teacher_logits           composer's LoRA off (eq. 8, A.4)
    lopd_step                  Algorithm 1: rollouts -> retrieve -> compose -> re-score -> eq. 13 -> AdamW -> dual step
    micro_batches /            its forward/backward passes (by rollouts, or by a token budget), and one pass: both
      micro_batch_objective    models' scores and eq. 13, from full logits or (--loss-chunk) from hidden states

The baselines (RFT, GRPO, OPSD, SDPO) run on these same functions: baselines.py. The calls `runtime.all_sum`,
`runtime.gathered` and their kind are data parallel under torchrun and the identity in one process: a first
read can skip them (runtime.py).

    python train.py --steps 5                   # runs lopd_step in the full pipeline
    python -m pytest tests/test_rollout.py tests/test_lopd.py -q

Notation: B episodes in a batch, T tokens, V vocabulary.

A conversation is one flat token sequence:

    [prompt: system + user + "<|im_start|>assistant\\n"] [reply 1 ... <|im_end|>] [observation 1] [reply 2 ...] ...
     ω = 0                                                ω = 1                     ω = 0           ω = 1

where an observation is the chat template's rendering of the tool results plus the next assistant header. Replies
are never re-tokenized: the ids that were sampled are the ids that are scored (docs/design.md, "Correctness traps").

Deviations from the paper
-------------------------
1. Generation uses Hugging Face `generate` (KV cache within a turn, left padding, explicit attention masks), not
   SGLang/vLLM; each turn re-encodes the conversation so far.
2. A reply cut off by the per-turn token budget ends the episode (the reply is kept, unterminated), and so does a
   conversation whose next reply might not fit its budget (`SampleConfig.max_len`, train.py --max-len).
"""
from __future__ import annotations

import contextlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import LogitsProcessor, LogitsProcessorList

import inject
import losses
import runtime
from envs import DONE_TEXT, Environment, ToolWorld, format_call


# ----------------------------------------------------------------------------------------------------------------
# Chat rendering: prompt ids and observation ids from the tokenizer's own chat template
# ----------------------------------------------------------------------------------------------------------------
def prompt_ids(tokenizer, messages, tools=None, enable_thinking=False) -> list[int]:
    """Token ids of the first messages plus the assistant generation header. The tools go to the template, or
    into the system message if the template ignores `tools=` (inject.chat_text)."""
    text = inject.chat_text(tokenizer, messages, tools, enable_thinking)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


_MARK = "\x00REPLY\x00"


def observation_text(tokenizer, results, enable_thinking=False) -> str:
    """The template's text between the end of a reply (after its end-of-turn token) and the next reply: the tool
    messages plus the next assistant header. Found by rendering a dummy conversation and cutting after the reply."""
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]
    msgs += [{"role": "tool", "content": r} for r in results]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=enable_thinking)
    cut = _MARK + tokenizer.eos_token
    if cut not in text:
        raise ValueError(f"chat template does not end an assistant turn with eos_token {tokenizer.eos_token!r}")
    return text[text.index(cut) + len(cut):]


def observation_ids(tokenizer, results, enable_thinking=False) -> list[int]:
    return tokenizer(observation_text(tokenizer, results, enable_thinking), add_special_tokens=False)["input_ids"]


def reply_ids(tokenizer, text: str) -> list[int]:
    """Ids of a scripted reply (demonstrations only; sampled replies keep their sampled ids) plus end-of-turn."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


# ----------------------------------------------------------------------------------------------------------------
# Episodes
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Episode:
    """One multi-turn episode as the losses see it, plus Table 3's behaviour counts."""
    task: object
    ids: list = field(default_factory=list)      # (T,) the whole conversation
    mask: list = field(default_factory=list)     # (T,) ω: 1 on sampled reply tokens only
    logps: list = field(default_factory=list)    # (T,) log π(a_t) at sampling time (temperature 1), 0 where ω = 0
    prompt_len: int = 0
    reward: float = 0.0
    steps: int = 0             # interaction steps (assistant replies)
    tool_calls: int = 0
    repeated_calls: int = 0    # calls identical (name and arguments) to an earlier call of the episode
    first_len: int = 0         # tokens in the first reply
    errors: int = 0
    trace: str = ""            # observation-lite trace (A.3), for the experience bank
    done: bool = False
    seen_calls: set = field(default_factory=set, repr=False)

    def add(self, ids, sampled: bool, logps=None):
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.logps += logps if logps is not None else [0.0] * len(ids)

    def metrics(self) -> dict:
        return {"reward": self.reward, "steps": self.steps, "calls_per_step": self.tool_calls / max(1, self.steps),
                "first_len": self.first_len, "repeated_calls": self.repeated_calls,
                "reward_per_call": self.reward / max(1, self.tool_calls), "full_pass": float(self.reward >= 1.0)}


def summarize(episodes) -> dict:
    """Mean of each behaviour metric over episodes (Table 3's columns)."""
    return _mean_rows([e.metrics() for e in episodes])


def _mean_rows(rows) -> dict:
    return {k: sum(r[k] for r in rows) / max(1, len(rows)) for k in rows[0]} if rows else {}


def summarize_all(episodes) -> dict:
    """`summarize` over every rank's episodes (under torchrun; this is `summarize` in one process)."""
    return _mean_rows(runtime.gather([e.metrics() for e in episodes]))


def _record_step(ep: Episode, env: Environment, reply: str, n_new: int) -> list[str]:
    """Execute one reply in the environment and update the episode's counts; returns the observations."""
    n_before = len(env.trace)
    return _count_step(ep, env, env.step(reply), n_before, n_new)


def _step_all(envs_, replies) -> list:
    """env.step(reply) for each live episode. An environment that runs programs to verify them (CodeWorld sets
    `parallel_steps`) steps in threads, one sandboxed process each, up to the core count; the tool world in order."""
    if envs_ and envs_[0].parallel_steps:
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            return list(pool.map(lambda pair: pair[0].step(pair[1]), zip(envs_, replies)))
    return [env.step(reply) for env, reply in zip(envs_, replies)]


def _count_step(ep: Episode, env: Environment, result, n_before: int, n_new: int) -> list[str]:
    """Update the episode's counts from a step's result (the calls after env.trace[n_before]); -> observations."""
    ep.steps += 1
    ep.first_len = ep.first_len or n_new
    for name, args, _ in env.trace[n_before:]:
        key = name + json.dumps(args, sort_keys=True)
        ep.repeated_calls += key in ep.seen_calls
        ep.seen_calls.add(key)
    ep.tool_calls += result.n_calls
    ep.errors += result.errors
    ep.done = result.done
    return result.observations


def _finish(ep: Episode, env: Environment):
    text = env.trace_text()                                       # the bank's experience (A.3)
    ep.done, ep.reward, ep.trace = True, env.reward(), text


def scripted_episode(tokenizer, env: Environment, task, calls, tools=None, prompt_fn=None) -> Episode:
    """Encode a scripted episode (a demonstration) with the same bookkeeping as a sampled one.
    calls: one (name, arguments) per reply, or a list of them for one reply with several (parallel) calls.
    prompt_fn(tokenizer, messages) -> ids overrides the prompt, as in `rollout`."""
    ep = Episode(task)
    msgs = env.reset(task)
    ep.add(prompt_fn(tokenizer, msgs) if prompt_fn else prompt_ids(tokenizer, msgs, tools), sampled=False)
    ep.prompt_len = len(ep.ids)
    replies = ["\n".join(format_call(n, a) for n, a in (c if isinstance(c, list) else [c])) for c in calls]
    for reply in replies + [DONE_TEXT]:
        ids = reply_ids(tokenizer, reply)
        ep.add(ids, sampled=True)
        obs = _record_step(ep, env, reply, len(ids))
        if ep.done:
            break
        ep.add(observation_ids(tokenizer, obs), sampled=False)
    _finish(ep, env)
    return ep


# ----------------------------------------------------------------------------------------------------------------
# Algorithm 1, steps 1-2: batched multi-turn rollouts with Hugging Face generate (eq. 1)
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class SampleConfig:
    temperature: float = 0.7      # B.2; 0 = greedy
    top_p: float = 0.95
    top_k: int = 20
    max_new_tokens: int = 64      # per reply
    max_len: int = 768            # the conversation's token budget: an episode ends when its next reply might not
                                  # fit (train.py --max-len; B.2's 40,960 for real models, 768 for the toy)
    batch_size: int = 64          # episodes generated together (train.py --gen-batch, or from --kv-budget)
    sort_by_length: bool = False  # batch tasks of similar length together (real models: less left padding)
    enable_thinking: bool = False # chat template: Qwen3 thinking mode (prompts, observations, latent prompts)


def left_pad(rows, pad_id, device):
    """(B, L) ids and attention mask, left-padded so that every row's next token is at position L."""
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)            # (B, L)
    att = torch.zeros((len(rows), L), dtype=torch.long)                   # (B, L)
    for i, r in enumerate(rows):
        ids[i, L - len(r):] = torch.tensor(r)
        att[i, L - len(r):] = 1
    return ids.to(device), att.to(device)


class SampledLogProbs(LogitsProcessor):
    """log π(a_t) at temperature 1 of each token that `generate` samples, one (B,) gather per step.

    generate calls a logits processor with step t's scores (B, V) and the ids up to step t − 1, so this one keeps
    step t's log-softmax until the next call (or `finish`) shows which token was drawn. Peak memory is one (B, V)
    step, where generate's `output_logits` would keep every step, (B, N, V): ~40 GB in fp32 at B = 64, N = 1024,
    V = 151,936. It runs after generate's own processors (none for the toy or Qwen3: the raw logits) and before
    the sampling warpers (temperature, top-k, top-p), which it never sees."""

    def __init__(self):
        self.steps, self.pending = [], None

    def __call__(self, input_ids, scores):
        if self.pending is not None:                                        # the token drawn at step t − 1
            self.steps.append(self.pending.gather(-1, input_ids[:, -1:])[:, 0])   # (B,)
        self.pending = F.log_softmax(scores.float(), -1)                     # (B, V) step t
        return scores

    def finish(self, new):
        """new (B, N) the sampled ids -> their log-probs (B, N)."""
        last = self.pending.gather(-1, new[:, -1:].to(self.pending.device))[:, 0]   # (B,)
        return torch.stack(self.steps + [last], 1)                          # (B, N)


@torch.no_grad()
def generate_replies(model, tokenizer, contexts, cfg: SampleConfig, embed_fn=None):
    """Sample one reply per context. Returns per row (new ids, their log-probs at temperature 1, finished?).

    `embed_fn(ids, attention_mask) -> inputs_embeds` lets a caller replace placeholder embeddings with latents
    (inject.py); generate then returns only the new tokens. The log-probs are gathered step by step
    (`SampledLogProbs`); no loss reads them (GRPO's π_old is the detached re-scored policy, ρ = 1), they are kept
    with the episode as a check that re-scoring reproduces sampling."""
    device = next(model.parameters()).device
    ids, att = left_pad(contexts, tokenizer.pad_token_id, device)        # (B, L)
    sample, logps, eos = cfg.temperature > 0, SampledLogProbs(), eos_ids(model, tokenizer)
    kw = dict(attention_mask=att, max_new_tokens=cfg.max_new_tokens, do_sample=sample,
              pad_token_id=tokenizer.pad_token_id, eos_token_id=eos if len(eos) > 1 else eos[0],
              logits_processor=LogitsProcessorList([logps]),
              synced_gpus=False)   # under torchrun a sharded student generates gathered (`gathered`): no lockstep
    if sample:
        kw.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    else:
        kw.update(temperature=None, top_p=None, top_k=None)
    if embed_fn is None:
        new = model.generate(input_ids=ids, **kw)[:, ids.shape[1]:]        # (B, N)
    else:
        new = model.generate(inputs_embeds=embed_fn(ids, att), **kw)       # (B, N): only new tokens
    return cut_at_eos(new, logps.finish(new), eos)                          # logps: (B, N)


def eos_ids(model, tokenizer) -> list[int]:
    """The ids that end a reply: the tokenizer's eos (the chat template's end of turn) first, then every other id
    of the model's generation config (Qwen3 lists <|im_end|> and <|endoftext|>)."""
    config = getattr(model, "generation_config", None) or getattr(getattr(model, "peft", None),
                                                                   "generation_config", None)
    more = getattr(config, "eos_token_id", None)
    more = [] if more is None else [more] if isinstance(more, int) else list(more)
    return [tokenizer.eos_token_id] + [i for i in more if i != tokenizer.eos_token_id]


def cut_at_eos(new, logp, eos_id) -> list:
    """Each row's reply up to and including its first eos (one id or a list of them): [(ids, log-probs, ended with
    eos)]. new, logp (B, N)."""
    ends = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id), device=new.device)
    rows = []
    for i in range(new.shape[0]):
        eos = torch.isin(new[i], ends).nonzero()
        n = int(eos[0]) + 1 if len(eos) else new.shape[1]
        rows.append((new[i, :n].tolist(), logp[i, :n].tolist(), bool(len(eos))))
    return rows


def rollout(model, tokenizer, tasks, cfg: SampleConfig, make_env=ToolWorld, tools=None, prompt_fn=None,
            embed_fn=None, progress=None) -> list[Episode]:
    """Roll out one episode per task (eq. 1), batched across tasks, turn by turn.

    prompt_fn(tokenizer, messages) -> ids overrides the prompt (the teacher's latent prompt, inject.py);
    embed_fn(ids, attention_mask, rows) then fills the placeholder span, where rows index `tasks`.
    cfg.sort_by_length: batches of tasks of similar length (less left padding); episodes come back in task order."""
    episodes = [None] * len(tasks)
    order = sorted(range(len(tasks)), key=lambda i: len(tasks[i].text)) if cfg.sort_by_length else range(len(tasks))
    was_training = model.training
    model.eval()
    for start in range(0, len(tasks), cfg.batch_size):
        which = order[start:start + cfg.batch_size]                          # indices into tasks
        chunk = [tasks[j] for j in which]
        envs = [make_env() for _ in chunk]
        for env in envs:          # the tokenizer's own reply parser, where it has one (envs.parse_tool_calls)
            if getattr(tokenizer, "response_template", None):
                env.response_template = tokenizer.response_template
        eps = [Episode(t) for t in chunk]
        for ep, env in zip(eps, envs):
            msgs = env.reset(ep.task)
            ep.add(prompt_fn(tokenizer, msgs) if prompt_fn else
                   prompt_ids(tokenizer, msgs, tools, cfg.enable_thinking), sampled=False)
            ep.prompt_len = len(ep.ids)
        while not all(ep.done for ep in eps):
            live = [i for i, ep in enumerate(eps) if not ep.done]
            bound = None if embed_fn is None else (  # tell embed_fn which tasks the rows are
                lambda ids, att, rows=[which[i] for i in live]: embed_fn(ids, att, rows))
            replies = generate_replies(model, tokenizer, [eps[i].ids for i in live], cfg, bound)
            texts = [tokenizer.decode(new, skip_special_tokens=False).replace(tokenizer.eos_token, "")
                     for new, _, _ in replies]
            n_before = [len(envs[i].trace) for i in live]
            results = _step_all([envs[i] for i in live], texts)
            for k, (i, (new, lp, finished)) in enumerate(zip(live, replies)):
                ep, env = eps[i], envs[i]
                ep.add(new, sampled=True, logps=lp)
                obs = _count_step(ep, env, results[k], n_before[k], len(new))
                if ep.done or not finished:
                    _finish(ep, env)
                    continue
                ep.add(observation_ids(tokenizer, obs, cfg.enable_thinking), sampled=False)
                if len(ep.ids) + cfg.max_new_tokens > cfg.max_len:
                    _finish(ep, env)
        for j, ep in zip(which, eps):
            episodes[j] = ep
        if progress is not None:
            progress.update(len(chunk))
    model.train(was_training)
    return episodes


# ----------------------------------------------------------------------------------------------------------------
# Algorithm 1, step 3: retrieve J experiences and compose c_φ; the teacher acting behind its latent prompt
# ----------------------------------------------------------------------------------------------------------------
def experience_text(entry: dict) -> str:
    """m_j as the encoder reads it: the bank entry's task description followed by its trace (A.3)."""
    return entry["task"] + "\n" + entry["trace"]


# What the composer reads in the "task only" control (train.py --retrieval none): no reference, and the task where
# the encoder is task-conditional (composer.py; the toy's encoder reads the reference alone, so then nothing).
NO_REFERENCE = {"task_id": "", "task": "", "trace": "(no reference)", "reward": 0.0, "meta": {}}


RETRIEVAL_MODES = ("same", "other", "none", "self", "shop")


def retrieve(retriever, tasks, n_ret: int, mode: str = "same"):
    """Ret(x) for each task (eq. 16): B lists of J bank entries.

    "same" is the method, never the task's own entries (retrieval.py, deviation 1); "self" is the same search with
    the task's own successes allowed (the official configs' allow_self_retrieval: true). Controls (does the teacher
    use the experience?): "other" never returns an entry of the task's own variant (shop), "none" gives the
    composer no reference, "shop" returns only entries of the task's own shop (an oracle retriever: it separates
    what retrieval finds from what the composer makes of it)."""
    if mode == "none":
        return [[NO_REFERENCE] * n_ret for _ in tasks]
    if mode not in RETRIEVAL_MODES:
        raise ValueError(f"retrieval mode {mode!r}: expected one of {RETRIEVAL_MODES}")
    variants = [t.variant for t in tasks] if mode in ("other", "shop") else None
    return retriever.retrieve([t.task_id for t in tasks], [t.text for t in tasks], n_ret=n_ret,
                              exclude_self=mode != "self", exclude_variants=variants if mode == "other" else None,
                              only_variants=variants if mode == "shop" else None)


def compose(composer, tasks, experiences, chunk: int = 32):
    """c_φ for each task (eqs. 4-7): experiences B lists of J entries -> latents (B, J·K, d)."""
    out = []
    for i in range(0, len(tasks), chunk):
        out.append(composer([t.text for t in tasks[i:i + chunk]],
                            [[experience_text(e) for e in es] for es in experiences[i:i + chunk]]))
    return torch.cat(out, 0)                                                  # (B, J·K, d)


@torch.no_grad()
def teacher_rollout(composer, tokenizer, tasks, latents, cfg: SampleConfig, make_env=ToolWorld, tools=None,
                    progress=None):
    """The frozen base θ̄ acting behind its latent prompt ("base + composer"): LoRA off (A.4), latents injected."""
    n, framing = latents.shape[1], make_env().framing
    starts = [inject.latent_prompt_ids(tokenizer, make_env().reset(t), n, framing, tools, cfg.enable_thinking)[1]
              for t in tasks]
    prompt_fn = inject.latent_prompt_fn(n, framing, tools, cfg.enable_thinking)
    embed_fn = inject.make_embed_fn(composer.peft, latents, starts)
    with composer.adapter_disabled():
        return rollout(composer.peft, tokenizer, tasks, cfg, make_env, tools, prompt_fn, embed_fn, progress)


# ----------------------------------------------------------------------------------------------------------------
# Algorithm 1, step 4: the student and the teacher score the SAME sampled ids (eq. 8)
# ----------------------------------------------------------------------------------------------------------------
def pack(prefixes, conts, pad_id, device):
    """Left-pad prefixes to a common length P and right-pad continuations to Tc, so that column P + t holds
    continuation token t in every row. Returns ids (B, P+Tc), attention mask, position ids, P, left-pad sizes."""
    P, Tc = max(len(p) for p in prefixes), max(len(c) for c in conts)
    ids = torch.full((len(conts), P + Tc), pad_id, dtype=torch.long)            # (B, P+Tc)
    att = torch.zeros_like(ids)                                                  # (B, P+Tc)
    for i, (p, c) in enumerate(zip(prefixes, conts)):
        ids[i, P - len(p):P + len(c)] = torch.tensor(p + c)
        att[i, P - len(p):P + len(c)] = 1
    pos = (att.cumsum(1) - 1).clamp(min=0)                                       # (B, P+Tc) true positions
    pad = torch.tensor([P - len(p) for p in prefixes])                           # (B,)
    return ids.to(device), att.to(device), pos.to(device), P, pad.to(device)


def continuation(eps, device):
    """The sampled part of each episode (everything after its prompt): ids list per row and ω (B, Tc)."""
    conts = [e.ids[e.prompt_len:] for e in eps]
    omega = torch.zeros((len(eps), max(len(c) for c in conts)), device=device)            # (B, Tc)
    for i, e in enumerate(eps):
        omega[i, :len(conts[i])] = torch.tensor(e.mask[e.prompt_len:], dtype=torch.float)
    return conts, omega


def continuation_logits(model, tokenizer, prefixes, eps, device):
    """`model` scores each episode's sampled continuation behind `prefixes` (one id list per episode).
    -> logits (B, Tc, V), continuation ids (B, Tc), ω (B, Tc). The continuation is never re-tokenized."""
    conts, omega = continuation(eps, device)
    ids, att, pos, P, _ = pack(prefixes, conts, tokenizer.pad_token_id, device)
    Tc = omega.shape[1]
    # only the last Tc+1 columns' logits are computed (HF logits_to_keep): the prefix is never a target. A scoring
    # forward keeps no KV cache (use_cache=False): nothing reads it, and at 40k tokens it is gigabytes
    logits = model(input_ids=ids, attention_mask=att, position_ids=pos, logits_to_keep=Tc + 1,
                   use_cache=False).logits                                             # (B, Tc+1, V)
    return logits[:, :Tc], ids[:, P:], omega     # column P-1+t (here t) predicts continuation token t


def student_logits(student, tokenizer, eps, device):
    """π_θ^S on the sampled continuation behind the student's own prompt (eq. 8): (B, Tc, V), ids (B, Tc), ω."""
    return continuation_logits(student, tokenizer, [e.ids[:e.prompt_len] for e in eps], eps, device)


def student_logprobs(student, tokenizer, eps, device, loss_chunk: int = 0):
    """log π_θ(a_t) of each episode's own sampled ids behind the student's prompt: (B, Tc) fp32, zeros off ω, with
    ids and ω (B, Tc); the NLL of RFT and GRPO's log π. loss_chunk > 0: from hidden states, the LM head applied that
    many rows at a time (memory bounded by tokens, `runtime.lm_head_bypassed`); 0: from full logits."""
    if not loss_chunk:
        ls, ids, omega = student_logits(student, tokenizer, eps, device)                  # (B, Tc, V)
        return losses.token_logprobs(ls, ids, omega), ids, omega
    with runtime.lm_head_bypassed(student):
        h, ids, omega = student_logits(student, tokenizer, eps, device)                   # (B, Tc, d)
    return losses.token_logprobs_from_hidden(h, runtime.lm_head(student), ids, omega, loss_chunk), ids, omega


def teacher_logits(composer, tokenizer, eps, latents, make_env, tools=None, enable_thinking=False):
    """π_θ̄,φ^T on the SAME continuation ids behind the latent prompt with c_φ injected, LoRA off (eqs. 7-8, A.4).
    Nothing is re-tokenized: the prompt changes, the continuation ids are the sampled ones. -> (B, Tc, V)."""
    device = latents.device
    conts, omega = continuation(eps, device)
    framing = make_env().framing
    prompts = [inject.latent_prompt_ids(tokenizer, make_env().reset(e.task), latents.shape[1], framing, tools,
                                        enable_thinking) for e in eps]
    ids, att, pos, P, pad = pack([p for p, _ in prompts], conts, tokenizer.pad_token_id, device)
    starts = torch.tensor([s for _, s in prompts], device=device) + pad                  # (B,) after left padding
    Tc = omega.shape[1]
    # only the last Tc+1 columns: column P-1+t (here t) predicts continuation token t
    logits = composer.teacher_logits(ids, att, latents, starts, keep=Tc + 1, position_ids=pos)   # (B, Tc+1, V)
    return logits[:, :Tc]                                                                  # (B, Tc, V)


def student_teacher_logits(student, composer, tokenizer, eps, latents, make_env, tools=None, enable_thinking=False):
    """Algorithm 1, step 4: both models score the SAME sampled continuation (never re-tokenized, eq. 8).
    Returns aligned student and teacher logits (B, Tc, V), continuation ids and ω (B, Tc)."""
    ls, ids, omega = student_logits(student, tokenizer, eps, latents.device)
    return ls, teacher_logits(composer, tokenizer, eps, latents, make_env, tools, enable_thinking), ids, omega


# ----------------------------------------------------------------------------------------------------------------
# Algorithm 1: one LOPD iteration
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class LOPDConfig:
    n_ret: int = 3             # J
    top_m: int = 20            # M (eq. 9)
    margin: float = 0.05       # m (eq. 13)
    anchor: float = 0.2        # λ (eq. 13)
    dual_lr: float = 0.5       # η_β (eq. 13)
    delta_per: str = "trajectory"   # Δ normalisation (eq. 12)
    kl_per: str = "token"      # L_distill normalisation: the whole batch's ω tokens | per trajectory (eq. 10)
    micro_batch: int = 8       # rollouts per forward/backward
    clip: float = 1.0          # gradient clipping, student and composer each
    freeze_composer: bool = False
    retrieval: str = "same"    # what the composer reads: same (the method) | other | none (controls, `retrieve`)
    privilege_against: str = "student"   # δ's baseline: the student (eq. 11) | phi0, the teacher behind c_φ0
    loss_chunk: int = 0        # supervised rows per LM-head application of the loss; 0: full logits (the reference)
    token_budget: int = 0      # padded tokens per forward/backward (0: micro_batch rollouts each; `micro_batches`)


@torch.no_grad()
def anchor_cache(composer, retriever, tasks, n_ret: int, mode: str = "same", chunk: int = 32) -> dict:
    """c_φ0 per task from the cold-started composer, computed once (Algorithm 1: "cache c_φ0 per task")."""
    cache = {}
    for i in range(0, len(tasks), chunk):
        part = tasks[i:i + chunk]
        c0 = compose(composer, part, retrieve(retriever, part, n_ret, mode))    # (b, J·K, d)
        cache.update({t.task_id: c for t, c in zip(part, c0.cpu())})
    return cache


def lopd_step(student, composer, tokenizer, tasks, retriever, c0_cache, beta, opts, cfg: LOPDConfig,
              sample_cfg: SampleConfig, make_env=ToolWorld, tools=None):
    """One iteration of Algorithm 1 on `tasks`. opts = (student optimizer, composer optimizer or None).
    Returns (β, metrics, episodes); a non-finite loss skips the update and β, and says so in the metrics."""
    # 1-2. on-policy student rollouts from the task alone (eq. 1); r_i from the verifier, A_i = 2 r_i − 1 later
    with runtime.gathered(student):
        eps = rollout(student, tokenizer, tasks, sample_cfg, make_env, tools)
    rewards = torch.tensor([e.reward for e in eps])                                       # (B,)
    # 3. retrieve J experiences per task (eq. 16)
    exps = retrieve(retriever, tasks, cfg.n_ret, cfg.retrieval)
    # whole-batch normalisers (summed over ranks under torchrun: the loss is then this rank's share of the total)
    n_tokens, n_traj = runtime.all_sum(sum(sum(e.mask) for e in eps), len(eps))
    student.train()
    totals, finite = {}, True
    for mb in micro_batches(eps, cfg.micro_batch, cfg.token_budget):
        idle = mb.stop == mb.start      # torchrun: a rank's extra micro-batch re-scores one episode with weight 0
        mb = slice(0, 1) if idle else mb
        with torch.set_grad_enabled(not cfg.freeze_composer):
            latents = compose(composer, tasks[mb], exps[mb])                              # (b, J·K, d) c_φ
        c0 = torch.stack([c0_cache[t.task_id] for t in tasks[mb]]).to(latents)           # (b, J·K, d) sg[c_φ0]
        # 4-5. both models score the same ids; eq. (13) at fixed β. Each micro-batch carries its share b / B of the
        # constant β·m, so that the micro-batch losses (and their logged values) sum to eq. (13) of the whole batch
        share = cfg.margin * len(eps[mb]) / n_traj
        loss, m = micro_batch_objective(student, composer, tokenizer, eps[mb], latents, c0, rewards[mb], beta, share,
                                        n_tokens, n_traj, cfg, make_env, tools, sample_cfg.enable_thinking)
        loss, m = (0.0 * loss, {}) if idle else (loss, m)
        finite &= bool(torch.isfinite(loss))
        if finite:
            loss.backward()
        for k, v in m.items():                                                            # micro-batch parts add
            totals[k] = totals.get(k, 0.0) + v
    student.eval()
    # every part adds up over micro-batches and ranks, "loss/total" included: it is the sum of the losses
    # backpropagated (eq. 13 of the whole batch)
    parts = ("loss/distill", "privilege/delta", "loss/anchor", "loss/total")
    totals.update(zip(parts, runtime.all_sum(*(totals[k] for k in parts))))
    finite = runtime.all_true(finite)
    # 6. AdamW steps, gradients clipped per model; 7. the dual step β ← [β + η_β (m − Δ)]₊
    finite = optimizer_step(opts, student, composer, cfg.clip, finite)
    if finite:
        beta = losses.dual_step(beta, totals["privilege/delta"], cfg.margin, cfg.dual_lr)
    behaviour = summarize_all(eps)
    metrics = {"reward/student": behaviour["reward"], **totals, "dual/beta": beta, "skipped": int(not finite),
               "tokens": n_tokens, **{"behaviour/" + k: v for k, v in behaviour.items() if k != "reward"}}
    return beta, metrics, eps


def micro_batches(eps, size: int, token_budget: int = 0) -> list[slice]:
    """The forward/backward passes of a batch, as consecutive slices of its episodes: `size` episodes each, or with
    a token budget as many as fit in it, counted as a padded batch (rows × the longest episode; at least one).
    Losses are normalised by the whole batch's counts, so any split gives the same gradient. Under torchrun every
    rank runs as many as the busiest one (a sharded model's forward is a collective): the extra ones are empty."""
    if not token_budget:
        out = [slice(i, i + size) for i in range(0, len(eps), size)]
    else:
        out, start, longest = [], 0, 0
        for i, e in enumerate(eps):
            longest = max(longest, len(e.ids))
            if i > start and longest * (i + 1 - start) > token_budget:   # e does not fit: it opens the next one
                out.append(slice(start, i))
                start, longest = i, len(e.ids)
        out.append(slice(start, len(eps)))
    busiest = int(runtime.all_max(float(len(out))))
    return out + [slice(0, 0)] * (busiest - len(out))


def micro_batch_objective(student, composer, tokenizer, eps, latents, c0, rewards, beta, share, n_tokens, n_traj,
                          cfg: LOPDConfig, make_env, tools, enable_thinking):
    """Algorithm 1, steps 4-5 for one micro-batch: both models score the SAME sampled ids (eq. 8), then eq. (13)
    at fixed β, whose one backward gives ∇θ (through p_S) and ∇φ (through p_T and the anchor). -> (loss, metrics).
    cfg.loss_chunk > 0: the forwards return hidden states and the loss applies the LM heads a chunk of rows at a
    time (memory bounded by the chunk, not by the conversation; `runtime.lm_head_bypassed`). 0: full logits and
    the readable `losses.lopd_objective`; the two agree in value and gradient (tests/test_losses.py)."""
    chunked = runtime.lm_head_bypassed(student, composer.peft) if cfg.loss_chunk else contextlib.nullcontext()
    with chunked:
        # 4. the teacher re-scores exactly the student's ids behind c_φ; the student behind its own prompt
        ls, lt, ids, omega = student_teacher_logits(student, composer, tokenizer, eps, latents, make_env, tools,
                                                    enable_thinking)          # (b, Tc, V), or (b, Tc, d) chunked
        ref = None                                                             # eq. (11): δ against the student
        if cfg.privilege_against == "phi0":       # option: the teacher behind φ0's latents (losses.py, deviation 6)
            with torch.no_grad():
                ref = teacher_logits(composer, tokenizer, eps, c0, make_env, tools, enable_thinking)
    # 5. eq. (13)
    rest = (ids, omega, rewards.to(ls.device), beta, share, None if cfg.freeze_composer else latents, c0, cfg.anchor,
            cfg.top_m, n_tokens, cfg.delta_per, n_traj)
    if not cfg.loss_chunk:
        return losses.lopd_objective(ls, lt, *rest, ref, kl_per=cfg.kl_per)
    heads = (runtime.lm_head(student), runtime.lm_head(composer.peft), runtime.lm_head(composer.peft))
    return losses.lopd_objective_from_hidden(ls, lt, heads, *rest, h_ref=ref, chunk=cfg.loss_chunk, kl_per=cfg.kl_per)


def optimizer_step(opts, student, composer, clip: float, ok: bool = True) -> bool:
    """Clip and step each optimizer. If the loss (ok=False) or any gradient is non-finite, drop all gradients
    (also those of micro-batches that did finish) and return False."""
    groups = [(opts[0], list(student.parameters()))]
    if opts[1] is not None:
        groups.append((opts[1], composer.trainable_parameters()))
    ok = runtime.all_true(ok)
    for _, params in groups:           # replicated parameters: gradients summed over ranks (no-op in one process)
        runtime.sync_grads(params)
    norms = [torch.nn.utils.clip_grad_norm_(params, clip) for _, params in groups]   # global norms under FSDP2
    ok = ok and all(bool(torch.isfinite(n)) for n in norms)
    for opt, _ in groups:
        if ok:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return ok
