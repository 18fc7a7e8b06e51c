"""Tests that pin what makes LOPD LOPD rather than plain distillation (issue 19): the composer learns through the
teacher, β and Δ act on the loss exactly as eq. (13) says, the dual step's order, the logged total, SDPO's EMA
teacher, the evaluation rows' isolation from the composer's LoRA, Table 3's behaviour counts, and full-state resume.

Run: python -m pytest tests/test_method.py -q
Offline: test_lopd.py's world (tiny toy backbone, K = 2 latents, J = 2, a scripted bank). Gradients are compared
with recomputations whose losses are written out here in float64 (no call into losses.py) and with a central
difference; resume with an uninterrupted run.
Each test names the break it catches (a change to the guarded code under which it fails).
"""
import copy
import functools
import inspect
import json
import os
import sys
import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines  # noqa: E402
import engine  # noqa: E402
import inject  # noqa: E402
import lopd  # noqa: E402
import losses  # noqa: E402
from runtime import checkpoints, devices  # noqa: E402
import train  # noqa: E402
from worlds import common, results, tool_world  # noqa: E402
from worlds import toy_backbone as toy  # noqa: E402
from test_lopd import J, make_models, record_grads, run_step, world  # noqa: E402,F401  (world: fixture)

BETA = 3.0          # the second β of the β/Δ test; large, so that its term stands well above fp32 noise


# ------------------------------------------------------------------------------------------------------------
# Float64 references, written out here: eq. (9)-(10) over the teacher's top-M + tail, and eq. (11)-(12)
# ------------------------------------------------------------------------------------------------------------
def ref_distill(ls, lt, ids, omega, top_m):
    """Σ ω·KL(p̃S ‖ p̃T) / Σ ω, float64, over the teacher's top-M ids plus the tail (eqs. 9-10)."""
    total, rows = 0.0, omega.nonzero().tolist()
    for b, t in rows:
        ps, pt = F.log_softmax(ls[b, t].double(), -1), F.log_softmax(lt[b, t].double(), -1)   # (V,)
        top = pt.topk(top_m).indices
        qs = torch.cat([ps[top], torch.log1p(-ps[top].exp().sum())[None]])                    # (M+1,)
        qt = torch.cat([pt[top], torch.log1p(-pt[top].exp().sum())[None]])
        total = total + (qs.exp() * (qs - qt)).sum()
    return total / len(rows)


def ref_delta(ls, lt, ids, omega, rewards):
    """Δ (eq. 12, per trajectory) of δ = log πT(a) − log πS(a) (eq. 11, the student side a constant), float64."""
    out = 0.0
    for b in range(len(rewards)):
        ts = omega[b].nonzero()[:, 0].tolist()
        d = sum(F.log_softmax(lt[b, t].double(), -1)[ids[b, t]]
                - F.log_softmax(ls[b, t].double(), -1)[ids[b, t]].detach() for t in ts)
        out = out + (2 * float(rewards[b]) - 1) * d / len(ts)
    return out / len(rewards)


def reference_grads(student, comp, world, tasks, eps, fn):
    """fn(student logits, teacher logits, ids, ω), a float64 function written out here, and its autograd
    derivative w.r.t. φ: the teacher re-scores the episodes behind freshly composed latents (no lopd_step)."""
    with torch.no_grad():
        ls, ids, omega = engine.student_logits(student, world["tok"], eps, "cpu")              # (B, Tc, V)
    latents = lopd.compose(comp, tasks, lopd.retrieve(world["retriever"], tasks, J))         # (B, J·K, d)
    lt = lopd.teacher_logits(comp, world["chat"], eps, latents)                        # (B, Tc, V)
    value = fn(ls, lt, ids, omega)
    return value, torch.autograd.grad(value, comp.trainable_parameters(), allow_unused=True)


