"""Bugs of the real-model path found by reading it against the paper (issue 18): the conversation budget, gradient
checkpointing of the frozen backbone under PEFT, the sampling-time log-probs, and the composer's precision.

Run: python -m pytest tests/test_real_path.py -q
Models: tiny random Qwen3 models (hidden 32, 2 layers) with the composer's LoRA in them, and for the budget a copy
of the shipped toy backbone without its toy_backbone.json marker, which train.py then treats as a real model (a
random model writes no tool call, and a reply without one ends a tool-world episode).
"""
import copy
import os
import shutil
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from composer import Composer, ComposerConfig  # noqa: E402
import engine  # noqa: E402
import inject  # noqa: E402
import lopd  # noqa: E402
import losses  # noqa: E402
from runtime import memory, models  # noqa: E402
import train  # noqa: E402
from worlds import tool_world  # noqa: E402
from worlds import toy_backbone as toy  # noqa: E402

CFG = ComposerConfig(n_latents=2, n_layers=1)


def toy_world():
    """The toy's prompts: short system prompt and framing, no tool schemas listed."""
    return tool_world.ToolWorld(system_prompt=tool_world.TOY_SYSTEM_PROMPT, framing=inject.TOY_FRAMING, tools=None)


def tiny_qwen3(tok, seed=0, **config):
    """A random Qwen3 of hidden 32 and 2 layers for `tok` (`config` overrides: tests/test_real_model.py gives it
    Qwen3's real vocabulary)."""
    torch.manual_seed(seed)
    config = Qwen3Config(**{**dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=4096), **config})
    config.eos_token_id, config.pad_token_id, config.bos_token_id = tok.eos_token_id, tok.pad_token_id, None
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    return model.requires_grad_(False).eval()


def perturb_lora(peft, adapter):
    """LoRA B starts at zero ("on" = "off"); small values make the adapter state matter."""
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n and f".{adapter}." in n:
                p.normal_(0, 0.05)


def backbone_and_student(tok, ckpt: bool, student_kind: str):
    """θ̄ with the composer's LoRA, and a student: a full copy of θ̄ (made before the LoRA goes in, as train.py
    does) or a second LoRA adapter on θ̄ (--student-lora). ckpt: models.checkpointing on each, as --grad-ckpt."""
    base = tiny_qwen3(tok)
    if ckpt:
        models.checkpointing(base)
    student = copy.deepcopy(base).requires_grad_(True) if student_kind == "full" else None
    torch.manual_seed(1)
    comp = Composer(base, tok, CFG)
    perturb_lora(comp.peft, "composer")
    if student is None:
        student = models.LoraStudent(comp.peft, 2)
        perturb_lora(comp.peft, "student")
    return base, student, comp


@pytest.fixture(scope="module")
def world():
    tok = toy.build_tokenizer(toy.corpus_texts(toy.demo_tasks(60, 0), 0))
    tasks, chat = tool_world.make_splits(0, 3, 1)[0], toy.toy_chat(tok, toy_world)
    eps = [engine.scripted_episode(chat, t, tool_world.oracle_replies(t)) for t in tasks]
    exps = [[{"task": t.text, "trace": e.trace}] * 2 for t, e in zip(tasks, eps[::-1])]
    return dict(tok=tok, chat=chat, tasks=tasks, eps=eps, exps=exps)


def evaluation(comp, student, world):
    """What --eval-every runs between steps: the base (LoRA off), the student, and base + composer rollouts."""
    cfg = engine.SampleConfig(temperature=1.0, max_new_tokens=4)
    tasks = world["tasks"][:2]
    train.eval_vanilla(comp, world["chat"], tasks, cfg)
    train.eval_student(student, world["chat"], tasks, cfg)
    with torch.no_grad():
        latents = lopd.compose(comp, tasks, world["exps"][:2])
    lopd.teacher_rollout(comp, world["chat"], tasks, latents, cfg)


def lopd_loss(student, comp, world):
    """eq. (13) on the scripted episodes: gradients reach θ through p_S and φ through p_T and the anchor."""
    latents = lopd.compose(comp, world["tasks"], world["exps"])                          # (B, J·K, d)
    ls, lt, ids, omega = lopd.student_teacher_logits(student, comp, world["chat"], world["eps"], latents)
    rewards = torch.tensor([1.0, 0.0, 1.0])
    return losses.lopd_objective(ls, lt, ids, omega, rewards, latents=(latents, latents.detach() + 0.01),
                                 eq=losses.Eq13(beta=0.3, margin=0.05, anchor=0.2, top_m=5, delta_per="trajectory", kl_per="token"))[0]


