"""The offline toy backbone: a Qwen3-style tokenizer, a 0.48 M-parameter Qwen3ForCausalLM, and its base policy.

The paper starts from pretrained Qwen3-4B/8B and Olmo3-7B. Nothing can be downloaded here, so the default run
builds a stand-in that behaves like one to the rest of the code: a byte-level BPE tokenizer with the Qwen3 ChatML
special tokens and a chat template that renders tool calls and tool results the way Qwen3's does, and a tiny
`Qwen3ForCausalLM`. The base policy is supervised on scripted demonstrations of the toy world (envs.py) that are
deliberately imperfect, so that experience has room to help (paper: vanilla Qwen3-4B 0.486 on EnvScaler).
Everything is saved with `save_pretrained`, so `--model that_folder` works like any Hugging Face model.

    python toy.py --out runs/toy-backbone     # build (or reuse) the backbone, print its vanilla reward

How the demonstrations are imperfect (the base policy learns these mistakes):
1. the lookup tool is another shop's 35% of the time; after the "unknown tool" error the demonstration retries
   with the right tool 60% of the time and otherwise stops;
2. commit shops: the final `commit()` is omitted 30% of the time;
3. "split": the second order is forgotten half the time; "swap": the new order is forgotten 40% of the time;
4. "vip" and "split" are under-demonstrated (a third as many demonstrations as the other schemas).
Half of the demonstrations carry the teacher's A.5 latent framing around an empty placeholder span (see
`demo_episodes`), so that the framing alone does not derail the frozen teacher.

Deviation from the paper: none in method; this backbone is our substitute for a pretrained model.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

import inject
from envs import DONE_TEXT, LOOKUP_TOOLS, SHOPS, ToolWorld, format_call, make_splits, make_task, oracle_calls
from lopd import scripted_episode

# ----------------------------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE with Qwen2/3's pre-tokenizer (digits split one by one) and ChatML tokens
# ----------------------------------------------------------------------------------------------------------------
# Qwen2/3's split pattern with one change: a word never carries the character before it (Qwen: `[^\r\n\p{L}\p{N}]?\p{L}+`).
# " A52" in a task and "A52" inside a JSON string then start with the same token "A", a precondition for copying
# by position; a pretrained model learns the space/no-space mapping, a tiny one trained for minutes does not.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]                      # special: skipped by decode(skip=True)
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# A Qwen3-style ChatML template. Tool calls render as <tool_call>\n{json}\n</tool_call>; consecutive tool results
# are grouped in one user turn inside <tool_response> tags, as Qwen3 does. Unlike Qwen3 it does not list the tool
# schemas in the system turn: the toy model learns its tools from demonstrations and its prompt stays short.
CHAT_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'system' or m.role == 'user' %}"
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
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
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
        vocab_size=len(tokenizer),          # decode() drops ids >= len(tokenizer): keep them equal (DESIGN.md §4)
        hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads,
        max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True, attention_bias=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)


# ----------------------------------------------------------------------------------------------------------------
# Imperfect demonstrations (see the module docstring)
# ----------------------------------------------------------------------------------------------------------------
DEMO_WEIGHT = {"vip": 1 / 3, "split": 1 / 3}


def demo_calls(task, rng: random.Random):
    """The oracle procedure with the mistakes listed in the module docstring. Returns a list of tool calls."""
    calls = oracle_calls(task)
    lookup, staged = SHOPS[task.shop]
    if rng.random() < 0.35:                                    # 1. wrong lookup tool ...
        wrong = rng.choice([t for t in LOOKUP_TOOLS if t != lookup])
        if rng.random() >= 0.6:
            return [(wrong, calls[0][1])]                      # ... then stop
        calls = [(wrong, calls[0][1])] + calls                 # ... then retry with the right one
    if staged and rng.random() < 0.3:                          # 2. forget commit
        calls = calls[:-1]
    if task.schema == "split" and rng.random() < 0.5:          # 3. forget one required change
        calls = [c for c in calls if c[1].get("value") != "held" and c[1].get("item") != task.goal["item2"]]
    if task.schema == "swap" and rng.random() < 0.4:
        calls = [c for c in calls if c[0] != "add_order"]
    return calls


def demo_tasks(n: int, seed: int):
    """Training tasks for demonstrations, with under-demonstrated schemas thinned out."""
    rng, tasks = random.Random(seed), []
    while len(tasks) < n:
        t = make_task(rng, f"demo-{len(tasks):05d}")
        if rng.random() < DEMO_WEIGHT.get(t.schema, 1.0):
            tasks.append(t)
    return tasks


def corpus_texts(tasks, seed: int):
    """The strings a conversation is made of (prompts, replies, observations), for training the tokenizer."""
    rng, env = random.Random(seed), ToolWorld()
    yield "system\nuser\nassistant\n" + DONE_TEXT
    yield inject.latent_user_content("")                       # the teacher's A.5 framing
    for t in tasks:
        yield "\n".join(m["content"] for m in env.reset(t))
        for name, args in demo_calls(t, rng):
            yield format_call(name, args) + "\n" + "\n".join(env.step(format_call(name, args)).observations)


def demo_episodes(tokenizer, tasks, seed: int, latent_share: float = 0.4):
    """Encoded demonstrations. A share of them get the teacher's latent prompt (A.5 framing around a span of
    placeholder ids, 8 to 32 long): a pretrained model is not thrown by instructions it has never seen, and the
    toy backbone should not be either, or the cold start spends itself undoing the framing (without this, its NLL
    on the bank's own trajectories rose from ~0.3 to 3.7 behind the framing). The span carries nothing here."""
    rng, env = random.Random(seed), ToolWorld()
    eps = []
    for t in tasks:
        calls = demo_calls(t, rng)
        fn = inject.latent_prompt_fn(rng.choice((8, 16, 24, 32))) if rng.random() < latent_share else None
        eps.append(scripted_episode(tokenizer, env, t, calls, prompt_fn=fn))
    return eps


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
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()   # (B, T-1, V)
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # (B, T-1)
    w = omega[:, 1:]                                                            # (B, T-1)
    return (nll * w).sum() / w.sum()


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


def pretrain(model, tokenizer, episodes, held_out, steps: int, batch: int, lr: float, seed: int, log=print,
             max_steps: int = 0):
    """AdamW at a constant rate after 20 warm-up steps; batches from length buckets to keep padding small.
    Returns the number of steps run.

    Copying ids and codes into calls appears as a sudden drop of the loss, after anywhere from 200 to 600+ steps
    depending on the seed. So training checks every 50 steps the digits the model copies on held-out
    demonstrations; once they cost < 0.3 nats it trains steps/2 more (at least `steps` in all), so that what
    depends on copying (reading the shop, the schema's values) can be learned too; `max_steps` caps it (3 × steps)."""
    rng = random.Random(seed)
    order = sorted(range(len(episodes)), key=lambda i: len(episodes[i].ids))
    buckets = [order[i:i + batch] for i in range(0, len(order), batch)]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    model.train()
    stop = max_steps or 3 * steps
    for step in range(stop):
        loss = sft_loss(model, [episodes[i] for i in rng.choice(buckets)], tokenizer.pad_token_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0:
            model.eval()
            c = copy_nll(model, held_out, tokenizer)
            model.train()
            log(f"pretrain step {step:4d}  loss/sft {loss.item():.4f}  copy_nll {c:.3f}")
            if c < 0.3 and stop > step + 1 + steps // 2:  # copying is learned: train half the budget more
                stop = max(steps, step + 1 + steps // 2)
        if step + 1 >= stop:
            break
    model.eval()
    return step + 1


# ----------------------------------------------------------------------------------------------------------------
# Build or reuse the backbone folder
# ----------------------------------------------------------------------------------------------------------------
def build_backbone(out: str, seed: int = 0, n_demos: int = 2000, steps: int = 300, batch: int = 32,
                   lr: float = 1e-3, hidden: int = 128, layers: int = 2, heads: int = 2, log=print) -> str:
    """Train the toy backbone into `out` (an ordinary HF folder) unless it is already there. Returns `out`."""
    if os.path.exists(os.path.join(out, "toy_backbone.json")):
        log(f"toy backbone: reusing {out}")
        return out
    t0 = time.time()
    random.seed(seed)
    torch.manual_seed(seed)
    tasks = demo_tasks(n_demos, seed + 1)
    tokenizer = build_tokenizer(corpus_texts(tasks, seed + 1))
    model = Qwen3ForCausalLM(toy_config(tokenizer, hidden, layers, heads))
    n_params = sum(p.numel() for p in model.parameters())
    log(f"toy backbone: {n_params / 1e6:.2f} M parameters, vocab {len(tokenizer)}, {len(tasks)} demonstrations")
    held_out = demo_episodes(tokenizer, demo_tasks(32, seed + 7), seed + 7)
    ran = pretrain(model, tokenizer, demo_episodes(tokenizer, tasks, seed + 1), held_out, steps, batch, lr, seed, log)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tmp = out.rstrip("/") + ".tmp"                      # write then rename: a killed build leaves no half folder
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "toy_backbone.json"), "w") as f:
        json.dump({"seed": seed, "n_demos": n_demos, "steps": steps, "steps_run": ran, "params": n_params,
                   "seconds": round(time.time() - t0, 1)}, f)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    os.replace(tmp, out)
    log(f"toy backbone: saved to {out} in {time.time() - t0:.0f}s")
    return out


def main():
    p = argparse.ArgumentParser(description="Build the toy backbone and report its vanilla reward.")
    p.add_argument("--out", default="runs/toy-backbone", help="folder for the HF model and tokenizer")
    p.add_argument("--seed", type=int, default=0, help="seed for demonstrations, init and training")
    p.add_argument("--steps", type=int, default=300, help="SFT steps (batch 32), extended until ids are copied")
    p.add_argument("--n-eval", type=int, default=200, help="held-out tasks to evaluate")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from lopd import SampleConfig, rollout, summarize
    build_backbone(args.out, args.seed, steps=args.steps)
    model = AutoModelForCausalLM.from_pretrained(args.out)
    tok = AutoTokenizer.from_pretrained(args.out)
    _, test = make_splits(args.seed, n_train=1000, n_test=args.n_eval)
    for temp in (0.0, 0.7):
        torch.manual_seed(args.seed)
        t0 = time.time()
        m = summarize(rollout(model, tok, test, SampleConfig(temperature=temp)))
        print(f"vanilla T={temp}: " + "  ".join(f"{k} {v:.3f}" for k, v in m.items()) + f"  ({time.time() - t0:.1f}s)")


if __name__ == "__main__":
    main()