@pytest.fixture(scope="module")
def two_betas(world):
    """One lopd_step at β = 0 and one at β = BETA from the same models and seed (so the same rollouts), with the
    anchor at 0 (λ = 0 and c_φ0 = c_φ), no clipping and lr 0 (the weights stay where the gradients were taken).
    Returns the recorded gradients per β, the episodes, the models and the metrics."""
    tasks = world["train"][6:10]
    out = {}
    for beta in (0.0, BETA):
        student, comp = make_models(world)
        c0 = lopd.anchor_cache(comp, world["retriever"], tasks, J)       # c_φ0 = c_φ: no gradient from it
        grads = {}
        opts = (record_grads(torch.optim.AdamW(student.parameters(), lr=0.0), grads),
                record_grads(torch.optim.AdamW(comp.trainable_parameters(), lr=0.0), grads))
        _, m, eps = run_step(world, student, comp, tasks, c0, opts, beta=beta, rng_seed=3, anchor=0.0, clip=1e9)
        out[beta] = dict(student=student, comp=comp, eps=eps, m=m,
                         g_s=[grads[id(p)] for p in student.parameters()],
                         g_c=[grads[id(p)] for p in comp.trainable_parameters()])
    assert [e.ids for e in out[0.0]["eps"]] == [e.ids for e in out[BETA]["eps"]]   # a fair comparison
    return tasks, out


def _flat(gs, like):
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).double() for g, p in zip(gs, like)])


# ------------------------------------------------------------------------------------------------------------
# 1. The composer learns through the teacher (break: latents.detach() in lopd_step)
# ------------------------------------------------------------------------------------------------------------
def test_composer_gradient_is_the_distillation_kl_through_the_teacher(world, two_betas):
    """λ = 0, c_φ0 = c_φ, β = 0: the only path to φ is p_T behind c_φ. The composer's gradient from lopd_step
    equals the autograd derivative of the KL written out here (float64 from the logits on), and a central
    difference of that KL on one QFormer entry."""
    tasks, runs = two_betas
    r = runs[0.0]
    params = r["comp"].trainable_parameters()
    got = _flat(r["g_c"], params)
    assert all(g is not None for g in r["g_c"]), "a composer tensor got no gradient: is c_φ detached?"
    kl, want = reference_grads(r["student"], r["comp"], world, tasks, r["eps"],
                               lambda ls, lt, ids, om: ref_distill(ls, lt, ids, om, 5))
    want = _flat(want, params)
    assert kl.item() == pytest.approx(r["m"]["loss/distill"], rel=1e-4)
    assert want.abs().max() > 1e-4                                        # a real signal, not noise
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * want.abs().max().item())
    # and a central difference of the KL on the QFormer entry with the largest gradient
    q = r["comp"].qformer.queries
    i = sum(p.numel() for p in params[:next(j for j, p in enumerate(params) if p is q)])   # q's flat offset
    k = int(want[i:i + q.numel()].abs().argmax())
    h, vals, saved = 1e-3, [], q.detach().clone()
    for sign in (1, -1):
        with torch.no_grad():
            q.view(-1)[k] += sign * h
            latents = lopd.compose(r["comp"], tasks, lopd.retrieve(world["retriever"], tasks, J))
            lt = lopd.teacher_logits(r["comp"], world["chat"], r["eps"], latents)
            ls, ids, om = engine.student_logits(r["student"], world["tok"], r["eps"], "cpu")
            vals.append(ref_distill(ls, lt, ids, om, 5).item())
            q.copy_(saved)                                                # exactly back (two_betas is shared)
    fd = (vals[0] - vals[1]) / (2 * h)
    assert got[i + k].item() == pytest.approx(fd, rel=1e-2)


# ------------------------------------------------------------------------------------------------------------
# 2. β and Δ act (breaks: Δ detached in eq. 13; β replaced by 0 in the call to lopd_objective)
# ------------------------------------------------------------------------------------------------------------
def test_beta_changes_the_composer_gradient_by_beta_times_the_privilege_gradient(world, two_betas):
    """∇φ L(β) − ∇φ L(0) = β ∂(m − Δ)/∂φ = −β ∂Δ/∂φ (eq. 13), with ∂Δ/∂φ from a float64 Δ written out here."""
    tasks, runs = two_betas
    params = runs[0.0]["comp"].trainable_parameters()
    diff = _flat(runs[BETA]["g_c"], params) - _flat(runs[0.0]["g_c"], params)
    rewards = torch.tensor([e.reward for e in runs[0.0]["eps"]])
    delta, d_delta = reference_grads(runs[0.0]["student"], runs[0.0]["comp"], world, tasks, runs[0.0]["eps"],
                                      lambda ls, lt, ids, om: ref_delta(ls, lt, ids, om, rewards))
    assert delta.item() == pytest.approx(runs[0.0]["m"]["privilege/delta"], rel=1e-4, abs=1e-6)
    want = -BETA * _flat(d_delta, params)
    assert want.abs().max() > 1e-3
    torch.testing.assert_close(diff, want, rtol=0, atol=2e-3 * want.abs().max().item())


