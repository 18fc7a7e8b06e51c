"""The token-level page (eval.py, eval.py --show): its numbers are training's, its HTML is escaped and whole.

Run: python -m pytest tests/test_show.py -q      (about 20 s)
"""
import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine  # noqa: E402
import eval as ev  # noqa: E402
import lopd  # noqa: E402
from worlds import tool_world  # noqa: E402
from test_lopd import J, SAMPLE, make_models, world  # noqa: E402,F401  (world is a fixture)


def test_the_pages_kl_terms_add_up_to_the_logged_distillation_loss(world):
    student, comp = make_models(world, seed=1)
    tasks = world["train"][6:10]
    torch.manual_seed(3)
    eps = engine.rollout(student, world["chat"], tasks, SAMPLE)
    with torch.no_grad():
        latents = lopd.compose(comp, tasks, lopd.retrieve(world["retriever"], tasks, J))          # (B, J·K, d)
        c0 = latents.clone()
        cfg = lopd.LOPDConfig(n_ret=J, top_m=5)
        n_tokens = sum(sum(e.mask) for e in eps)
        rewards = torch.tensor([e.reward for e in eps])
        _, logged = lopd.micro_batch_objective(student, comp, world["chat"], eps, (latents, c0), rewards,
                                               eq=cfg.eq13(0.3, n_tokens, len(eps)), cfg=cfg)   # what lopd_step logs
    terms = ev.episode_terms(student, comp, world["chat"], eps, latents, top_m=5)
    kl = [x["kl"] for t in terms for x in t["tokens"] if x["omega"]]
    assert len(kl) == n_tokens and logged["loss/distill"] > 0
    assert sum(kl) / n_tokens == pytest.approx(logged["loss/distill"], rel=1e-5)
    # Δ's shares on the page add up to the logged Δ (eq. 12, per trajectory)
    shares = []
    for ep, t in zip(eps, terms):
        d = [x["delta"] for x in t["tokens"] if x["omega"]]
        shares.append((2 * ep.reward - 1) * sum(d) / max(1, len(d)) / len(eps))
    assert sum(shares) == pytest.approx(logged["privilege/delta"], rel=1e-4, abs=1e-7)


class FakeTok:
    """Decodes ids to fixed strings, a hostile one among them."""
    words = {0: "<script>alert(1)</script>", 1: "A & B", 2: '"quoted"', 3: "ok", 4: "x" * 900}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.words[i] for i in ids)


def test_tokens_and_observations_are_escaped_and_counted():
    ep = engine.Episode(tool_world.Task("t<1>", "alder", "upgrade", "Do <b>this</b> & that", {}, {}, []), reward=1.0)
    ep.ids, ep.prompt_len = [9, 9, 0, 1, 4, 2, 3], 2
    alts = [(3, 0.5), (0, 0.2)]
    tokens = [{"id": 0, "omega": 1, "kl": 0.5, "delta": 0.1, "p_s": 0.2, "p_t": 0.3, "alts": alts},
              {"id": 1, "omega": 1, "kl": 0.0, "delta": 0.0, "p_s": 0.5, "p_t": 0.5, "alts": alts},
              {"id": 4, "omega": 0},
              {"id": 2, "omega": 1, "kl": 0.1, "delta": -0.2, "p_s": 0.4, "p_t": 0.3, "alts": alts},
              {"id": 3, "omega": 0}]
    body = ev.episode_html(FakeTok(), ep, {"tokens": tokens}, ["<ref> & co"], n_traj=1)
    page = ev.page("a <title>", [("h", "p", [body])])
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "A &amp; B" in page and "&quot;quoted&quot;" in page and "&lt;b&gt;this&lt;/b&gt;" in page
    assert page.count('class="tok"') == 3 and page.count('class="obs"') == 2          # ω tokens, grey runs
    assert "rgb(255,0,0)" in page                                                      # the largest KL is red
    assert "characters] …" in page                                                     # a long run is cut
    assert not re.search(r"<(script|link|img|iframe)\b", page)                         # nothing loads or runs


