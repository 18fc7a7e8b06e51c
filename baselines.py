"""The baselines of B.1 and the RFT control, on LOPD's own loop: each step beside its loss.

Each method shares with LOPD (lopd.py) the rollout, the re-scoring of the student's sampled ids, the optimizer step
and the evaluation. What differs is only the teacher's context and the loss, each kept as its paper has it:

    method   teacher                  its context                            loss
    lopd     frozen θ̄ (LoRA off)      latents c_φ of J retrieved trajs       reverse KL, teacher top-M + tail, eq. 13
    rft      none                     none: NLL of the bank's successes      masked NLL (the control; no rollouts)
    grpo     none                     none                                   PPO-clip, group-normalised Â
    opsd     frozen θ̄                 a successful traj. of the SAME task    forward KL, full vocabulary
    sdpo     EMA of θ (rate 0.05)     a successful SIBLING of the group      reverse KL, student top-K + tail
    sdft     EMA of θ (rate 0.01)     the task's demonstration (the pool's)  forward KL, full vocabulary
    skillsd  θ itself, detached       one skill of its family, by UCB1       PPO-clip (0.2, 0.28) + λ_sdl·IW reverse KL

    python train.py --method grpo          # or rft | opsd | sdpo | sdft | skillsd: the same pipeline and evaluation
    python -m pytest tests/test_baselines.py -q

`METHODS` at the bottom is what train.py runs beside LOPD's own entry (lopd.METHOD): per method, what it keeps across
steps and one step. A new method is a step function, its loss and one entry there (docs/adding-a-method.md).

Deviations from the papers
--------------------------
1. GRPO and Skill-SD take one update per batch, as LOPD does, so their PPO clip never binds (ρ = 1).
2. OPSD's pool (SDFT's too) is the bank's successes, and the environment's oracle trace where a task has none (B.1
   asks stronger models to write them).
3. On the toy backbone the text teachers (OPSD, SDPO, SDFT, Skill-SD) read their text in the framed span where
   LOPD's latents go (`engine.Chat.context_prompt`, "span"): the toy learned to read a reference only there, and
   only a trace. Real models get the B.1 system-message wording (OPSD), a reprompt appended to the task (SDPO), and
   B.1's wordings appended to the first user message (SDFT, Skill-SD; --text-context chooses only span or not).
   Skill-SD's span holds its skill's suggested workflow alone (the trace of the best attempt it was written from);
   the other two fields are still written and logged.
4. RFT spends no rollouts of its own: it re-reads the bank (its generations are the bank's).
5. Skill-SD's skills on the toy backbone, which cannot write prose: `toy_skill`, a deterministic summary of the
   family's traces. A real model's are written by the frozen base θ̄ (`SKILL_WRITER_PROMPT`).

Choices B.1 leaves open (Skill-SD, arXiv 2604.10674. What we could read of it, its abstract and its project page
k1xe.github.io/skill-sd, says that "completed trajectories are summarized into compact natural language skills that
describe successful behaviors, mistakes, and workflows" ("each completed trajectory", the page says: successes and
failures alike), that skills condition only the teacher, that the teacher is synchronised with the improving student,
that the reverse KL is importance-weighted to make its gradient right, and that skills are retrieved by a UCB bandit;
its method section and code were not open to us, so how an arm is valued is ours. B.1 says only "each task selects
one skill from a skill bank via UCB1 (c = √2)" and "skills are distilled from rollout trajectories".)
------------------------------------------------------------------------------------------------------------------
a. The teacher is the student itself behind its skill, detached (sg[θ]): the closest synchronisation (every step)
   and no second copy of the model in memory.
b. Skills belong to a task family, the task's `variant` and `schema` ("" where a world has none), B.1's "similar
   past task": one per family from the base rollouts at setup (the bank's, already counted as generations), then
   after each step one per task from its G rollouts, whether or not the group has a success (the paper summarises
   every completed trajectory; a group rather than each trajectory: one generation per task). The writer is the
   frozen base θ̄ (nothing we could read names Skill-SD's), greedy, thinking off, from the family's best attempts
   and worst failures; every skill is appended to OUT/skill_bank.jsonl, which --resume replays.
c. UCB1's arms are the task's family's skills (every skill where its family has none); a step's tasks all choose
   from the bank as it stood at the step's start, so that every rank chooses alike. An arm's reward must be
   something the skill changes: the student's rollouts never see the skill (they are sampled from the plain
   prompt), so their reward measures the task, not the skill. What the skill does change is the teacher: on each
   rollout, its edge e = mean over ω of log πT(a) − log πθ(a), the skill's effect on the same model's log-probs
   (`skill_edges`), which is where λ_sdl's reverse KL pulls the student. A pull's reward is the fraction of the
   group's pairs of rollouts with different rewards that the edge orders as the rewards do (ties ½; `skill_value`):
   1 when the skill's teacher favours every better rollout over every worse one, ½ when it cannot tell them apart,
   0 when it favours the failures. It lies in [0, 1] as UCB1 assumes, costs no rollout, and depends on how the
   rewards order the rollouts, not on how high they are (a hard task and an easy one value the same skill alike);
   per token, so that a failure that runs long does not weigh more. A group whose rewards are all equal orders
   nothing: no pull is counted for it.
d. The importance-weighted sampled-token reverse KL is Σ ω·ρ·sg[log πθ(a) − log πT(a)] / Σ ω, ρ = πθ(a)/π_old(a):
   its value estimates KL(πθ ‖ πT) at the sampled ids, and its gradient, through ρ, is the reverse KL's
   score-function gradient (without ρ the sampled-token KL's gradient, ∇log πθ(a), is zero in expectation). PPO-clip
   and λ_sdl times it are both normalised by the batch's ω tokens.

Notation: B trajectories, T tokens, V vocabulary, G rollouts per task (a group), K the student's top-K.
"""
from __future__ import annotations

import copy
import json
import math
import os
import re
from dataclasses import dataclass, field, fields, replace

import torch

import engine
import losses
from runtime import preflight
from runtime import checkpoints, models, parallel
from engine import Method
from losses import bucket_reverse_kl, fp32, supervised_logprobs, topm_tail


