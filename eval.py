"""Evaluate a finished run on held-out tasks, and look inside its composer (paper §4, B.3, B.4, §4.4).

    python eval.py --run runs/toy                    # Table 3's rows again: OUT/eval_200tasks.md and .json
    python eval.py --run runs/toy --world-check      # also: the teacher with other-variant / no references
    python eval.py --run runs/toy --inspect-latents  # what the composer carries (§4.4; `latent_similarity`)
    python eval.py --run runs/code --conventions     # toy code world: which judges' conventions each row writes
    python eval.py --run runs/toy --show 5           # OUT/show.html: 5 episodes token by token
    python eval.py --run runs/code --show runs/code/lcb_v5_all.records.jsonl --index 3   # an evaluated task's
    python eval.py --run runs/code --tasks lcb_v5.jsonl HumanEvalPlus.jsonl   # the student on real benchmarks (B.3)
    python eval.py --model Qwen/Qwen3-4B --tasks bfcl-v3                      # a model as released: no run needed
    python eval.py --run DIR --tasks acebench=../ACEBench                      # ACEBench, from its clone
    python eval.py --run DIR --tasks envscaler=DATA bfcl-v3 acebench=../ACEBench   # Table 1's columns, one table

The rows themselves are train.py's stage 6 (`train.evaluate`: vanilla, base + composer, the LOPD student alone,
each with Table 3's behaviour counts; a code run reports pass@1 and the reply length instead, beside paper Table
2's Qwen3-4B values where the text gives them). This file loads a run through train.py (`train.load_args`,
`train.load_run`) and adds what only a finished run can show. It imports train.py; train.py never imports it.

Latent inspection (§4.4). The paper projects each latent token through the LM head and reads its nearest words.
On the toy run that prints the same five tokens for every latent of every task, and so does the projection of
each latent minus the mean latent over tasks (all 24 latents of a task move along one shared direction, which is
no word's): the latents are not words. What they carry shows in how they differ between tasks instead.
`latent_similarity` removes what all tasks share and asks whether two tasks' latents point the same way when the
tasks share a shop (the conventions a reference shows) or a task family (the procedure). `teacher_shift` shows what
the experience changes in the teacher: the reply tokens of one episode whose teacher log-probability moves most
between latents of same-variant references and latents of other variants' references.

Code benchmarks (B.3). `--tasks FILE ...` scores the run's student on benchmark files in their released layouts
(LiveCodeBench, HumanEval+, MBPP+, TACO; worlds/tool_world.py reads them with their harnesses' rules): pass@1 per
benchmark, with EvalPlus's base and plus separately, beside the values the paper quotes for Qwen3-4B.

Tool-use benchmarks (§4.1, Table 1, B.3). `--tasks envscaler=DIR` (EnvScaler's release, or hf: its 200 held-out
tasks, worlds/envscaler.py's split), `bfcl-v3[:CATS]` and `acebench=PATH[:REGIME]` each score the student alone and
write their files; several at once are evaluated in turn, each writing exactly the files it writes alone, and
then one row of Table 1's columns on its 0-100 scale (`eval_table1`). Each benchmark samples as B.3 says
(`B3_BY_BENCHMARK`).

Deviation: the paper evaluates on EnvScaler's 200 held-out tasks, BFCL-v3 and ACEBench; a run's own Table 3 rows
(no --tasks) are on its world's held-out split: EnvScaler's for a real backbone trained without --env, the toy
world's standing in for it on the toy backbone (preflight.default_world).
"""
from __future__ import annotations

import dataclasses
import functools
import html
import json
import os
import time

from runtime import preflight    # first: as the script being run, it checks the command line before torch loads
import torch
import torch.nn.functional as F
from tqdm import tqdm

import engine
import inject
import lopd
import losses
from runtime import checkpoints, devices, memory, models, parallel, serving
import train
from worlds import code_benchmarks, code_world, results, sandbox


def final_eval(args: train.Args, n_test: int = 0, temperature=None, controls: bool = False,
               keep: dict | None = None):
    """Rebuild the run from OUT (`train.load_run`), evaluate its rows on the first n_test held-out tasks (0: all),
    with `controls` also the world check's rows; write them into files of their own (`eval_name`), never over the
    training run's results.md. A row already finished on the same tasks, sampling and checkpoint (by the training
    run, or by this command before a kill) is read back, not rolled out again (`train.evaluate`'s cache).
    -> (rows, run, tasks)."""
    run = train.load_run(args)
    tasks = run.test[:n_test] if n_test else run.test
    rows = train.evaluate(args, run, run.student, tasks, temperature, keep=keep, cache=True)   # rows done: read back
    if controls:
        rows.update({k: v for k, v in world_check(args, run, tasks).items() if k not in rows})
    results.write_results(args.out, rows, table=train.environment(args).results,
                        name=eval_name(len(tasks), temperature, controls))
    return rows, run, tasks


def world_check(args, run, tasks) -> dict:
    """Does the teacher use the experience? base + composer (φ0) with the same-variant retrieval it was trained
    on, with references from other variants only, and with no reference (docs/design.md, "The toy world")."""
    rows = {}
    for mode, name in (("same", "base + composer"), ("other", "base + composer, other-variant reference"),
                       ("none", "base + composer, no reference")):
        margs = dataclasses.replace(args, retrieval=mode)
        rows[name] = train.evaluate(margs, run, None, tasks, which=("base + composer",))["base + composer"]
    return rows


def eval_name(n_tasks: int, temperature=None, controls: bool = False) -> str:
    """What an evaluation wrote its rows into, named by what it evaluated: eval_200tasks, eval_4tasks_T0
    (temperature 0), eval_200tasks_world-check."""
    return (f"eval_{n_tasks}tasks" + ("" if temperature is None else f"_T{temperature:g}") +
            ("_world-check" if controls else ""))


def result_stem(out: str, what: str, n_test: int = 0, temperature=None) -> str:
    """OUT/<what>_<split>[_T<t>]: a benchmark evaluation's files, named by the benchmark (and its categories), the
    split (all, or first<N>) and the temperature; a name already taken gets -2, -3, ...: never another's files."""
    stem = os.path.join(out, f"{what}_{f'first{n_test}' if n_test else 'all'}" +
                        ("" if temperature is None else f"_T{temperature:g}"))
    taken = lambda s: any(os.path.exists(s + ext) for ext in (".json", ".records.jsonl"))   # noqa: E731
    n = 1
    while taken(stem if n == 1 else f"{stem}-{n}"):
        n += 1
    return stem if n == 1 else f"{stem}-{n}"


def task_record(tok, benchmark: str, ep, verdict: dict | None) -> dict:
    """One task's JSON line: its id, reward, why its episode ended (`end`: worlds.common.ENDS), the checker's reason
    in words ("" where it passed or gives none), its verdict (the world's log) and the conversation as text (the
    prompt, then every reply and observation), so a reader can see why a task scored what it did."""
    verdict = dict(verdict) if verdict is not None else None
    reason = verdict.pop("reason", "") if verdict else ""
    return {"benchmark": benchmark, "task_id": ep.task.task_id, "reward": ep.reward, "end": ep.end, "reason": reason,
            "verdict": verdict, "prompt": tok.decode(ep.ids[:ep.prompt_len]),
            "conversation": tok.decode(ep.ids[ep.prompt_len:])}


