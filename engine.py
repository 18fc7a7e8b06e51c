"""The engine every method shares: chat rendering, episodes, generation and rollouts, scoring, the micro-batch
loop and the optimizer step (paper §3.1, eq. 1 and eq. 8's "the same sampled ids"). It knows no method: lopd.py
(Algorithm 1) and baselines.py build their losses on it, and a faster generator plugs in at `generate_replies`.

    prompt_ids / observation_ids   the chat template's own rendering of a prompt and of tool results
    Chat                           a run's tokenizer, environment and thinking mode, made once; the student's,
                                   the latent teacher's and the text teacher's prompts
    Episode / rollout              on-policy episodes from the task alone (eq. 1): the exact sampled ids, the
                                   assistant-token mask ω, the sampling-time log-probs, the reward
    Conversations / sample_next    generation: each conversation's KV cache kept across turns, the prompt prefix a
                                   batch shares computed once, a reply sampled on the device into a cache with room
                                   for it (`PreallocatedLayer`); Hugging Face's sampling (temperature, top-k, top-p)
    student_logits / _logprobs     a model's scores of an episode's own ids behind a prompt (eq. 8's p_S)
    micro_batches / accumulate     the one forward/backward loop of every method's step: micro-batches by rollouts
                                   and a token budget, whole-batch normalisers, idle passes under torchrun
    optimizer_step                 clip and step each model, or drop a non-finite update

    python -m pytest tests/test_rollout.py tests/test_scale.py -q

Notation: B episodes in a batch, T tokens, V vocabulary.

A conversation is one flat token sequence:

    [prompt: system + user + "<|im_start|>assistant\\n"] [reply 1 ... <|im_end|>] [observation 1] [reply 2 ...] ...
     ω = 0                                                ω = 1                     ω = 0           ω = 1

where an observation is the chat template's rendering of the tool results plus the next assistant header. Replies
are never re-tokenized: the ids that were sampled are the ids that are scored (docs/design.md, "Correctness traps").

Deviations from the paper
-------------------------
1. Generation is a small KV-cached sampler on the Hugging Face model (`Conversations`: left padding, explicit
   attention masks and positions, Hugging Face's warpers), not SGLang/vLLM. Each conversation keeps its cache
   across turns and the prompt prefix a batch shares is computed once, as a serving engine's prefix cache would.
2. A reply cut off by the per-turn token budget ends the episode (the reply is kept, unterminated), and so does a
   conversation whose next reply might not fit its budget (`SampleConfig.max_len`, train.py --max-len).
"""
from __future__ import annotations

import inspect
import json
import os
import random
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, DynamicLayer

import inject
import losses
from runtime import memory, models, parallel, serving


# ----------------------------------------------------------------------------------------------------------------
# Chat rendering: prompt ids and observation ids from the tokenizer's own chat template
# ----------------------------------------------------------------------------------------------------------------
# Tools in the prompt (`chat_text`, used by every prompt: the student's, the teacher's, the baselines'). The tool
# schemas go to the chat template as `tools=`, which Qwen3's renders in its system turn. Some templates drop `tools=`
# silently (SmolLM2's, most base-model templates); the model then never learns that tools exist. `template_lists_tools`
# renders the same messages with and without a tool: equal text means the template ignores them. Such a template gets
# the tools in the system message as the official code writes them for every model: a "# Tools" block with one JSON
# schema a line inside <tools></tools>, and the <tool_call>{"name": ..., "arguments": ...}</tool_call> reply format.
def tools_block(tools) -> str:
    """The tool list and the reply format as text, in the official code's layout (JSON schema a line)."""
    schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + schemas +
            "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


def with_tools_in_system(messages, tools) -> list[dict]:
    """A copy of `messages` whose system message ends with `tools_block` (a system message is added if none)."""
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + tools_block(tools)}, *messages[1:]]
    return [{"role": "system", "content": tools_block(tools)}, *messages]


_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "description": "d",
                                                 "parameters": {"type": "object", "properties": {}}}}
_LISTS_TOOLS = {}       # chat template text -> does it render `tools=`? (checked once per template)


def template_lists_tools(tokenizer) -> bool:
    """Does the chat template render `tools=`? The same two messages, rendered with and without a tool."""
    key = str(tokenizer.chat_template)
    if key not in _LISTS_TOOLS:
        msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        render = lambda tools: tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False,  # noqa: E731
                                                             add_generation_prompt=True)
        _LISTS_TOOLS[key] = render([_PROBE_TOOL]) != render(None)
        if not _LISTS_TOOLS[key]:
            print("chat template ignores tools=: the tool schemas and the <tool_call> format go into the system "
                  "prompt (engine.tools_block, as the official code writes them)")
    return _LISTS_TOOLS[key]


def chat_text(tokenizer, messages, tools=None, enable_thinking=False) -> str:
    """The chat template's text of `messages` plus the assistant header; tools by `tools=`, or in the system
    message when the template ignores `tools=`."""
    if tools and not template_lists_tools(tokenizer):
        messages, tools = with_tools_in_system(messages, tools), None
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=enable_thinking)


def prompt_ids(tokenizer, messages, tools=None, enable_thinking=False) -> list[int]:
    """Token ids of the first messages plus the assistant generation header. The tools go to the template, or
    into the system message if the template ignores `tools=` (`chat_text`)."""
    text = chat_text(tokenizer, messages, tools, enable_thinking)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def latent_prompt_ids(tokenizer, messages, n: int, framing=inject.AGENTIC_FRAMING, tools=None,
                      enable_thinking=False) -> tuple[list[int], int]:
    """The teacher's prompt (eq. 17): `messages` with the framed sentinel in the first user message
    (inject.latent_messages), rendered like `prompt_ids`, then split around n placeholder ids
    (inject.latent_prompt_ids). -> (ids, start): ids[start:start + n] are the placeholders."""
    text = chat_text(tokenizer, inject.latent_messages(messages, framing), tools, enable_thinking)
    return inject.latent_prompt_ids(tokenizer, text, n)


