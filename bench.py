"""Benchmarks: figures printed, never asserted (speed and memory targets live here, not in tests).

    python bench.py --loss                  # top-M + tail reverse KL vs F.cross_entropy on the same logits
    python bench.py --loss --vocab 151936   # at Qwen3's vocabulary size

Machines are noisy: every comparison is a ratio measured in one run, best of --repeats.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import losses


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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--loss", action="store_true", help="time the distillation loss against cross-entropy")
    p.add_argument("--batch", type=int, default=16, help="B")
    p.add_argument("--tokens", type=int, default=512, help="T")
    p.add_argument("--vocab", type=int, default=468, help="V (default: the toy tokenizer's size)")
    p.add_argument("--top-m", type=int, default=20, help="M")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; the minimum is reported")
    a = p.parse_args()
    if a.loss:
        bench_loss(a.batch, a.tokens, a.vocab, a.top_m, a.repeats)
    else:
        p.print_help()


if __name__ == "__main__":
    main()