@pytest.mark.equality
def test_student_gradient_does_not_depend_on_beta(two_betas):
    """Eq. (11) detaches the student's side of δ: Δ never moves θ, whatever β (break: no detach in δ)."""
    _, runs = two_betas
    like = list(runs[0.0]["student"].parameters())
    a, b = _flat(runs[0.0]["g_s"], like), _flat(runs[BETA]["g_s"], like)
    assert a.abs().max() > 0
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5 * a.abs().max().item())


def test_logged_total_is_the_sum_of_the_losses_backpropagated(world, monkeypatch):
    """With two micro-batches and β > 0, "loss/total" is what backward() saw, and equals eq. (13) of the batch:
    L_distill + β(m − Δ) + anchor (β·m counted once). Break: a total rebuilt from its parts, or β = 0 in the call."""
    real, seen = losses.lopd_objective, []

    def spy(*args, **kwargs):
        loss, m = real(*args, **kwargs)
        seen.append(loss.item())
        return loss, m

    monkeypatch.setattr(losses, "lopd_objective", spy)
    student, comp = make_models(world)
    tasks = world["train"][6:10]
    c0 = lopd.anchor_cache(comp, world["retriever"], tasks, J)
    c0 = {k: v + 0.05 for k, v in c0.items()}                            # the anchor term is not zero
    opts = (torch.optim.AdamW(student.parameters(), lr=1e-3), torch.optim.AdamW(comp.trainable_parameters(), lr=1e-3))
    beta = 0.7
    _, m, _ = run_step(world, student, comp, tasks, c0, opts, beta=beta, margin=0.5, micro_batch=2)
    assert len(seen) == 2 and m["loss/anchor"] > 0
    assert m["loss/total"] == pytest.approx(sum(seen), rel=1e-6)
    eq13 = m["loss/distill"] + beta * (0.5 - m["privilege/delta"]) + m["loss/anchor"]
    assert m["loss/total"] == pytest.approx(eq13, rel=1e-5)


# ------------------------------------------------------------------------------------------------------------
# 3. Full runs in-process through train.joint_training (the loop of train.py), at tiny size
# ------------------------------------------------------------------------------------------------------------
@dataclass
class HashWorld(tool_world.ToolWorld):
    """The tool world with a verifier that scores the replies' text by its hash, in [0, 1]. The tiny backbone
    never solves a task (its reward is always 0), which would leave GRPO's advantages zero, A(τ) = −1 everywhere
    and SDPO without successful siblings; hashed rewards differ between rollouts of one task."""
    said: str = ""

    def reset(self, task):
        self.said = ""
        return super().reset(task)

    def step(self, reply):
        self.said += reply
        return super().step(reply)

    def reward(self):
        return zlib.crc32(self.said.encode()) % 1001 / 1000


def joint_run(world, out, method, steps, resume=False):
    """train.joint_training at tiny size on the world's models: 4 rollouts a step in 2 micro-batches, a checkpoint
    every step, m = 1 (β rises from its first step), student and composer lr 1e-3. -> the run (engine.Run)"""
    argv = ["--model", world["path"], "--out", str(out), "--method", method, "--steps", str(steps),
            "--rollouts-per-step", "4", "--micro-batch", "2", "--save-every", "1", "--max-new-tokens", "12",
            "--max-env-steps", "2", "--eval-every", "0", "--n-ret", str(J), "--bank-threshold", "0.5",
            "--margin", "1.0", "--lr", "1e-3", "--composer-lr", "1e-3"] + (["--resume"] if resume else [])
    args = train.parse_args(argv)
    os.makedirs(out, exist_ok=True)
    student, comp = make_models(world)
    run = engine.Run(args=args, tok=world["tok"], chat=None, sample=None, composer=comp, retriever=world["retriever"],
                     train=world["train"], test=[], episodes=[], log=devices.Log(str(out)), student=student)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "env_factory", lambda a: lambda: HashWorld(max_steps=a.max_env_steps))
        train.joint_training(run)
    return run