# ----------------------------------------------------------------------------------------------------------------
# Settings shared by the baselines (B.1)
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class BaselineConfig:
    group: int = 4             # G rollouts per task (GRPO, SDPO; B.1)
    clip_eps: float = 0.2      # ε_lo = ε_hi (GRPO; B.1)
    top_k: int = losses.TOP_M  # SDPO's top-K support (the same M as LOPD's)
    ema_rate: float = 0.05     # SDPO's teacher update rate (B.1)
    sdft_ema_rate: float = 0.01   # SDFT's α_EMA, its teacher synced after every step (B.1)
    skill_clip: tuple = (0.2, 0.28)   # Skill-SD's PPO clip (ε_lo, ε_hi) (B.1)
    sdl_weight: float = 0.001  # λ_sdl, Skill-SD's importance-weighted reverse KL beside PPO-clip (B.1)
    ucb_c: float = math.sqrt(2)   # c of UCB1's bonus c·√(ln N / n), Skill-SD's skill choice (B.1)
    success: float = 1.0       # reward threshold of a "successful" trajectory (the bank's)
    context: str = "system"    # where the text goes: system | user | span (`engine.Chat.context_prompt`)
    micro_batch: int = 8
    clip: float = 1.0
    loss_chunk: int = 0        # rows per LM-head application (0: full logits); train.py --loss-chunk
    token_budget: int = 0      # padded tokens per forward/backward (0: micro_batch rollouts); engine.micro_batches
    sample: engine.SampleConfig = field(default_factory=engine.SampleConfig)   # the student's rollouts (B.2)


# ----------------------------------------------------------------------------------------------------------------
# RFT, the control: rejection fine-tuning on the bank's successes (losses.masked_nll), no teacher
# ----------------------------------------------------------------------------------------------------------------
def rft_step(student, tokenizer, episodes, opt, cfg: BaselineConfig):
    """One step of rejection fine-tuning: the NLL of successful bank episodes' own ω tokens, normalised by the
    batch's token count, on the student's optimizer. What differs from `lopd_step`: no rollout, no retrieval,
    no teacher and no composer; the targets are tokens the base already produced. Returns metrics."""
    device, n_tokens = next(student.parameters()).device, engine.supervised_tokens(episodes)

    def part_loss(idx):
        logp, _, omega = engine.student_logprobs(student, tokenizer, engine.pick(episodes, idx), device,
                                                 cfg.loss_chunk)                                # (b, Tc)
        loss = losses.nll(logp, omega, n_tokens)      # the masked NLL; micro-batch parts add up to the batch mean
        return loss, {"loss/rft": loss.item()}
    m, ok = engine.update(student, (opt, None), episodes, part_loss, cfg)
    return {**m, "skipped": int(not ok), "tokens": n_tokens}


# ----------------------------------------------------------------------------------------------------------------
# GRPO: group-normalised advantages, PPO-clip; no teacher, no context
# ----------------------------------------------------------------------------------------------------------------
def group_advantages(rewards, group: int, eps: float = 1e-4):
    """GRPO's group-normalised advantage: Â_i = (r_i − mean_g r) / (std_g r + eps) within each group of G.

    rewards (B,) with B = n_groups·G, rows of one group adjacent -> (B,) fp32. std is the unbiased sample std
    (as TRL's GRPOTrainer); a group whose rewards are all equal gets Â = 0 (no signal)."""
    r = fp32(rewards).reshape(-1, group)                               # (n_groups, G)
    mean, std = r.mean(1, keepdim=True), r.std(1, keepdim=True)         # (n_groups, 1) each
    return ((r - mean) / (std + eps)).reshape(-1)                       # (B,)


def ppo_clip_loss(logp, logp_old, advantages, mask, *, eps_lo=0.2, eps_hi=0.2, n_tokens=None):
    """GRPO's clipped surrogate, token level: −Σ ω·min(ρ Â, clip(ρ, 1−ε_lo, 1+ε_hi) Â) / n_tokens,
    ρ = π/π_old.

    logp (B, T) log π_θ(a_t) with gradient, logp_old (B, T) the same under the policy that sampled (no gradient),
    advantages Â (B,) one per trajectory, mask ω (B, T) -> (scalar loss, clip fraction over ω tokens).
    n_tokens: the whole batch's Σ ω when micro-batching. With one update per batch ρ = 1 and the clip never
    binds: the gradient is then Σ ω Â ∇log π / n_tokens, plain REINFORCE with a group baseline."""
    ratio = torch.exp(logp - logp_old.detach())                         # (B, T) ρ
    adv = fp32(advantages).unsqueeze(1)                                # (B, 1)
    # the pessimistic bound: min of the unclipped and the clipped surrogate
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps_lo, 1 + eps_hi) * adv)   # (B, T)
    n = mask.sum() if n_tokens is None else n_tokens
    clipped = ((ratio < 1 - eps_lo) | (ratio > 1 + eps_hi)).float()     # (B, T)
    return -(surrogate * mask).sum() / n, ((clipped * mask).sum() / mask.sum().clamp(min=1)).item()


def grpo_step(student, chat: engine.Chat, tasks, opt, cfg: BaselineConfig):
    """GRPO: G rollouts per task, Â group-normalised, PPO-clip. No teacher, no context.

    One update per batch (as LOPD), so π_old is the policy that sampled: ρ = 1 at the update, the clip never
    binds, and π_old's log-probs need no extra forward (they are the detached current ones)."""
    group_tasks = [t for t in tasks for _ in range(cfg.group)]                               # rows of a group adjacent
    with parallel.gathered(student):
        eps = engine.rollout(student, chat, group_tasks, cfg.sample)
    rewards = torch.tensor([e.reward for e in eps])                                         # (B,)
    adv = group_advantages(rewards, cfg.group)                                       # (B,) groups never split
    device, n_tokens = next(student.parameters()).device, engine.supervised_tokens(eps)

    def part_loss(idx):
        logp, _, omega = engine.student_logprobs(student, chat.tokenizer, engine.pick(eps, idx), device,
                                                 cfg.loss_chunk)
        loss, clipped = ppo_clip_loss(logp, logp.detach(), adv[idx].to(device), omega, eps_lo=cfg.clip_eps,
                                      eps_hi=cfg.clip_eps, n_tokens=n_tokens)                     # logp: (b, Tc)
        # the clipped fraction of the batch's ω tokens: each part's share adds up
        return loss, {"loss/grpo": loss.item(), "grpo/clip_frac": clipped * float(omega.sum()) / n_tokens}
    m, ok = engine.update(student, (opt, None), eps, part_loss, cfg)
    zero = parallel.all_sum(int((adv.reshape(-1, cfg.group).abs().sum(1) == 0).sum()))
    return {"reward/student": engine.summarize_all(eps)["reward"], **m, "grpo/zero_adv_groups": zero,
            "skipped": int(not ok), "tokens": n_tokens}, eps


