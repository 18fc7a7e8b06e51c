"""--engine vllm (vllm_engine.py): the vLLM tier, skipped without vLLM (installed in its own virtualenv as
docs/real-models.md says; .ci/run runs it).

A tiny random Llama with a tied LM head is written here (no download) with the toy tokenizer: the engine's sampled
log-probs against Hugging Face's re-scoring of the same ids, the sync after optimizer steps, and what the check
catches when the sync, the tied head or the prefix-cache reset is left out; then two LOPD steps through train.py.

Run: python -m pytest tests/test_vllm.py -q
"""
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
import toy  # noqa: E402
import vllm_engine  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    return student, vllm_engine.VLLMGenerator(llama, student, max_len=2048)


def step(student):
    """One AdamW step of a random LM loss: the student's weights move, the engine's do not."""
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    ids = torch.randint(0, student.config.vocab_size, (1, 16))
    student(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def test_sampled_logprobs_equal_hugging_faces_rescoring(student_and_engine):
    student, gen = student_and_engine
    cfg = engine.SampleConfig(temperature=0.7, max_new_tokens=12)
    contexts = [[5, 6, 7, 8], [9, 10, 11]]
    for ctx, (ids, logps, _) in zip(contexts, gen.generate(contexts, cfg, [student.config.eos_token_id])):
        with torch.no_grad():
            lp = student(input_ids=torch.tensor([ctx + ids])).logits[0].log_softmax(-1)   # (L, V)
        want = [lp[len(ctx) - 1 + t, i].item() for t, i in enumerate(ids)]
        assert len(ids) > 0 and max(abs(a - b) for a, b in zip(logps, want)) < 1e-4


def test_the_sync_follows_optimizer_steps_and_the_check_catches_what_it_leaves_out(student_and_engine):
    student, gen = student_and_engine
    for _ in range(2):                                        # k steps, each synced: the check passes every time
        step(student)
        gen.sync(student)
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


def test_two_lopd_steps_generate_with_the_engine(llama, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", "--model", llama, "--engine", "vllm", "--out", str(out), "--n-train", "8",
           "--n-test", "2", "--bank-rollouts", "1", "--bank-threshold", "0", "--max-new-tokens", "8",
           "--max-env-steps", "2", "--max-len", "2048", "--latents", "2", "--n-ret", "1", "--cold-steps", "1",
           "--cold-batch", "2", "--steps", "2", "--rollouts-per-step", "2", "--micro-batch", "2", "--eval-every", "0",
           "--device", "cpu", "--no-thinking"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [json.loads(line) for line in open(out / "metrics.jsonl") if '"stage": "lopd"' in line]
    assert [s["step"] for s in steps] == [0, 1] and all(s["skipped"] == 0 for s in steps)
    assert all(0 <= s["engine/gap"] < vllm_engine.TOLERANCE for s in steps)      # synced and checked every step
