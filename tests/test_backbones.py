"""The real-model path on CPU (issue: the paper's backbones): any causal LM folder runs through train.py and eval.py,
the chat template lists the tools, --student-lora keeps one copy of the backbone, checkpointing changes nothing.

Run: python -m pytest tests/test_backbones.py -q
The "real" models are tiny random-weight Qwen3, Llama and Olmo3 models saved with `save_pretrained`, each with a
tokenizer whose chat template lists tools the way Qwen3's does (toy.TOOLS_CHAT_TEMPLATE). They hold no
toy_backbone.json, so train.py treats them as real models: A.5 system prompt and framing, the paper's defaults
(overridden to tiny sizes by flags), on the toy tool world by --env tools (a real model's default is EnvScaler).
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Olmo3Config, Qwen3Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import engine  # noqa: E402
import inject  # noqa: E402
from runtime import models  # noqa: E402
import train  # noqa: E402
from worlds import code_world  # noqa: E402
from worlds import tool_world  # noqa: E402
from worlds import toy_backbone as toy  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=4096)
ARCHS = {"qwen3": lambda v: Qwen3Config(vocab_size=v, head_dim=16, **SMALL),
         "llama": lambda v: LlamaConfig(vocab_size=v, **SMALL),
         "olmo3": lambda v: Olmo3Config(vocab_size=v, **SMALL)}


def tiny_args(model, out, *extra):
    return ["--model", str(model), "--env", "tools", "--out", str(out), "--n-train", "12", "--n-test", "3",
            "--bank-threshold", "0", "--cold-steps", "1", "--steps", "2", "--rollouts-per-step", "2", "--micro-batch", "1", "--latents", "2",
            "--max-new-tokens", "12", "--max-env-steps", "2", "--save-every", "1", "--embedder", "backbone", *extra]


def save_model(kind, tok, path):
    torch.manual_seed(0)
    config = ARCHS[kind](len(tok))
    config.eos_token_id, config.pad_token_id, config.bos_token_id = tok.eos_token_id, tok.pad_token_id, None
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tools_tok():
    tok = toy.build_tokenizer(toy.corpus_texts(toy.demo_tasks(60, 0), 0))
    tok.chat_template = toy.TOOLS_CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def folders(tools_tok, tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {kind: save_model(kind, tools_tok, root / kind) for kind in ARCHS}


def test_each_architecture_trains_and_evaluates(folders, tmp_path):
    """python train.py --model DIR --steps 2, then python eval.py, for Qwen3, Llama and Olmo3 (two at a time)."""
    runs = {kind: tmp_path / kind for kind in folders}
    procs = {kind: subprocess.Popen([sys.executable, "train.py", *tiny_args(folders[kind], runs[kind])], cwd=ROOT,
                                    env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for kind in folders}
    for kind, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{kind}: {err[-3000:]}"
        assert "| LOPD student |" in out
        steps = [json.loads(line) for line in open(runs[kind] / "metrics.jsonl") if '"stage": "lopd"' in line]
        assert [r["step"] for r in steps] == [0, 1]
    res = subprocess.run([sys.executable, "eval.py", "--run", str(runs["llama"]), "--n-test", "2"], cwd=ROOT,
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "| base + composer |" in res.stdout


def test_chat_template_lists_tools_and_the_sentinel_splits_once(tools_tok):
    msgs = tool_world.ToolWorld(system_prompt=tool_world.AGENTIC_SYSTEM_PROMPT).reset(tool_world.make_splits(0, 1, 1)[0][0])
    text = tools_tok.apply_chat_template(msgs, tools=tool_world.TOOLS, tokenize=False, add_generation_prompt=True)
    for tool in tool_world.TOOLS:
        assert json.dumps(tool) in text                                   # every schema, as Qwen3 renders it
    ids, start = engine.latent_prompt_ids(tools_tok, msgs, 6, inject.AGENTIC_FRAMING, tool_world.TOOLS)
    assert ids[start:start + 6] == [inject.placeholder_id(tools_tok)] * 6
    plain = engine.prompt_ids(tools_tok, msgs, tool_world.TOOLS)
    assert len(ids) > len(plain) + 6 and ids[:20] == plain[:20]           # same system turn with the tools


def test_student_lora_keeps_one_copy_of_the_backbone(folders, tmp_path):
    args = train.parse_args(tiny_args(folders["qwen3"], tmp_path / "run", "--student-lora", "--student-lora-r", "2"))
    run = train.prepare(args)
    student, composer = run.student, run.composer
    assert student.peft is composer.peft
    base = [p for n, p in composer.peft.named_parameters() if "lora_" not in n]
    storages = {p.untyped_storage().data_ptr() for p in base}
    everything = [p for m in (composer.peft, composer.qformer) for p in m.parameters()]
    lora_or_qformer = sum(p.numel() for n, p in composer.peft.named_parameters() if "lora_" in n) + sum(
        p.numel() for p in composer.qformer.parameters())
    # one copy: the base weights are stored once, and nothing else holds a backbone-sized tensor
    assert len(storages) == len(base)
    assert sum(p.numel() for p in everything) == sum(p.numel() for p in base) + lora_or_qformer
    assert {id(p) for p in student.parameters()}.isdisjoint({id(p) for p in composer.trainable_parameters()})
    before = {n: p.detach().clone() for n, p in composer.peft.named_parameters()}
    trained = train.joint_training(run)
    after = dict(composer.peft.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert any(".student." in n for n in changed)                          # the student's LoRA learned
    assert all("lora_" in n for n in changed)                              # the backbone did not move
    assert trained is student


@pytest.mark.equality
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(folders):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folders["qwen3"])
    tasks = tool_world.make_splits(0, 3, 1)[0]
    results = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(folders["qwen3"]).train()
        if ckpt:
            models.checkpointing(model)
        assert all((layer.forward.__func__ is models._checkpointed_forward) == ckpt for layer in model.model.layers)
        eps = [engine.scripted_episode(toy.toy_chat(tok), t, tool_world.oracle_replies(t)) for t in tasks]   # no tools
        logits, ids, omega = engine.student_logits(model, tok, eps, "cpu")
        loss = -(torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0] * omega).sum() / omega.sum()
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_code_env_runs_the_pipeline_with_a_real_model_folder(folders, tmp_path):
    """--env code --tasks DIR: single-turn problems (TACO layout here), verified in the sandbox, same pipeline."""
    tasks = tmp_path / "problems"
    tasks.mkdir()
    rows = [{"question": f"Read an integer n and print n + {k}.",
             "input_output": json.dumps({"inputs": ["1\n", "5\n"], "outputs": [f"{1 + k}\n", f"{5 + k}\n"]})}
            for k in range(8)]
    (tasks / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:6]) + "\n")
    (tasks / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows[6:]) + "\n")
    out = tmp_path / "run"
    train.main(tiny_args(folders["qwen3"], out, "--env", "code", "--tasks", str(tasks)))
    steps = [json.loads(line) for line in open(out / "metrics.jsonl") if '"stage": "lopd"' in line]
    assert [r["step"] for r in steps] == [0, 1]
    rows = json.load(open(out / "results.json"))["rows"]
    assert set(rows) == {"vanilla", "base + composer", "LOPD student"}
    assert all(set(r) == {"pass@1", "reply_tokens"} and 0.0 <= r["pass@1"] <= 1.0 for r in rows.values())
    # the experience is the program the model wrote: the reply's text with its end-of-turn token stripped
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folders["qwen3"])
    recs = [json.loads(line) for line in open(out / "base_rollouts.jsonl")]
    assert len(recs) == 12 and all(r["steps"] == 1 and r["reward"] in (0.0, 1.0) for r in recs)
    for r in recs:
        reply = tok.decode(r["ids"][r["prompt_len"]:], skip_special_tokens=False).replace(tok.eos_token, "")
        assert r["trace"] == code_world.extract_code(reply)
    bank = [json.loads(line) for line in open(out / "bank" / "bank.jsonl")]
    assert sorted(e["trace"] for e in bank) == sorted(r["trace"] for r in recs)   # --bank-threshold 0: all of them