# ----------------------------------------------------------------------------------------------------------------
# Teachers that read a trajectory as TEXT (OPSD, SDPO, SDFT): where LOPD's teacher has latents
# ----------------------------------------------------------------------------------------------------------------
# B.1, OPSD: appended to the system message (the paper's wording).
OPSD_CONTEXT = (
    "The following is a reference plan for the upcoming task. Use it only as guidance for your own reasoning; you "
    "must still interact with the environment to complete the task.\n\n{text}\n\nAfter reading the reference "
    "solution above, make sure you truly understand the reasoning behind each step. Now, using your own words and "
    "independent reasoning, derive the same final answer.")


# SDPO: a successful attempt from the same group, appended to the task (our wording of SDPO's reprompt).
SDPO_CONTEXT = "\n\nA successful attempt at this task:\n{text}\n\nNow complete the task yourself."


@dataclass
class TextTeacher:
    """A teacher that reads a trajectory as text (OPSD, SDPO, SDFT): its model, the template around the text
    (`engine.Chat.context_prompt` puts it where BaselineConfig.context says), and its loss against the student."""
    model: object              # a module, or OPSD's composer.base_forward (the base with the composer's LoRA off)
    template: str              # OPSD_CONTEXT, SDPO_CONTEXT or SDFT_CONTEXT, with {text}
    loss_fn: object            # (student logits, teacher logits (b, Tc, V), ω (b, Tc), n_tokens) -> scalar


def _text_teacher_logits(teacher: TextTeacher, chat, eps, texts, where, device):
    """The teacher re-scores the student's ids behind its text context (one text per episode). -> (B, Tc, V)"""
    prefixes = [chat.context_prompt(*chat.begin(e.task), x, teacher.template, where) for e, x in zip(eps, texts)]
    with torch.no_grad():
        return engine.continuation_logits(teacher.model, chat.tokenizer, prefixes, eps, device)[0]   # (B, Tc, V)


def _distill_loss(student, teacher: TextTeacher, chat, eps, texts, *, cfg, n_tokens):
    """One micro-batch's loss_fn(p_S, p_T): the teacher behind its text, the student behind its own prompt, on the
    same ids. cfg.loss_chunk > 0: both forwards return hidden states and the loss applies the heads in chunks."""
    device = next(student.parameters()).device
    if not cfg.loss_chunk:
        lt = _text_teacher_logits(teacher, chat, eps, texts, cfg.context, device)           # (b, Tc, V)
        ls, _, omega = engine.student_logits(student, chat.tokenizer, eps, device)            # (b, Tc, V)
        return teacher.loss_fn(ls, lt, omega, n_tokens)
    model = teacher.model
    t_model = model if isinstance(model, torch.nn.Module) else model.__self__.peft         # OPSD: base_forward
    with models.lm_head_bypassed(student, t_model):
        ht = _text_teacher_logits(teacher, chat, eps, texts, cfg.context, device)           # (b, Tc, d)
        hs, _, omega = engine.student_logits(student, chat.tokenizer, eps, device)            # (b, Tc, d)
    return losses.rowwise_from_hidden(teacher.loss_fn, hs, ht, models.lm_head(student), models.lm_head(t_model),
                                      omega, n_tokens=n_tokens, chunk=cfg.loss_chunk)


def _distill_step(student, teacher: TextTeacher, chat, eps, texts, *, opt, cfg):
    """Shared by OPSD, SDPO and SDFT: rows with a text context are distilled, normalised by their token count."""
    rows = [i for i, x in enumerate(texts) if x is not None]
    n_tokens = engine.supervised_tokens(engine.pick(eps, rows))

    def part_loss(idx):
        loss = _distill_loss(student, teacher, chat, engine.pick(eps, idx), [texts[i] or "" for i in idx], cfg=cfg,
                             n_tokens=n_tokens)
        return loss, {"loss/distill": loss.item()}
    m, ok = engine.update(student, (opt, None), eps, part_loss, cfg, rows=rows)
    return {**m, "context/rows": parallel.all_sum(len(rows)), "skipped": int(not ok), "tokens": n_tokens}


# ----------------------------------------------------------------------------------------------------------------
# OPSD: the frozen base reads a successful trajectory of the same task; forward KL
# ----------------------------------------------------------------------------------------------------------------
def forward_kl_full(student_logits, teacher_logits, mask, n_tokens=None):
    """OPSD's (and SDFT's) loss: Σ ω·KL(πT ‖ πS) / n_tokens over the FULL vocabulary, FORWARD KL (teacher first):
    Σ_v πT(v) log(πT(v)/πS(v)). The teacher is a target: its side is detached, only θ learns.

    student_logits, teacher_logits (B, T, V) aligned with mask ω (B, T) -> scalar fp32."""
    logp_s = supervised_logprobs(student_logits, mask)                  # (N, V)
    logp_t = supervised_logprobs(teacher_logits, mask).detach()         # (N, V)
    kl = (logp_t.exp() * (logp_t - logp_s)).sum(-1)                     # (N,)
    n = mask.sum() if n_tokens is None else n_tokens
    return kl.sum() / n


