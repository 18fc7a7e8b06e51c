"""LOPD, Algorithm 1: on-policy multi-turn rollouts and the bookkeeping the losses need (paper §3.1, §3.3).

This file holds what one LOPD iteration does with a model: roll the student out in the environment on-policy
(eq. 1), keeping the exact sampled token ids, the assistant-token mask ω and the sampling-time log-probs, so that
the teacher can later re-score *exactly* those ids behind its privileged prompt (eq. 8).

    python -m pytest tests/test_rollout.py -q

Notation: B episodes in a batch, T tokens, V vocabulary.

A conversation is one flat token sequence:

    [prompt: system + user + "<|im_start|>assistant\\n"] [reply 1 ... <|im_end|>] [observation 1] [reply 2 ...] ...
     ω = 0                                                ω = 1                     ω = 0           ω = 1

where an observation is the chat template's rendering of the tool results plus the next assistant header. Replies
are never re-tokenized: the ids that were sampled are the ids that are scored (DESIGN.md §3).

Deviations from the paper
-------------------------
1. Generation uses Hugging Face `generate` (KV cache within a turn, left padding, explicit attention masks), not
   SGLang/vLLM; each turn re-encodes the conversation so far.
2. A reply cut off by the per-turn token budget ends the episode (the reply is kept, unterminated).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from envs import DONE_TEXT, ToolWorld, format_call, lite_trace


# ----------------------------------------------------------------------------------------------------------------
# Chat rendering: prompt ids and observation ids from the tokenizer's own chat template
# ----------------------------------------------------------------------------------------------------------------
def prompt_ids(tokenizer, messages, tools=None, enable_thinking=False) -> list[int]:
    """Token ids of the first messages plus the assistant generation header."""
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=enable_thinking)
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
    rows = [e.metrics() for e in episodes]
    return {k: sum(r[k] for r in rows) / max(1, len(rows)) for k in rows[0]} if rows else {}


def _record_step(ep: Episode, env: ToolWorld, reply: str, n_new: int) -> list[str]:
    """Execute one reply in the environment and update the episode's counts; returns the observations."""
    ep.steps += 1
    ep.first_len = ep.first_len or n_new
    n_before = len(env.trace)
    result = env.step(reply)
    for name, args, _ in env.trace[n_before:]:
        key = name + json.dumps(args, sort_keys=True)
        ep.repeated_calls += key in ep.seen_calls
        ep.seen_calls.add(key)
    ep.tool_calls += result.n_calls
    ep.errors += result.errors
    ep.done = result.done
    return result.observations


def _finish(ep: Episode, env: ToolWorld):
    ep.done, ep.reward, ep.trace = True, env.reward(), lite_trace(env.trace)


def scripted_episode(tokenizer, env: ToolWorld, task, calls, tools=None) -> Episode:
    """Encode a scripted episode (a demonstration) with the same bookkeeping as a sampled one."""
    ep = Episode(task)
    ep.add(prompt_ids(tokenizer, env.reset(task), tools), sampled=False)
    ep.prompt_len = len(ep.ids)
    for reply in [format_call(n, a) for n, a in calls] + [DONE_TEXT]:
        ids = reply_ids(tokenizer, reply)
        ep.add(ids, sampled=True)
        obs = _record_step(ep, env, reply, len(ids))
        if ep.done:
            break
        ep.add(observation_ids(tokenizer, obs), sampled=False)
    _finish(ep, env)
    return ep


# ----------------------------------------------------------------------------------------------------------------
# Batched multi-turn rollouts with Hugging Face generate
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class SampleConfig:
    temperature: float = 0.7      # B.2; 0 = greedy
    top_p: float = 0.95
    top_k: int = 20
    max_new_tokens: int = 64      # per reply
    max_len: int = 768            # whole conversation; an episode that reaches it ends
    batch_size: int = 64          # episodes generated together


