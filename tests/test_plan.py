"""The memory plan comes before the download, and a refusal names only what fits (issue 59).

Run: python -m pytest tests/test_plan.py -q
Models: Qwen3-4B's shapes as a folder holding only config.json (no tokenizer, no weights: the plan must refuse or
pass before either is needed), planned on the meta device with a device of 80 GB or 141 GB given by --memory;
and a tiny random Qwen3 with a 40,960-token context (test_backbones.py's way) for the docs' smallest real-model
command, which runs through train.py in a subprocess.
"""
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from runtime import devices, memory, models, parallel
import train
from test_envscaler import write_release
from test_errors import one_line_exit
from worlds import toy_backbone as toy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
QWEN3_4B = dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=9728, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True)
# docs/real-models.md, "Memory at the paper's budgets" (its real run): the real-model tier's command, less --model, --out
DOCS_COMMAND = ["--env", "tools", "--n-train", "16", "--n-test", "4", "--cold-steps", "2", "--steps", "2", "--rollouts-per-step", "4",
                "--micro-batch", "2", "--latents", "2", "--max-new-tokens", "48", "--max-env-steps", "2",
                "--bank-threshold", "0"]


RELEASE = []        # EnvScaler's release as the tests write it: the card's world, offline (`config_only` fills it)


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """A --model folder with Qwen3-4B's config.json and nothing else (and, beside it, an EnvScaler release)."""
    folder = tmp_path_factory.mktemp("qwen3-4b-config")
    Qwen3Config(architectures=["Qwen3ForCausalLM"], **QWEN3_4B).save_pretrained(folder)
    assert os.listdir(folder) == ["config.json"]
    RELEASE[:] = [write_release(tmp_path_factory.mktemp("envscaler") / "release", "roll", "jsonl")]
    return str(folder)


def card(folder, out, *flags) -> list:
    """The card's command (python train.py --model Qwen/Qwen3-4B: EnvScaler, B.2-B.3) on `folder`, bf16 as on CUDA,
    its release from the folder the tests wrote, with `flags`."""
    return ["--model", folder, "--out", str(out), "--dtype", "bfloat16", "--tasks", RELEASE[0], *flags]


refusal = one_line_exit      # train.main(argv) exits 2 with one error line on stderr, no traceback; -> that line


@pytest.fixture
def h100(monkeypatch):
    """The device train.py plans for is an H100 (81,559 MiB, ~1 GB of it CUDA's context), whatever this machine's."""
    real = memory.machine
    monkeypatch.setattr(memory, "machine", lambda args, device, loaded=0: dataclasses.replace(
        real(args, device, loaded), type="cuda", total=81_559 * 2**20, free=81_559 * 2**20 - 10**9))


@pytest.fixture(autouse=True)
def roomy_disk(monkeypatch):
    """--out on a disk with 1 TB free, whatever this machine's (the disk's own test sets its own)."""
    monkeypatch.setattr(memory, "disk_free", lambda out: 10**12)


def plans(argv, world: int = 1) -> bool:
    """Whether train.py's plan before loading passes for `argv` on `world` ranks (torchrun --nproc-per-node)."""
    args = train.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(parallel, "world", lambda: world)
        try:
            train.plan_before_loading(args, torch.device("cpu"), torch.bfloat16, train.load_splits(args, False)[0])
            return True
        except devices.UserError:
            return False


def planning(args, model, machine, prompt: int) -> memory.Planning:
    """What train.plan_before_loading plans from, for `model` on `machine` and a prompt of `prompt` tokens."""
    return memory.Planning(args, model, machine, train.trains(args, model.config), prompt)


def suggestions(line: str) -> list:
    """The refusal's "What fits: a; b; c" as a list."""
    return re.sub(r" \(--student-lora does not fit either\)$", "", line.split("What fits: ")[1]).split("; ")


def followed(argv, suggestion: str) -> tuple:
    """(argv, world) of `argv` with one suggestion followed."""
    if m := re.fullmatch(r"torchrun --nproc-per-node (\d+) \(FSDP2 shards the student\)", suggestion):
        return argv, int(m[1])
    if m := re.fullmatch(r"a (?:card|machine) with ([\d.]+) GB free", suggestion):
        return [*argv, "--memory", m[1]], 1
    return [*argv, *suggestion.split()], 1


def test_the_cards_command_on_80_gb_refuses_before_any_weight_and_every_suggestion_fits(config_only, tmp_path,
                                                                                     capsys, h100):
    """`python train.py --model Qwen/Qwen3-4B` on an 80 GB device: the full fp32 student's weights, gradients and
    AdamW states alone pass what the plan may fill, so no --max-len can help and none is named. The refusal comes
    from the config alone (the folder has no weights, no tokenizer), in one line that names the device's total and
    free; --student-lora, the fewest GPUs under torchrun and a larger device are each planned again and fit."""
    argv = card(config_only, tmp_path / "run", "--memory", "80")
    line = refusal(capsys, argv)
    assert line.startswith("error: memory plan: cuda 85.5 GB total, 84.5 GB free; the run fills at most 80.0 GB "
                           "(--memory), the 8.0 GB backbone included: 61.2 GB planned of the 72.0 GB beside it: ")
    assert "(65.9 GB)" in line and "no --max-len fits" in line
    fits = suggestions(line)
    assert fits[0] == "--student-lora" and fits[1].startswith("torchrun --nproc-per-node 4 ") and \
        fits[2].startswith("a card with ") and not any("--max-len" in s for s in fits), fits
    for s in fits:
        assert plans(*followed(argv, s)), s
    assert not plans(argv, 2) and parallel.uneven(train.parse_args(argv), 3)    # 3: 32 rollouts do not split
    gb = float(re.search(r"with ([\d.]+) GB free", fits[2])[1])
    assert not plans([*argv, "--memory", f"{gb - 0.1:.1f}"])                      # the smallest device, to 0.1 GB