_MARK = "\x00REPLY\x00"


def observation_text(tokenizer, results, enable_thinking=False, user: str | None = None) -> str:
    """The template's text between the end of a reply (after its end-of-turn token) and the next reply: the tool
    messages, then the next user message where the reply ended a turn of a multi-turn task (`StepResult.user`),
    plus the next assistant header. Found by rendering a dummy conversation and cutting after the reply."""
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]
    msgs += [{"role": "tool", "content": r} for r in results]
    msgs += [] if user is None else [{"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=enable_thinking)
    cut = _MARK + tokenizer.eos_token
    if cut not in text:
        raise ValueError(f"chat template does not end an assistant turn with eos_token {tokenizer.eos_token!r}")
    return text[text.index(cut) + len(cut):]


def observation_ids(tokenizer, results, enable_thinking=False, user: str | None = None) -> list[int]:
    return tokenizer(observation_text(tokenizer, results, enable_thinking, user),
                     add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------------------------------------------
# A run's chat: the tokenizer, the environment and how its prompts read, in one object
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Chat:
    """Everything a prompt is rendered from, made once per run (train.py `chat_of`): the tokenizer, the
    environment factory (called for a fresh environment per episode), `thinking` (the chat template's Qwen3 thinking
    mode) and the framing around the teacher's latent block (A.5), read off one instance. The tools (JSON schemas
    for the template, or None) come with each task's first messages (`begin`): a world may list different tools per
    task (BFCL, EnvScaler). The project's three prompts:

        prompt(messages, tools)                      the task alone: the student's (eq. 1)
        latent_prompt(messages, tools, n)            n placeholder ids where c_φ goes: the teacher's (eq. 17)
        context_prompt(messages, tools, text, ...)   a trajectory as text: OPSD's and SDPO's teachers (baselines.py)
    """
    tokenizer: object
    make_env: object                       # () -> a fresh environment (worlds/common.py: Environment)
    thinking: bool = False
    framing: tuple = field(init=False, default=())

    def __post_init__(self):
        self.framing = self.make_env().framing   # read once: every environment of a run frames latents alike

    def begin(self, task) -> tuple[list[dict], list | None]:
        """The task's first chat messages (system, user) and the tools its environment lists, from a fresh one."""
        env = self.make_env()
        messages = env.reset(task)
        return messages, env.tools

    def prompt(self, messages, tools) -> list[int]:
        return prompt_ids(self.tokenizer, messages, tools, self.thinking)

    def observation(self, results, user: str | None = None) -> list[int]:
        """The ids between one reply and the next: tool results, then a user message where a turn ended."""
        return observation_ids(self.tokenizer, results, self.thinking, user)

    def latent_prompt(self, messages, tools, n: int) -> tuple[list[int], int]:
        """(ids, start): the prompt with n placeholder ids at ids[start:start + n] (`latent_prompt_ids`)."""
        return latent_prompt_ids(self.tokenizer, messages, n, self.framing, tools, self.thinking)

    def context_prompt(self, messages, tools, text: str, template: str, where: str) -> list[int]:
        """The prompt with TEXT (a trajectory, or Skill-SD's skill) where LOPD's teacher has latents (text teachers).

        where="system": template.format(text=text) is appended to the system message; "user": to the first user
        message; "span": the text's own ids fill the framed placeholder span of A.5, exactly where LOPD's latents
        go. The toy backbone learned to read a reference only there (worlds/toy_backbone.py, "in-context reading")."""
        if where == "span":
            ref = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            ids, s = self.latent_prompt(messages, tools, len(ref))
            return ids[:s] + ref + ids[s + len(ref):]
        msgs = [dict(m) for m in messages]
        i = next(k for k, m in enumerate(msgs) if m["role"] == {"system": "system", "user": "user"}[where])
        msgs[i]["content"] += ("\n\n" if where == "system" else "") + template.format(text=text)
        return self.prompt(msgs, tools)


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
    end: str = ""              # why it ended, one of worlds.common.ENDS: the world's reason, or a budget's
    seen_calls: set = field(default_factory=set, repr=False)

    def add(self, ids, sampled: bool, logps=None):
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.logps += logps if logps is not None else [0.0] * len(ids)

    RECORDED = ("ids", "mask", "logps", "prompt_len", "reward", "steps", "tool_calls", "repeated_calls", "first_len",
                "errors", "trace", "end")

    def record(self) -> dict:
        """The episode as a JSON line (OUT/base_rollouts.jsonl): its task's id and the RECORDED fields."""
        return {"task_id": self.task.task_id, **{k: getattr(self, k) for k in self.RECORDED}}

    @classmethod
    def from_record(cls, rec: dict, task) -> "Episode":
        """The episode a `record` was made of, on `task` (the one rec["task_id"] names)."""
        return cls(task, **{k: v for k, v in rec.items() if k != "task_id"})

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
    return _mean_rows(parallel.gather([e.metrics() for e in episodes]))


def _record_step(ep: Episode, env, reply: str, n_new: int):
    """Execute one reply in the environment and update the episode's counts; returns its StepResult."""
    n_before = len(env.trace)
    return _count_step(ep, env, env.step(reply), n_before, n_new)


def _step_all(envs_, replies) -> list:
    """env.step(reply) for each live episode. An environment that runs programs to verify them (CodeWorld sets
    `parallel_steps`) steps in threads, one sandboxed process each, up to the core count; the tool world in order."""
    if envs_ and envs_[0].parallel_steps:
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            return list(pool.map(lambda pair: pair[0].step(pair[1]), zip(envs_, replies)))
    return [env.step(reply) for env, reply in zip(envs_, replies)]


def _count_step(ep: Episode, env, result, n_before: int, n_new: int):
    """Update the episode's counts from a step's result (the calls after env.trace[n_before]); -> the result."""
    ep.steps += 1
    ep.first_len = ep.first_len or n_new
    for name, args, _ in env.trace[n_before:]:
        key = _call_key(name, args)
        ep.repeated_calls += key is not None and key in ep.seen_calls
        ep.seen_calls.add(key)
    ep.tool_calls += result.n_calls
    ep.errors += result.errors
    ep.done = result.done
    return result


def _call_key(name, args) -> str | None:
    """What makes two calls the same call (Table 3's repeated calls): the name and the arguments, written
    canonically. A world's trace is its own to fill, so arguments JSON cannot sort or write (keys of mixed types,
    bytes) fall back on repr, and a call that not even repr can write (an int past the digit limit) is None: never a
    repeat, never an exception."""
    try:
        return f"{name}{json.dumps(args, sort_keys=True, default=repr)}"
    except (TypeError, ValueError, RecursionError):
        try:
            return f"{name}{args!r}"
        except (ValueError, RecursionError):
            return None


def _finish(ep: Episode, env, end: str):
    text = env.trace_text()                                       # the bank's experience (A.3)
    ep.done, ep.end, ep.reward, ep.trace = True, end, env.reward(), text


def _end(result, finished: bool = True) -> str:
    """Why a reply ends its episode, or "" where it goes on: cut at the reply budget (whatever the world made of the
    cut reply), else the world's reason (common.ENDS; "world" where it names none)."""
    if not finished:
        return "token budget"
    return (result.end or "world") if result.done else ""


def scripted_episode(chat: Chat, task, replies, prompt_fn=None) -> Episode:
    """Encode a scripted episode (a demonstration) with the same bookkeeping as a sampled one: `replies` are the
    assistant's texts in order (worlds.common.scripted_replies writes them from tool calls), played until the
    environment ends the episode. prompt_fn(messages, tools) -> ids overrides the prompt, as in `rollout`."""
    ep, env = Episode(task), chat.make_env()
    msgs = env.reset(task)
    ep.add(prompt_fn(msgs, env.tools) if prompt_fn else chat.prompt(msgs, env.tools), sampled=False)
    ep.prompt_len = len(ep.ids)
    result = None
    for reply in replies:
        ids = reply_ids(chat.tokenizer, reply)
        ep.add(ids, sampled=True)
        result = _record_step(ep, env, reply, len(ids))
        if ep.done:
            break
        ep.add(chat.observation(result.observations, result.user), sampled=False)
    # a script that runs out of replies before the world ends the episode stops as a reply without a call would
    _finish(ep, env, (_end(result) if result is not None else "") or "no call")
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
    batch_size: int = 64          # episodes generated together (train.py --gen-batch, or the memory plan's)
    sort_by_length: bool = False  # batch tasks of similar length together (real models: less left padding)
    generator: object = None      # a serving engine that samples the replies (--engine vllm); None: ours
    compile_decode: bool = False  # one-token decode steps through torch.compile (`compiled`; train.py --compile-decode)


def left_pad(rows, pad_id, device):
    """(B, L) ids and attention mask, left-padded so that every row's next token is at position L."""
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)            # (B, L)
    att = torch.zeros((len(rows), L), dtype=torch.long)                   # (B, L)
    for i, r in enumerate(rows):
        ids[i, L - len(r):] = torch.tensor(r)
        att[i, L - len(r):] = 1
    return ids.to(device), att.to(device)


def sample_next(scores, cfg: SampleConfig):
    """The next token of each row from its logits (B, V) fp32: argmax at temperature 0; otherwise Hugging Face's
    sampling, in its order: divide by the temperature, keep the top-k, keep the top-p nucleus, draw from the
    softmax. -> (B,) ids.

    After the top-k every other token has probability 0, so the nucleus is found among the k candidates: k scores
    are sorted (torch.topk returns them in order), not V, and the same tokens are kept. Scores tied with the k-th
    one are all kept by the top-k, as before; the nucleus then sums the k that torch.topk returned (the full sort
    ordered such ties as torch.sort happened to). Without a top-k the whole vocabulary is sorted, as before."""
    if cfg.temperature <= 0:
        return scores.argmax(-1)                                              # (B,)
    s = scores / cfg.temperature if cfg.temperature != 1.0 else scores       # (B, V)
    if cfg.top_k:
        top = torch.topk(s, min(cfg.top_k, s.shape[-1]))[0]                   # (B, k) descending
        s = s.masked_fill(s < top[..., -1:], float("-inf"))                   # the top-k
        if cfg.top_p < 1.0:
            s = s.masked_fill(s < nucleus_floor(top.flip(-1), cfg.top_p), float("-inf"))
    elif cfg.top_p < 1.0:
        s = s.masked_fill(s < nucleus_floor(torch.sort(s)[0], cfg.top_p), float("-inf"))
    return draw(s.softmax(-1))                                                # (B,)


def nucleus_floor(ascending, top_p: float):
    """The lowest score the top-p nucleus keeps, from candidate scores sorted ascending (B, n): Hugging Face's
    rule drops the low tail whose cumulative probability is at most 1 − top_p and always keeps the most likely
    token. -> (B, 1)"""
    drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p                      # (B, n) the tail outside the nucleus
    drop[..., -1:] = False                                                    # the most likely token always stays
    return ascending.masked_fill(drop, float("inf")).amin(-1, keepdim=True)   # (B, 1)


def draw(probs):
    """One index per row of (B, V) probabilities, drawn as torch.multinomial(probs, 1) draws it: its own method for
    one sample (the argmax of p / q, q ~ Exp(1) from the device's default generator), the same random numbers and
    the same index, without its checks of the probabilities, which read two values back to the host at every call
    (tests/test_decode.py checks the equality). -> (B,)"""
    q = torch.empty_like(probs).exponential_(1)                               # (B, V)
    return (probs / q).argmax(-1)                                             # (B,)


END_CHECK = 8   # decode: tokens between two looks, from the host, at whether every row has ended (see decode)


class PreallocatedLayer(DynamicLayer):
    """One full-attention layer's KV cache (B, heads, L, hd) with room behind it for a reply's tokens.

    transformers' DynamicLayer appends by concatenation, which copies the layer's whole cache: O(L) a token. Here
    `reserve(n)` allocates room for n more columns once a reply (one copy of the cache), and `update` writes each
    token into it in place; attention reads views of the buffers' first L columns. A feed that does not fit (a
    prompt, an observation) is concatenated as DynamicLayer does. What runs between turns assigns new tensors to
    keys and values (batch_repeat_interleave, batch_select_indices, crop, Conversations._compact); the room goes
    with them until the next reserve. transformers' StaticCache also writes in place, but into one buffer of a
    fixed max_cache_len that attention reads whole, and it has none of those batch operations."""

    def lazy_initialization(self, *args, **kwargs):      # its arguments differ across transformers 5.x releases
        super().lazy_initialization(*args, **kwargs)
        self.room = None        # (keys buffer, values buffer, the views of them that keys and values were set to)

    def free(self) -> int:
        """Columns that can be written in place: 0 once keys or values are no longer views of the buffers."""
        if not self.is_initialized or self.room is None or self.room[2] is not self.keys or \
                self.room[3] is not self.values:
            return 0
        return self.room[0].shape[-2] - self.keys.shape[-2]

    def reserve(self, n: int):
        """Room for n more columns, the cache copied into buffers of L + n columns unless it has the room."""
        if not self.is_initialized or self.keys.dim() < 4 or self.free() >= n:
            return
        B, heads, L, hd = self.keys.shape
        buffers = [t.new_empty((B, heads, L + n, t.shape[-1])) for t in (self.keys, self.values)]   # (B, h, L+n, hd)
        for buf, t in zip(buffers, (self.keys, self.values)):
            buf[:, :, :L] = t
        self._set(*buffers, L)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized or self.free() < key_states.shape[-2]:
            return super().update(key_states, value_states, *args, **kwargs)          # concatenated
        L, n = self.keys.shape[-2], key_states.shape[-2]
        kbuf, vbuf = self.room[:2]
        kbuf[:, :, L:L + n], vbuf[:, :, L:L + n] = key_states, value_states          # (B, h, n, hd) in place
        self._set(kbuf, vbuf, L + n)
        return self.keys, self.values

    def _set(self, kbuf, vbuf, L: int):
        self.keys, self.values = kbuf[:, :, :L], vbuf[:, :, :L]                       # (B, h, L, hd) views
        self.room = (kbuf, vbuf, self.keys, self.values)


def kv_cache(model):
    """An empty KV cache for `model`: transformers' DynamicCache of its config (sliding-window layers as there),
    every plain full-attention layer a `PreallocatedLayer`."""
    cache = DynamicCache(config=inner_model(model).config)
    cache.layers = [PreallocatedLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class Conversations:
    """The KV caches of the conversations that generate together, kept from turn to turn.

    A turn feeds each conversation only what its cache lacks: the prompt once, then the last reply's final token
    and the observation. So a turn costs its new tokens, not the whole conversation again, and the prompt part that
    every conversation of the batch shares (the system prompt and the tool schemas) is computed once, for one row,
    then copied to every row. The layout is left-padded: each feed ends in the last column, whose logits predict
    every row's next token. Padding has attention mask 0 and no position of its own (position ids count each
    row's real tokens), so every row sees exactly its own conversation. Keys are cached after their rotary
    embedding, so squeezing the padding out between turns (`_compact`) changes no key.

    `embed_fn(ids, attention_mask) -> inputs_embeds` fills the prompts' placeholder span with latents (inject.py);
    it is called once, on the left-padded prompts, and the latents then live in the cache."""

    def __init__(self, model, tokenizer, embed_fn=None):
        self.model, self.pad, self.embed_fn = model, tokenizer.pad_token_id, embed_fn
        self.device = next(model.parameters()).device
        self.cache, self.mask = None, None      # the model's cache of B rows; (B, L) 1 on each row's real tokens
        self.keys, self.fed = [], []            # per row: the caller's key, the ids its cache holds
        self.cache_arg = cache_argument(model)
        self.step_model = model                 # what runs one-token steps (`decode`: compiled with --compile-decode)

    def forward(self, ids=None, embeds=None):
        """Feed (B, n) new ids (or embeddings) behind the cache, whose mask already covers them. -> (B, V) fp32
        logits of each row's last column."""
        n = (ids if embeds is None else embeds).shape[1]
        pos = (self.mask.cumsum(1) - 1).clamp(min=0)[:, -n:]                              # (B, n)
        model = self.step_model if n == 1 and embeds is None else self.model
        out = model(input_ids=ids, inputs_embeds=embeds, attention_mask=self.mask, position_ids=pos,
                    use_cache=True, logits_to_keep=1, **{self.cache_arg: self.cache})
        self.cache = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
        return out.logits[:, -1].float()                                      # (B, V)

    def start(self, keys, prompts):
        """The first feed: the prompts' shared prefix once, for one row, then each row's own rest. -> (B, V)."""
        self.keys, self.fed = list(keys), [list(p) for p in prompts]
        self.cache = self.empty_cache()
        rows = self._prompt_vectors(prompts)                       # per row (n_i,) ids or (n_i, d) embeddings
        p = _shared_prefix(rows)
        B, embeds = len(rows), self.embed_fn is not None
        if p:
            self.mask = torch.ones((1, p), dtype=torch.long, device=self.device)          # (1, p)
            self.forward(**{"embeds" if embeds else "ids": rows[0][None, :p]})
            self.cache.batch_repeat_interleave(B)                                         # (B, heads, p, hd)
            self.mask = self.mask.expand(B, p)                                            # (B, p)
        return self._feed([r[p:] for r in rows])

    def empty_cache(self):
        """The KV cache a batch starts from (`kv_cache`)."""
        return kv_cache(self.model)

    def _prompt_vectors(self, prompts) -> list:
        if self.embed_fn is None:
            return [torch.tensor(p, device=self.device) for p in prompts]
        ids, att = left_pad(prompts, self.pad, self.device)                              # (B, L)
        embeds = self.embed_fn(ids, att)                                                  # (B, L, d)
        return [embeds[i, ids.shape[1] - len(p):] for i, p in enumerate(prompts)]       # (n_i, d) each

    def _feed(self, tails) -> torch.Tensor:
        """Append each row's new ids (or embeddings) behind its cache, left-padded to one width. -> (B, V)."""
        n, first = max(len(t) for t in tails), tails[0]
        new = first.new_zeros((len(tails), n) + tuple(first.shape[1:]))                 # (B, n) or (B, n, d)
        if first.dim() == 1:
            new.fill_(self.pad)
        mask = torch.zeros((len(tails), n), dtype=torch.long, device=self.device)         # (B, n)
        for i, t in enumerate(tails):
            new[i, n - len(t):], mask[i, n - len(t):] = t, 1
        self.mask = mask if self.mask is None else torch.cat([self.mask, mask], 1)         # (B, L + n)
        return self.forward(**{"embeds" if new.dim() == 3 else "ids": new})

    def resume(self, keys, contexts) -> torch.Tensor:
        """A later turn: keep the rows of `keys` (in their order), squeeze out padding, feed what each cache lacks."""
        rows = [self.keys.index(k) for k in keys]
        if rows != list(range(len(self.keys))):
            self.cache.batch_select_indices(torch.tensor(rows, device=self.device))
            self.mask, self.keys, self.fed = self.mask[rows], list(keys), [self.fed[i] for i in rows]
        self._compact()
        tails = []
        for i, ctx in enumerate(contexts):
            if ctx[:len(self.fed[i])] != self.fed[i] or len(ctx) == len(self.fed[i]):
                raise ValueError(f"conversation {self.keys[i]!r}: its context does not extend what it was fed")
            tails.append(torch.tensor(ctx[len(self.fed[i]):], device=self.device))
            self.fed[i] = list(ctx)
        return self._feed(tails)

    def _compact(self):
        """Move each row's cached tokens to the right end, in order, and drop the columns that hold only padding.
        Only for caches of full-attention layers (a sliding window keeps its own positions): others keep it."""
        if bool(self.mask.all()) or not self._full_attention():
            return                                                        # no padding, or a cache of another kind
        width = int(self.mask.sum(1).max())                               # the longest row's cached tokens
        order = torch.sort(self.mask, dim=1, stable=True).indices[:, -width:]             # (B, width) real last
        for layer in self.cache.layers:
            at = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, at), layer.values.gather(2, at)  # (B, heads, width, hd)
        self.mask = self.mask.gather(1, order)                                             # (B, width)

    def decode(self, logits, cfg: SampleConfig, eos: list) -> list:
        """Sample up to cfg.max_new_tokens per row from the logits of its last fed token; a row stops at its first
        end-of-turn id. -> per row (reply ids, their log-probs at temperature 1, ended with eos?).

        The reply stays on the device until it is done: ids and log-probs go into (B, T) tensors, the attention
        mask into columns made for the whole reply, keys and values into the room each layer reserved for it
        (`PreallocatedLayer`), so a token copies no cache and waits for no read-back. The host looks at whether
        every row has ended only every END_CHECK tokens: a read-back stalls the GPU's queue, and END_CHECK bounds
        the steps run in vain after the last end to END_CHECK − 1. Those steps are then undone: their columns
        are cropped from the cache and the mask, and the random generator is set back to where it stood after the
        last row's end, so the cache, the mask and the random stream are exactly those of stopping at once (the
        same seed, the same samples). A cache with sliding-window layers, which cannot be cropped past their
        window, is looked at every token instead. The Python lists (replies, `fed`) are filled once, at the end."""
        B, T, L, dev = logits.shape[0], cfg.max_new_tokens, self.mask.shape[1], self.device
        ends, gen = torch.tensor(eos, device=dev), default_generator(dev)
        ids = torch.zeros((B, T), dtype=torch.long, device=dev)                          # (B, T) sampled ids
        logps = torch.zeros((B, T), device=dev)                                          # (B, T) log π(a_t)
        kept = torch.zeros((B, T), dtype=torch.bool, device=dev)                         # (B, T) in the reply
        live = torch.ones(B, dtype=torch.bool, device=dev)                               # (B,)
        mask = torch.cat([self.mask, self.mask.new_zeros((B, T))], 1)                    # (B, L + T) 0 until fed
        self._reserve(T)
        self.step_model = compiled(self.model) if cfg.compile_decode else self.model
        every = END_CHECK if self._full_attention() else 1     # a sliding window cannot be cropped: look each token
        states = [None] * END_CHECK             # the generator's state before each of the last END_CHECK draws
        for t in range(T):
            states[t % END_CHECK] = gen.get_state()
            tok = sample_next(logits, cfg)                                                 # (B,)
            ids[:, t], kept[:, t] = tok, live
            logps[:, t] = F.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]         # (B,) log π(a_t)
            live = live & ~torch.isin(tok, ends)
            if t == T - 1 or (t % every == every - 1 and not bool(live.any())):
                break
            mask[:, L + t] = live                                  # the token goes into the cache of a live row
            self.mask = mask[:, :L + t + 1]                                                # (B, L + t + 1)
            logits = self.forward(ids=tok.masked_fill(~live, self.pad)[:, None])           # (B, V)
        lengths = kept.sum(1).tolist()
        last = max(lengths) - 1                      # the step at which the last row ended (or the last step)
        if t > last:                                 # steps run after every row had ended: undone
            self.cache.crop(last - t)
            self.mask = mask[:, :L + last]
            gen.set_state(states[(last + 1) % END_CHECK])
        replies = [r[:n] for r, n in zip(ids.tolist(), lengths)]
        self.fed = [f + r[:-1] for f, r in zip(self.fed, replies)]       # all but each reply's last token are cached
        return [(r, lp[:n], r[-1] in eos) for r, lp, n in zip(replies, logps.tolist(), lengths)]

    def _full_attention(self) -> bool:
        """Is every layer's cache a plain full-attention one, whose columns can be squeezed out or cropped?"""
        return all(type(layer) in (DynamicLayer, PreallocatedLayer) for layer in self.cache.layers)

    def _reserve(self, n: int):
        """Room for n more columns in every layer that can write in place (`PreallocatedLayer.reserve`)."""
        for layer in self.cache.layers:
            if isinstance(layer, PreallocatedLayer):
                layer.reserve(n)


def default_generator(device) -> torch.Generator:
    """torch's default random generator of `device`: the one `draw` takes its random numbers from."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    if device.type == "mps":
        return torch.mps._get_default_mps_generator()
    return torch.default_generator


_COMPILED = weakref.WeakKeyDictionary()    # model -> its compiled forward, made once (--compile-decode)


def compiled(model):
    """`model`'s forward compiled by torch.compile for one-token decode steps (--compile-decode), once per model.

    dynamic=True: the cache grows by a column a token, so a shape-specialised graph would recompile at every step;
    no CUDA graphs ("reduce-overhead"), which replay fixed shapes and addresses, not a cache that grows. Checked
    here on CPU: the toy backbone's ids and log-probs against the eager path (tests/test_decode.py). What only a
    GPU shows: the speed-up over eager decode, the graph breaks and recompiles at the paper's sizes (TORCH_LOGS=
    "graph_breaks,recompiles"), and that bf16 autocast compiles to the same replies within sampling noise."""
    if model not in _COMPILED:
        _COMPILED[model] = torch.compile(model, dynamic=True)
    return _COMPILED[model]


def cache_argument(model) -> str:
    """The name under which `model`'s forward takes a KV cache: `cache` in recent transformers 5.x releases,
    `past_key_values` before them."""
    inner = inner_model(model)
    return "cache" if "cache" in inspect.signature(type(inner).forward).parameters else "past_key_values"


def inner_model(model):
    """The transformers model that `model` runs (itself, or the one inside a PEFT wrapper or a LoRA student)."""
    from transformers import PreTrainedModel
    wrapped = getattr(model, "peft", model)             # models.LoraStudent keeps its backbone off its modules
    return next((m for m in wrapped.modules() if isinstance(m, PreTrainedModel)), wrapped)


def _shared_prefix(rows) -> int:
    """How many leading positions every row shares (equal ids, or equal embedding vectors), leaving each row at
    least one position of its own (its last one gives the logits of its first reply token)."""
    n = min(len(r) for r in rows) - 1
    if len(rows) == 1 or n <= 0:
        return 0 if len(rows) > 1 else max(n, 0)
    first = rows[0][:n]
    same = torch.stack([(r[:n] == first).reshape(n, -1).all(-1) for r in rows[1:]]).all(0)   # (n,)
    return int(same.long().cumprod(0).sum())


@torch.no_grad()
def generate_replies(model, tokenizer, contexts, cfg: SampleConfig, *, embed_fn=None, conversations=None, keys=None,
                     embeds=None):
    """Sample one reply per context. Returns per row (new ids, their log-probs at temperature 1, finished?).

    `conversations` (a `Conversations`) keeps each context's KV cache from an earlier call, under `keys` (one per
    context): a later turn then feeds only what a context added since. Without it, every context is fed whole.
    `embed_fn(ids, attention_mask) -> inputs_embeds` replaces the placeholder embeddings with latents (inject.py).
    The log-probs are those of the raw logits; no loss reads them (GRPO's π_old is the detached re-scored policy,
    ρ = 1): they are kept with the episode as a check that re-scoring reproduces sampling. With cfg.generator (a
    serving engine, --engine vllm) the engine samples the replies from `model`'s weights instead, from each
    context's ids or, given `embeds` (per context its (n_i, d) input embeddings, latents included), from those."""
    if cfg.generator is not None:
        return cfg.generator.generate(model, contexts, cfg, eos_ids(model, tokenizer), embeds)
    conv = conversations if conversations is not None else Conversations(model, tokenizer, embed_fn)
    keys = list(range(len(contexts))) if keys is None else list(keys)
    logits = conv.resume(keys, contexts) if conv.cache is not None else conv.start(keys, contexts)   # (B, V)
    return conv.decode(logits, cfg, eos_ids(model, tokenizer))


