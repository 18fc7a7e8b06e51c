"""The baselines of B.1 and the RFT control, on LOPD's own loop: each step beside its loss.

Each method shares with LOPD (lopd.py) the rollout, the re-scoring of the student's sampled ids, the optimizer step
and the evaluation. What differs is only the teacher's context and the loss, each kept as its paper has it:

    method  teacher                  its context                            loss
    lopd    frozen θ̄ (LoRA off)      latents c_φ of J retrieved trajs       reverse KL, teacher top-M + tail, eq. 13
    rft     none                     none: NLL of the bank's successes      masked NLL (the control; no rollouts)
    grpo    none                     none                                   PPO-clip, group-normalised Â
    opsd    frozen θ̄                 a successful traj. of the SAME task    forward KL, full vocabulary
    sdpo    EMA of θ (rate 0.05)     a successful SIBLING of the group      reverse KL, student top-K + tail

    python train.py --method grpo          # or rft | opsd | sdpo: the same pipeline, stages and evaluation
    python -m pytest tests/test_baselines.py -q

`METHODS` at the bottom is what train.py runs beside LOPD's own entry (lopd.METHOD): per method, what it keeps across
steps and one step. A new method is a step function, its loss and one entry there (docs/adding-a-method.md).

Deviations from the papers
--------------------------
1. GRPO takes one update per batch, as LOPD does, so its PPO clip never binds (ρ = 1).
2. OPSD's pool is the bank's successes, and the environment's oracle trace where a task has none (B.1 asks
   stronger models to write them).
3. On the toy backbone OPSD's and SDPO's teachers read their trajectory text in the framed span where LOPD's
   latents go (`engine.Chat.context_prompt`, "span"): the toy learned to read a reference only there. Real models
   get the B.1 system-message wording (OPSD) and a reprompt appended to the task (SDPO).
4. RFT spends no rollouts of its own: it re-reads the bank (its generations are the bank's).

Notation: B trajectories, T tokens, V vocabulary, G rollouts per task (a group), K the student's top-K.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields

import torch

import engine
import losses
import runtime
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
    with runtime.gathered(student):
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
    zero = runtime.all_sum(int((adv.reshape(-1, cfg.group).abs().sum(1) == 0).sum()))
    return {"reward/student": engine.summarize_all(eps)["reward"], **m, "grpo/zero_adv_groups": zero,
            "skipped": int(not ok), "tokens": n_tokens}, eps


# ----------------------------------------------------------------------------------------------------------------
# Teachers that read a trajectory as TEXT (OPSD, SDPO): where LOPD's teacher has latents
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
    """A teacher that reads a trajectory as text (OPSD, SDPO): its model, the template around the text
    (`engine.Chat.context_prompt` puts it where BaselineConfig.context says), and its loss against the student."""
    model: object              # a module, or OPSD's composer.base_forward (the base with the composer's LoRA off)
    template: str              # OPSD_CONTEXT or SDPO_CONTEXT, with {text}
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
    with runtime.lm_head_bypassed(student, t_model):
        ht = _text_teacher_logits(teacher, chat, eps, texts, cfg.context, device)           # (b, Tc, d)
        hs, _, omega = engine.student_logits(student, chat.tokenizer, eps, device)            # (b, Tc, d)
    return losses.rowwise_from_hidden(teacher.loss_fn, hs, ht, runtime.lm_head(student), runtime.lm_head(t_model),
                                      omega, n_tokens=n_tokens, chunk=cfg.loss_chunk)


def _distill_step(student, teacher: TextTeacher, chat, eps, texts, *, opt, cfg):
    """Shared by OPSD and SDPO: rows with a text context are distilled, normalised by their token count."""
    rows = [i for i, x in enumerate(texts) if x is not None]
    n_tokens = engine.supervised_tokens(engine.pick(eps, rows))

    def part_loss(idx):
        loss = _distill_loss(student, teacher, chat, engine.pick(eps, idx), [texts[i] or "" for i in idx], cfg=cfg,
                             n_tokens=n_tokens)
        return loss, {"loss/distill": loss.item()}
    m, ok = engine.update(student, (opt, None), eps, part_loss, cfg, rows=rows)
    return {**m, "context/rows": runtime.all_sum(len(rows)), "skipped": int(not ok), "tokens": n_tokens}


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
    with runtime.gathered(student):
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
    with runtime.gathered(student):
        eps = engine.rollout(student, chat, group_tasks, cfg.sample)
    texts = sibling_contexts(eps, cfg.group, cfg.success)

    def loss_fn(ls, lt, omega, n_tokens):
        return reverse_kl_student_topk(ls, lt, omega, cfg.top_k, n_tokens)
    m = _distill_step(student, TextTeacher(ema_teacher, SDPO_CONTEXT, loss_fn), chat, eps, texts, opt=opt, cfg=cfg)
    ema_update(ema_teacher.parameters(), student.parameters(), cfg.ema_rate)   # shard by shard under FSDP2
    return {"reward/student": engine.summarize_all(eps)["reward"], **m}, eps


# ----------------------------------------------------------------------------------------------------------------
# The baselines as train.py runs them (--method): what each keeps across steps, and one step (engine.Method)
# ----------------------------------------------------------------------------------------------------------------
def baseline_config(args, sample: engine.SampleConfig = None) -> BaselineConfig:
    """The baselines' settings from train.py's Args, with the rollouts' sampling (train.sample_config). Most have a
    flag of the same name; SDPO's top-K is LOPD's M, "success" the bank's threshold, "context" --text-context."""
    same = [f.name for f in fields(BaselineConfig) if f.name not in ("top_k", "success", "context", "sample")]
    return BaselineConfig(**{k: getattr(args, k) for k in same}, top_k=args.top_m, success=args.bank_threshold,
                          context=args.text_context, sample=sample or engine.SampleConfig())


def rft_setup(run: engine.Run) -> dict:
    return {"successes": [e for e in run.episodes if e.reward >= run.args.bank_threshold]}


def rft_train_step(run: engine.Run, state: dict, student, opts, step: int):
    """The control: the same optimizer and step count, no teacher, no new rollouts."""
    batch = runtime.shard(run.task_rng.choices(state["successes"], k=run.args.rollouts_per_step))
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
        return {"ema": runtime.full_student(run.args, run.source, frozen=True).eval()}
    ema = copy.deepcopy(run.student).requires_grad_(False).eval()        # a caller that brings its own student
    return {"ema": runtime.shard_student(ema, frozen=True) if runtime.world() > 1 else ema}


def sdpo_train_step(run: engine.Run, state: dict, student, opts, step: int):
    G = run.args.group
    m, _ = sdpo_step(student, state["ema"], run.chat, run.tasks(step, G), opts[0],
                     baseline_config(run.args, run.sample))
    return m, run.args.rollouts_per_step // G * G


METHODS = {
    "rft": Method(rft_setup, rft_train_step, "RFT student", uses_bank=True),
    "grpo": Method(lambda run: {}, grpo_train_step, "GRPO student", per_task="group"),
    "opsd": Method(opsd_setup, opsd_train_step, "OPSD student", uses_bank=True),
    "sdpo": Method(sdpo_setup, sdpo_train_step, "SDPO student", per_task="group", keeps_ema=True),
}
