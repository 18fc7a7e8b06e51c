"""Data-parallel LOPD under torchrun: FSDP2 student, gloo on CPU, two processes (parallel.dist_setup,
parallel.shard_student, runtime/parallel.py).

Run: python -m pytest tests/test_distributed.py -q
Every multi-process run is a real `torchrun --standalone --nproc-per-node 2` subprocess with a timeout, so a hang
fails the test instead of stalling the suite. The backbone is a tiny untrained toy Qwen3 (one SFT step: building it
takes ~2 s); replies are capped at 8 tokens and episodes at 2 turns, so rollouts cost little. The same file is the
worker script: `python -m torch.distributed.run ... tests/test_distributed.py --equivalence BACKBONE OUT` runs one
LOPD iteration and one GRPO step on fixed rollouts, and `... --fail-on-rank1 TRAIN_ARGS` is train.py with an
exception raised in rank 1's first rollout.
"""
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import baselines  # noqa: E402
import engine  # noqa: E402
import lopd  # noqa: E402
import retrieval  # noqa: E402
from runtime import checkpoints, models, parallel  # noqa: E402
from worlds import common, tool_world  # noqa: E402
from worlds import toy_backbone as toy  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
B = 2                                   # rollouts per rank in the equivalence test; one process gets 2 x B
REWARDS = [1.0, 0.0, 0.5, 1.0]          # the fixed rollouts' rewards (mixed, so Δ and GRPO's advantages are not 0)
STAGES = ("tasks", "base_rollouts.jsonl", "bank", "composer0")   # a run's cached stages 1-4


def small(backbone, out, *extra):
    return ["train.py", "--model", str(backbone), "--out", str(out), "--n-train", "8", "--n-test", "2",
            "--bank-threshold", "0.0", "--cold-steps", "2", "--cold-batch", "4", "--rollouts-per-step", "4",
            "--micro-batch", "2", "--latents", "2", "--max-new-tokens", "8", "--max-env-steps", "2",
            "--temperature", "0", "--eval-every", "0", *extra]