def context_embeds(model, embed_fn, contexts, rows) -> list:
    """Each context's input embeddings, the latents of its task (rows index the rollout's tasks) in its span:
    per context (n_i, d)."""
    device = next(model.parameters()).device
    return [embed_fn(torch.tensor([c], device=device), torch.ones((1, len(c)), dtype=torch.long, device=device),
                     [r])[0] for c, r in zip(contexts, rows)]


def eos_ids(model, tokenizer) -> list[int]:
    """The ids that end a reply: the tokenizer's eos (the chat template's end of turn) first, then every other id
    of the model's generation config (Qwen3 lists <|im_end|> and <|endoftext|>)."""
    config = getattr(model, "generation_config", None) or getattr(getattr(model, "peft", None),
                                                                   "generation_config", None)
    more = getattr(config, "eos_token_id", None)
    more = [] if more is None else [more] if isinstance(more, int) else list(more)
    return [tokenizer.eos_token_id] + [i for i in more if i != tokenizer.eos_token_id]


def rollout(model, chat: Chat, tasks, cfg: SampleConfig, *, prompt_fn=None, embed_fn=None,
            progress=None, watch=None) -> list[Episode]:
    """Roll out one episode per task (eq. 1), batched across tasks, turn by turn.

    prompt_fn(messages, tools) -> ids overrides the prompt (the teacher's latent prompt, lopd.teacher_rollout);
    embed_fn(ids, attention_mask, rows) then fills the placeholder span, where rows index `tasks`.
    cfg.sort_by_length: batches of tasks of similar length (less left padding); episodes come back in task order.
    progress: a bar, updated per batch of tasks; watch(ep, n_new): told of each reply as soon as it is stepped (its
    `n_new` tokens), an episode that ended already scored, with its `end` (eval.py writes its record then)."""
    tokenizer, episodes = chat.tokenizer, [None] * len(tasks)
    order = sorted(range(len(tasks)), key=lambda i: len(tasks[i].text)) if cfg.sort_by_length else range(len(tasks))
    was_training = model.training
    model.eval()
    # a fp32 student under bf16 autocast generates from a bf16 copy, made once here (models.decoding_copy)
    decoder = model if cfg.generator is not None else models.decoding_copy(model)
    for start in range(0, len(tasks), cfg.batch_size):
        which = order[start:start + cfg.batch_size]                          # indices into tasks
        chunk = [tasks[j] for j in which]
        envs = [chat.make_env() for _ in chunk]
        for env in envs:          # the tokenizer's own reply parser, where it has one (common.parse_tool_calls)
            if getattr(tokenizer, "response_template", None):
                env.response_template = tokenizer.response_template
        eps = [Episode(t) for t in chunk]
        for ep, env in zip(eps, envs):
            msgs = env.reset(ep.task)
            ep.add(prompt_fn(msgs, env.tools) if prompt_fn else chat.prompt(msgs, env.tools), sampled=False)
            ep.prompt_len = len(ep.ids)
        # each conversation keeps its KV cache from turn to turn; embed_fn is told which tasks the rows are
        conv = Conversations(decoder, tokenizer, None if embed_fn is None else
                             lambda ids, att, rows=which: embed_fn(ids, att, rows))
        while not all(ep.done for ep in eps):
            live = [i for i, ep in enumerate(eps) if not ep.done]
            embeds = None                      # a serving engine is sent the latent prompts as embeddings
            if cfg.generator is not None and embed_fn is not None:
                embeds = context_embeds(model, embed_fn, [eps[i].ids for i in live], [which[i] for i in live])
            replies = generate_replies(model, tokenizer, [eps[i].ids for i in live], cfg, conversations=conv,
                                       keys=live, embeds=embeds)
            texts = [tokenizer.decode(new, skip_special_tokens=False).replace(tokenizer.eos_token, "")
                     for new, _, _ in replies]
            n_before = [len(envs[i].trace) for i in live]
            results = _step_all([envs[i] for i in live], texts)
            for k, (i, (new, lp, finished)) in enumerate(zip(live, replies)):
                ep, env = eps[i], envs[i]
                ep.add(new, sampled=True, logps=lp)
                result = _count_step(ep, env, results[k], n_before[k], len(new))
                end = _end(result, finished)
                if end:
                    _finish(ep, env, end)
                else:
                    ep.add(chat.observation(result.observations, result.user), sampled=False)
                    if len(ep.ids) + cfg.max_new_tokens > cfg.max_len:
                        _finish(ep, env, "context full")
                if watch is not None:
                    watch(ep, len(new))
        for j, ep in zip(which, eps):
            episodes[j] = ep
        if progress is not None:
            progress.update(len(chunk))
    model.train(was_training)
    return episodes


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
    many rows at a time (memory bounded by tokens, `models.lm_head_bypassed`); 0: from full logits."""
    if not loss_chunk:
        ls, ids, omega = student_logits(student, tokenizer, eps, device)                  # (B, Tc, V)
        return losses.token_logprobs(ls, ids, omega), ids, omega
    with models.lm_head_bypassed(student):
        h, ids, omega = student_logits(student, tokenizer, eps, device)                   # (B, Tc, d)
    return losses.token_logprobs_from_hidden(h, models.lm_head(student), ids, omega, loss_chunk), ids, omega


def micro_batches(eps, size: int, token_budget: int = 0) -> list[slice]:
    """The forward/backward passes of a batch, as consecutive slices of its episodes: at most `size` episodes each,
    and with a token budget at most as many as fit in it, counted as a padded batch (rows × the longest episode; at
    least one), an episode longer than memory.SHARED_FORWARD_TOKENS alone. Losses are normalised by the whole
    batch's counts, so any split gives the same gradient. Under torchrun every rank runs as many as the busiest one
    (a sharded model's forward is a collective): the extra ones are empty."""
    if not token_budget:
        out = [slice(i, i + size) for i in range(0, len(eps), size)]
    else:
        out, start, longest = [], 0, 0
        for i, e in enumerate(eps):
            longest = max(longest, len(e.ids))
            # e opens the next: over the budget, over `size`, or too long to share a forward (its padding would make
            # SDPA build a (B, 1, T, T) mask: memory.SHARED_FORWARD_TOKENS)
            if i > start and (longest * (i + 1 - start) > token_budget or i - start == size or
                              longest > memory.SHARED_FORWARD_TOKENS):
                out.append(slice(start, i))
                start, longest = i, len(e.ids)
        out.append(slice(start, len(eps)))
    busiest = int(parallel.all_max(float(len(out))))
    return out + [slice(0, 0)] * (busiest - len(out))


def accumulate(eps, part_loss, micro_batch: int, token_budget: int = 0, *, rows=None) -> tuple[dict, bool]:
    """The one forward/backward loop of every method's step (and of the cold start): the episodes `rows` of `eps`
    (all by default) in micro-batches (`micro_batches`: at most micro_batch episodes, at most token_budget padded
    tokens), part_loss(indices into eps) -> (loss, metrics) for each, one backward each. part_loss normalises by
    whole-batch counts, so the parts add up to the batch's loss and any split gives the same gradient.

    Under torchrun every rank runs as many passes as the busiest one (a sharded model's forward is a collective): an
    extra pass re-scores one episode with weight 0. After a non-finite loss no part is back-propagated (the caller's
    `optimizer_step` then drops the gradients). -> (each metric summed over the parts and ranks, finite everywhere?)"""
    rows = list(range(len(eps))) if rows is None else list(rows)
    totals, finite = {}, True
    serving.rest()                  # --engine vllm on CUDA: the engine's weights and cache leave the device meanwhile
    for part in micro_batches(pick(eps, rows), micro_batch, token_budget):
        idx, weight = rows[part], 1.0
        if not idx:                                                  # torchrun: an idle pass
            idx, weight = rows[:1] or [0], 0.0
        loss, metrics = part_loss(idx)
        loss = weight * loss
        finite &= bool(torch.isfinite(loss))
        if finite:
            loss.backward()
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + weight * v
    keys = list(totals)                     # the same order on every rank (the same parts): one all-reduce
    sums = parallel.all_sum(*(totals[k] for k in keys)) if keys else ()
    return dict(zip(keys, sums if len(keys) > 1 else [sums])), parallel.all_true(finite)


def pick(items, idx) -> list:
    """items[i] for i in idx."""
    return [items[i] for i in idx]


def supervised_tokens(eps) -> int:
    """Σ ω of the episodes, over every rank's (the whole batch's count a loss is normalised by)."""
    return parallel.all_sum(sum(sum(e.mask) for e in eps))


def update(student, opts, eps, part_loss, cfg, *, composer=None, rows=None) -> tuple[dict, bool]:
    """A method's update after its rollouts, the same for every method: `accumulate` part_loss over the episodes
    (`rows` of them, all by default) in cfg.micro_batch / cfg.token_budget passes with the student in train mode,
    then `optimizer_step` at cfg.clip. opts = (student's optimizer, composer's or None). -> (each metric summed over
    the parts and ranks, stepped?): False after a non-finite loss or gradient, when nothing was applied."""
    student.train()
    metrics, finite = accumulate(eps, part_loss, cfg.micro_batch, cfg.token_budget, rows=rows)
    student.eval()
    return metrics, optimizer_step(opts, student, composer, cfg.clip, finite)


def optimizer_step(opts, student, composer, clip: float, ok: bool = True) -> bool:
    """Clip and step each optimizer. If the loss (ok=False) or any gradient is non-finite, drop all gradients
    (also those of micro-batches that did finish) and return False."""
    groups = [(opts[0], list(student.parameters()))]
    if opts[1] is not None:
        groups.append((opts[1], composer.trainable_parameters()))
    ok = parallel.all_true(ok)
    for _, params in groups:           # replicated parameters: gradients summed over ranks (no-op in one process)
        parallel.sync_grads(params)
    norms = [torch.nn.utils.clip_grad_norm_(params, clip) for _, params in groups]   # global norms under FSDP2
    ok = ok and all(bool(torch.isfinite(n)) for n in norms)
    for opt, _ in groups:
        if ok:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return ok


# ----------------------------------------------------------------------------------------------------------------
# A method as train.py runs it (--method): what it keeps across steps, one step, and the run it reads
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What a method reads of the run, made once by train.py (`prepare`) after stages 1-4. Under torchrun every rank
    holds the same run and draws the same tasks (each keeps its slice: `tasks`)."""
    args: object                # the run's settings (train.Args): each method builds its config from them
    tok: object                 # the tokenizer
    chat: Chat                  # how every prompt of the run renders
    sample: SampleConfig        # the student's sampling (B.2)
    composer: object            # the composer, whose backbone is θ̄ with the LoRA off (composer.py)
    retriever: object           # the experience bank and its index (retrieval.py)
    train: list                 # the training tasks
    test: list                  # the held-out tasks
    episodes: list              # the base rollouts (stage 2): the bank's source, RFT's data
    log: object                 # devices.Log: log(stage, **metrics)
    student: object = None      # a LoRA student made with the composer, or None (train.py builds a full copy)
    source: object = None       # θ̄'s weights, for a full student or SDPO's EMA teacher (models.student_source)
    task_rng: random.Random = field(default_factory=random.Random)   # the training tasks' draws (checkpointed)

    def tasks(self, step: int, per_task: int = 1) -> list:
        """Step `step`'s training tasks, rollouts_per_step / per_task of them, this rank's slice (`draw_tasks`)."""
        a = self.args
        return draw_tasks(self.train, a.rollouts_per_step // per_task, self.task_rng, order=a.task_order,
                          seed=a.seed, step=step)


# A step takes (run, state, student, opts, step) and returns (metrics, generations spent); `state` is what its setup
# made (LOPD's c_φ0 cache and β, SDPO's EMA teacher, ...) and it may change it. Every method draws rollouts_per_step
# generations: LOPD and OPSD as one rollout of that many tasks, GRPO and SDPO as G of each.
@dataclass
class Method:
    setup: object              # (run) -> state: what the method keeps across steps
    step: object               # (run, state, student, opts, step) -> (metrics, generations)
    label: str                 # its student's row in the results ("LOPD student")
    uses_bank: bool = False    # its data includes the bank: the bank's rollouts count towards its generations
    trains_composer: bool = False   # φ has an optimizer (LOPD, unless --freeze-composer)
    per_task: str = ""         # the Args field that gives rollouts per task ("group"), or "" for one
    keeps_ema: bool = False    # it keeps an EMA copy of the full student as its teacher (SDPO): memory counts it


def draw_tasks(tasks, n: int, rng: random.Random, *, order: str = "fresh", seed: int = 0, step: int = 0) -> list:
    """n of `tasks` for step `step` (this rank's slice). order "fresh" draws them anew each step from `rng`; "epoch"
    walks through shuffled epochs (the official code), so every task comes once before any comes twice. Epoch e's
    order is a function of the seed and e alone, so a resumed run continues it."""
    if order == "fresh":
        return parallel.shard(rng.sample(tasks, n))
    first = step * n                                                   # positions first .. first + n − 1
    epochs = range(first // len(tasks), (first + n - 1) // len(tasks) + 1)      # the one or two it reaches into
    orders = {e: epoch_order(tasks, seed, e) for e in epochs}
    return parallel.shard([orders[i // len(tasks)][i % len(tasks)] for i in range(first, first + n)])


def epoch_order(tasks, seed: int, epoch: int) -> list:
    """--task-order epoch: epoch `epoch`'s shuffle of the training tasks, a function of the seed and the epoch."""
    return random.Random(f"{seed}/epoch/{epoch}").sample(tasks, len(tasks))