def test_on_a_cpu_more_ranks_are_not_suggested(config_only, tmp_path, capsys):
    """torchrun's ranks on one CPU machine share its memory: the same refusal there names no torchrun."""
    line = refusal(capsys, card(config_only, tmp_path / "run", "--memory", "80"))
    assert line.startswith("error: memory plan: cpu ") and suggestions(line)[0] == "--student-lora"
    assert "torchrun" not in line and suggestions(line)[1].startswith("a machine with ")


def test_where_a_shorter_conversation_fits_the_refusal_names_the_longest_max_len(config_only, tmp_path, capsys,
                                                                                 h100):
    """At 110 GB the resident states and AdamW's temporary fit but one 40,960-token conversation does not: the
    refusal names the longest --max-len that fits (one token more does not), and the other suggestions, each planned again."""
    argv = card(config_only, tmp_path / "run", "--memory", "110")
    line = refusal(capsys, argv)
    assert "one 40960-token conversation needs " in line
    fits = suggestions(line)
    n = int(re.fullmatch(r"--max-len (\d+)", fits[0])[1])
    assert 1000 < n < 40960 and plans([*argv, "--max-len", str(n)]) and not plans([*argv, "--max-len", str(n + 1)])
    for s in fits[1:]:
        assert plans(*followed(argv, s)), s


def test_on_141_gb_the_plan_line_says_the_device_and_the_checkpoints_disk(config_only, tmp_path):
    """An H200's worth: the card's command plans, and its line names the device's total and free, what the run may
    fill with the backbone, and two checkpoints (12 bytes a trained parameter) against --out's free disk."""
    args = train.parse_args(card(config_only, tmp_path / "run", "--memory", "141"))
    model = models.meta_backbone(Qwen3Config(**QWEN3_4B), torch.bfloat16)
    machine = memory.Machine("cuda", total=150_755_000_000, free=149_700_000_000, limit=141 * 10**9, given=True,
                              disk=500 * 10**9)
    plan = memory.memory_plan(planning(args, model, machine, prompt=4096))
    line = plan.line()
    assert line.startswith("memory plan: cuda 150.8 GB total, 149.7 GB free; the run fills at most 141.0 GB "
                           "(--memory), the 8.0 GB backbone included: 113.0 GB planned of the 133.0 GB beside it; ")
    assert plan.grad_ckpt and "one 40960-token conversation trains in 110.8 GB" in line
    foot = memory.footprint(args, model, train.trains(args, model.config))
    assert plan.checkpoint == foot.checkpoint and 12 * 4.02e9 < plan.checkpoint < 12 * 4.2e9
    assert line.endswith(f"checkpoints 2 × {plan.checkpoint / 1e9:.1f} GB on --out's disk (500.0 GB free)")


def test_two_checkpoints_that_do_not_fit_the_disk_refuse_with_what_fits(config_only, tmp_path, capsys, monkeypatch):
    """--out on a disk with 60 GB free: a full student's checkpoint (~49 GB) is written while the last is kept, so
    the run stops in one line before any weight is read, naming --student-lora's checkpoints and the disk needed;
    both fit when followed. --steps 0 writes none and passes."""
    monkeypatch.setattr(memory, "disk_free", lambda out: 60 * 10**9)
    argv = card(config_only, tmp_path / "run", "--memory", "141")
    line = refusal(capsys, argv)
    assert line.startswith("error: disk plan: a checkpoint of the run is 49.") and "60.0 GB free for --out" in line
    lora, disk = suggestions(line)
    assert lora.startswith("--student-lora (its checkpoints: ") and plans([*argv, "--student-lora"])
    need = float(re.fullmatch(r"--out on a disk with ([\d.]+) GB free", disk)[1])
    monkeypatch.setattr(memory, "disk_free", lambda out: need * 10**9)
    assert 98 < need < 100 and plans(argv)
    monkeypatch.setattr(memory, "disk_free", lambda out: 10**9)
    assert plans([*argv, "--steps", "0"])