def start(cmd, log):
    """cmd in its own process group (torchrun's workers included), output to log.out."""
    with open(f"{log}.out", "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log = f"{log}.out"
    return proc


def finish(proc, timeout=150):
    """Wait (killing the whole job on timeout: the test then fails, never hangs). -> (return code, output)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        pytest.fail(f"{' '.join(map(str, proc.args))} still running after {timeout} s:\n{read(proc.log)[-3000:]}")
    return proc.returncode, read(proc.log)


def kill(proc):
    """SIGKILL the launcher and every worker it started (one process group)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def ok(proc, timeout=150) -> str:
    rc, out = finish(proc, timeout)
    errors = "\n".join(line for line in out.splitlines() if "Error" in line)     # each rank's, not only torchrun's
    assert rc == 0, f"{' '.join(map(str, proc.args))}\nexit {rc}\n{errors[-2000:]}\n{out[-3000:]}"
    return out


def read(path):
    with open(path) as f:
        return f.read()


def records(run, stage="lopd"):
    return [r for r in map(json.loads, read(os.path.join(run, "metrics.jsonl")).splitlines()) if r["stage"] == stage]


def copy_stages(src, dst):
    os.makedirs(dst)
    for name in STAGES:
        (shutil.copytree if os.path.isdir(os.path.join(src, name)) else shutil.copy)(os.path.join(src, name),
                                                                                      os.path.join(dst, name))


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    out = str(tmp_path_factory.mktemp("bb") / "toy")
    toy.build_backbone(out, seed=0, n_demos=40, steps=1, batch=16, hidden=32, layers=2, log=lambda *_: None)
    torch.set_num_threads(n)
    return out


# ------------------------------------------------------------------------------------------------------------
# 1. Equivalence: one LOPD iteration and one GRPO step, 2 ranks x B fixed rollouts against 1 process on all 2 x B
# ------------------------------------------------------------------------------------------------------------
def equivalence(backbone, out):
    """One lopd_step and one grpo_step on fixed rollouts (engine.rollout replaced): each rank gets its slice.
    Plain SGD at lr 1 without clipping, so a weight's change IS its gradient: Adam's first step (g/|g|) or a clip
    would hide a gradient off by the factor 2 of averaging where the rule sums. Writes {metrics, each trained
    part's change} to `out` (rank 0)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from composer import Composer, ComposerConfig
    tok = AutoTokenizer.from_pretrained(backbone)
    base = AutoModelForCausalLM.from_pretrained(backbone).eval()
    tasks, _ = tool_world.make_splits(seed=0, n_train=2 * B + 4, n_test=1)
    tasks, bank_tasks = tasks[:2 * B], tasks[2 * B:]
    chat, fixed = toy.toy_chat(tok), []                        # scripted episodes with the rewards above
    for task, r in zip(tasks, REWARDS):
        ep = engine.scripted_episode(chat, task, common.scripted_replies(tool_world.oracle_calls(task)[:1]))
        ep.reward, ep.mask = r, [m if i % 3 or not m else 0 for i, m in enumerate(ep.mask)]   # uneven ω counts
        fixed.append(ep)
    entries = [retrieval.make_entry(t.task_id, t.text, f"trace {i}", 1.0, {"episode": i})
               for i, t in enumerate(bank_tasks)]
    ret = retrieval.Retriever(entries, retrieval.Embedder.from_model(base, tok, pooling="mean"))
    ret.cache_queries([t.task_id for t in tasks], [t.text for t in tasks])
    # the student as train.py makes it: on the meta device, sharded before it is materialised (each rank allocates
    # its half of the fp32 weights only), filled from θ̄'s tensors
    grpo_student = copy.deepcopy(base).requires_grad_(True)
    before = {k: v.detach().clone() for k, v in base.state_dict().items()}
    student = models.full_student(types.SimpleNamespace(grad_ckpt=False), models.student_source(base))
    local = sum(getattr(p, "_local_tensor", p).numel() for p in student.parameters())
    assert local <= sum(p.numel() for p in base.parameters()) / parallel.world() + 64, local   # + uneven splits
    torch.manual_seed(0)
    comp = Composer(base, tok, ComposerConfig(n_latents=2, n_layers=1))
    with torch.no_grad():
        for n, p in comp.peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    g = torch.Generator().manual_seed(1)
    c0 = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in lopd.anchor_cache(comp, ret, tasks, 2).items()}
    composer = lambda: ({n: p.detach().clone() for n, p in comp.peft.named_parameters() if p.requires_grad}  # noqa
                        | {"qformer." + n: p.detach().clone() for n, p in comp.qformer.named_parameters()})
    composer_before = composer()
    if parallel.world() > 1:
        grpo_student = parallel.shard_student(grpo_student)
    saved, engine.rollout = engine.rollout, lambda *a, **k: parallel.shard(fixed)     # every rank: its slice of `fixed`
    try:
        opts = (torch.optim.SGD(student.parameters(), lr=1.0), torch.optim.SGD(comp.trainable_parameters(), lr=1.0))
        cfg = lopd.LOPDConfig(n_ret=2, top_m=5, micro_batch=1, margin=0.5, clip=1e9)
        beta, m, _ = lopd.lopd_step(student, comp, chat, parallel.shard(tasks), ret, c0_cache=c0, beta=0.3, opts=opts, cfg=cfg)
        # the chunked loss (hidden states out, LM heads applied by the loss) on the FSDP2 student, a second step
        chunked = lopd.LOPDConfig(n_ret=2, top_m=5, micro_batch=1, margin=0.5, clip=1e9, loss_chunk=2)
        opts = (torch.optim.SGD(student.parameters(), lr=1e-3), torch.optim.SGD(comp.trainable_parameters(), lr=1e-3))
        beta, m_chunked, _ = lopd.lopd_step(student, comp, chat, parallel.shard(tasks), ret, c0_cache=c0, beta=beta, opts=opts,
                                            cfg=chunked)
        assert (parallel.full_optimizer_state(opts[0]) is None) == (parallel.rank() != 0)   # rank 0 keeps the copy
        opt = torch.optim.SGD(grpo_student.parameters(), lr=1.0)
        bcfg = baselines.BaselineConfig(group=2, micro_batch=1, clip=1e9)
        g_m, _ = baselines.grpo_step(grpo_student, chat, parallel.shard(tasks[:2]), opt, bcfg)
    finally:
        engine.rollout = saved
    def change(model):
        after = parallel.full_state(model)                             # FSDP2: gathered on rank 0, {} elsewhere
        after = {k: p.detach() for k, p in model.named_parameters()} if after is None else after   # tied once
        return {k: after[k] - before[k] for k in after}
    result = {"beta": beta, "lopd": m, "lopd_chunked": m_chunked, "grpo": g_m, "student": change(student),
              "grpo_student": change(grpo_student), "composer": {k: v - composer_before[k] for k, v in composer().items()}}
    if parallel.rank() == 0:
        torch.save(result, out)


def test_one_lopd_iteration_and_one_grpo_step_on_two_ranks_equal_one_process(backbone, tmp_path):
    two = start(TORCHRUN + [__file__, "--equivalence", backbone, str(tmp_path / "two.pt")], tmp_path / "two")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        equivalence(backbone, str(tmp_path / "one.pt"))
    finally:
        torch.set_num_threads(n)
    ok(two)
    one, two = (torch.load(tmp_path / f"{k}.pt", weights_only=False) for k in ("one", "two"))
    for key in ("loss/total", "loss/distill", "privilege/delta", "loss/anchor", "reward/student", "tokens"):
        assert two["lopd"][key] == pytest.approx(one["lopd"][key], rel=1e-5, abs=1e-7), key
    assert two["lopd"]["privilege/delta"] != 0 and two["lopd"]["loss/anchor"] > 0
    for key in ("loss/total", "loss/distill", "privilege/delta", "loss/anchor", "tokens"):   # --loss-chunk, FSDP2
        assert two["lopd_chunked"][key] == pytest.approx(one["lopd_chunked"][key], rel=1e-5, abs=1e-7), key
    assert two["lopd_chunked"]["skipped"] == 0
    assert two["beta"] == pytest.approx(one["beta"], rel=1e-6) and two["beta"] != 0.3     # the dual step moved β
    for key in ("loss/grpo", "reward/student", "tokens", "grpo/zero_adv_groups"):
        assert two["grpo"][key] == pytest.approx(one["grpo"][key], rel=1e-5, abs=1e-7), key
    assert one["lopd"]["skipped"] == one["grpo"]["skipped"] == two["lopd"]["skipped"] == 0
    for part in ("student", "grpo_student", "composer"):            # each weight's change = its summed gradient
        assert one[part].keys() == two[part].keys()
        assert max(v.abs().max() for v in one[part].values()) > 1e-6, part          # the step moved it
        for k in one[part]:
            torch.testing.assert_close(two[part][k], one[part][k], rtol=1e-4, atol=1e-8, msg=f"{part} {k}")


# ------------------------------------------------------------------------------------------------------------
# 2-4. train.py under torchrun: smoke + eval.py, SIGKILL after a checkpoint then rerun by ONE process, failure
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(backbone, tmp_path_factory):
    """a: an uninterrupted 2-rank run of 3 steps (greedy: the rollouts do not depend on how tasks are split).
    b: the same from a's cached stages, every rank SIGKILLed right after the step-2 checkpoint (at that point, not
    when a poller gets to it: a loaded machine could let step 3 finish first), then the same flags run by ONE
    process, which continues it (no flag needed)."""
    root = tmp_path_factory.mktemp("runs")
    a, b = str(root / "a"), str(root / "b")
    out_a = ok(start(TORCHRUN + small(backbone, a, "--steps", "3", "--save-every", "2"), root / "a-log"))
    copy_stages(a, b)
    copy_stages(a, str(root / "c"))
    evaluation = start([sys.executable, "eval.py", "--run", a, "--n-test", "2"], root / "eval")
    failing = start(TORCHRUN + [__file__, "--fail-on-rank1"] + small(backbone, root / "c", "--steps", "2")[1:],
                    root / "c-log")          # test_a_failure_on_one_rank_ends_the_job_with_its_message
    t0 = time.time()
    rc, out_b = finish(start(TORCHRUN + [__file__, "--kill-after-checkpoint"] + small(backbone, b, "--steps", "3",
                                                                                      "--save-every", "2")[1:],
                             root / "b-log"))
    assert rc != 0 and "Signal 9 (SIGKILL)" in out_b, out_b[-3000:]
    assert open(os.path.join(b, "ckpt", "LATEST")).read().strip() == "step-000002"
    resumed = ok(start([sys.executable] + small(backbone, b, "--steps", "3", "--save-every", "2"), root / "b-rerun"))
    rc, out_c = finish(failing, timeout=90)
    return dict(a=a, b=b, out_a=out_a, eval=ok(evaluation), resumed=resumed, failed=(rc, out_c, time.time() - t0))


def test_torchrun_smoke_run_and_eval_reads_it(runs):
    a = runs["a"]
    assert runs["out_a"].count("world size 2, backend gloo") == 1          # rank 0 only, once
    assert runs["out_a"].count("| LOPD student |") == 1                     # results printed once
    assert [r["step"] for r in records(a)] == [0, 1, 2]                     # one record per step: rank 0 logs
    assert all(r["skipped"] == 0 and r["generations"] == 16 + 4 * (r["step"] + 1) for r in records(a))
    assert len(read(os.path.join(a, "base_rollouts.jsonl")).splitlines()) == 16   # both ranks' slices gathered
    assert sorted(os.listdir(os.path.join(a, "ckpt"))) == ["LATEST", "step-000003"]
    for row in ("vanilla", "base + composer", "LOPD student"):
        assert f"| {row} |" in runs["eval"]


def same_value(got, want, rel=1e-4, abs=2e-5) -> bool:
    """A metrics value: a number within tolerance (pytest.approx takes numbers only since pytest 9.2), anything
    else (the record's "stage", a list) exactly."""
    if isinstance(want, (int, float)) and not isinstance(want, bool):
        return isinstance(got, (int, float)) and got == pytest.approx(want, rel=rel, abs=abs)
    return got == want


def test_same_value_compares_numbers_approximately_and_the_rest_exactly():
    assert same_value(1.0, 1.0 + 1e-6) and not same_value(1.0, 1.01)
    assert same_value("lopd", "lopd") and not same_value("lopd", "grpo") and not same_value("1", 1)


def test_two_rank_checkpoint_resumed_by_one_process_continues_the_two_rank_run(runs):
    assert "world size" not in runs["resumed"]                               # plain python: no group
    ckpt = os.path.join(runs["b"], "ckpt", "step-000002")
    assert f"joint stage: continuing from {ckpt} at step 2 of 3" in runs["resumed"]
    last = {r["step"]: r for r in records(runs["b"])}                      # the resumed record of a step counts
    want = {r["step"]: r for r in records(runs["a"])}
    assert sorted(last) == [0, 1, 2]
    for step in (0, 1, 2):
        for k, v in want[step].items():
            if k != "seconds":
                assert same_value(last[step][k], v), (step, k, last[step][k], v)
    # the weights after the last update: the 2-rank AdamW states (gathered whole) carried the 1-process step
    from safetensors.torch import load_file
    for part in ("student/model.safetensors", "composer/qformer.safetensors"):
        a, b = (load_file(os.path.join(runs[k], "ckpt", "step-000003", part)) for k in ("a", "b"))
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6, msg=f"{part} {k}")