def opsd_pool(bank, tasks, make_env, success: float = 1.0) -> dict:
    """B.1's shared pool of verified-successful trajectories: the bank's own (base rollouts, already counted as
    generations), and where a task has none, the environment's oracle trace if it offers one (the toy world does;
    B.1 asks stronger models here). -> {task_id: trace text}, and the number filled by the oracle."""
    pool = {e["task_id"]: e["trace"] for e in bank if e.get("reward", 1.0) >= success}
    env = make_env()
    filled = {t.task_id: env.oracle_trace(t) for t in tasks if t.task_id not in pool}   # None: the world has none
    filled = {k: v for k, v in filled.items() if v is not None}
    pool.update(filled)
    return pool, len(filled)


def opsd_step(student, base, chat: engine.Chat, tasks, *, pool, opt, cfg: BaselineConfig):
    """OPSD: the frozen base θ̄ sees a successful trajectory of the SAME task as text; forward KL, full vocabulary.
    pool: task_id -> trace text (`opsd_pool`); a task missing from it gives no teacher signal."""
    with parallel.gathered(student):
        eps = engine.rollout(student, chat, tasks, cfg.sample)
    texts = [pool.get(t.task_id) for t in tasks]
    m = _distill_step(student, TextTeacher(base, OPSD_CONTEXT, forward_kl_full), chat, eps, texts, opt=opt, cfg=cfg)
    return {"reward/student": engine.summarize_all(eps)["reward"], **m}, eps


# ----------------------------------------------------------------------------------------------------------------
# SDPO: an EMA teacher reads a successful sibling; reverse KL over the student's top-K
# ----------------------------------------------------------------------------------------------------------------
def reverse_kl_student_topk(student_logits, teacher_logits, mask, top_k=20, n_tokens=None):
    """SDPO's loss: reverse KL(p̃S ‖ sg p̃T) over the STUDENT's top-K ids plus a tail bucket (SDPO picks the
    support from the student; LOPD's eq. 9 from the teacher). The EMA teacher is a target: detached.

    student_logits, teacher_logits (B, T, V) aligned with mask ω (B, T) -> scalar fp32."""
    logp_s = supervised_logprobs(student_logits, mask)                  # (N, V)
    logp_t = supervised_logprobs(teacher_logits, mask).detach()         # (N, V)
    # topm_tail(a, b) takes b's top ids: passing the student second puts the support on the student
    logq_t, logq_s = topm_tail(logp_t, logp_s, top_k)                   # (N, K+1) each
    n = mask.sum() if n_tokens is None else n_tokens
    return bucket_reverse_kl(logq_s, logq_t).sum() / n


@torch.no_grad()
def ema_update(teacher_params, student_params, rate: float):
    """SDPO's teacher: θ̄ ← (1 − rate)·θ̄ + rate·θ, in place, parameter by parameter (rate 0.05 in B.1)."""
    for t, s in zip(teacher_params, student_params):
        t.mul_(1 - rate).add_(s.detach().to(t.dtype), alpha=rate)


def sibling_contexts(eps, group: int, success: float = 1.0):
    """For each rollout, the trace of the first successful OTHER rollout of its group, or None."""
    out = []
    for i, e in enumerate(eps):
        g = i // group * group
        sib = [eps[j] for j in range(g, g + group) if j != i and eps[j].reward >= success]
        out.append(sib[0].trace if sib else None)
    return out


def sdpo_step(student, ema_teacher, chat: engine.Chat, tasks, opt, cfg: BaselineConfig):
    """SDPO: G rollouts per task; each rollout's teacher is the EMA θ̄_ema behind a successful SIBLING's trace (never
    its own); reverse KL over the student's top-K + tail; then θ̄_ema ← (1 − rate)θ̄_ema + rate·θ.
    A rollout with no successful sibling gets no teacher signal."""
    group_tasks = [t for t in tasks for _ in range(cfg.group)]
    with parallel.gathered(student):
        eps = engine.rollout(student, chat, group_tasks, cfg.sample)
    texts = sibling_contexts(eps, cfg.group, cfg.success)

    def loss_fn(ls, lt, omega, n_tokens):
        return reverse_kl_student_topk(ls, lt, omega, cfg.top_k, n_tokens)
    m = _distill_step(student, TextTeacher(ema_teacher, SDPO_CONTEXT, loss_fn), chat, eps, texts, opt=opt, cfg=cfg)
    ema_update(ema_teacher.parameters(), student.parameters(), cfg.ema_rate)   # shard by shard under FSDP2
    return {"reward/student": engine.summarize_all(eps)["reward"], **m}, eps


# ----------------------------------------------------------------------------------------------------------------
# SDFT: an EMA teacher (rate 0.01) reads the task's demonstration in the first user message; forward KL
# ----------------------------------------------------------------------------------------------------------------
# B.1, SDFT: appended to the first user message (the paper's wording; Chat.context_prompt adds no separator there).
SDFT_CONTEXT = ("\n\nThis is an example for a response to the question:\n\n{text}\n\nNow answer with a response of "
                "your own, including the thinking process.")


def user_or_span(cfg: BaselineConfig) -> str:
    """Where SDFT's and Skill-SD's teachers read their text: B.1's first user message, or the toy's span."""
    return "span" if cfg.context == "span" else "user"


def sdft_step(student, ema_teacher, chat: engine.Chat, tasks, *, pool, opt, cfg: BaselineConfig):
    """SDFT: one rollout per task; the EMA teacher θ̄_ema reads the task's demonstration from the shared pool
    (`opsd_pool`) appended to its first user message; forward KL over the full vocabulary; then
    θ̄_ema ← (1 − α)·θ̄_ema + α·θ with α = cfg.sdft_ema_rate, after every step. A task missing from the pool gives no
    teacher signal."""
    with parallel.gathered(student):
        eps = engine.rollout(student, chat, tasks, cfg.sample)
    texts = [pool.get(t.task_id) for t in tasks]
    teacher = TextTeacher(ema_teacher, SDFT_CONTEXT, forward_kl_full)
    m = _distill_step(student, teacher, chat, eps, texts, opt=opt, cfg=replace(cfg, context=user_or_span(cfg)))
    ema_update(ema_teacher.parameters(), student.parameters(), cfg.sdft_ema_rate)   # shard by shard under FSDP2
    return {"reward/student": engine.summarize_all(eps)["reward"], **m}, eps