def left_pad(rows, pad_id, device):
    """(B, L) ids and attention mask, left-padded so that every row's next token is at position L."""
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)            # (B, L)
    att = torch.zeros((len(rows), L), dtype=torch.long)                   # (B, L)
    for i, r in enumerate(rows):
        ids[i, L - len(r):] = torch.tensor(r)
        att[i, L - len(r):] = 1
    return ids.to(device), att.to(device)


@torch.no_grad()
def generate_replies(model, tokenizer, contexts, cfg: SampleConfig, embed_fn=None):
    """Sample one reply per context. Returns per row (new ids, their log-probs at temperature 1, finished?).

    `embed_fn(ids, attention_mask) -> inputs_embeds` lets a caller replace placeholder embeddings with latents
    (inject.py); generate then returns only the new tokens."""
    device = next(model.parameters()).device
    ids, att = left_pad(contexts, tokenizer.pad_token_id, device)        # (B, L)
    sample = cfg.temperature > 0
    kw = dict(attention_mask=att, max_new_tokens=cfg.max_new_tokens, do_sample=sample,
              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
              output_logits=True, return_dict_in_generate=True)
    if sample:
        kw.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    else:
        kw.update(temperature=None, top_p=None, top_k=None)
    if embed_fn is None:
        out = model.generate(input_ids=ids, **kw)
        new = out.sequences[:, ids.shape[1]:]                             # (B, N)
    else:
        out = model.generate(inputs_embeds=embed_fn(ids, att), **kw)
        new = out.sequences                                               # (B, N): only new tokens
    logits = torch.stack(out.logits, 1).float()                           # (B, N, V) raw, before sampling warpers
    logp = F.log_softmax(logits, -1).gather(-1, new[:, :, None])[..., 0]  # (B, N)
    rows = []
    for i in range(len(contexts)):
        eos = (new[i] == tokenizer.eos_token_id).nonzero()
        n = int(eos[0]) + 1 if len(eos) else new.shape[1]
        rows.append((new[i, :n].tolist(), logp[i, :n].tolist(), bool(len(eos))))
    return rows


def rollout(model, tokenizer, tasks, cfg: SampleConfig, make_env=ToolWorld, tools=None, prompt_fn=None,
            embed_fn=None, progress=None) -> list[Episode]:
    """Roll out one episode per task (eq. 1), batched across tasks, turn by turn.

    prompt_fn(tokenizer, messages) -> ids overrides the prompt (the teacher's latent prompt, inject.py);
    embed_fn(ids, attention_mask, rows) then fills the placeholder span, where rows index `tasks`."""
    episodes = []
    was_training = model.training
    model.eval()
    for start in range(0, len(tasks), cfg.batch_size):
        chunk = tasks[start:start + cfg.batch_size]
        envs = [make_env() for _ in chunk]
        eps = [Episode(t) for t in chunk]
        for ep, env in zip(eps, envs):
            msgs = env.reset(ep.task)
            ep.add(prompt_fn(tokenizer, msgs) if prompt_fn else prompt_ids(tokenizer, msgs, tools), sampled=False)
            ep.prompt_len = len(ep.ids)
        while not all(ep.done for ep in eps):
            live = [i for i, ep in enumerate(eps) if not ep.done]
            bound = None if embed_fn is None else (  # tell embed_fn which tasks the rows are
                lambda ids, att, rows=[start + i for i in live]: embed_fn(ids, att, rows))
            replies = generate_replies(model, tokenizer, [eps[i].ids for i in live], cfg, bound)
            for i, (new, lp, finished) in zip(live, replies):
                ep, env = eps[i], envs[i]
                ep.add(new, sampled=True, logps=lp)
                text = tokenizer.decode(new, skip_special_tokens=False).replace(tokenizer.eos_token, "")
                obs = _record_step(ep, env, text, len(new))
                if ep.done or not finished:
                    _finish(ep, env)
                    continue
                ep.add(observation_ids(tokenizer, obs), sampled=False)
                if len(ep.ids) + cfg.max_new_tokens > cfg.max_len:
                    _finish(ep, env)
        episodes += eps
        if progress is not None:
            progress.update(len(chunk))
    model.train(was_training)
    return episodes