@dataclasses.dataclass
class Recording:
    """Where one benchmark's records go as its tasks end (`rollout_recorded`)."""
    tok: object
    benchmark: str     # the records' benchmark: bfcl-v3:base, envscaler, acebench:multi_turn, a file's name
    log: dict          # the world's verdicts by task id, written as each episode is scored
    stem: str          # the evaluation's files (`result_stem`): STEM.records.jsonl


def watcher(rec: Recording, bar):
    """engine.rollout's `watch`: each reply on the bar (the task, its reply count, the reply's tokens), and each
    task's record (`task_record`) appended to STEM.records.jsonl the moment its episode ends, with one line saying
    how it ended. -> (watch, {id of the episode: its record})."""
    records, started = {}, time.time()

    def watch(ep, n_new: int):
        bar.set_postfix_str(f"{ep.task.task_id}: reply {ep.steps}, {n_new} tokens", refresh=True)
        if not ep.done:
            return
        record = records[id(ep)] = task_record(rec.tok, rec.benchmark, ep, rec.log.get(ep.task.task_id))
        checkpoints.append_jsonl(rec.stem + ".records.jsonl", record)
        bar.update(1)
        reason = f"; {record['reason']}" if record["reason"] else ""
        bar.write(f"{rec.benchmark} {ep.task.task_id}: reward {ep.reward:.2f} after {ep.steps} replies, ended by "
                  f"{ep.end}{reason} ({devices.duration(time.time() - started)} in)")
    return watch, records


def rollout_recorded(model, chat, tasks, cfg, rec: Recording) -> tuple[list, list]:
    """engine.rollout of one benchmark's `tasks`, each record appended as its task ends (`watcher`).
    -> (the episodes, their records), in task order."""
    with devices.precision(model), tqdm(total=len(tasks), desc=f"eval {rec.benchmark}", leave=False) as bar:
        watch, records = watcher(rec, bar)
        eps = engine.rollout(model, chat, tasks, cfg, watch=watch)
    return eps, [records[id(ep)] for ep in eps]


@dataclasses.dataclass
class Scored:
    """What a benchmark's evaluation wrote: STEM.json's path and its contents (the student's name, the rows)."""
    path: str
    result: dict


def write_result(stem: str, result: dict, records: list[dict]) -> Scored:
    """STEM.json (the rows) and STEM.records.jsonl (a line per task, appended as each ended: now again in task
    order), each written atomically."""
    checkpoints.write_json(stem + ".json", result)
    with checkpoints.atomic_open(stem + ".records.jsonl") as f:
        f.writelines(json.dumps(r, default=str) + "\n" for r in records)   # a verdict may hold non-JSON values
    print(f"written to {stem}.json and {stem}.records.jsonl")
    return Scored(stem + ".json", result)