# ----------------------------------------------------------------------------------------------------------------
# Skill-SD: skills written from rollouts, one per task by UCB1, read by the student itself; PPO-clip + IW reverse KL
# ----------------------------------------------------------------------------------------------------------------
# B.1, Skill-SD: appended to the teacher's first user message (the paper's wording).
SKILLSD_CONTEXT = ("\n\nHere is a skill summary from a similar past task that may help guide your approach:\n\n"
                   "**What works:** {success_analysis}\n\n**What to avoid:** {mistake_analysis}\n\n"
                   "**Suggested workflow:** {golden_workflow}\n\nNow solve the current task using your own reasoning.")
SKILL_FIELDS = ("success_analysis", "mistake_analysis", "golden_workflow")
SKILL_LABELS = ("What works", "What to avoid", "Suggested workflow")     # the writer's three lines, in that order

# What the frozen base reads to write a skill on a real model (ours: B.1 gives no prompt), and its reply budget.
SKILL_WRITER_PROMPT = (
    "Below are attempts at tasks of one kind, each with its outcome and its actions. Distill them into a skill for "
    "future attempts at similar tasks.\n\n{attempts}\n\nAnswer with exactly three lines and nothing else:\n"
    "What works: <what the successful attempts did that made them succeed; if none did, what the best got right>\n"
    "What to avoid: <the mistakes of the failed attempts>\n"
    "Suggested workflow: <the steps to follow, in order>")
SKILL_WRITER_TOKENS = 512


def iw_reverse_kl(logp, logp_old, logp_teacher, mask, n_tokens=None):
    """Skill-SD's distillation term: the sampled-token reverse KL(πθ ‖ πT), importance-weighted,
    Σ ω·ρ·sg[log πθ(a) − log πT(a)] / n_tokens with ρ = πθ(a)/π_old(a) and a ~ π_old (choice d, module docstring).
    Its value estimates KL(πθ ‖ πT) on the sampled ids; its gradient ρ·(log πθ(a) − log πT(a))·∇log πθ(a) is the
    reverse KL's score-function gradient. The teacher is a target: detached.

    logp (B, T) log πθ(a_t) with gradient, logp_old (B, T) the sampling policy's, logp_teacher (B, T) the skill
    teacher's, mask ω (B, T) -> scalar fp32."""
    ratio = torch.exp(fp32(logp) - fp32(logp_old).detach())                   # (B, T) ρ
    gap = (fp32(logp) - fp32(logp_teacher)).detach()                          # (B, T) log πθ(a) − log πT(a)
    n = mask.sum() if n_tokens is None else n_tokens
    return (ratio * gap * mask).sum() / n


def skillsd_loss(logp, logp_old, logp_teacher, advantages, mask, *, clip=(0.2, 0.28), sdl_weight=0.001,
                 n_tokens=None):
    """Skill-SD's loss: PPO-clip with the range [1 − ε_lo, 1 + ε_hi] (`ppo_clip_loss`) plus λ_sdl times the
    importance-weighted sampled-token reverse KL (`iw_reverse_kl`), both over the batch's ω tokens.

    logp, logp_old, logp_teacher (B, T) as for `iw_reverse_kl`, advantages Â (B,), mask ω (B, T), clip (ε_lo, ε_hi)
    -> (scalar loss, its two terms {"loss/ppo", "loss/sdl"} as floats, the clipped fraction of ω tokens)."""
    ppo, clipped = ppo_clip_loss(logp, logp_old, advantages, mask, eps_lo=clip[0], eps_hi=clip[1], n_tokens=n_tokens)
    sdl = iw_reverse_kl(logp, logp_old, logp_teacher, mask, n_tokens)
    return ppo + sdl_weight * sdl, {"loss/ppo": ppo.item(), "loss/sdl": sdl.item()}, clipped


def skill_edges(logp, logp_teacher, mask):
    """Each rollout's skill edge (choice c): the mean over its ω tokens of log πT(a) − log πθ(a), what reading the
    skill does to the same model's log-probs of the student's own ids.

    logp (B, T) log πθ(a_t), logp_teacher (B, T) the skill teacher's, mask ω (B, T) -> (B,) fp32, no gradient."""
    gap = (fp32(logp_teacher) - fp32(logp)).detach() * mask                   # (B, T)
    return gap.sum(1) / mask.sum(1).clamp(min=1)                                # (B,)


def skill_value(rewards, edges):
    """One pull's reward for a skill (choice c): over the pairs of a group's rollouts whose rewards differ, the
    fraction whose skill edges are ordered as their rewards are (a tie in the edges counts ½). -> a float in
    [0, 1], or None where every reward is equal (no pair: nothing the skill could order).

    rewards, edges: G floats each, one per rollout of the task's group."""
    right = pairs = 0.0
    for i in range(len(rewards)):
        for j in range(len(rewards)):
            if rewards[i] > rewards[j]:                    # i the better rollout: does the skill's teacher agree?
                pairs += 1
                right += 1.0 if edges[i] > edges[j] else 0.5 if edges[i] == edges[j] else 0.0
    return right / pairs if pairs else None


def ucb1_scores(pulls, rewards, c: float = math.sqrt(2)) -> list:
    """UCB1 (Auer et al., 2002) over arms pulled n_i times for a summed reward R_i: R_i / n_i + c·√(ln N / n_i),
    N = Σ n_i; an arm never pulled scores +inf (it goes first)."""
    N = sum(pulls)
    return [math.inf if n == 0 else r / n + c * math.sqrt(math.log(N) / n) for n, r in zip(pulls, rewards)]


def ucb1_choice(pulls, rewards, c: float = math.sqrt(2)) -> int:
    """The arm of highest `ucb1_scores`, ties (never-pulled arms among them) to the lowest index."""
    scores = ucb1_scores(pulls, rewards, c)
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def task_family(task) -> str:
    """A task's family for the skill bank: its variant and schema (worlds/common.py's task fields; "" if none)."""
    return "/".join(str(getattr(task, k, "") or "") for k in ("variant", "schema"))


