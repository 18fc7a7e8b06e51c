"""`python -m scripts.bench --where`: the tables of docs/real-models.md, "What runs where", and README's, printed
by the plan itself: its verdicts against the plan read here on its own, its times against the docs' arithmetic.

Run: python -m pytest tests/test_where.py -q   (about 20 s: the command once, then two plans on the meta device)
"""
import os
import re
import subprocess
import sys

import pytest
import torch
from transformers import Qwen3Config

from runtime import memory, models
from runtime.devices import UserError
from scripts import bench
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# Qwen3-4B's published config.json, and what nvidia-smi reports for one H100 80 GB, less 1 GB of CUDA context
QWEN3_4B = dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=9728, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True)
H100_FREE = 81_559 * 2**20 - 10**9
QWEN3_4B_PARAMS = 4_022_468_096     # Qwen3-4B's parameters (its model card: 4.0 B; the embedding tied)


@pytest.fixture(scope="module")
def printed():
    """The command's output: {table heading's first cell: {row's first cells: the rest}}."""
    done = subprocess.run([sys.executable, "-m", "scripts.bench", "--where"], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    tables, rows = {}, None
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None or set(cells[0]) == {"-"}:
            continue
        if cells[0] in ("backbone, student", "case (engine HF unless named)"):
            rows = tables.setdefault(cells[0] + (" short" if len(cells) == 4 else ""), {"head": cells})
        else:
            width = 2 if len(rows["head"]) == 5 else 1           # the verdict table: backbone and engine
            rows[tuple(cells[:width])] = cells[width:]
    return tables


def planning(lora: bool, engine: str = "hf") -> memory.Planning:
    """Qwen3-4B at B.2's defaults on one H100, as train.plan_before_loading plans it on a config-only folder."""
    model = models.meta_backbone(Qwen3Config(**QWEN3_4B), torch.bfloat16)
    args = train.parse_args(["--model", "org/qwen3-4b", "--engine", engine, *(["--student-lora"] if lora else [])])
    machine = memory.Machine("cuda", H100_FREE, H100_FREE, H100_FREE, False, 10**12)
    return memory.Planning(args, model, machine, train.trains(args, model.config),
                           memory.PROMPT_TOKENS + args.n_ret * args.latents)


def gb(cell: str) -> float:
    return float(re.fullmatch(r"no \(([\d.]+)(?: GB)?\)", cell).group(1))


def test_qwen3_4b_full_on_one_80_gb_card_is_refused_for_what_its_conversation_needs(printed):
    cell = printed["backbone, student"][("Qwen3-4B, full", "HF")][0]
    with pytest.raises(UserError) as refused:
        memory.memory_plan(planning(lora=False))
    # the refusal names the smallest card that fits: HEADROOM of what it leaves beside the bf16 backbone is the need
    card = float(re.search(r"a card with ([\d.]+) GB free", str(refused.value)).group(1))
    assert abs(gb(cell) - 0.85 * (card - 2 * QWEN3_4B_PARAMS / 1e9)) < 0.15, (cell, card)
    assert printed["backbone, student short"][("Qwen3-4B, full",)][0] == f"no ({gb(cell):.1f})"


def test_qwen3_4b_lora_on_one_80_gb_card_runs_the_plans_batch_with_either_engine(printed):
    """--engine vllm too: its bf16 engine sleeps while the trainer steps (serving.engine_share), so the plan counts
    it only while generating, and the table's batch is the plan's."""
    for engine, name in (("hf", "HF"), ("vllm", "vLLM")):
        plan = memory.memory_plan(planning(lora=True, engine=engine))
        assert printed["backbone, student"][("Qwen3-4B, LoRA", name)][0] == f"runs: {plan.gen_batch} conversations"
    assert "the vLLM engine" in plan.line() and "asleep while the trainer steps" in plan.line()


def test_the_time_of_qwen3_4b_lora_on_one_80_gb_card_is_the_docs_arithmetic(printed):
    batch = memory.memory_plan(planning(lora=True)).gen_batch
    N, flops = QWEN3_4B_PARAMS, 0.35 * 989e12          # training and prefill at 35% of 989 TFLOP/s
    decode = lambda n: n * 9_600 * 0.030 / batch        # noqa: E731  9,600 sampled tokens, 30 ms a step of the batch
    prefill = lambda n: n * (20_000 - 9_600) * 2 * N / flops   # noqa: E731  the rest of a 20,000-token conversation
    encoder = 3 * 512 * 8 * N                            # J × 512 experience tokens a rollout at 8·N
    hours = {"bank": (decode(4_700) + prefill(4_700)) / 3600,
             "cold start": 1_000 * 8 * (20_000 * 6 * N + encoder) / flops / 3600,      # the official configs' counts
             "100 steps": (decode(3_200) + prefill(3_200) + 3_200 * (20_000 * 12 * N + encoder) / flops) / 3600,
             "evaluation": (decode(600) + prefill(600)) / 3600}
    total = sum(hours.values())
    got = bench.stage_hours(planning(lora=True).args, N, batch, 1)
    assert got == pytest.approx({**hours, "in all": total}, rel=1e-9)
    row = printed["case (engine HF unless named)"][("Qwen3-4B LoRA, one 80 GB",)]
    assert row == [f"{h:.1f} h" for h in hours.values()] + [f"{total / 24:.1f} days"]
    assert printed["backbone, student short"][("Qwen3-4B, LoRA",)][0] == f"~{total / 24:.1f} days"
