"""Benchmarks: figures printed, never asserted (speed and memory targets live here, not in tests).

    python bench.py --loss                  # top-M + tail reverse KL vs F.cross_entropy on the same logits
    python bench.py --loss --vocab 151936   # at Qwen3's vocabulary size
    python bench.py --step --model runs/toy/backbone   # one LOPD step vs one OPSD-style step, time per phase

Machines are noisy: every comparison is a ratio measured in one run, best of --repeats.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import envs
import losses
import lopd


def best_of(fn, repeats: int) -> float:
    """Minimum wall time of fn() over `repeats` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_loss(B: int, T: int, V: int, M: int, repeats: int):
    """Forward + backward of the distillation loss against cross-entropy on (B, T, V) logits, all tokens supervised."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(B, T, V, generator=g, requires_grad=True)                 # (B, T, V) student logits
    t = torch.randn(B, T, V, generator=g, requires_grad=True)                 # (B, T, V) teacher logits
    ids = torch.randint(0, V, (B, T), generator=g)                            # (B, T)
    mask = torch.ones(B, T)                                                   # (B, T)

    def kl():
        losses.reverse_kl_topm(s, t, mask, top_m=M).backward()

    def ce():
        F.cross_entropy(s.reshape(-1, V), ids.reshape(-1)).backward()

    t_kl, t_ce = best_of(kl, repeats), best_of(ce, repeats)
    print(f"loss (B={B}, T={T}, V={V}, M={M}), forward+backward, best of {repeats}:")
    print(f"  top-M + tail reverse KL  {t_kl * 1e3:8.1f} ms   (student and teacher gradients)")
    print(f"  F.cross_entropy          {t_ce * 1e3:8.1f} ms   (student gradient only)")
    print(f"  ratio KL / CE            {t_kl / t_ce:8.2f}")


class Timer:
    """Accumulates wall time per named phase."""

    def __init__(self):
        self.t = {}

    def __call__(self, name, fn):
        t0 = time.perf_counter()
        out = fn()
        self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0
        return out


def text_teacher_logits(model, tok, eps, exps):
    """OPSD-style teacher (B.1): the same frozen model with the retrieved trajectories as TEXT in its system
    message, re-scoring the student's continuation. -> teacher logits (B, Tc, V) aligned like lopd's."""
    prompts = []
    for e, es in zip(eps, exps):
        ref = "\n\n".join(lopd.experience_text(x) for x in es)
        msgs = [{"role": "system", "content": envs.TOY_SYSTEM_PROMPT + "\n\nSolved examples:\n" + ref},
                {"role": "user", "content": e.task.text}]
        prompts.append(lopd.prompt_ids(tok, msgs))
    conts, _ = lopd.continuation(eps, "cpu")
    ids, att, pos, P, _ = lopd.pack(prompts, conts, tok.pad_token_id, "cpu")
    Tc = ids.shape[1] - P
    return model(input_ids=ids, attention_mask=att, position_ids=pos).logits[:, P - 1:P - 1 + Tc]


def bench_step(model_dir: str, batch: int, repeats: int):
    """One LOPD iteration's phases against an OPSD-style iteration at equal batch (same rollouts)."""
    import copy
    import random
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import retrieval
    from composer import Composer, ComposerConfig
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir).requires_grad_(False)
    student = copy.deepcopy(base).requires_grad_(True)
    composer = Composer(base, tok, ComposerConfig(n_latents=8))
    train, _ = envs.make_splits(0, 200, 1)
    bank = [retrieval.make_entry(t.task_id, t.text, lopd.scripted_episode(tok, envs.ToolWorld(), t,
            envs.oracle_calls(t)).trace, 1.0) for t in train[:100]]
    ret = retrieval.Retriever(bank, retrieval.Embedder(retrieval.minilm_path(), pooling="mean"))
    tasks = random.Random(0).sample(train, batch)
    torch.manual_seed(0)
    clock = {"LOPD": Timer(), "OPSD-style (text teacher)": Timer()}
    for _ in range(repeats):
        tm = clock["LOPD"]
        eps = tm("rollout", lambda: lopd.rollout(student, tok, tasks, lopd.SampleConfig()))
        exps = tm("retrieve", lambda: lopd.retrieve(ret, tasks, 3))
        lat = tm("compose", lambda: lopd.compose(composer, tasks, exps))
        ls, lt, ids, om = tm("teacher + student forward", lambda: lopd.student_teacher_logits(
            student, composer, tok, eps, lat, envs.ToolWorld))
        loss = tm("loss", lambda: losses.lopd_objective(ls, lt, ids, om, torch.ones(batch), 0.1, 0.05, lat,
                                                         lat.detach(), 0.2)[0])
        tm("backward", loss.backward)
        tm = clock["OPSD-style (text teacher)"]
        tm("rollout", lambda: lopd.rollout(student, tok, tasks, lopd.SampleConfig()))
        exps = tm("retrieve", lambda: lopd.retrieve(ret, tasks, 3))
        with torch.no_grad():
            lt = tm("teacher forward", lambda: text_teacher_logits(base, tok, eps, exps))
        ls, ids, om = tm("student forward", lambda: lopd.student_logits(student, tok, eps, "cpu"))
        loss = tm("loss", lambda: losses.reverse_kl_topm(ls, lt, om))
        tm("backward", loss.backward)
    totals = {k: sum(v.t.values()) / repeats for k, v in clock.items()}
    print(f"one iteration at {batch} rollouts, mean of {repeats} (seconds):")
    for k, v in clock.items():
        print(f"  {k:28s} {totals[k]:6.2f}  = " + "  ".join(f"{n} {t / repeats:.2f}" for n, t in v.t.items()))
    print(f"  ratio LOPD / OPSD-style      {totals['LOPD'] / totals['OPSD-style (text teacher)']:6.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--loss", action="store_true", help="time the distillation loss against cross-entropy")
    p.add_argument("--step", action="store_true", help="time one LOPD step against an OPSD-style step")
    p.add_argument("--model", default="runs/toy/backbone", help="backbone folder for --step")
    p.add_argument("--batch", type=int, default=16, help="B")
    p.add_argument("--tokens", type=int, default=512, help="T")
    p.add_argument("--vocab", type=int, default=468, help="V (default: the toy tokenizer's size)")
    p.add_argument("--top-m", type=int, default=20, help="M")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; the minimum is reported")
    a = p.parse_args()
    if a.loss:
        bench_loss(a.batch, a.tokens, a.vocab, a.top_m, a.repeats)
    if a.step:
        bench_step(a.model, a.batch, a.repeats)
    if not (a.loss or a.step):
        p.print_help()


if __name__ == "__main__":
    main()