def test_a_failure_on_one_rank_ends_the_job_with_its_message(runs):
    """Rank 1 raises in its first rollout of the joint stage while rank 0 waits in a collective: torchrun ends the
    job (within the fixture's 90 s timeout: no hang) and reports rank 1's message as the root cause (train.main
    is wrapped in torch's @record)."""
    rc, text, seconds = runs["failed"]
    assert rc != 0 and "injected failure in rank 1's rollout" in text, text[-3000:]
    root_cause = text[text.index("Root Cause"):]
    assert "rank      : 1" in root_cause and "injected failure" in root_cause
    assert seconds < 90


def test_an_uneven_split_is_refused_naming_the_flag(backbone, tmp_path):
    """What main() checks right after joining the group: every rank must get an equal slice (GRPO: whole groups)."""
    import train
    for argv, flag in ((["--rollouts-per-step", "3"], "--rollouts-per-step 3"),
                       (["--method", "grpo", "--rollouts-per-step", "4", "--group", "4"], "--rollouts-per-step 4"),
                       (["--cold-batch", "5"], "--cold-batch 5")):
        args = train.parse_args(small(backbone, tmp_path)[1:] + argv)
        with pytest.raises(SystemExit, match=flag + ".*2 processes"):
            parallel.check_world(args, 2, train.rollouts_per_task(args))        # as main() calls it
    parallel.check_world(train.parse_args(small(backbone, tmp_path)[1:]), 2)      # the smoke runs' settings pass


if __name__ == "__main__":
    import torch.distributed as dist
    if sys.argv[1] == "--equivalence":
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        equivalence(sys.argv[2], sys.argv[3])
        dist.destroy_process_group()
    else:                               # train.py with a failure injected
        import train
        rollout, save = engine.rollout, checkpoints.save_checkpoint

        def failing(*a, **k):
            if parallel.rank() == 1:
                raise RuntimeError("injected failure in rank 1's rollout")
            return rollout(*a, **k)

        def save_then_die(*a, **k):     # every rank, right after the first checkpoint is complete
            save(*a, **k)
            dist.barrier()              # rank 0 writes alone: the others would die first and torchrun would end it
            os.kill(os.getpid(), signal.SIGKILL)
        if sys.argv[1] == "--fail-on-rank1":
            engine.rollout = failing
        else:
            checkpoints.save_checkpoint = save_then_die
        os.chdir(ROOT)
        train.main(sys.argv[2:])
