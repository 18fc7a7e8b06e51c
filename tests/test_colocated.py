"""--engine vllm colocated with the trainer (runtime/serving.py, memory.engine_costs), checked without vLLM or a GPU:
what a CUDA run's engine gets (bf16, CUDA graphs, sleep mode, its share of the card, --max-len, the plan's batch)
against a CPU run's (as before); the sleep before each update and the wake before the engine generates or takes
weights, on a stand-in for vLLM's LLM; a LoRA student merged in fp32 before the engine's cast; the check's
tolerance from what each side computes in; and the memory plan at the paper's budgets on the meta device (Qwen3-4B
from its config, test_where's way): --student-lora fits one 80 GB card, the full student eight.

Run: python -m pytest tests/test_colocated.py -q   (about 30 s; the vLLM tier itself: tests/test_vllm.py)
"""
import dataclasses
import types

import pytest
import torch

import engine
from runtime import memory, serving
from test_where import H100_FREE, QWEN3_4B_PARAMS, planning


# ----------------------------------------------------------------------------------------------------------------
# What the engine gets
# ----------------------------------------------------------------------------------------------------------------
def test_a_cuda_engine_gets_bf16_cuda_graphs_sleep_mode_and_its_share_a_cpu_engine_what_it_had():
    cuda = serving.engine_settings("cuda", 30 * 10**9, 40960, 8, share=0.4813)
    assert cuda == dict(dtype="bfloat16", enforce_eager=False, kv_cache_memory_bytes=30 * 10**9, max_model_len=40960,
                        max_num_seqs=8, enable_sleep_mode=True, gpu_memory_utilization=0.482)   # rounded up
    cpu = serving.engine_settings("cpu", 10**9, 2048, 1000)
    assert cpu == dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=10**9, max_model_len=2048,
                       max_num_seqs=memory.VLLM_MAX_SEQS)             # no sleep mode, vLLM's own memory share unused


def test_the_checks_tolerance_follows_what_the_engine_and_the_model_compute_in():
    exact, low = serving.VLLM_TOLERANCE, serving.VLLM_LOW_TOLERANCE
    assert serving.tolerance("cpu", torch.float32, False) == exact
    assert serving.tolerance("cpu", torch.float32, True) == exact        # gloo's FSDP2 gathers fp32
    assert serving.tolerance("cpu", torch.bfloat16, False) == low        # --dtype bfloat16 on a CPU
    assert serving.tolerance("cuda", torch.float32, True) == low         # FSDP2 computes in bf16 there: not 1e-4
    assert serving.tolerance("cuda", torch.float32, False) == low        # the engine computes in bf16


# ----------------------------------------------------------------------------------------------------------------
# A LoRA student merged in fp32
# ----------------------------------------------------------------------------------------------------------------
class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, bias=False, dtype=torch.bfloat16)
        torch.nn.init.ones_(self.lin.weight)


def test_an_update_below_half_a_bf16_ulp_survives_the_merge():
    """W = 1 in bf16 (an ulp of 2⁻⁷ there), ΔW = B·A·s = 1e-3 < 2⁻⁸: merged in fp32 the engine reads W + ΔW (and a
    fp32 engine keeps it); cast to bf16 before the sum, as before, ΔW vanished."""
    from peft import LoraConfig, get_peft_model
    peft = get_peft_model(Tiny(), LoraConfig(r=1, lora_alpha=1, target_modules=["lin"]))
    layer = peft.get_base_model().lin
    with torch.no_grad():
        layer.lora_A["default"].weight.fill_(1e-3 ** 0.5)
        layer.lora_B["default"].weight.fill_(1e-3 ** 0.5)
    delta = layer.get_delta_weight("default").detach()
    assert float(delta.max()) < 2 ** -8 and layer.lora_A["default"].weight.dtype == torch.float32
    merged = dict(serving.weights_of(peft))["lin.weight"]
    base = layer.base_layer.weight
    assert merged.dtype == torch.float32 and torch.allclose(merged - base.float(), delta, atol=1e-7)
    assert torch.equal(base + delta.to(base.dtype), base)          # the old merge: the update never reached the engine
    with peft.disable_adapter():                                    # θ̄: no adapter folded in
        assert torch.equal(dict(serving.weights_of(peft))["lin.weight"], base)


# ----------------------------------------------------------------------------------------------------------------
# Sleep before each update, wake before generating or taking weights
# ----------------------------------------------------------------------------------------------------------------
class FakeLLM:
    """vLLM's LLM as far as the generator calls it around an update: each call recorded."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(f"sleep({level})")

    def wake_up(self):
        self.calls.append("wake_up")

    def collective_rpc(self, fn):
        worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(reload_weights=self.reload))
        fn(worker)

    def reload(self, weights_iterator):
        self.calls.append(f"reload({len(list(weights_iterator))})")

    def reset_prefix_cache(self):
        self.calls.append("reset")


def fake_engine(monkeypatch, device: str):
    """serving.GENERATOR on a FakeLLM with `device`'s settings; its check passes."""
    settings = serving.engine_settings(device, 10**9, 2048, 4, share=0.1)
    gen = serving.VLLMGenerator("unused", types.SimpleNamespace(vocab_size=10), settings, llm=FakeLLM())
    monkeypatch.setattr(gen, "check", lambda model, limit, every_rank=False: 0.0)
    monkeypatch.setattr(serving, "GENERATOR", gen)
    return gen