def conventions_table(tok, episodes: dict) -> str:
    """Toy code world: per row, how often replies write the `Answer` prefix and the `END` line, and how often each
    is right for the problem's judge. A student that learned WHEN (per judge) is right well above 0.5; one that
    only changed HOW OFTEN it writes a convention stays near 0.5 (docs/results.md, Figure 4 on the code world)."""
    keys = ("prefix", "prefix_right", "end", "end_right")
    lines = ["| row | pass | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for name, eps in episodes.items():
        marks = [code_world.code_conventions(e.task, tok.decode(e.ids[e.prompt_len:], skip_special_tokens=True))
                 for e in eps]
        rates = [sum(m[k] for m in marks) / len(marks) for k in keys]
        passed = sum(e.reward for e in eps) / len(eps)
        lines.append(f"| {name} | {passed:.3f} | " + " | ".join(f"{r:.3f}" for r in rates) + " |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# §4.4: what the composer carries
# ----------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def latent_similarity(latents, groups) -> tuple[float, float]:
    """latents (N, n, d) of N tasks; groups: N labels (the tasks' shops, say). Each task's latents minus the mean
    over the N tasks, flattened, then the mean cosine between two different tasks of the same group and between
    two tasks of different groups. -> (same, different)."""
    own = (latents.float() - latents.float().mean(0)).flatten(1)             # (N, n·d) what each task adds
    cos = F.normalize(own, dim=-1) @ F.normalize(own, dim=-1).T               # (N, N)
    label = list(groups)
    same = torch.tensor([[a == b for b in label] for a in label])             # (N, N)
    off = ~torch.eye(len(label), dtype=torch.bool)                            # two DIFFERENT tasks
    return cos[same & off].mean().item(), cos[~same].mean().item()


@torch.no_grad()
def teacher_shift(composer, chat, ep, lat_same, lat_other, top: int = 8) -> list[str]:
    """The reply tokens of episode `ep` whose teacher log-probability moves most between latents composed from
    same-variant references (lat_same, (n, d)) and from other variants' references (lat_other). Positive: the
    same-variant experience makes the teacher surer of the token the episode took. -> one line per token."""
    tok = chat.tokenizer
    same, other = (teacher_logprobs(composer, chat, [ep], lat[None])[0]
                   for lat in (lat_same, lat_other))                          # (Tc,) log π_T(a_t), 0 off ω each
    conts, omega = engine.continuation([ep], lat_same.device)
    move = same - other                                                       # (Tc,) only sampled tokens count
    lines = []
    for t in move.abs().topk(min(top, int(omega[0].sum()))).indices.tolist():
        before = tok.decode(conts[0][max(0, t - 8):t], skip_special_tokens=True).replace("\n", " ")
        lines.append(f"{move[t]:+6.2f} nats  {tok.decode([conts[0][t]])!r:16} after ...{before[-40:]!r}  "
                     f"(same-variant {same[t].exp():.2f}, other {other[t].exp():.2f})")
    return lines


def similarity_table(latents_by_mode: dict, tasks) -> str:
    """Markdown: `latent_similarity` with the tasks grouped by variant (shop, judge) and by schema (task family),
    for each retrieval mode's latents. Groupings with a single label (real tasks have none) are left out."""
    keys = [k for k in ("variant", "schema") if len({getattr(t, k, "") for t in tasks}) > 1]
    lines = ["| references | " + " | ".join(f"same {k} | other {k}" for k in keys) + " |",
             "|---|" + "---|---|" * len(keys)]
    for mode, latents in latents_by_mode.items():
        cells = [f"{v:+.3f}" for k in keys for v in latent_similarity(latents, [getattr(t, k) for t in tasks])]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def inspect_latents(args: train.Args, run, tasks, n_tasks: int = 50):
    """§4.4, what the latents carry: `similarity_table` over the first n_tasks held-out tasks (latents of their
    retrieved references, and of other variants' references), then `teacher_shift` on the first task's greedy
    teacher episode (base + composer with same-variant references)."""
    composer, ret, chat = run.composer, run.retriever, train.chat_of(args, run.tok)
    part = tasks[:n_tasks]
    with torch.no_grad(), devices.precision(composer.peft):
        latents = {mode: lopd.compose(composer, part, lopd.retrieve(ret, part, args.n_ret, mode))   # (N, J·K, d)
                   for mode in ("same", "other")}
        greedy = dataclasses.replace(train.sample_config(args), temperature=0.0)
        ep = lopd.teacher_rollout(composer, chat, part[:1], latents["same"][:1], greedy)[0]
        print(f"\nWhat the latents carry: each task's latents minus their mean over {len(part)} held-out tasks, "
              "and the mean cosine between two tasks of the same group or of different groups (§4.4):\n")
        print(similarity_table(latents, part))
        print(f"Task {part[0].task_id}: {part[0].text}")
        print(f"The teacher's greedy episode (reward {ep.reward:.2f}): the tokens whose probability moves most "
              "between same-variant and other-variant references:")
        print("\n".join(teacher_shift(composer, chat, ep, latents["same"][0], latents["other"][0])))


def show_episodes(args: train.Args, n: int, path: str) -> str:
    """eval.py --show N: the run's student on its first N held-out tasks, each token coloured by its term of eq. (10)
    against the teacher behind same-shop references, then by how much those references move the teacher against
    other shops'. Writes a self-contained HTML page to `path`; -> path."""
    run = trained_run(args)
    chat = train.chat_of(args, run.tok)
    devices.seed_everything(args.seed + 1)                                  # the evaluation rows' sampling seed
    with torch.no_grad(), devices.precision(run.composer.peft), parallel.gathered(run.student):
        eps = engine.rollout(run.student, chat, run.test[:n], train.sample_config(args))
    return token_page(args, run, chat, eps, path)


def trained_run(args: train.Args):
    """The run rebuilt from OUT (`train.load_run`), a UserError where it has no student yet."""
    run = train.load_run(args)
    if run.student is None:
        raise devices.UserError(f"--run {args.out!r} has no checkpoint yet: train it first (python train.py --out "
                                f"{args.out})")
    return run


def token_page(args: train.Args, run, chat, eps, path: str) -> str:
    """The token view of episodes `eps` (the student's) written to `path`: each reply token's term of eq. (10)
    against the teacher behind the retrieved references, then the world check token by token. -> path."""
    composer, tok, ret, student, tasks = run.composer, run.tok, run.retriever, run.student, [e.task for e in eps]
    with torch.no_grad(), devices.precision(composer.peft), parallel.gathered(student):
        exps = {m: lopd.retrieve(ret, tasks, args.n_ret, m) for m in ("same", "other")}
        lat = {m: lopd.compose(composer, tasks, e) for m, e in exps.items()}         # (N, J·K, d) each
        terms = episode_terms(student, composer, chat, eps, lat["same"], args.top_m)
        shift = teacher_shift_terms(composer, chat, eps, lat["same"], lat["other"])
    same, other = reference_lines(exps["same"]), reference_lines(exps["other"])
    alike = sum(a == b for a, b in zip(exps["same"], exps["other"]))   # a world of one variant: nothing to compare
    warn = (f" Warning: on {alike} of {len(eps)} episodes the other-variant references are the same entries as the "
            "retrieved ones (a world with one variant?), so their rows are 0 by construction." if alike else "")
    sections = [
        ("The student's episodes and its teacher",
         "Each reply token of the student (its own sample, temperature as in training), coloured by its term of "
         f"eq. (10): white 0, red {largest_kl(terms):.4f} nats, the page's largest. Hover a token for δ "
         "(eq. 11), p_S and p_T of the sampled token, and the teacher's likeliest alternatives. Grey: observations (ω = 0). The list: the J references "
         "the teacher's latents were composed from.",
         [episode_html(tok, ep, t, r, None, len(eps), largest_kl(terms)) for ep, t, r in
          zip(eps, terms, same)]),
        ("The world check, token by token",
         "The same tokens, coloured by log p_T(a) behind the retrieved references minus behind references of other "
         "variants only (the tool world's shops, the code world's judges; red: the task's own variant's experience "
         "makes the teacher surer of the student's token; blue: less sure; full colour at 3 nats). The list: the "
         "other variants' references." + warn,
         [episode_html(tok, ep, t, r, s, len(eps)) for ep, t, r, s in zip(eps, terms, other, shift)])]
    with open(path, "w", encoding="utf-8") as f:
        f.write(page(f"{train.student_row(args)} and its teacher, token by token: {args.out}", sections))
    return path


@dataclasses.dataclass
class RecordTask:
    """The task of a record read back (`show_record`): its id, the text of its first user message, its variant where
    the run knows the task (else None: no other variant to compare), and the prompt as it was rendered."""
    task_id: str
    text: str
    variant: str | None
    prompt: str


class RecordChat:
    """The run's `engine.Chat` for episodes read back from text: `begin` gives a RecordTask's prompt as it was
    rendered, and `latent_prompt` puts the framed latent block where `inject.latent_messages` puts it, at the head of
    the first user message, so the teacher reads the prompt it reads in training (tests/test_show.py holds the two
    equal on a rollout's prompt). The records keep no messages or tools to render it from anew."""

    def __init__(self, chat: engine.Chat):
        self.tokenizer, self.framing = chat.tokenizer, chat.framing
        alone = engine.chat_text(self.tokenizer, [{"role": "user", "content": "\x00U"}], None, chat.thinking)
        after = engine.chat_text(self.tokenizer, [{"role": "system", "content": "\x00S"},
                                                  {"role": "user", "content": "\x00U"}], None, chat.thinking)
        self.first = alone[:alone.index("\x00U")]                       # a prompt that opens with the user message
        self.user = after[after.index("\x00S") + 2:after.index("\x00U")]   # what opens it after a system message

    def begin(self, task: RecordTask):
        return task.prompt, None

    def user_start(self, prompt: str) -> int:
        """Where the first user message's content begins in a rendered prompt."""
        if prompt.startswith(self.first):
            return len(self.first)
        if self.user not in prompt:
            raise devices.UserError("the record's prompt has no user message this tokenizer's template would open")
        return prompt.index(self.user) + len(self.user)

    def task_text(self, prompt: str) -> str:
        """The first user message's content (the task), up to its end of turn."""
        at = self.user_start(prompt)
        return prompt[at:prompt.find(self.tokenizer.eos_token, at)]

    def latent_prompt(self, prompt: str, tools, n: int) -> tuple[list[int], int]:
        at = self.user_start(prompt)
        text = prompt[:at] + inject.latent_user_content("", self.framing) + prompt[at:]     # eq. (17)'s sentinel
        return inject.latent_prompt_ids(self.tokenizer, text, n)


def record_episode(tok, record: dict, task, ends: list[str]) -> engine.Episode:
    """An episode rebuilt from a .records.jsonl line (`task_record`). The records keep text, not ids: the prompt,
    each reply and each observation are tokenized again, a piece at a time as the rollout tokenized them. A reply is
    the text up to its first end of turn (`ends`, its strings), ω = 1; an observation is what follows up to the next
    assistant header (the prompt's text after its last end of turn), ω = 0. A reply whose sampled ids were not the
    tokenizer's own split of its text is scored on that split: the same text, not always the same ids."""
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]       # noqa: E731
    prompt = record["prompt"]
    header = prompt[prompt.rindex(tok.eos_token) + len(tok.eos_token):]       # "\n<|im_start|>assistant\n", ...
    ep = engine.Episode(task, reward=record["reward"])
    ep.add(ids(prompt), sampled=False)
    ep.prompt_len = len(ep.ids)
    turns = record["conversation"].split(header)
    for k, turn in enumerate(turns):
        cut = min([turn.index(e) + len(e) for e in ends if e in turn], default=len(turn))
        if turn[:cut]:
            ep.add(ids(turn[:cut]), sampled=True)
        rest = turn[cut:] + (header if k + 1 < len(turns) else "")
        if rest:
            ep.add(ids(rest), sampled=False)
    return ep


def show_record(args: train.Args, path: str, index: int) -> str:
    """eval.py --show FILE.records.jsonl --index K: record K of an evaluation's records (`task_record`), its reply
    tokens scored again by the run's student and its teacher on the token view (`token_page`), written beside FILE
    as <stem>.show<K>.html. -> that page's path."""
    if not os.path.isfile(path):
        raise devices.UserError(f"--show {path!r}: no such file (give N, or an evaluation's .records.jsonl)")
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not 0 <= index < len(records):
        raise devices.UserError(f"--index {index}: {path!r} holds records 0 to {len(records) - 1}")
    run = trained_run(args)
    chat, rec = RecordChat(train.chat_of(args, run.tok)), records[index]
    known = {t.task_id: t for t in run.train + run.test}
    task = RecordTask(str(rec["task_id"]), chat.task_text(rec["prompt"]),
                      getattr(known.get(rec["task_id"]), "variant", None), rec["prompt"])
    ends = [run.tok.decode([i]) for i in engine.eos_ids(run.student, run.tok)]
    ep = record_episode(run.tok, rec, task, ends)
    stem = path[:-len(".records.jsonl")] if path.endswith(".records.jsonl") else os.path.splitext(path)[0]
    return token_page(args, run, chat, [ep], f"{stem}.show{index}.html")


# ----------------------------------------------------------------------------------------------------------------
# Real benchmarks (B.3): eval.py --run DIR --tasks FILE [FILE ...] | envscaler=DIR | bfcl-v3 | acebench=PATH
# ----------------------------------------------------------------------------------------------------------------
# B.3 (Table 5): every benchmark samples at temperature 0.7, top-p 0.95, top-k 20, thinking on. A real model uses
# these in place of its run's wherever the command sets none (eval.py --temperature; with --model, train.py's
# --top-p, --top-k, --max-new-tokens after it); the toy keeps its run's settings (budgets sized for short replies).
# The code benchmarks' budget is 16,384 new tokens a reply. The tool-use ones' budget (40,960 tokens a conversation)
# and max steps (30; ACEBench 20 replies) are a real run's own already (train.PAPER_DEFAULTS' max_len, fitted to the
# model's context, and max_env_steps; acebench.MAX_MESSAGES); B.3 gives them no reply budget, so a reply keeps the
# run's --max-new-tokens (PAPER_DEFAULTS: 10,000).
B3_DECODING = {"temperature": 0.7, "top_p": 0.95, "top_k": 20}
B3_SAMPLING = {**B3_DECODING, "max_new_tokens": 16384}        # the code benchmarks'
B3_BY_BENCHMARK = {"code": B3_SAMPLING, "envscaler": B3_DECODING, "bfcl-v3": B3_DECODING, "acebench": B3_DECODING}
B3_THINKING = True


def b3_args(args, kind: str, given=()) -> train.Args:
    """The run's settings with B.3's sampling for benchmark `kind` (B3_BY_BENCHMARK) in place of its own, except
    what `given` (the names of train.py's flags on the command line) sets; the toy's run keeps its own."""
    if train.is_toy(args):
        return args
    return dataclasses.replace(args, **{k: v for k, v in B3_BY_BENCHMARK[kind].items() if k not in given})


def benchmark_sample_config(args, temperature=None):
    """The code benchmarks' sampling: B.3's for a real model (`b3_args`; a --temperature given to eval.py still
    wins), the run's for the toy."""
    return train.sample_config(b3_args(args, "code"), temperature)


def given_flags(flags) -> set:
    """train.py's flags after --model (["--top-p", "0.9", "--max-new-tokens=512"]) -> their Args fields."""
    return {f[2:].split("=")[0].replace("-", "_") for f in flags if f.startswith("--")}


def load_eval_student(args):
    """The run's student for a benchmark: the backbone with the latest checkpoint's student (a full HF folder, or a
    LoRA adapter with --student-lora), or the backbone itself if the run has no checkpoint yet.
    -> (model, tokenizer, row name)."""
    device, dtype = devices.pick_device(args.device, args.dtype)
    model, tok = train.load_backbone(args, device, dtype)
    serving.start_engine(args, model, args.model or train.toy_backbone(args), memory.free_memory(device))
    ckpt = checkpoints.latest_checkpoint(args.out)
    if ckpt is None:                     # eval.py --model, or a run not trained yet: the backbone as it is
        plain = not os.path.isfile(os.path.join(args.out, "args.json"))
        return model, tok, f"{args.model} ({models.provenance(args.model)})" if plain else \
            "vanilla (the run has no checkpoint)"
    saved = models.saved_student(os.path.join(ckpt, "student"), dtype, model if args.student_lora else None)
    return saved.to(device).eval(), tok, f"{train.student_row(args)} ({os.path.basename(ckpt)})"


def eval_benchmarks(args, files, n_test: int = 0, temperature=None) -> Scored:
    """The run's student on each benchmark file (TACO, LiveCodeBench, HumanEval+, MBPP+ or ours; worlds/tool_world.py): A.5's
    coding system prompt for TACO / LiveCodeBench, none for EvalPlus (B.3; CodeWorld.reset), the sampling of `args`
    (B.3's, `b3_args`, as `main` gives them). Prints the table and writes its files (`result_stem`, `write_result`)."""
    model, tok, name = load_eval_student(args)
    cfg, rows, records = train.sample_config(args, temperature), [], []
    thinking = bool(args.thinking) if train.is_toy(args) else B3_THINKING
    stem = result_stem(args.out, code_what(files), n_test, temperature)
    for path in files:
        problems = code_benchmarks.load_problems(path)
        problems = problems[:n_test] if n_test else problems
        log = {}
        chat = engine.Chat(tok, functools.partial(code_world.CodeWorld, log=log), thinking)   # log: per problem
        devices.seed_everything(args.seed + 1)
        _, done = rollout_recorded(model, chat, problems, cfg, Recording(tok, os.path.basename(path), log, stem))
        rows += results.benchmark_rows(problems, log, os.path.basename(path))
        records += done
    print(results.benchmark_table(rows, name))
    return write_result(stem, {"student": name, "rows": rows}, records)


def code_what(files) -> str:
    """What the code benchmarks' files are named by: their files' names, joined (lcb_v5-HumanEvalPlus)."""
    return "-".join(os.path.splitext(os.path.basename(f))[0] for f in files)


def eval_envscaler(args, where: str, n_test: int = 0, temperature=None) -> Scored:
    """The run's student on EnvScaler's held-out tasks (worlds/envscaler.py: the release at `where`, a folder or hf,
    split by its rule into B.3's 200), by the official episode rules: the mean reward (Table 1's column), with
    Table 3's behaviour counts beside it. The sampling and budgets of `args` (B.3's, `b3_args`; 30 steps). Prints
    the table and writes its files (`write_result`)."""
    from worlds import envscaler
    _, test, split = envscaler.load_release(where)                   # a bad folder: one line, before the model
    tasks = test[:n_test] if n_test else test
    model, tok, name = load_eval_student(args)
    log, stem = {}, result_stem(args.out, "envscaler", n_test, temperature)
    world = functools.partial(envscaler.EnvScalerWorld, max_steps=args.max_env_steps, log=log)
    devices.seed_everything(args.seed + 1)
    eps, records = rollout_recorded(model, engine.Chat(tok, world, bool(args.thinking)), tasks,
                                    train.sample_config(args, temperature), Recording(tok, "envscaler", log, stem))
    rows = [{"split": "test", "tasks": len(tasks), **engine.summarize(eps)}]
    print(f"EnvScaler, {len(tasks)} held-out tasks ({split['rule']})\n")
    print(results.markdown_table({name: rows[0]}, table="behaviour"))
    result = {"student": name, "release": split["env_metadata"], "split": split["rule"], "rows": rows}
    return write_result(stem, result, records)


def eval_bfcl(args, categories, n_test: int = 0, temperature=None) -> Scored:
    """The run's student on BFCL-v3 multi-turn (bfcl.py): per category BFCL's accuracy (every turn passes its
    checker) and the mean fraction of turns passed (the training reward), then their mean over the categories as
    BFCL averages them. The sampling and budgets of `args` (B.3's, `b3_args`). Prints the table and writes its files
    (`write_result`)."""
    from worlds import bfcl
    model, tok, name = load_eval_student(args)
    cfg, rows, records = train.sample_config(args, temperature), [], []
    stem = result_stem(args.out, bfcl_what(categories), n_test, temperature)
    for cat in categories:
        single = cat in bfcl.SINGLE_TURN                      # one reply, BFCL's AST checker
        tasks = bfcl.load_single_turn([cat]) if single else bfcl.load_tasks([cat])
        tasks, log = (tasks[:n_test] if n_test else tasks), {}
        steps = {} if single else {"max_steps": args.max_env_steps or bfcl.MAX_STEPS_PER_TURN}   # B.3: 30
        world = functools.partial(bfcl.BFCLSingleWorld if single else bfcl.BFCLWorld, log=log, **steps)
        chat = engine.Chat(tok, world, bool(args.thinking))
        devices.seed_everything(args.seed + 1)
        records += rollout_recorded(model, chat, tasks, cfg, Recording(tok, f"bfcl-v3:{cat}", log, stem))[1]
        passed = sum(v["passed"] for v in log.values())                      # BFCL's verdict per task
        turns = sum(v["turns_passed"] / v["turns"] for v in log.values())     # the training reward per task
        rows.append({"category": cat, "tasks": len(tasks), "accuracy": passed / len(tasks),
                     "turns": turns / len(tasks)})
    print(results.bfcl_table(rows, name, single=bfcl.SINGLE_TURN))
    result = {"student": name, "release": bfcl.RELEASE, "rows": rows}
    return write_result(stem, result, records)


def eval_acebench(args, path, regimes, n_test: int = 0, temperature=None, *, user_model: str = "") -> Scored:
    """The run's student on ACEBench's English agent tasks (worlds/acebench.py), from the clone at `path`: per
    regime ACEBench's end-to-end and process accuracy (its own checker), then both over all the tasks (Figure 5's
    overall). The multi-turn user simulator is `user_model` (--user-model; "" = the run's backbone). The sampling
    and budgets of `args` (B.3's, `b3_args`). Prints the table and writes its files (`write_result`)."""
    from worlds import acebench
    tasks = {r: acebench.load_tasks(path, [r])[:n_test or None] for r in regimes}   # a bad clone: one line, now
    model, tok, name = load_eval_student(args)
    user = acebench.ModelUser(*acebench_user(args, model, tok, user_model),
                              min(acebench.USER_MAX_TOKENS, args.max_new_tokens))
    cfg, rows, records = train.sample_config(args, temperature), [], []
    stem = result_stem(args.out, acebench_what(regimes), n_test, temperature)
    for regime, part in tasks.items():
        log = {}
        chat = engine.Chat(tok, functools.partial(acebench.AceBenchWorld, user=user, log=log), bool(args.thinking))
        devices.seed_everything(args.seed + 1)
        records += rollout_recorded(model, chat, part, cfg, Recording(tok, f"acebench:{regime}", log, stem))[1]
        verdict = acebench.score(part, [log[t.task_id]["record"] for t in part])    # ACEBench's, over the regime
        if "error" in verdict:
            print(f"acebench {regime}: ACEBench's checker gave no verdict, scored 0 ({verdict['error']})")
        rows.append({"regime": regime, "tasks": len(part), **verdict})
    rows.append(results.acebench_overall(rows))
    print(results.acebench_table(rows, name))
    result = {"student": name, "clone": os.path.abspath(path), "user_model": user_model or "the backbone",
              "rows": rows}
    return write_result(stem, result, records)


def acebench_user(args, student, tok, spec: str):
    """--user-model: the model that plays ACEBench's user -> (model, tokenizer). "" = the run's backbone: the model
    under evaluation itself where there is no checkpoint, else the backbone loaded again; or an HF id or folder."""
    if not spec and checkpoints.latest_checkpoint(args.out) is None:
        return student, tok
    device, dtype = devices.pick_device(args.device, args.dtype)
    if not spec:
        return train.load_backbone(args, device, dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        models.check_causal_lm(spec)
    except devices.UserError as err:
        raise devices.UserError(str(err).replace("--model", "--user-model", 1)) from None
    user_tok = AutoTokenizer.from_pretrained(spec)
    user_tok.pad_token = user_tok.pad_token or user_tok.eos_token        # one row at a time, but the cache pads
    return AutoModelForCausalLM.from_pretrained(spec, dtype=dtype).to(device).eval(), user_tok


# ----------------------------------------------------------------------------------------------------------------
# --tasks: the benchmarks it names, read before any model loads; several: Table 1's columns (§4.1)
# ----------------------------------------------------------------------------------------------------------------
BENCHMARK_NAMES = ("bfcl-v3", "bfcl-v3:single", "envscaler=DIR", "acebench=PATH")   # --tasks values, not files
TOOL_USE = ("bfcl-v3", "envscaler=", "acebench=")                                  # what they start with


@dataclasses.dataclass
class Benchmark:
    """One benchmark of --tasks (`parse_tasks`)."""
    kind: str          # code | envscaler | bfcl-v3 | acebench (B3_BY_BENCHMARK's keys)
    what: str          # what its files are named by (`result_stem`): lcb_v5-HumanEvalPlus, envscaler, bfcl-v3_base
    value: object      # code: the files; envscaler: DIR or hf; bfcl-v3: the categories; acebench: (PATH, regimes)


def parse_tasks(specs) -> list[Benchmark]:
    """--tasks's values -> the benchmarks they name, each read far enough to fail in one line before any model
    loads. Code files together are one benchmark (one evaluation, Table 2's); bfcl-v3, envscaler= and acebench= are
    one each (Table 1's), each named at most once; the two kinds go in separate commands."""
    files = [s for s in specs if not s.startswith(TOOL_USE)]
    benches = [Benchmark("code", code_what(files), files)] if files else []
    benches += [tool_use_benchmark(s) for s in specs if s.startswith(TOOL_USE)]
    kinds = [b.kind for b in benches]
    twice = next((k for k in kinds if kinds.count(k) > 1), None)
    if twice:
        raise devices.UserError(f"--tasks names {twice} twice: give each benchmark once")
    if files and len(benches) > 1:
        raise devices.UserError("--tasks: code benchmark files (Table 2) and bfcl-v3, envscaler=, acebench= (Table 1) "
                                "go in separate commands")
    return benches


def tool_use_benchmark(spec: str) -> Benchmark:
    """One of bfcl-v3[:CATS], envscaler=DIR (or hf) and acebench=PATH[:REGIME] -> its Benchmark, checked: the
    categories or regimes exist, BFCL is installed, the folder holds EnvScaler's release, the clone is ACEBench's."""
    if spec.startswith("envscaler="):
        from worlds import envscaler
        where = spec.removeprefix("envscaler=")
        if where != "hf":                                  # the Hub's files are fetched when they are read
            envscaler.find_release(where)
        return Benchmark("envscaler", "envscaler", where)
    if spec.startswith("acebench="):
        from worlds import acebench
        path, regimes = acebench.parse_spec(spec)
        acebench.load_tasks(path, regimes)
        return Benchmark("acebench", acebench_what(regimes), (path, regimes))
    from worlds import bfcl
    categories = bfcl_categories(spec)
    if categories is None:
        raise devices.UserError(f"--tasks {spec!r}: no such benchmark; expected {', '.join(BENCHMARK_NAMES)}, or "
                                "bfcl-v3:CATEGORY")
    bfcl.package_dir()                                     # installed, or one line naming the install
    return Benchmark("bfcl-v3", bfcl_what(categories), categories)


def evaluate_benchmark(args, bench: Benchmark, a) -> Scored:
    """One benchmark of --tasks with eval.py's options `a` (--n-test, --temperature, --user-model)."""
    if bench.kind == "code":
        return eval_benchmarks(args, bench.value, a.n_test, a.temperature)
    if bench.kind == "envscaler":
        return eval_envscaler(args, bench.value, a.n_test, a.temperature)
    if bench.kind == "bfcl-v3":
        return eval_bfcl(args, bench.value, a.n_test, a.temperature)
    path, regimes = bench.value
    return eval_acebench(args, path, regimes, a.n_test, a.temperature, user_model=a.user_model)


def fit_budgets(args, bench: Benchmark, n_test: int, given=()) -> train.Args:
    """One benchmark's budgets before the model loads (memory.eval_budgets: on a CPU, replies and steps that take
    minutes where the command set none, `given` the names of train.py's flags on it; conversations within the
    model's context), said in one line with the tasks and the device. The toy's run keeps its own (train.py fitted
    them to its backbone)."""
    from worlds import acebench
    device, real = devices.device_type(args.device), not train.is_toy(args)
    n_ctx = getattr(models.check_causal_lm(args.model), "max_position_embeddings", None) if real else None
    args, whence = memory.eval_budgets(args, device == "cpu" and real, n_ctx, given)
    steps = {"code": "one reply a problem", "acebench": f"{acebench.MAX_MESSAGES} messages (ACEBench's)",
             "bfcl-v3": f"{args.max_env_steps} steps a turn", "envscaler": f"{args.max_env_steps} steps"}[bench.kind]
    steps += f" ({whence['max_env_steps']}; --max-env-steps sets it)" if bench.kind in ("bfcl-v3", "envscaler") else ""
    parts = bench.value if bench.kind == "bfcl-v3" else bench.value[1] if bench.kind == "acebench" else ()
    named = f"{bench.kind} ({', '.join(parts)})" if parts else bench.what
    devices.say(f"evaluation: {named}, {f'the first {n_test}' if n_test else 'all'} tasks"
                f"{' of each part' if bench.kind in ('code', 'bfcl-v3', 'acebench') else ''}; replies up to "
                f"{args.max_new_tokens:,} tokens ({whence['max_new_tokens']}; --max-new-tokens sets it); at most "
                f"{steps}; conversations up to {args.max_len:,} tokens ({whence['max_len']}); on {device}")
    return args


# §4.1, Table 1: the student's row of EnvScaler, BFCL-v3 and ACEBench, each benchmark sampled as B.3 says
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens", "max_len", "thinking")   # the table records them


def eval_table1(args, benches, a, given=()) -> dict:
    """Several tool-use --tasks: each benchmark in turn with its own B.3 sampling (`b3_args`; `given`: train.py's
    flags on the command line), each writing the files it writes alone, then one row of Table 1's columns on the
    paper's 0-100 scale from what they wrote, into OUT/table1_<benchmarks>_<split>[_T<t>].md and .json
    (`result_stem`: never over another's). -> the table's JSON."""
    scored, sampling = {}, {}
    for bench in benches:
        bargs = fit_budgets(b3_args(args, bench.kind, given), bench, a.n_test, given)
        scored[bench.kind] = evaluate_benchmark(bargs, bench, a)
        sampling[bench.kind] = {k: getattr(bargs, k) for k in SAMPLING_FIELDS}
        sampling[bench.kind]["temperature"] = bargs.temperature if a.temperature is None else a.temperature
    order = [k for k in results.TABLE1 if k in scored]                     # Table 1's, whatever the command's
    student = scored[order[0]].result["student"]
    cells = results.table1_cells({k: scored[k].result for k in order})
    table = {"student": student, "scale": "0-100", "columns": cells, "sampling": {k: sampling[k] for k in order},
             "files": {k: os.path.basename(scored[k].path) for k in order}}
    stem = result_stem(args.out, "table1_" + "-".join(b.what for k in order for b in benches if b.kind == k),
                       a.n_test, a.temperature)
    checkpoints.write_json(stem + ".json", table)
    with checkpoints.atomic_open(stem + ".md") as f:
        f.write(results.table1_markdown(student, cells) + "\n")
    print("\n" + results.table1_markdown(student, cells))
    print(f"written to {stem}.md and {stem}.json")
    return table


def bfcl_what(categories) -> str:
    """What BFCL-v3's files are named by: bfcl-v3 (the paper's four), bfcl-v3_single, bfcl-v3_base-miss_func."""
    from worlds import bfcl
    return "bfcl-v3" + ("" if list(categories) == list(bfcl.CATEGORIES) else
                        "_single" if list(categories) == list(bfcl.SINGLE_TURN) else "_" + "-".join(categories))


def acebench_what(regimes) -> str:
    """What ACEBench's files are named by: acebench (both regimes), acebench_multi_turn."""
    from worlds import acebench
    return "acebench" + ("" if list(regimes) == list(acebench.REGIMES) else "_" + "-".join(regimes))


def bfcl_categories(spec: str) -> list[str] | None:
    """--tasks bfcl-v3 (its four multi-turn categories, the paper's), bfcl-v3:single (the single-turn Python
    categories) or bfcl-v3:CAT[,CAT] -> the categories; None for anything else (benchmark files)."""
    from worlds import bfcl
    name, _, cats = spec.partition(":")
    if name != "bfcl-v3":
        return None
    cats = list(bfcl.SINGLE_TURN) if cats == "single" else cats.split(",") if cats else list(bfcl.CATEGORIES)
    unknown = [c for c in cats if c not in bfcl.CATEGORIES + bfcl.SINGLE_TURN]
    if unknown:
        raise devices.UserError(f"--tasks {spec}: no BFCL-v3 category {unknown[0]!r}; expected one of "
                                f"{', '.join(bfcl.CATEGORIES + bfcl.SINGLE_TURN)}, or single")
    return cats


# ----------------------------------------------------------------------------------------------------------------
# The token view (--show): what the teacher knows, token by token, as one self-contained HTML page (§3.3, eqs. 9-12)
# ----------------------------------------------------------------------------------------------------------------
# The method's idea sits on a few tokens: where the teacher behind its latents disagrees with the student. The page
# shows each held-out episode of the student in order. Every token the student sampled (ω = 1) is coloured by its
# term of eq. (10), the reverse KL(p̃S ‖ p̃T) over the teacher's top-M ids and the tail; hovering over it (a title
# attribute: no script) gives δ of eq. (11), the sampled token's probability under student and teacher, and the
# teacher's five likeliest alternatives. Observations (ω = 0) are grey. Above each episode: its reward, A = 2r − 1,
# its share of Δ (eq. 12), and the J references the retriever gave the teacher. A second section scores the same
# episodes under the teacher behind same-shop references and behind other-shop references and colours each token by
# the difference of its log-probability: the world check, token by token.
# The numbers are the training path's: `lopd.student_teacher_logits` for the scores and `losses.token_terms` for
# eqs. (9)-(11), the function `losses.lopd_objective` itself calls; tests/test_show.py checks that the page's KL
# terms add up to the `loss/distill` that training logs for the same batch. The page holds no script, no external
# resource, and escapes every token and observation (a token may be `<script>`).
# Long observations (a tool's answer, a program's output) are cut in the middle so a page of a 4,000-token episode
# stays readable: the first and last characters of a longer grey run are kept.
# A benchmark's records (OUT/<name>.records.jsonl, a task a line with its conversation as text) open in the same view
# (--show FILE --index K, `show_record`): the text is tokenized again (`record_episode`) and the teacher's latent
# prompt made from the prompt's text (`RecordChat`), since a record keeps neither the sampled ids nor the messages.
OBSERVATION_CHARS = 400


@torch.no_grad()
def episode_terms(student, composer, chat, eps, latents, top_m: int = losses.TOP_M) -> list[dict]:
    """Per episode, per continuation token: its id, ω, and (on ω tokens) the KL term of eq. (10), δ of eq. (11),
    p_S(a), p_T(a) and the teacher's top-5 ids with their probabilities. chat: the run's engine.Chat; latents
    (B, J·K, d)."""
    ls, lt, ids, omega = lopd.student_teacher_logits(student, composer, chat, eps, latents)   # (B, Tc, V), (B, Tc)
    sel = omega.bool()                                                          # (B, Tc)
    logp_s, logp_t = losses.supervised_logprobs(ls, sel), losses.supervised_logprobs(lt, sel)   # (N, V) each
    kl, lt_a, ls_a = losses.token_terms(logp_s, logp_t, ids[sel].unsqueeze(-1), top_m)          # (N,) each
    delta = losses.privilege_delta(lt_a, ls_a)                                  # (N,) eq. (11)
    top_p, top_i = logp_t.exp().topk(5, dim=-1)                                 # (N, 5)
    kl, delta, p_s, p_t = (x.tolist() for x in (kl, delta, ls_a.exp(), lt_a.exp()))
    top_p, top_i, sel = top_p.tolist(), top_i.tolist(), sel.tolist()
    rows, k = [], 0
    for b, ep in enumerate(eps):
        toks = []
        for t in range(len(ep.ids) - ep.prompt_len):
            tid = ep.ids[ep.prompt_len + t]                                    # the sampled id, as scored
            if not sel[b][t]:
                toks.append({"id": tid, "omega": 0})
                continue
            toks.append({"id": tid, "omega": 1, "kl": kl[k], "delta": delta[k], "p_s": p_s[k], "p_t": p_t[k],
                         "alts": list(zip(top_i[k], top_p[k]))})
            k += 1
        rows.append({"tokens": toks})
    return rows


@torch.no_grad()
def teacher_logprobs(composer, chat, eps, latents):
    """log p_T(a_t) of each episode's own sampled tokens behind `latents` (B, J·K, d): (B, Tc), 0 on observations."""
    lp = lopd.teacher_logits(composer, chat, eps, latents).float().log_softmax(-1)                 # (B, Tc, V)
    conts, omega = engine.continuation(eps, latents.device)                                           # ω (B, Tc)
    ids = torch.zeros(omega.shape, dtype=torch.long, device=latents.device)                        # (B, Tc)
    for b, c in enumerate(conts):
        ids[b, :len(c)] = torch.tensor(c, device=latents.device)
    return lp.gather(-1, ids.unsqueeze(-1)).squeeze(-1) * omega                                     # (B, Tc)


def teacher_shift_terms(composer, chat, eps, lat_same, lat_other) -> list[list[float]]:
    """Per episode, per continuation token: log p_T(a) behind same-shop latents minus behind other-shop latents
    (0 on observations). lat_* (B, J·K, d)."""
    move = teacher_logprobs(composer, chat, eps, lat_same) - teacher_logprobs(composer, chat, eps, lat_other)  # (B, Tc)
    return [move[b, :len(ep.ids) - ep.prompt_len].tolist() for b, ep in enumerate(eps)]


def _colour(value: float, scale: float, negative: bool = False) -> str:
    """White for 0, red at `scale` (blue below 0 where `negative`): a CSS background."""
    x = max(-1.0, min(1.0, value / scale)) if scale > 0 else 0.0
    if x < 0 and negative:
        return f"rgb({int(255 * (1 + x))},{int(255 * (1 + x))},255)"
    x = max(0.0, x)
    return f"rgb(255,{int(255 * (1 - x))},{int(255 * (1 - x))})"


def _token_text(tok, tid: int) -> str:
    return tok.decode([tid], skip_special_tokens=False)


def _grey(text: str) -> str:
    if len(text) > OBSERVATION_CHARS:
        half = OBSERVATION_CHARS // 2
        text = text[:half] + f" … [{len(text) - OBSERVATION_CHARS} characters] … " + text[-half:]
    return f'<span class="obs">{html.escape(text, quote=True)}</span>'


def episode_html(tok, ep, terms: dict, refs: list[str], shift: list[float] | None = None,
                 n_traj: int = 1, scale: float | None = None) -> str:
    """One episode as HTML: a header (task, reward, A, its share of Δ, references), then its tokens. scale: the KL
    that is full red (default: this episode's largest; a page passes its own largest, so colours compare)."""
    omega_terms = [x for x in terms["tokens"] if x["omega"]]
    A = 2 * ep.reward - 1
    mean_delta = sum(x["delta"] for x in omega_terms) / max(1, len(omega_terms))
    largest = max([x["kl"] for x in omega_terms] + [1e-6])
    scale = scale or largest
    head = (f'<h3>{html.escape(ep.task.task_id)}: {html.escape(ep.task.text)}</h3>'
            f'<p class="meta">reward {ep.reward:.2f} · A = 2r − 1 = {A:+.2f} · share of Δ (eq. 12) A·mean δ / '
            f'{n_traj} = {A * mean_delta / n_traj:+.4f} · reply tokens {len(omega_terms)} · largest KL term '
            f'{largest:.4f} nats</p><ol class="refs">' +
            "".join(f"<li>{html.escape(r)}</li>" for r in refs) + "</ol>")
    spans, grey = [], []
    for t, x in enumerate(terms["tokens"]):
        text = _token_text(tok, x["id"])
        if not x["omega"]:
            grey.append(text)
            continue
        if grey:
            spans.append(_grey("".join(grey)))
            grey = []
        alts = ", ".join(f"{_token_text(tok, i)!r} {p:.2f}" for i, p in x["alts"])
        tip = (f"KL {x['kl']:.4f} · δ {x['delta']:+.3f} · p_S {x['p_s']:.3f} · p_T {x['p_t']:.3f} · "
               f"teacher's top 5: {alts}")
        if shift is not None:
            tip += f" · same − other variant {shift[t]:+.2f} nats"
            bg = _colour(shift[t], 3.0, negative=True)
        else:
            bg = _colour(x["kl"], scale)
        spans.append(f'<span class="tok" style="background:{bg}" title="{html.escape(tip, quote=True)}">'
                     f'{html.escape(text, quote=True)}</span>')
    if grey:
        spans.append(_grey("".join(grey)))
    return f'<section class="ep">{head}<pre>{"".join(spans)}</pre></section>'


STYLE = """body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}
pre{white-space:pre-wrap;font:13px/1.5 monospace;border:1px solid #ddd;padding:8px}
.obs{color:#999}.tok{border-radius:2px}.meta{color:#555;font-size:13px}.refs{font-size:12px;color:#555}
.key span{padding:0 6px}"""


def page(title: str, sections: list[tuple[str, str, list[str]]]) -> str:
    """The whole page: sections of (heading, explanation, episodes' HTML)."""
    body = "".join(f"<h2>{html.escape(h)}</h2><p>{html.escape(p)}</p>{''.join(eps)}" for h, p, eps in sections)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>")


def largest_kl(terms: list[dict]) -> float:
    """The largest KL term of a page's episodes: the colour scale they share."""
    return max([x["kl"] for t in terms for x in t["tokens"] if x["omega"]] + [1e-6])


def reference_lines(experiences) -> list[list[str]]:
    """The task line of each retrieved reference (what the teacher's latents were composed from)."""
    return [[(e.get("task") or "(no reference)").splitlines()[0][:160] for e in es] for es in experiences]


def plain_model_args(a, flags) -> train.Args:
    """--model without a run: train.py's settings for that backbone (its defaults, the paper's for a real model;
    `flags`, train.py's, change them: --max-new-tokens 512), writing into --out (default runs/eval/<name>), where
    no checkpoint is: the model is scored as it is."""
    name = os.path.basename(a.model.rstrip("/")) or "model"
    return train.parse_args(["--model", a.model, "--out", a.out or os.path.join("runs", "eval", name), *flags])


def main(argv=None):
    p = preflight.OneLineParser(description="Evaluate a run on held-out tasks.")
    p.add_argument("--run", default="", help="run folder written by train.py (holds args.json)")
    p.add_argument("--model", default="", metavar="ID_OR_FOLDER",
                   help="instead of --run: this model itself (an HF id or folder, train.py --model) on --tasks; "
                        "train.py's flags after it set its settings (--max-new-tokens 512)")
    p.add_argument("--out", default="", help="with --model: where its files go (default runs/eval/<model's name>)")
    p.add_argument("--n-test", type=int, default=0, help="evaluate only the first N held-out tasks (0 = all); with --tasks, the first N "
                        "problems of each benchmark file, of each BFCL-v3 category or ACEBench regime, or of "
                        "EnvScaler's held-out tasks")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: the run's; with --tasks and a real model, B.3's 0.7)")
    p.add_argument("--inspect-latents", action="store_true",
                   help="what the composer carries: how latents differ between tasks of the same and of other "
                        "shops and families, and the teacher's tokens that move most between same- and "
                        "other-variant references (§4.4)")
    p.add_argument("--world-check", action="store_true",
                   help="also base + composer with other-variant references and with no reference (does the teacher "
                        "use the experience?)")
    p.add_argument("--conventions", action="store_true",
                   help="toy code world: per row, which output conventions replies write and whether each is right "
                        "for the problem's judge")
    p.add_argument("--tasks", nargs="+", default=None, metavar="FILE",
                   help="evaluate the run's student on these benchmark files instead (TACO, LiveCodeBench, "
                        "HumanEval+, MBPP+ JSONL; pass@1 per benchmark beside the paper's Table 2), or on bfcl-v3 "
                        "(BFCL-v3 multi-turn: base, miss_func, miss_param, long_context; bfcl-v3:base for one; "
                        "bfcl-v3:single for the single-turn AST categories; needs pip install --no-deps "
                        "bfcl-eval==2025.7.17), or on acebench=PATH (ACEBench's English agent tasks from a clone "
                        "at PATH: M-Step, M-Turn, overall; acebench=PATH:multi_turn for one regime), or on "
                        "envscaler=DIR (EnvScaler's release in DIR, or hf: its 200 held-out tasks, mean reward). "
                        "Several of bfcl-v3, envscaler=, acebench=: each evaluated as alone, then one row of Table "
                        "1's columns (0-100) in OUT/table1_*.md and .json. A real model samples as B.3 says: "
                        "temperature 0.7, top-p 0.95, top-k 20, and 16,384 new tokens a reply on code files (the "
                        "tool-use benchmarks keep the run's reply budget, 40,960-token conversations and 30 steps, "
                        "ACEBench 20 replies); "
                        "--temperature, and train.py's flags after --model, win; the toy keeps its run's")
    p.add_argument("--user-model", default="", metavar="ID_OR_FOLDER",
                   help="with --tasks acebench=PATH: the model that plays ACEBench's user in its multi-turn tasks "
                        "(default: the run's backbone; the paper used deepseek-v4-flash through an API)")
    p.add_argument("--show", nargs="?", const="5", default="", metavar="N_OR_FILE",
                   help="write OUT/show.html: N held-out episodes of the student (default 5), each token coloured by "
                        "what the teacher knows; or an evaluation's FILE.records.jsonl: its record --index K, scored "
                        "again by the run's student and teacher, into FILE.show<K>.html")
    p.add_argument("--index", type=int, default=0, metavar="K",
                   help="with --show FILE.records.jsonl: which record, counted from 0 (default 0)")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                   help="what generates the rollouts (train.py --engine): hf, or vllm (runtime/serving.py)")
    p.add_argument("--unsafe-no-sandbox", action="store_true",
                   help="run untrusted code (programs, environments, BFCL's calls) even where the kernel cannot "
                        "confine it (train.py --unsafe-no-sandbox); asked again here, whatever the run was "
                        "trained with")
    a, rest = p.parse_known_args(argv)         # with --model, train.py's flags set the model's settings
    preflight.check_eval(p, a, rest, BENCHMARK_NAMES, TOOL_USE)     # before the run is read: one line at once
    with devices.one_line_errors():                 # a category, regime, clone or release that is not there
        benches = parse_tasks(a.tasks) if a.tasks else []
    args = plain_model_args(a, rest) if a.model else train.load_args(a.run)
    # the folder given, wherever it was trained; the engine this command asks for, whichever trained it
    args = dataclasses.replace(args, out=a.run or args.out, engine=a.engine,
                               unsafe_no_sandbox=a.unsafe_no_sandbox)
    os.makedirs(args.out, exist_ok=True)
    with devices.one_line_errors():            # programs, environments and BFCL's calls run confined, or not at all
        sandbox.require_for(train.environment(args), args.unsafe_no_sandbox, f"--env {args.env}")
        if a.tasks:
            sandbox.check_confinement(f"--tasks {' '.join(a.tasks)}")
    if benches:                                      # B.3's sampling per benchmark, where the command set none
        with devices.one_line_errors():
            if len(benches) > 1:
                return eval_table1(args, benches, a, given_flags(rest))
            given, bench = given_flags(rest), benches[0]
            bargs = fit_budgets(b3_args(args, bench.kind, given), bench, a.n_test, given)
            return evaluate_benchmark(bargs, bench, a).result["rows"]
    if a.conventions and (args.env != "code" or args.tasks):
        p.error(f"--conventions: the run {a.run!r} is not on the toy code world, the only one with judges' conventions")
    if a.show:
        with devices.one_line_errors():
            path = (show_episodes(args, int(a.show), os.path.join(a.run, "show.html")) if a.show.isdigit() else
                    show_record(args, a.show, a.index))
        print(f"wrote {path}")
        return
    keep = {} if a.conventions else None
    with devices.one_line_errors():
        rows, run, tasks = final_eval(args, a.n_test, a.temperature, a.world_check, keep)
    print(results.markdown_table(rows, table=train.environment(args).results))
    print(f"written to {os.path.join(a.run, eval_name(len(tasks), a.temperature, a.world_check))}.md and .json")
    if a.conventions:
        print(conventions_table(run.tok, keep))
    if a.inspect_latents:
        inspect_latents(args, run, tasks)


if __name__ == "__main__":
    main()