def beta_of(fn, args, kwargs):
    """β of one call fn(*args, **kwargs) of losses.lopd_objective: its Eq13's, however it was passed."""
    call = inspect.signature(fn).bind(*args, **kwargs)
    call.apply_defaults()
    return call.arguments["eq"].beta


@pytest.fixture(scope="module")
def lopd_spied(world, tmp_path_factory):
    """A two-step LOPD run with a spy on losses.lopd_objective: each call's β and returned (loss, metrics)."""
    real, calls = losses.lopd_objective, []

    def spy(*args, **kwargs):
        loss, m = real(*args, **kwargs)
        calls.append(dict(beta=beta_of(real, args, kwargs), loss=loss.item(), **m))
        return loss, m

    out = tmp_path_factory.mktemp("lopd") / "a"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(losses, "lopd_objective", spy)
        run = joint_run(world, out, "lopd", 2)
    return out, run, calls


def test_loss_of_iteration_t_uses_beta_t_and_the_dual_step_follows(lopd_spied):
    """Iteration 0's loss uses β_0 = 0; β_1 = [β_0 + η(m − Δ_0)]₊ from iteration 0's Δ, and iteration 1's loss
    uses β_1 (break: β = 0 in the call, or the dual step before the loss)."""
    out, _, calls = lopd_spied
    assert len(calls) == 4                                                # 2 iterations x 2 micro-batches
    delta0 = calls[0]["privilege/delta"] + calls[1]["privilege/delta"]
    beta1 = max(0.0, 0.0 + 0.5 * (1.0 - delta0))
    assert calls[0]["beta"] == calls[1]["beta"] == 0.0
    assert beta1 > 0.1 and calls[2]["beta"] == calls[3]["beta"] == pytest.approx(beta1, rel=1e-12)
    delta1 = calls[2]["privilege/delta"] + calls[3]["privilege/delta"]
    logged = train_records(out, "lopd")
    assert [r["dual/beta"] for r in logged] == pytest.approx([beta1, max(0.0, beta1 + 0.5 * (1.0 - delta1))],
                                                             abs=1e-5)
    # the logged total (rounded to 5 digits by the log) is what backward() saw, β·m counted once
    assert [r["loss/total"] for r in logged] == pytest.approx([calls[0]["loss"] + calls[1]["loss"],
                                                               calls[2]["loss"] + calls[3]["loss"]], abs=2e-5)
    assert logged[1]["loss/total"] == pytest.approx(
        logged[1]["loss/distill"] + beta1 * (1.0 - logged[1]["privilege/delta"]) + logged[1]["loss/anchor"], abs=1e-4)


def train_records(out, stage):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["stage"] == stage]


def checkpoint_tensors(out):
    """Every tensor of the latest checkpoint: weights (safetensors files) and state.pt (optimizers, β, RNG)."""
    ckpt, flat = checkpoints.latest_checkpoint(str(out)), {}
    for root, _, files in os.walk(ckpt):
        for f in files:
            if f.endswith(".safetensors"):
                for k, v in load_file(os.path.join(root, f)).items():
                    flat[os.path.relpath(os.path.join(root, f), ckpt) + ":" + k] = v
    state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=False)
    return flat, state