def family_attempts(eps, success: float = 1.0) -> list:
    """Episodes by task family, each attempt (task text, trace, reward, succeeded?), every family whether or not
    it has a success (choice b). -> [(family, attempts)], families in first-seen order."""
    groups = {}
    for e in eps:
        groups.setdefault(task_family(e.task), []).append((e.task.text, e.trace, e.reward, e.reward >= success))
    return list(groups.items())


def _actions(trace: str) -> list:
    """A trace's actions without their arguments and results (`2. get_order(id="O1") -> ...` -> `get_order`)."""
    return [re.sub(r"^\d+\.\s*", "", line).split("(")[0].split(" -> ")[0].strip() for line in trace.splitlines()
            if line.strip()]


def _best_first(attempts) -> list:
    """Attempts best first: successes, then by reward, then the shortest trace."""
    return sorted(attempts, key=lambda a: (not a[3], -a[2], len(a[1])))


def toy_skill(attempts) -> dict:
    """The toy backbone's skill writer (it cannot write prose): the three fields from the traces alone. What works:
    the actions every success took (with no success, those of the best attempt); what to avoid: actions of failures
    that no success took; the workflow: the trace of the best attempt (a success if any, the highest reward, then
    the shortest; a failed group's is its nearest miss, a skill whose teacher the bandit learns to value by what it
    does: choice c). attempts as `family_attempts` gives them."""
    best = _best_first(attempts)[0]
    wins = [a for a in attempts if a[3]]
    fails = [a for a in attempts if not a[3]]
    won = [set(_actions(a[1])) for a in wins]
    common = [x for x in dict.fromkeys(_actions(best[1])) if all(x in w for w in won)]
    bad = sorted({x for a in fails for x in _actions(a[1])} - set().union(*won))
    done = (f"every success called {', '.join(common) or 'no action in common'}" if wins else
            f"the best (reward {best[2]:.2f}) called {', '.join(common) or 'nothing'}")
    return {"success_analysis": f"{len(wins)} of {len(attempts)} attempts succeeded; {done}",
            "mistake_analysis": ("failures called " + ", ".join(bad) + ", which no success did") if bad else
                                ("no failed attempt" if not fails else "the failures called nothing new"),
            "golden_workflow": best[1]}


def skill_prompt(attempts, per_kind: int = 2, chars: int = 2000) -> str:
    """SKILL_WRITER_PROMPT for one family: its best `per_kind` attempts (successes first) and its worst `per_kind`
    failures not among them, each trace cut at `chars` characters."""
    order = _best_first(attempts)
    top = order[:per_kind]
    worst = sorted(order[per_kind:], key=lambda a: a[2])
    shown = top + [a for a in worst if not a[3]][:per_kind]
    shown = [f"Attempt {i}: {'success' if ok else 'failure'} (reward {r:.2f})\nTask: {text}\nActions:\n{trace[:chars]}"
             for i, (text, trace, r, ok) in enumerate(shown, 1)]
    return SKILL_WRITER_PROMPT.format(attempts="\n\n".join(shown))


def parse_skill(reply: str) -> dict:
    """The three fields of a written skill, from its "What works: ..." lines (bold and a thinking block allowed); a
    field the writer left out reads "(none)"."""
    text = re.sub(r"<think>.*?</think>", "", reply, flags=re.S).replace("**", "")
    any_label = "|".join(SKILL_LABELS)
    out = {}
    for name, label in zip(SKILL_FIELDS, SKILL_LABELS):
        m = re.search(rf"{label}\s*:\s*(.*?)(?=\n\s*(?:{any_label})\s*:|\Z)", text, re.S | re.I)
        out[name] = (m.group(1).strip() if m else "") or "(none)"
    return out


@torch.no_grad()
def base_skills(composer, tokenizer, groups, batch: int = 8) -> list:
    """A real model's skill writer: the frozen base θ̄ (the composer's LoRA off, A.4) answers `skill_prompt` for
    each (family, attempts), greedily with thinking off, in batches. -> each reply's three fields (`parse_skill`)."""
    cfg, out = engine.SampleConfig(temperature=0.0, max_new_tokens=SKILL_WRITER_TOKENS), []
    for i in range(0, len(groups), batch):
        prompts = [engine.prompt_ids(tokenizer, [{"role": "user", "content": skill_prompt(a)}])
                   for _, a in groups[i:i + batch]]
        with composer.adapter_disabled():
            replies = engine.generate_replies(composer.peft, tokenizer, prompts, cfg)
        out += [parse_skill(tokenizer.decode(ids, skip_special_tokens=True)) for ids, _, _ in replies]
    return out


def skill_writer(run: engine.Run):
    """(family, attempts) list -> skills: `toy_skill` on the toy backbone (no --model, or a folder toy_backbone.py
    wrote: preflight.is_toy_model), the frozen base's `base_skills` on a real model."""
    if preflight.is_toy_model(run.args.model):
        return lambda groups: [toy_skill(a) for _, a in groups]
    return lambda groups: base_skills(run.composer, run.tok, groups)


@dataclass
class SkillBank:
    """Skill-SD's skill bank: each skill its three fields, its family and its source, and UCB1's statistics per skill
    (pulls: the tasks that chose it and could value it; reward: the sum of their `skill_value`s). Every event (a
    skill written, a step's pulls) is appended to `path` (OUT/skill_bank.jsonl, rank 0), which a reader opens and
    --resume replays."""
    path: str = ""
    skills: list = field(default_factory=list)
    pulls: list = field(default_factory=list)
    reward: list = field(default_factory=list)
    next_step: int = 0                                # the first step whose events the bank has not seen

    def select(self, task, c: float) -> int:
        """UCB1 over the task's family's skills (over every skill where its family has none)."""
        arms = [i for i, s in enumerate(self.skills) if s["family"] == task_family(task)] or range(len(self.skills))
        if not arms:
            raise ValueError("Skill-SD's skill bank is empty: no rollout to write a skill from")
        return arms[ucb1_choice([self.pulls[i] for i in arms], [self.reward[i] for i in arms], c)]

    def apply(self, event: dict):
        if event["event"] == "skill":
            self.skills.append({k: event[k] for k in ("family", "source", *SKILL_FIELDS)})
            self.pulls.append(0)
            self.reward.append(0.0)
        for i, r in event.get("pulls", []):
            self.pulls[i] += 1
            self.reward[i] += r
        self.next_step = max(self.next_step, event["step"] + 1)

    def add(self, event: dict):
        """Apply one event and append it to the log."""
        event = {**event, "id": len(self.skills)} if event["event"] == "skill" else event
        self.apply(event)
        if self.path and parallel.rank() == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(event) + "\n")

    @classmethod
    def replay(cls, path: str, events, before: int) -> "SkillBank":
        """--resume: the bank after the logged events of steps before `before`; the log is cut to them."""
        kept = [e for e in events if e["step"] < before]
        bank = cls()
        for e in kept:
            bank.apply(e)
        bank.path = path
        if parallel.rank() == 0:
            checkpoints.write_jsonl(path, kept)
        return bank