def one_update(model):
    """A method's update as every method runs it (engine.update: accumulate, then the optimizer)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    part_loss = lambda idx: (model(torch.ones(1, 4)).sum(), {"loss": 1.0})       # noqa: E731
    engine.update(model, (opt, None), [None], part_loss, types.SimpleNamespace(micro_batch=1, token_budget=0,
                                                                                clip=1.0))


def test_on_cuda_the_engine_sleeps_for_each_update_and_wakes_to_take_the_weights(monkeypatch):
    gen, model = fake_engine(monkeypatch, "cuda"), torch.nn.Linear(4, 4)
    for step in range(2):
        one_update(model)                                  # the trainer steps: the engine asleep
        assert not gen.awake
        assert serving.follow(model) == {"engine/gap": 0.0, "engine/sleeps": 1, "engine/wakes": 1}
    assert gen.llm.calls == ["sleep(1)", "wake_up", "reload(2)", "reset"] * 2      # woken before the reload
    serving.rest()
    serving.rest()                                         # a second sleep while asleep: nothing
    assert gen.llm.calls[-1] == "sleep(1)" and gen.llm.calls.count("sleep(1)") == 3


def test_on_a_cpu_the_same_points_are_passed_and_vllm_is_never_put_to_sleep(monkeypatch):
    gen, model = fake_engine(monkeypatch, "cpu"), torch.nn.Linear(4, 4)
    one_update(model)
    assert gen.naps == ["sleep"] and not gen.awake
    assert serving.follow(model) == {"engine/gap": 0.0, "engine/sleeps": 1, "engine/wakes": 1}
    assert gen.llm.calls == ["reload(2)", "reset"]         # vLLM's CPU worker has no sleep mode


# ----------------------------------------------------------------------------------------------------------------
# The plan at the paper's budgets (B.2: 40,960-token conversations), Qwen3-4B on the meta device
# ----------------------------------------------------------------------------------------------------------------
def beside(p) -> int:
    """Bytes the plan fills beside the backbone."""
    return int(memory.HEADROOM * (p.machine.limit - memory.backbone_bytes(p.model)))


def test_with_student_lora_the_bf16_engine_fits_one_80_gb_card_asleep_while_the_trainer_steps():
    p = planning(lora=True, engine="vllm")
    plan, hf = memory.memory_plan(p), memory.memory_plan(planning(lora=True))
    share = plan.engine
    assert share.dtype == "bfloat16" and share.sleeps and share.weights == 2 * QWEN3_4B_PARAMS
    assert share.kv >= p.args.max_len * share.kv_token                   # one --max-len conversation at least
    assert (plan.longest, plan.token_budget) == (hf.longest, hf.token_budget)   # training never holds the engine
    trained = 16 * p.footprint_of(p.args).trained                       # generating: the trainer's states and it
    assert trained + share.total <= beside(p) < trained + share.total + p.args.max_len * share.kv_token
    assert plan.gen_batch == share.kv // share.kv_token // p.args.max_len >= 1
    assert f"the vLLM engine {share.total / 1e9:.1f} GB: its bfloat16 weights 8.0 GB" in plan.line()
    settings = serving.engine_settings("cuda", share.kv, p.args.max_len, plan.gen_batch, share.total / H100_FREE)
    assert settings["max_model_len"] == 40960 and settings["gpu_memory_utilization"] * H100_FREE >= share.total


def test_the_full_student_with_the_engine_fits_eight_80_gb_cards_not_one():
    p = planning(lora=False, engine="vllm")
    plan = memory.memory_plan(p, 8)
    assert plan.engine.sleeps and plan.gen_batch >= 1 and "asleep while the trainer steps" in plan.line()
    assert not memory.fits(p, 1)
    assert memory.refusal(p, 1).what == "train"                           # what does not train is said first


def test_the_engines_cache_is_sized_by_max_len_and_the_batch():
    """--max-len 8192, --gen-batch 4 of 2 × 1,024-token replies: 8,192 tokens of cache (one --max-len conversation,
    and 4 × 2,048), not the model's 40,960-token context in fp32; --gen-batch 8: 8 × 2,048."""
    p = planning(lora=True, engine="vllm")
    args = dataclasses.replace(p.args, max_len=8192, max_new_tokens=1024, max_env_steps=2, gen_batch=4)
    plan = memory.memory_plan(dataclasses.replace(p, args=args))
    assert plan.engine.kv == 8192 * plan.engine.kv_token == 8192 * 36 * 8 * 128 * 2 * 2     # bf16 keys and values
    args = dataclasses.replace(args, gen_batch=8)
    assert memory.memory_plan(dataclasses.replace(p, args=args)).engine.kv == 8 * 2048 * plan.engine.kv_token


def test_on_a_cpu_the_engine_stays_resident_in_fp32_as_before():
    p = planning(lora=True, engine="vllm")             # a CPU's fp32 engine resident: 8,192-token conversations
    args = dataclasses.replace(p.args, max_len=8192, max_new_tokens=1024, max_env_steps=2)
    cpu = dataclasses.replace(p, args=args, machine=dataclasses.replace(p.machine, type="cpu"))
    plan = memory.memory_plan(cpu)
    hf = memory.memory_plan(dataclasses.replace(cpu, args=dataclasses.replace(cpu.args, engine="hf")))
    share = plan.engine
    assert share.dtype == "float32" and not share.sleeps and share.weights == 4 * QWEN3_4B_PARAMS
    assert share.kv == (p.machine.limit - memory.backbone_bytes(p.model)) // 4 and share.runtime == 0
    assert plan.longest - hf.longest == share.total and "resident beside training" in plan.line()