def assert_same(a, b, where=""):
    """Nested dicts / lists / tensors / numbers equal, exactly."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif hasattr(a, "shape"):                                            # numpy arrays in the RNG state
        assert (a == b).all(), where
    else:
        assert a == b, where


@pytest.mark.parametrize("method", ["lopd", "grpo", "sdpo"])
def test_resume_restores_weights_optimizers_beta_and_ema(world, tmp_path, lopd_spied, method):
    """A run stopped after its step-1 checkpoint and resumed to step 2 ends exactly where the uninterrupted run
    does: student and composer weights, both AdamW states, β, SDPO's EMA teacher, the RNG streams. Step 2 is
    AdamW's second step, so it reads the first step's moments (breaks: any of these not saved or not restored)."""
    if method == "lopd":
        a_out, a_run, _ = lopd_spied                                    # the uninterrupted two-step run
    else:
        a_out = tmp_path / "a"
        a_run = joint_run(world, a_out, method, 2)
    b_out = tmp_path / "b"
    joint_run(world, b_out, method, 1)
    _, stopped = checkpoint_tensors(b_out)
    assert stopped["step"] == 1
    moments = [s["exp_avg"] for s in stopped["opt_s"]["state"].values()]
    assert moments and any(m.abs().sum() > 0 for m in moments)          # the optimizer state at the stop matters
    b_run = joint_run(world, b_out, method, 2, resume=True)
    assert [r["step"] for r in train_records(b_out, method)] == [0, 1]  # the resumed run did only step 1
    (wa, sa), (wb, sb) = checkpoint_tensors(a_out), checkpoint_tensors(b_out)
    assert sa["step"] == sb["step"] == 2
    assert_same(wa, wb, "weights")
    assert_same(sa, sb, "state")
    if method == "lopd":
        assert sa["state"]["beta"] > 0 and sa["opt_c"]["state"]
    if method == "sdpo":
        assert any(k.startswith("ema_teacher") for k in wa)
    for x, y in zip(list(a_run.student.parameters()) + a_run.composer.trainable_parameters(),
                    list(b_run.student.parameters()) + b_run.composer.trainable_parameters()):
        assert torch.equal(x, y)                                          # and the live objects agree too


# ------------------------------------------------------------------------------------------------------------
# 4. SDPO's EMA teacher (break: ema_update removed from sdpo_step)
# ------------------------------------------------------------------------------------------------------------
def test_sdpo_step_moves_the_ema_teacher_towards_the_updated_student(world):
    """θ̄_ema ← (1 − rate)·θ̄_ema + rate·θ after the student's update, parameter by parameter."""
    student, _ = make_models(world)
    ema = copy.deepcopy(student).requires_grad_(False)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in ema.parameters():                                      # θ̄_ema ≠ θ, so that the update shows
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    before = [p.detach().clone() for p in ema.parameters()]
    s_before = [p.detach().clone() for p in student.parameters()]
    cfg = baselines.BaselineConfig(group=4, ema_rate=0.3, success=0.5, context="span",
                                   sample=engine.SampleConfig(temperature=1.0, max_new_tokens=12))
    chat = toy.toy_chat(world["tok"], functools.partial(HashWorld, tools=None))
    torch.manual_seed(0)
    m, _ = baselines.sdpo_step(student, ema, chat, world["train"][:1], torch.optim.AdamW(student.parameters(), lr=1e-2),
                               cfg)
    assert m["context/rows"] > 0 and m["skipped"] == 0
    assert any(not torch.equal(p, q) for p, q in zip(student.parameters(), s_before))   # θ moved
    for t, t0, s in zip(ema.parameters(), before, student.parameters()):
        torch.testing.assert_close(t, 0.7 * t0 + 0.3 * s, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------------------
# 5. The evaluation rows: "vanilla" and "base + composer" are θ̄ without the composer's LoRA
# ------------------------------------------------------------------------------------------------------------
def test_vanilla_and_teacher_rows_are_the_pure_base(world):
    """With a non-zero composer LoRA: eval_vanilla = the pure base's rollout, eval_teacher = the pure base behind
    the same latents, each from the same sampling seed; the same rollouts WITH the LoRA differ, so a leaked
    adapter would show (break: adapter_disabled() dropped in eval_vanilla or teacher_rollout)."""
    tok, chat, tasks = world["tok"], world["chat"], world["train"][8:11]
    _, comp = make_models(world)
    pure = AutoModelForCausalLM.from_pretrained(world["path"]).eval()   # θ̄, no adapter anywhere
    cfg = engine.SampleConfig(temperature=1.0, max_new_tokens=12, batch_size=8)

    def ids(fn, seed=5):
        torch.manual_seed(seed)
        return [e.ids for e in fn()]

    vanilla = ids(lambda: train.eval_vanilla(comp, chat, tasks, cfg))
    assert vanilla == ids(lambda: engine.rollout(pure, chat, tasks, cfg))
    assert vanilla != ids(lambda: engine.rollout(comp.peft, chat, tasks, cfg))   # leaked
    with torch.no_grad():
        latents = lopd.compose(comp, tasks, lopd.retrieve(world["retriever"], tasks, J))     # (B, J·K, d)
    n, framing = latents.shape[1], tool_world.ToolWorld().framing
    starts = [engine.latent_prompt_ids(tok, tool_world.ToolWorld().reset(t), n, framing, None)[1] for t in tasks]
    prompt_fn = lambda msgs, tools: engine.latent_prompt_ids(tok, msgs, n, framing, None)[0]   # noqa: E731

    def behind_latents(model):
        return lambda: engine.rollout(model, chat, tasks, cfg, prompt_fn=prompt_fn,
                                      embed_fn=inject.make_embed_fn(model, latents, starts))

    teacher = ids(lambda: train.eval_teacher(comp, world["retriever"], chat, tasks, cfg, J))
    assert teacher == ids(behind_latents(pure))
    assert teacher != ids(behind_latents(comp.peft))                    # the LoRA left on while acting
    assert teacher != vanilla                                           # the latents change what θ̄ does


# ------------------------------------------------------------------------------------------------------------
# 6. Table 3's behaviour counts on hand-scripted episodes
# ------------------------------------------------------------------------------------------------------------
def test_behaviour_metrics_on_scripted_episodes(world):
    """Three episodes whose counts are known by construction, on a "reorder" task of a shop without commit (its
    checklist: the old order removed, the new one added); summarize() averages them column by column."""
    tok = world["tok"]
    task = next(t for t in world["train"] if t.schema == "reorder" and not tool_world.SHOPS[t.shop][1])
    find, verify, find_order, cancel, add = tool_world.oracle_calls(task)       # the intended procedure
    assert (find[0], verify[0], cancel[0], add[0]) == ("find_customer", "verify_customer", "cancel_order",
                                                       "add_order")
    first = len(tok(common.format_call(*find), add_special_tokens=False)["input_ids"]) + 1   # + end of turn
    # the procedure, the lookup repeated twice in a three-call reply: 6 replies ("Task Completed" last), 7 calls
    a = engine.scripted_episode(world["chat"], task, common.scripted_replies([find, [verify, find, find], find_order, cancel, add]))
    want_a = {"reward": 1.0, "steps": 6, "calls_per_step": 7 / 6, "first_len": first, "repeated_calls": 2,
              "reward_per_call": 1 / 7, "full_pass": 1.0}
    # lookups only, one of another account (other arguments: not a repeat): 5 replies, 4 calls, nothing written
    other = ("find_customer", {"account": "nobody"})
    b = engine.scripted_episode(world["chat"], task, common.scripted_replies([find, find, other, find]))
    want_b = {"reward": 0.0, "steps": 5, "calls_per_step": 0.8, "first_len": first, "repeated_calls": 2,
              "reward_per_call": 0.0, "full_pass": 0.0}
    # cut by the world's 3-step limit before add_order: 3 replies, 4 calls, half the checklist done
    short = toy.toy_chat(tok, lambda: tool_world.ToolWorld(max_steps=3, tools=None))
    c = engine.scripted_episode(short, task, common.scripted_replies([find, verify, [find_order, cancel], add]))
    want_c = {"reward": 0.5, "steps": 3, "calls_per_step": 4 / 3, "first_len": first, "repeated_calls": 0,
              "reward_per_call": 0.125, "full_pass": 0.0}
    for ep, want in ((a, want_a), (b, want_b), (c, want_c)):
        assert ep.metrics() == pytest.approx(want), (ep.metrics(), want)
    means = engine.summarize([a, b, c])
    assert means == pytest.approx({k: (want_a[k] + want_b[k] + want_c[k]) / 3 for k in want_a})
    assert list(results.markdown_table({"x": means}).splitlines()[2].split(" | ")[1:3]) == \
        [f"{means['reward']:.3f}", f"{means['full_pass']:.3f}"]