def test_memory_means_the_whole_run_backbone_included(tmp_path):
    """--memory GB is what the run fills on the device in total: beside the backbone the plan has --memory less
    θ̄'s bytes, before loading and after."""
    args = train.parse_args(["--model", "org/x", "--out", str(tmp_path), "--memory", "30"])
    assert "backbone included" in train.Args.__dataclass_fields__["memory"].metadata["help"]
    model = models.meta_backbone(Qwen3Config(**QWEN3_4B), torch.bfloat16)
    before = memory.machine(args, "cpu")
    after = memory.machine(args, "cpu", loaded=8 * 10**9)
    assert before.limit == after.limit == 30 * 10**9 and before.given
    lora = dataclasses.replace(args, student_lora=True, max_len=4096)
    plan = memory.memory_plan(planning(lora, model, before, prompt=1000))
    assert plan.free == 30 * 10**9 - memory.backbone_bytes(model)


def test_a_conversation_is_priced_at_its_episodes_budget():
    """min(--max-len, prompt + steps × (reply + observation)): the card's budgets reach --max-len, the docs'
    smallest command does not come near it."""
    card_args = train.parse_args(["--model", "org/qwen3-4b"])
    small = train.parse_args(["--model", "org/qwen3-4b", *DOCS_COMMAND])
    assert memory.conversation_tokens(card_args, 2000) == 40960
    assert memory.conversation_tokens(small, 1000) == 1000 + 2 * (48 + memory.OBSERVATION_TOKENS) < 4096


def test_the_docs_smallest_real_model_command_runs_on_a_40960_context_model(tmp_path):
    """The docs' smallest real-model command on a tiny random Qwen3 with a 40,960-token context, without --max-len,
    on a --memory that a 40,960-token conversation does not fit: the plan prices the episode's own budget (the
    world's first prompts measured with the model's tokenizer, plus two replies and observations) and the run
    finishes."""
    tok = toy.build_tokenizer(toy.corpus_texts(toy.demo_tasks(60, 0), 0))
    tok.chat_template = toy.TOOLS_CHAT_TEMPLATE
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=40960)
    config.eos_token_id, config.pad_token_id, config.bos_token_id = tok.eos_token_id, tok.pad_token_id, None
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    argv = ["--model", str(folder), "--out", str(tmp_path / "run"), *DOCS_COMMAND]
    args = train.parse_args(argv)
    tasks = train.load_splits(args, False)[0]
    prompt = train.plan_before_loading(args, torch.device("cpu"), torch.float32, tasks).prompt   # measured
    episode = prompt + 2 * (48 + memory.OBSERVATION_TOKENS)
    assert episode < 8192
    meta = models.meta_backbone(config, torch.float32)
    machine = memory.Machine("cpu", total=10**11, free=10**11, limit=10**8, given=True, disk=10**12)
    whole = memory.smallest_limit(planning(args, meta, machine, prompt=40960))   # priced at --max-len
    gb = f"{whole / 2 / 1e9:.4f}"                      # half of what a 40,960-token conversation needs
    assert memory.smallest_limit(planning(args, meta, machine, prompt=prompt)) < float(gb) * 1e9
    res = subprocess.run([sys.executable, "train.py", *argv, "--memory", gb], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"(one {episode}-token conversation trains in " in res.stdout
    steps = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl") if '"stage": "lopd"' in x]
    assert [r["step"] for r in steps] == [0, 1]


def test_a_refusal_on_eight_ranks_plans_its_suggestions_on_eight(config_only, tmp_path):
    """memory_plan(p, ranks=8) of Qwen3-8B's full student on eight 80 GB cards: each suggestion it names fits on
    eight ranks (the way `bench --where` asks), not on this process's one."""
    argv = ["--model", config_only, "--out", str(tmp_path / "run"), "--dtype", "bfloat16", "--tasks", RELEASE[0]]
    args = train.parse_args(argv)
    cfg = Qwen3Config(architectures=["Qwen3ForCausalLM"], **{**QWEN3_4B, "hidden_size": 4096, "num_hidden_layers": 36,
                                                               "intermediate_size": 12288})     # Qwen3-8B's shapes
    model = models.meta_backbone(cfg, torch.bfloat16)
    card_bytes = 81_559 * 2**20 - 10**9
    machine = memory.Machine("cuda", total=81_559 * 2**20, free=card_bytes, limit=card_bytes, given=False,
                             disk=10**12)
    p = planning(args, model, machine, prompt=4096)
    with pytest.raises(devices.UserError) as err:
        memory.memory_plan(p, ranks=8)
    fits = suggestions(str(err.value))
    assert fits and all("torchrun" not in s or "nproc-per-node 8 " not in s for s in fits), fits
    for s in fits:
        if m := re.fullmatch(r"--max-len (\d+)", s):
            assert memory.fits(dataclasses.replace(p, args=dataclasses.replace(args, max_len=int(m[1]),
                                                   max_new_tokens=min(args.max_new_tokens, int(m[1]) // 2))), 8), s
        elif m := re.fullmatch(r"a card with ([\d.]+) GB free", s):
            card = lambda gb: dataclasses.replace(p, machine=dataclasses.replace(machine, limit=int(gb * 1e9)))  # noqa
            assert memory.fits(card(float(m[1])), 8) and not memory.fits(card(float(m[1]) - 0.1), 8), s
        elif s == "--student-lora":
            assert memory.fits(dataclasses.replace(p, args=dataclasses.replace(args, student_lora=True)), 8), s