def skill_text(skill: dict, where: str) -> str:
    """What the teacher reads of a skill: SKILLSD_CONTEXT with its three fields, or in the toy's span its workflow
    alone (a trace: all the toy reads; deviation 3)."""
    return skill["golden_workflow"] if where == "span" else SKILLSD_CONTEXT.format(**skill)


def _teacher_token_logprobs(model, chat: engine.Chat, eps, texts, *, where: str, loss_chunk: int):
    """log πT(a_t) of each episode's own ids, `model` behind its text as the prompt (`Chat.context_prompt`), no
    gradient: (B, Tc) fp32, zeros off ω. loss_chunk > 0: from hidden states, the head applied in chunks."""
    device = next(model.parameters()).device
    prefixes = [chat.context_prompt(*chat.begin(e.task), x, "{text}", where) for e, x in zip(eps, texts)]
    with torch.no_grad():
        if not loss_chunk:
            logits, ids, omega = engine.continuation_logits(model, chat.tokenizer, prefixes, eps, device)  # (B, Tc, V)
            return losses.token_logprobs(logits, ids, omega)
        with models.lm_head_bypassed(model):
            h, ids, omega = engine.continuation_logits(model, chat.tokenizer, prefixes, eps, device)       # (B, Tc, d)
        return losses.token_logprobs_from_hidden(h, models.lm_head(model), ids, omega, loss_chunk)


def skillsd_step(student, chat: engine.Chat, tasks, bank: SkillBank, *, opt, cfg: BaselineConfig):
    """Skill-SD: G rollouts per task from the task alone; each task chooses one skill by UCB1 (`SkillBank.select`);
    the teacher, the student itself detached (choice a), reads it appended to its first user message; the loss is
    PPO-clip on group-normalised Â plus λ_sdl times the importance-weighted sampled-token reverse KL
    (`skillsd_loss`). -> (metrics, episodes, each task's pull [skill index, `skill_value` or None]); the bank's
    update is `grow_skill_bank`'s."""
    G, where = cfg.group, user_or_span(cfg)
    group_tasks = [t for t in tasks for _ in range(G)]                                     # rows of a group adjacent
    with parallel.gathered(student):
        eps = engine.rollout(student, chat, group_tasks, cfg.sample)
    adv = group_advantages(torch.tensor([e.reward for e in eps]), G)                      # (B,)
    chosen = [bank.select(t, cfg.ucb_c) for t in tasks]                                   # one skill per task
    texts = [skill_text(bank.skills[k], where) for k in chosen for _ in range(G)]
    device, n_tokens = next(student.parameters()).device, engine.supervised_tokens(eps)
    edges = {}                                                                             # row -> its skill edge

    def part_loss(idx):
        part = engine.pick(eps, idx)
        logp, _, omega = engine.student_logprobs(student, chat.tokenizer, part, device, cfg.loss_chunk)   # (b, Tc)
        logp_t = _teacher_token_logprobs(student, chat, part, engine.pick(texts, idx), where=where,
                                         loss_chunk=cfg.loss_chunk)                                       # (b, Tc)
        for i, e in zip(idx, skill_edges(logp, logp_t, omega).tolist()):
            edges.setdefault(i, e)                             # a torchrun idle pass re-scores a row: keep the first
        loss, terms, clipped = skillsd_loss(logp, logp.detach(), logp_t, adv[idx].to(device), omega,
                                            clip=cfg.skill_clip, sdl_weight=cfg.sdl_weight, n_tokens=n_tokens)
        return loss, {**terms, "skillsd/clip_frac": clipped * float(omega.sum()) / n_tokens}
    m, ok = engine.update(student, (opt, None), eps, part_loss, cfg)
    rows = [range(i * G, (i + 1) * G) for i in range(len(chosen))]                        # each task's group
    pulls = [[k, skill_value([eps[j].reward for j in r], [edges[j] for j in r])] for k, r in zip(chosen, rows)]
    return {"reward/student": engine.summarize_all(eps)["reward"], **m, "skipped": int(not ok),
            "tokens": n_tokens}, eps, pulls


def grow_skill_bank(bank: SkillBank, write, tasks, eps, pulls, *, step: int, cfg: BaselineConfig) -> dict:
    """After a Skill-SD step (choices b, c): each task's skill pulled once for its `skill_value` (`skillsd_step`'s
    pulls; a group that orders nothing, value None, counts no pull); then a skill for each task, written by `write`
    from its group, successes or not. Every rank's, gathered in rank order, so that every rank holds the same bank.
    -> metrics."""
    G = cfg.group
    valued = parallel.gather([[k, v] for k, v in pulls if v is not None])
    bank.add({"step": step, "event": "pulls", "pulls": valued})
    groups = [g for i in range(len(tasks)) for g in family_attempts(eps[i * G:(i + 1) * G], cfg.success)]
    new = parallel.gather([{"family": f, **s} for (f, _), s in zip(groups, write(groups) if groups else [])])
    for skill in new:
        bank.add({"step": step, "event": "skill", "source": f"step {step}", **skill})
    return {"skillsd/new_skills": len(new), "skillsd/skills": len(bank.skills), "skillsd/valued_pulls": len(valued)}


