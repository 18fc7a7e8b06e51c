"""What keeps memory bounded by tokens at the paper's budgets and keeps long jobs alive, each in a check that fails
without it: the process group's timeout, autocast without a resident bf16 copy of the student, every eos id of the
generation config, rank 0 alone holding a checkpoint's optimizer state (tests/test_distributed.py), scoring without
a KV cache and the chunked loss (tests/test_lopd.py, tests/test_losses.py).

Run: python -m pytest tests/test_scale.py -q      (a few seconds)
"""
import argparse
import datetime
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import engine  # noqa: E402
from runtime import devices, memory, models, parallel  # noqa: E402
import train  # noqa: E402


def test_the_timeout_reaches_init_process_group(monkeypatch):
    seen = {}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(parallel.dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend, **kw))
    parallel.dist_setup("cpu", 7)
    assert seen == {"backend": "gloo", "timeout": datetime.timedelta(minutes=7)}
    assert train.parse_args([]).dist_timeout == 360                    # hours of unbalanced rollouts survive
    # train.py passes the flag through
    monkeypatch.setattr(parallel, "dist_setup", lambda device, minutes: seen.update(minutes=minutes) or (0, 1, ""))
    monkeypatch.setattr(train, "prepare", lambda args: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        train.main(["--dist-timeout", "90", "--steps", "0"])
    assert seen["minutes"] == 90


def test_autocast_keeps_no_cast_copy_of_the_weights():
    """devices.precision wraps a whole step; with autocast's cache on it would keep a bf16 copy of every fp32
    weight it cast (the whole student) until the step ends."""
    bf16 = torch.nn.Linear(2, 2).to(torch.bfloat16)
    with devices.precision(bf16):
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_cache_enabled()
    with devices.precision(torch.nn.Linear(2, 2)):                      # fp32: no autocast at all
        assert not torch.is_autocast_enabled("cpu")


class Gen:
    def __init__(self, eos):
        self.generation_config = type("C", (), {"eos_token_id": eos})()


def test_every_eos_id_of_the_generation_config_ends_a_reply():
    tok = type("T", (), {"eos_token_id": 5})()
    assert engine.eos_ids(Gen([7, 5]), tok) == [5, 7]                     # Qwen3: <|im_end|> and <|endoftext|>
    assert engine.eos_ids(Gen(5), tok) == [5] and engine.eos_ids(Gen(None), tok) == [5]
    # a reply ends at its first id of the list; a row that ended is fed nothing more (mask 0)
    script = torch.tensor([[1, 7, 2, 5], [1, 2, 3, 4], [5, 1, 1, 1]])            # (B, N) the argmax each step
    conv = engine.Conversations.__new__(engine.Conversations)
    conv.device, conv.pad, conv.fed = torch.device("cpu"), 0, [[], [], []]
    conv.mask, conv.model, conv.cache = torch.ones(3, 2, dtype=torch.long), None, engine.DynamicCache()
    steps = iter(range(1, 4))
    conv.forward = lambda ids=None, embeds=None: torch.nn.functional.one_hot(script[:, next(steps)], 9).float()
    greedy = engine.SampleConfig(temperature=0.0, max_new_tokens=4)
    rows = conv.decode(torch.nn.functional.one_hot(script[:, 0], 9).float(), greedy, [5, 7])
    assert [(r[0], r[2]) for r in rows] == [([1, 7], True), ([1, 2, 3, 4], False), ([5], True)]
    assert conv.mask[:, 2:].tolist() == [[1, 0, 0], [1, 1, 1], [0, 0, 0]] and conv.fed == [[1], [1, 2, 3], []]


def test_real_models_think_by_default_with_the_papers_budgets(tmp_path):
    """B.2: Qwen3 with thinking on and 10,000-token calls (code: B.3's 16,384); the toy keeps its short replies."""
    import shutil
    from worlds import toy_backbone as toy
    folder = tmp_path / "model"
    shutil.copytree(toy.SHIPPED, folder)
    os.remove(folder / "toy_backbone.json")                              # a "real" model to train.py
    qwen3 = type("T", (), {"chat_template": "{% if enable_thinking is defined %}...{% endif %}"})()
    plain = type("T", (), {"chat_template": "{{ messages }}"})()
    real = train.parse_args(["--model", str(folder), "--out", str(tmp_path / "r")])
    assert real.max_new_tokens == 10000 and train.thinks_by_default(real, qwen3)
    assert not train.thinks_by_default(real, plain)                     # SmolLM2's template has no switch
    off = train.parse_args(["--model", str(folder), "--out", str(tmp_path / "r"), "--no-thinking"])
    assert real.thinking is None and off.thinking is False             # None: fit_to_model decides
    template = tmp_path / "qwen3.jinja"                                 # a template with the switch
    template.write_text(qwen3.chat_template)
    for a, want in ((real, True), (off, False)):                        # --no-thinking is kept as given
        a.chat_template = str(template)
        planned = train.plan_before_loading(a, torch.device("cpu"), torch.float32, [])
        model, tok = train.load_backbone(a, "cpu", torch.float32)
        train.fit_to_model(a, model, tok, torch.device("cpu"), planned)
        assert a.thinking is want
    toy_args = train.parse_args(["--out", str(tmp_path / "t")])
    assert toy_args.max_new_tokens == 64 and not train.thinks_by_default(toy_args, qwen3)
    code = train.parse_args(["--model", str(folder), "--env", "code", "--out", str(tmp_path / "c")])
    assert code.max_new_tokens == 16384


class Headed(torch.nn.Module):
    """The least a model needs for models.lm_head_bypassed: an LM head and a forward through it."""

    def __init__(self, softcap=None):
        super().__init__()
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.config = type("C", (), {"final_logit_softcapping": softcap})()

    def get_output_embeddings(self):
        return self.head

    def forward(self, x):
        return self.head(x)


def test_the_lm_head_bypass_nests_and_restores():
    """A LoRA student and the teacher share one head: the bypass is entered twice for it and must undo both."""
    m, x = Headed(), torch.randn(2, 3)
    with models.lm_head_bypassed(m, m):
        assert torch.equal(m(x), x)                                       # hidden states out
    assert m(x).shape == (2, 5) and "forward" not in m.head.__dict__      # the head is back
    assert models.lm_head(m)[0] is m.head.weight
    with pytest.raises(ValueError, match="--loss-chunk 0"):               # Gemma-style soft-capped logits
        models.lm_head_bypassed(Headed(softcap=30.0)).__enter__()


def test_micro_batches_by_a_token_budget(monkeypatch):
    eps = [type("E", (), {"ids": [0] * n})() for n in (5, 3, 8, 2, 2, 9)]
    assert engine.micro_batches(eps, 4) == [slice(0, 4), slice(4, 8)]            # by rollouts: the readable default
    got = engine.micro_batches(eps, 4, token_budget=12)                           # rows × the longest of each
    assert got == [slice(0, 2), slice(2, 3), slice(3, 5), slice(5, 6)]
    for part in got:
        assert max(len(e.ids) for e in eps[part]) * len(eps[part]) <= 12 or part.stop - part.start == 1
    assert engine.micro_batches(eps, 4, token_budget=1) == [slice(i, i + 1) for i in range(6)]   # at least one each
    monkeypatch.setattr(parallel, "all_max", lambda v: 6.0)                     # torchrun: a busier rank has 6
    assert engine.micro_batches(eps, 4)[2:] == [slice(0, 0)] * 4                 # idle passes keep the collectives


def test_generation_is_batched_by_a_kv_budget_and_by_length(toy_backbone_dir):
    """--kv-budget: as many conversations as their KV cache fits; sort_by_length: batches of similar tasks, the
    episodes back in task order and embed_fn told which task each row is."""
    from worlds import tool_world
    from transformers import AutoModelForCausalLM, AutoTokenizer
    qwen3_4b = type("C", (), {"head_dim": 128, "num_hidden_layers": 36, "num_key_value_heads": 8,
                              "num_attention_heads": 32, "hidden_size": 2560})()
    assert memory.kv_bytes_per_token(qwen3_4b) == 147456
    assert memory.kv_budget_batch(qwen3_4b, 48, 40960) == 7 and memory.kv_budget_batch(qwen3_4b, 1, 40960) == 1
    model = AutoModelForCausalLM.from_pretrained(toy_backbone_dir).eval()
    tok = AutoTokenizer.from_pretrained(toy_backbone_dir)
    tasks = tool_world.make_splits(0, 6, 1)[0]
    seen = []

    def embed_fn(ids, att, rows):
        seen.append(sorted(rows))
        return model.get_input_embeddings()(ids)
    cfg = engine.SampleConfig(max_new_tokens=6, batch_size=2, temperature=0.0, sort_by_length=True)
    chat = engine.Chat(tok, lambda: tool_world.ToolWorld(max_steps=1, tools=None))
    eps = engine.rollout(model, chat, tasks, cfg, embed_fn=embed_fn)
    assert [e.task for e in eps] == tasks                                   # task order, whatever the batches
    by_length = sorted(range(6), key=lambda i: len(tasks[i].text))
    assert seen[0] == sorted(by_length[:2]) and by_length != list(range(6))


def test_under_vllm_the_generation_batch_follows_the_paged_cache_not_max_len(capsys):
    """SmolLM2-135M's shape (fp32, on the meta device) at --kv-budget 1 --max-len 8192, 3 replies of 128 tokens
    after a 1,000-token prompt: --engine hf keeps a KV cache of the episode's budget a conversation (1,000 + 3 ×
    (128 + 512 of observation) = 2,920 tokens: 7 fit); vLLM pages its cache, so the plan fits the cache's tokens over
    what a conversation's replies add, at most the engine's max_num_seqs; the line names the bound. The figures
    are worked by hand from the shape, not from runtime's helpers; vLLM is not imported."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    kv_token = 2 * 30 * 3 * (576 // 9) * 4                     # keys and values, 30 layers, 3 heads of 64, fp32
    flags = ["--model", "org/smollm2", "--max-len", "8192", "--max-new-tokens", "128", "--max-env-steps", "3",
             "--memory", "48"]
    machine = memory.Machine("cpu", total=64 * 10**9, free=60 * 10**9, limit=48 * 10**9, given=True, disk=10**12)

    def plan(*more):
        args = train.parse_args(flags + list(more))
        return memory.fit_memory(memory.Planning(args, model, machine, train.trains(args, config), prompt=1000))
    assert memory.OBSERVATION_TOKENS == 512
    hf, vllm = plan("--kv-budget", "1"), plan("--kv-budget", "1", "--engine", "vllm")
    assert hf.conversation == 2920 and hf.gen_batch == 10**9 // (kv_token * 2920) == 7   # the episode's caches
    assert vllm.gen_batch == 10**9 // kv_token // (3 * 128) == 56           # 21,701 tokens, 384 a conversation
    assert "56 conversations generate together (vLLM's paged cache: 21701 tokens, 384 a conversation's replies; " \
           "--gen-batch to set)" in capsys.readouterr().out
    roomy = plan("--kv-budget", "20", "--engine", "vllm")                   # 434,027 tokens: 1,130 would fit
    assert roomy.gen_batch == memory.VLLM_MAX_SEQS == 256 and "(vLLM's max_num_seqs; " in roomy.line()
    given = plan("--kv-budget", "1", "--engine", "vllm", "--gen-batch", "8")
    assert given.gen_batch == 8 and "8 conversations generate together (given); the vLLM engine 1.7 GB: its float32 " \
        "weights 0.7 GB, a KV cache of 1.0 GB (21701 tokens); resident beside training (no sleep mode here); " \
        "checkpoints" in given.line()                    # 4 bytes × 162.8 M parameters; --kv-budget 1; no sleep on a CPU
    hf_planned = plan()                  # no --kv-budget: --engine hf fills what training leaves, as it did
    assert hf_planned.gen_bound == "" and "conversations generate together; checkpoints" in hf_planned.line()


@pytest.mark.parametrize("tied", [True, False])
def test_the_full_student_is_built_when_needed_and_equals_a_float_copy_of_the_backbone(tied):
    """models.full_student builds θ on the meta device and fills it from θ̄ (under torchrun, shard by shard:
    tests/test_distributed.py). In one process it must equal copy.deepcopy(θ̄).float(): every parameter and buffer
    (the rotary inv_freq is not in the state dict), the tie, the generation config and the logits."""
    import copy
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, tie_word_embeddings=tied)
    base = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    base.generation_config = GenerationConfig(eos_token_id=[3, 5], temperature=0.6)
    source = models.student_source(base)
    want = copy.deepcopy(base).float()
    got = models.full_student(argparse.Namespace(grad_ckpt=False), source)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in got.parameters())
    for (n, a), (m, b) in zip(want.named_parameters(), got.named_parameters(), strict=True):
        assert n == m and torch.equal(a, b), n
    for (n, a), (m, b) in zip(want.named_buffers(), got.named_buffers(), strict=True):
        assert n == m and torch.equal(a, b), n
    assert (got.lm_head.weight is got.model.embed_tokens.weight) == tied
    assert got.generation_config.eos_token_id == [3, 5]
    ids = torch.randint(0, 61, (2, 9))
    assert torch.equal(got(ids).logits, want(ids).logits)
    got.lm_head.weight.data.add_(1.0)                                   # its own storage: θ̄ is untouched
    assert torch.equal(base.lm_head.weight.float(), want.lm_head.weight)


def test_prepare_leaves_the_full_student_to_the_joint_stage(toy_backbone_dir, tmp_path):
    """Stages 1-4 hold no student (it would sit in memory through them, and unsharded under torchrun)."""
    args = train.parse_args(["--model", toy_backbone_dir, "--out", str(tmp_path / "run"), "--n-train", "20",
                             "--n-test", "2", "--bank-threshold", "0", "--cold-steps", "1", "--latents", "2",
                             "--max-new-tokens", "8", "--max-env-steps", "2"])
    run = train.prepare(args)
    assert run.student is None and run.source["cls"].__name__ == "Qwen3ForCausalLM"
    peft = run.composer.peft                                        # θ̄ with the composer's LoRA inside
    backbone = {t.data_ptr() for t in [*peft.parameters(), *peft.buffers()]}
    assert {t.data_ptr() for t in run.source["tensors"].values()} <= backbone   # θ̄'s own tensors, not copies


def test_the_plan_of_a_forward_and_backward_is_within_20_percent_of_its_measured_peak_in_each_mix():
    """For each dtype mix a run uses (the CPU's fp32 student, the fp32 student under bf16 autocast, the frozen bf16
    teacher, a LoRA student), with and without checkpointing: the resident memory's high-water mark over its
    baseline while 2,048 tokens go forward and backward through a random Qwen3's decoder, measured in a process of
    its own, against the plan's bytes for that step (saved activations, a layer's backward, a full student's weight
    casts). The measurement sees every allocation, the plan only its terms: what the plan misses shows here."""
    from scripts import bench
    peaks = bench.check_step_peaks()
    assert len(peaks) == 4
    for mix, by_ckpt in peaks.items():
        for ckpt, (measured, planned) in by_ckpt.items():
            assert 0.8 <= measured / planned <= 1.2, (mix, ckpt, measured, planned)


def test_each_per_token_term_of_the_memory_plan_is_within_20_percent_of_a_measurement():
    """bench.check_plan measures, on a small random Qwen3 with Qwen3's vocabulary, for each dtype mix a run uses (the
    CPU's fp32, the full student fp32 under bf16 autocast, the frozen bf16 teacher, a LoRA student), what autograd
    saves a token (with and without checkpointing) and the KV cache a token; once, the chunked loss's peak a row and
    AdamW's temporary a parameter; the plan's terms (structural formulas, fitted on nothing) must be within 20% of
    each. In a process of its own: the loss's peak is read from the RSS, which memory freed by earlier tests would
    hide."""
    import json
    import subprocess
    code = "from scripts import bench; import json; print(json.dumps(bench.check_plan(tokens=128, chunk=64)))"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True).stdout
    checked = json.loads(out.strip().splitlines()[-1])
    assert len(checked) == 5                                  # four mixes (CPU, autocast, the teacher, LoRA) and once
    for mix, terms in checked.items():
        for term, (measured, planned) in terms.items():
            assert 0.8 <= measured / planned <= 1.2, (mix, term, measured, planned)