def grads(student, comp):
    return [p.grad.clone() for p in [*student.parameters(), *comp.trainable_parameters()]]


# ------------------------------------------------------------------------------------------------------------
# 1. the conversation budget: a real model's episode goes on after its first reply
# ------------------------------------------------------------------------------------------------------------
def test_real_model_tool_episodes_go_on_after_the_first_reply(tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(toy.SHIPPED, folder)
    os.remove(folder / "toy_backbone.json")                              # now a "real" model to train.py
    args = train.parse_args(["--model", str(folder), "--env", "tools", "--out", str(tmp_path / "run"),
                             "--max-env-steps", "3"])
    assert not train.is_toy(args) and (args.max_new_tokens, args.max_len) == (10000, 40960)   # PAPER_DEFAULTS
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    n_ctx = model.config.max_position_embeddings                         # 40,960 > the model's 2,048 positions
    args.max_len, args.max_new_tokens = memory.fit_context(args.max_len, args.max_new_tokens, n_ctx)
    assert args.max_len == model.config.max_position_embeddings == 2048 and "2048" in capsys.readouterr().out
    assert args.max_new_tokens == 1024                                   # and 10,000-token replies would not fit
    make_env, cfg = train.env_factory(args), train.sample_config(args)

    def without_tools():
        """No tool list: this toy template ignores tools=, and the 1,800-token list (engine.tools_block) would fill
        the 2,048 positions; the toy backbone knows its tools from its demonstrations."""
        env = make_env()
        env.tools = None
        return env
    torch.manual_seed(0)
    eps = engine.rollout(model, engine.Chat(tok, without_tools), tool_world.make_splits(0, 1, 4)[1], cfg)
    assert max(e.steps for e in eps) == 3                                # --max-env-steps, not one reply
    for e in eps:
        assert len(e.ids) <= cfg.max_len
        assert e.steps == 3 or e.tool_calls < e.steps                    # only the env or a call-less reply ends it
    # the toy keeps its 768-token budget (its results do not move)
    toy_args = train.parse_args(["--out", str(tmp_path / "toy")])
    assert train.sample_config(toy_args).max_len == 768 == engine.SampleConfig().max_len


# ------------------------------------------------------------------------------------------------------------
# 2. --grad-ckpt: teacher, encoder and student are recomputed, under the adapter state of their forward
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("student_kind", ["full", "lora"])
@pytest.mark.equality
def test_checkpointing_gives_the_same_gradients_also_after_an_evaluation(world, student_kind):
    results = {}
    for ckpt in (False, True):
        base, student, comp = backbone_and_student(world["tok"], ckpt, student_kind)
        for evaluated in (False, True):
            if evaluated:
                torch.manual_seed(2)
                evaluation(comp, student, world)
            for p in [*student.parameters(), *comp.trainable_parameters()]:
                p.grad = None
            loss = lopd_loss(student, comp, world)
            loss.backward()
            results[ckpt, evaluated] = loss.item(), grads(student, comp)
            assert not base.training                                     # the frozen backbone stays in eval mode
    for evaluated in (False, True):
        (loss0, g0), (loss1, g1) = results[False, evaluated], results[True, evaluated]
        assert loss0 == pytest.approx(loss1, abs=1e-6)
        assert any(g.abs().sum() > 0 for g in g0[-len(list(comp.trainable_parameters())):])   # φ learns
        for a, b in zip(g0, g1):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def count_layer_calls(layer, adapter_off):
    """Pre-hook on a decoder layer's first module (inside the checkpointed region, so a recompute calls it again;
    torch may stop a recompute early, once it has what the backward needs): appends, per call, whether the
    layer's adapters were off (the teacher) or on (encoder, LoRA student)."""
    calls = []
    return calls, layer.input_layernorm.register_forward_pre_hook(lambda *_: calls.append(adapter_off()))


@pytest.mark.parametrize("ckpt", [False, True])
def test_teacher_encoder_and_student_layers_are_recomputed_in_the_backward(world, ckpt):
    base, student, comp = backbone_and_student(world["tok"], ckpt, "full")
    torch.manual_seed(2)
    evaluation(comp, student, world)
    layer = base.model.layers[0]
    teacher_calls, h1 = count_layer_calls(layer, lambda: layer.self_attn.q_proj.disable_adapters)
    student_calls, h2 = count_layer_calls(student.model.layers[0], lambda: None)
    loss = lopd_loss(student, comp, world)
    forward = sorted(teacher_calls), len(student_calls)
    assert forward == ([False, True], 1)                                 # encoder (LoRA on), teacher (off); student
    loss.backward()
    h1.remove(), h2.remove()
    recomputed = sorted(teacher_calls[2:]), len(student_calls) - 1
    # each recompute under its forward's adapter state: the teacher's with the LoRA off, the encoder's with it on
    assert recomputed == (([False, True], 1) if ckpt else ([], 0))


def test_checkpointing_is_idempotent_and_survives_a_deepcopy(world):
    base = tiny_qwen3(world["tok"])
    models.checkpointing(base)
    wrapped = [layer.forward for layer in base.model.layers]
    models.checkpointing(base)
    assert [layer.forward for layer in base.model.layers] == wrapped
    copied = copy.deepcopy(base)
    for layer, twin in zip(base.model.layers, copied.model.layers):
        assert twin.forward.__self__ is twin and layer.forward.__self__ is layer   # each runs its own weights


# ------------------------------------------------------------------------------------------------------------
# 3. generation keeps one (B, V) step of log-probs, not (B, N, V)
# ------------------------------------------------------------------------------------------------------------
def test_the_recorded_logprobs_are_those_of_the_drawn_tokens(world):
    """Generation keeps one (B, V) step of log-probs at a time; each reply's recorded log-probs equal a forward
    over context + reply."""
    tok, model = world["tok"], tiny_qwen3(world["tok"])
    contexts = [engine.prompt_ids(tok, toy_world().reset(t)) for t in world["tasks"]]
    torch.manual_seed(0)
    rows = engine.generate_replies(model, tok, contexts, engine.SampleConfig(temperature=1.0, max_new_tokens=12))
    for ctx, (new, logps, _) in zip(contexts, rows):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ctx + new])).logits[0, len(ctx) - 1:-1]     # (n, V)
        again = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(new)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logps), again, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 20, 0.95), (1.0, 3, 1.0), (0.5, 0, 0.6), (1.3, 50, 0.9)])