# ----------------------------------------------------------------------------------------------------------------
# The baselines as train.py runs them (--method): what each keeps across steps, and one step (engine.Method)
# ----------------------------------------------------------------------------------------------------------------
def baseline_config(args, sample: engine.SampleConfig = None) -> BaselineConfig:
    """The baselines' settings from train.py's Args, with the rollouts' sampling (train.sample_config). Most have a
    flag of the same name; SDPO's top-K is LOPD's M, "success" the bank's threshold, "context" --text-context, and
    Skill-SD's clip range and UCB1's c keep B.1's values (no flag)."""
    same = [f.name for f in fields(BaselineConfig)
            if f.name not in ("top_k", "success", "context", "sample", "skill_clip", "ucb_c")]
    return BaselineConfig(**{k: getattr(args, k) for k in same}, top_k=args.top_m, success=args.bank_threshold,
                          context=args.text_context, sample=sample or engine.SampleConfig())


def rft_setup(run: engine.Run) -> dict:
    return {"successes": [e for e in run.episodes if e.reward >= run.args.bank_threshold]}


def rft_train_step(run: engine.Run, state: dict, student, opts, step: int):
    """The control: the same optimizer and step count, no teacher, no new rollouts."""
    batch = parallel.shard(run.task_rng.choices(state["successes"], k=run.args.rollouts_per_step))
    return rft_step(student, run.tok, batch, opts[0], baseline_config(run.args)), 0


def grpo_train_step(run: engine.Run, state: dict, student, opts, step: int):
    G = run.args.group
    m, _ = grpo_step(student, run.chat, run.tasks(step, G), opts[0], baseline_config(run.args, run.sample))
    return m, run.args.rollouts_per_step // G * G


def opsd_setup(run: engine.Run) -> dict:
    pool, n_oracle = opsd_pool(run.retriever.bank, run.train, run.chat.make_env, run.args.bank_threshold)
    run.log("opsd_pool", tasks=len(pool), from_oracle=n_oracle)
    return {"pool": pool}


def opsd_train_step(run: engine.Run, state: dict, student, opts, step: int):
    m, _ = opsd_step(student, run.composer.base_forward, run.chat, run.tasks(step), pool=state["pool"], opt=opts[0],
                     cfg=baseline_config(run.args, run.sample))
    return m, run.args.rollouts_per_step


def sdpo_setup(run: engine.Run) -> dict:
    """SDPO's EMA teacher starts at θ̄: a frozen full copy, built as the student is (sharded under torchrun)."""
    if run.source is not None:
        return {"ema": models.full_student(run.args, run.source, frozen=True).eval()}
    ema = copy.deepcopy(run.student).requires_grad_(False).eval()        # a caller that brings its own student
    return {"ema": parallel.shard_student(ema, frozen=True) if parallel.world() > 1 else ema}


def sdpo_train_step(run: engine.Run, state: dict, student, opts, step: int):
    G = run.args.group
    m, _ = sdpo_step(student, state["ema"], run.chat, run.tasks(step, G), opts[0],
                     baseline_config(run.args, run.sample))
    return m, run.args.rollouts_per_step // G * G


def sdft_setup(run: engine.Run) -> dict:
    """SDFT's demonstrations (OPSD's pool) and its EMA teacher, which starts at θ̄ (SDPO's)."""
    return {**opsd_setup(run), **sdpo_setup(run)}


def sdft_train_step(run: engine.Run, state: dict, student, opts, step: int):
    m, _ = sdft_step(student, state["ema"], run.chat, run.tasks(step), pool=state["pool"], opt=opts[0],
                     cfg=baseline_config(run.args, run.sample))
    return m, run.args.rollouts_per_step


def skillsd_setup(run: engine.Run) -> dict:
    """Skill-SD's skill bank: a skill per task family from the base rollouts, written by `skill_writer` (this
    rank's share of the families, gathered), logged to OUT/skill_bank.jsonl. --resume replays that file instead, at
    the first step (the checkpoint's)."""
    path = os.path.join(run.args.out, "skill_bank.jsonl")
    if run.args.resume and os.path.isfile(path):
        return {"skills": SkillBank(path), "replay": [json.loads(line) for line in open(path)]}
    if parallel.rank() == 0:
        open(path, "w").close()
    bank, groups = SkillBank(path), parallel.shard(family_attempts(run.episodes, run.args.bank_threshold))
    written = parallel.gather([{"family": f, **s} for (f, _), s in zip(groups, skill_writer(run)(groups))])
    for skill in written:
        bank.add({"step": -1, "event": "skill", "source": "base rollouts", **skill})
    run.log("skill_bank", skills=len(written), families=len({s["family"] for s in written}), path=path)
    return {"skills": bank}


def skillsd_train_step(run: engine.Run, state: dict, student, opts, step: int):
    """One Skill-SD step (`skillsd_step`), then the bank's pulls and new skills (`grow_skill_bank`)."""
    if "replay" in state:                             # --resume: the logged events before this step
        state["skills"] = SkillBank.replay(state["skills"].path, state.pop("replay"), before=step)
    cfg, bank = baseline_config(run.args, run.sample), state["skills"]
    tasks = run.tasks(step, cfg.group)
    m, eps, pulls = skillsd_step(student, run.chat, tasks, bank, opt=opts[0], cfg=cfg)
    m.update(grow_skill_bank(bank, skill_writer(run), tasks, eps, pulls, step=step, cfg=cfg))
    return m, run.args.rollouts_per_step // cfg.group * cfg.group


METHODS = {
    "rft": Method(rft_setup, rft_train_step, "RFT student", uses_bank=True),
    "grpo": Method(lambda run: {}, grpo_train_step, "GRPO student", per_task="group"),
    "opsd": Method(opsd_setup, opsd_train_step, "OPSD student", uses_bank=True),
    "sdpo": Method(sdpo_setup, sdpo_train_step, "SDPO student", per_task="group", keeps_ema=True),
    "sdft": Method(sdft_setup, sdft_train_step, "SDFT student", uses_bank=True, keeps_ema=True),
    "skillsd": Method(skillsd_setup, skillsd_train_step, "Skill-SD student", uses_bank=True, per_task="group"),
}