def test_tensorboard_scalars_hold_the_values_of_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoard is optional: pip install tensorboard")
    import json

    from runtime import devices
    import train
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = tmp_path / "run"
    out.mkdir()
    log = devices.Log(str(out), str(tmp_path / "tb"))
    log("bank", entries=10, recall3_variant=0.875)
    for step in range(3):
        log("lopd", step=step, generations=32 * step, **{"loss/distill": 0.5 / (step + 1), "dual/beta": 0.1 * step,
                                                           "skipped": 0})
    files = list((tmp_path / "tb").rglob("events.out.tfevents*"))
    assert len(files) == 1 and str(out).strip("/") in str(files[0])            # a sub-folder named after OUT
    acc = EventAccumulator(str(files[0].parent))
    acc.Reload()
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    n = 0
    for i, rec in enumerate(records):
        for k, v in rec.items():
            if k in ("stage", "step"):
                continue
            events = {e.step: e.value for e in acc.Scalars(f"{rec['stage']}/{k}")}
            assert events[rec.get("step", 0)] == pytest.approx(v, rel=1e-6), (rec["stage"], k)
            n += 1
    assert n == 2 + 3 * 4
    assert train.parse_args(["--tensorboard", str(tmp_path / "tb")]).tensorboard == str(tmp_path / "tb")


def records_read_back(tok, chat, eps):
    """Each episode written as an evaluation's record (eval.task_record) and read back (eval.record_episode), with
    the RecordChat and the RecordTask the token view reads it through. -> [(chat, task, episode)]."""
    rchat = ev.RecordChat(chat)
    out = []
    for ep, rec in zip(eps, [ev.task_record(tok, "toy", ep, None) for ep in eps]):
        task = ev.RecordTask(rec["task_id"], rchat.task_text(rec["prompt"]), ep.task.variant, rec["prompt"])
        out.append((rchat, task, ev.record_episode(tok, rec, task, [tok.eos_token])))
    return out


def test_a_record_read_back_is_its_episode_and_the_teacher_reads_the_same_prompt(world):
    """A record keeps text, not ids: read back, the prompt and every observation are the ids the rollout made, the
    replies decode to the same text (the toy samples its tokenizer's own split, so their ids come back too), ω is
    the same, and the teacher's latent prompt made from the prompt's text is the one training makes from the task."""
    student, comp = make_models(world, seed=1)
    tasks = world["train"][6:10]
    torch.manual_seed(3)
    eps = engine.rollout(student, world["chat"], tasks, SAMPLE)
    chat = world["chat"]
    for ep, (rchat, task, back) in zip(eps, records_read_back(world["tok"], chat, eps)):
        assert task.text == ep.task.text and back.reward == ep.reward and back.prompt_len == ep.prompt_len
        assert back.ids == ep.ids and back.mask == ep.mask and sum(back.mask) > 0
        assert rchat.latent_prompt(*rchat.begin(task), 4) == chat.latent_prompt(*chat.begin(ep.task), 4)
    with torch.no_grad():                             # the token view's numbers, through the record's chat
        rebuilt = [back for _, _, back in records_read_back(world["tok"], world["chat"], eps)]
        latents = lopd.compose(comp, tasks, lopd.retrieve(world["retriever"], tasks, J))            # (B, J·K, d)
        want = ev.episode_terms(student, comp, world["chat"], eps, latents, top_m=5)
        got = ev.episode_terms(student, comp, ev.RecordChat(world["chat"]), rebuilt, latents, top_m=5)
    assert got == want


def test_records_read_back_on_a_real_template(smollm2):
    """The same on SmolLM2's template, which writes a default system prompt and takes the tools into the system
    message (engine.chat_text): scripted multi-turn episodes of the tool world, prompts as a real model gets them."""
    import train
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2)
    chat = train.chat_of(train.parse_args(["--model", smollm2, "--env", "tools"]), tok)
    tasks = tool_world.make_splits(seed=0, n_train=4, n_test=1)[0]
    eps = [engine.scripted_episode(chat, t, tool_world.oracle_replies(t)) for t in tasks]
    for ep, (rchat, task, back) in zip(eps, records_read_back(tok, chat, eps)):
        assert task.text == ep.task.text and back.ids == ep.ids and back.mask == ep.mask
        assert rchat.latent_prompt(*rchat.begin(task), 4) == chat.latent_prompt(*chat.begin(ep.task), 4)