def test_sampling_draws_from_hugging_faces_warped_distribution(temperature, top_k, top_p):
    """sample_next against transformers' own warpers (temperature, top-k, top-p, in generate's order): the same
    support, and with the same seed the same draws."""
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    scores = torch.randn(6, 97, generator=torch.Generator().manual_seed(1)) * 3               # (B, V)
    warp = LogitsProcessorList([TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])
                               + ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
    want = warp(None, scores.clone()).softmax(-1)                                           # (B, V)
    cfg = engine.SampleConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    torch.manual_seed(3)
    got = torch.stack([engine.sample_next(scores, cfg) for _ in range(200)])                 # (200, B)
    torch.manual_seed(3)
    ref = torch.stack([torch.multinomial(want, 1)[:, 0] for _ in range(200)])                # (200, B)
    assert torch.equal(got, ref)
    assert bool((want.gather(1, got.T) > 0).all())                                          # never outside the support
    assert torch.equal(engine.sample_next(scores, engine.SampleConfig(temperature=0.0)), scores.argmax(-1))


# ------------------------------------------------------------------------------------------------------------
# 4. the composer runs outside autocast: the anchor is exactly zero at step 0
# ------------------------------------------------------------------------------------------------------------
def test_anchor_is_zero_at_step_zero_under_bf16_autocast(world):
    """train.py caches c_φ0 outside autocast and computes c_φ inside `precision` (bf16 autocast on CUDA); CPU
    autocast to bf16 stands in for the CUDA path here."""
    _, _, comp = backbone_and_student(world["tok"], False, "full")
    tasks, exps = [t.text for t in world["tasks"]], [[e["trace"] for e in es] for es in world["exps"]]
    with torch.no_grad():
        c0 = comp(tasks, exps)                                           # (B, J·K, d) Algorithm 1: cache c_φ0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            c = comp(tasks, exps)                                        # (B, J·K, d) c_φ at step 0
            E = comp.compress(tasks[:1])                                 # (1, K, d)
    assert torch.equal(c, c0) and ((c - c0) ** 2).sum().item() == 0.0
    assert c.dtype == torch.float32 and E.dtype == torch.float32
