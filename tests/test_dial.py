"""The difficulty dial (train.py --conventions K, scripts/experiments.py dial): the K = 2 world is today's, every K's
conventions are hidden and all-or-nothing, a same-shop reference shows them, and the dial's table pairs its seeds."""
import dataclasses
import hashlib
import itertools
import json
import os
import random
import subprocess
import sys

import pytest

import engine
from runtime import devices
from scripts import experiments
import train
from worlds.common import format_call
from worlds import tool_world
from worlds.tool_world import CONVENTION_TOOLS, RULES, ToolWorld, oracle_calls
from worlds import toy_backbone as toy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def play(task, calls):
    env = ToolWorld()
    env.reset(task)
    obs = [o for name, args in calls for o in env.step(format_call(name, args)).observations]
    return env, obs


def test_k2_is_the_world_before_the_dial():
    """Digests taken from the code before the dial existed (commit 5ff9b1b): the same tasks, the same shops and
    tools, and the toy demonstrator draws the same coins (so `python -m worlds.toy_backbone` rebuilds the shipped backbone)."""
    train_tasks, test_tasks = tool_world.make_splits(0, 100, 50)
    assert digest([dataclasses.asdict(t) for t in train_tasks + test_tasks]) == "717599b265d56b68"
    assert tool_world.make_splits(0, 100, 50, conventions=2) == (train_tasks, test_tasks)
    assert tool_world.shops(2) == sorted(tool_world.SHOPS) and tool_world.tools_for(2) == tool_world.TOOLS
    assert {s: (RULES[s]["verify"], RULES[s]["commit"]) for s in tool_world.SHOPS} == tool_world.SHOPS
    rng = random.Random(5)
    assert digest([toy.demo_calls(t, rng) for t in toy.demo_tasks(100, 1)]) == "e0426332ced1fc06"


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_every_combination_is_a_shop_and_only_all_of_them_right_succeeds(k):
    """2^K shops, one per combination. On every shop the oracle scores 1; dropping any one required convention, or
    adding the tool of one the shop lacks, scores 0 (brute force over shops, conventions and schemas)."""
    names = tool_world.shops(k)
    assert len(names) == 2 ** k and len({tuple(RULES[s].values()) for s in names}) == 2 ** k
    assert {c for s in names for c in RULES[s]} == set(tool_world.WORLD_CONVENTIONS[k])
    rng = random.Random(k)
    for shop, schema in itertools.product(names, sorted(tool_world.SCHEMAS)):
        task = tool_world.make_task(rng, "t", shop=shop, schema=schema)
        calls = oracle_calls(task)
        assert play(task, calls)[0].reward() == 1.0
        cid = calls[0][1]["account"] and next(c for c, r in task.db["customers"].items()
                                              if r["account"] == task.goal["account"])
        for conv, required in RULES[shop].items():
            tool = CONVENTION_TOOLS[conv]
            if required:
                wrong = [c for c in calls if c[0] != tool]
            else:
                wrong = calls[:1] + [(tool, {} if tool in ("commit", "open_ticket") else {"customer_id": cid})] + \
                    calls[1:]
            assert play(task, wrong)[0].reward() == 0.0, (shop, schema, conv)


@pytest.mark.parametrize("k", [1, 3, 4])
def test_no_convention_but_verification_shows_in_the_observations(k):
    """Forgetting commit, a ticket or a notice answers every other call exactly as doing it does: the
    observations do not tell (verification's refusal does, and K = 1 leaves it out)."""
    rng = random.Random(10 + k)
    for shop in tool_world.shops(k):
        task = tool_world.make_task(rng, "t", shop=shop, schema="reorder")
        calls = oracle_calls(task)
        for conv in set(RULES[shop]) - {"verify"}:
            tool = CONVENTION_TOOLS[conv]
            if not RULES[shop][conv]:
                continue
            _, full = play(task, calls)
            _, missing = play(task, [c for c in calls if c[0] != tool])
            assert [o for c, o in zip(calls, full) if c[0] != tool] == missing, (shop, conv)


@pytest.mark.parametrize("k", [1, 3, 4])
def test_a_same_shop_reference_shows_exactly_the_shops_conventions(k):
    rng = random.Random(k)
    tools = set(CONVENTION_TOOLS.values())
    for shop in tool_world.shops(k):
        task = tool_world.make_task(rng, "t", shop=shop)
        trace = toy.reference_trace(task, rng)
        shown = {t for t in tools if t + "(" in trace}
        assert shown == {CONVENTION_TOOLS[c] for c, on in RULES[shop].items() if on}, shop


@pytest.mark.parametrize("k", [1, 3, 4])
def test_the_demonstrator_is_at_chance_on_each_convention(k):
    """Each convention of the world in about half of the demonstrations of every shop, none outside the world;
    they score about 2^-K (plus what retrying after a refusal recovers when the world verifies)."""
    tasks, rng = toy.demo_tasks(1600, 3, k), random.Random(0)
    env, rewards, seen = ToolWorld(), [], {t: 0 for t in CONVENTION_TOOLS.values()}
    for t in tasks:
        calls = toy.demo_calls(t, rng)
        for tool in seen:
            seen[tool] += any(c[0] == tool for c in calls)
        env.reset(t)
        for name, args in calls:
            env.step(format_call(name, args))
        rewards.append(env.reward())
    for conv, tool in CONVENTION_TOOLS.items():
        share = seen[tool] / len(tasks)
        if conv not in tool_world.WORLD_CONVENTIONS[k]:
            assert share == 0, tool
        elif conv != "verify":                      # verify: 0.5 up front, and again after most refusals
            assert 0.45 < share < 0.55, (tool, share)
    mean = sum(rewards) / len(rewards)
    assert 0.7 * 2 ** -k < mean < 1.5 * 2 ** -k + (0.1 if "verify" in tool_world.WORLD_CONVENTIONS[k] else 0), mean


def test_a_dial_shop_outside_its_world_is_an_unknown_tool():
    """K = 1 has no verification: verify_customer is no tool of that world (an error observation, no abort)."""
    task = tool_world.make_task(random.Random(0), "t", shop="gorse")
    env, obs = play(task, [("verify_customer", {"customer_id": "C1"})])
    assert obs == ["Error: unknown tool 'verify_customer'"] and not env.aborted
    assert [t["function"]["name"] for t in tool_world.tools_for(4)][-2:] == ["open_ticket", "notify_customer"]


def test_conventions_flag_checks(tmp_path, toy_backbone_dir):
    for bad, says in ((["--conventions", "5"], "--conventions must be one of 1, 2, 3, 4"),
                      (["--conventions", "3", "--env", "code"], "takes --env tools")):
        r = subprocess.run([sys.executable, "train.py", "--out", str(tmp_path), *bad], cwd=ROOT,
                           capture_output=True, text=True)
        assert r.returncode == 2 and says in r.stderr
    args = train.parse_args(["--model", toy_backbone_dir, "--out", str(tmp_path / "a"), "--conventions", "3"])
    with pytest.raises(devices.UserError, match="built for the tool world with 2 conventions, not --conventions 3"):
        train.load_backbone(args, "cpu", None)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "args.json").write_text(json.dumps({"conventions": 4}))
    with pytest.raises(devices.UserError, match="another world"):
        train.prepare(dataclasses.replace(args, out=str(tmp_path / "b")))


def test_shipped_dial_backbones_name_their_world():
    for k in (1, 3, 4):
        folder = toy.shipped("tools", k)
        assert folder.endswith(f"toy-backbone-k{k}")
        if os.path.isdir(folder):
            assert toy.backbone_conventions(folder) == k
    assert toy.backbone_conventions(toy.SHIPPED) == 2


def fake_rows():
    rows = []
    for k, seed in itertools.product((1, 2), (0, 1, 2)):
        def row(method, measure, step, value):
            rows.append(dict(k=k, seed=seed, method=method, measure=measure, step=step, generations=32 * step,
                             value=value))
        row("base", "vanilla", 0, 0.3)
        row("base", "teacher", 0, 0.7)
        for m, end in (("lopd", 0.6 + 0.1 * seed), ("lopd-phi0", 0.5), ("grpo", 0.5 + 0.05 * k), ("rft", 0.4)):
            row(m, "student", 0, 0.3)
            row(m, "student", 20, end - 0.1)
            row(m, "student_end", 20, end)
        row("lopd", "teacher", 20, 0.6)
        row("grpo", "flat_groups", 20, 0.25)
    return rows


def test_dial_gaps_are_paired_by_seed_and_tabled():
    rows = fake_rows()
    gaps = experiments.dial_gaps(rows)
    # K = 1, seed s: LOPD 0.6 + 0.1 s against GRPO 0.55 -> 0.05, 0.15, 0.25
    assert gaps[(1, "LOPD − GRPO")] == pytest.approx([0.05, 0.15, 0.25])
    assert gaps[(2, "LOPD − RFT")] == pytest.approx([0.2, 0.3, 0.4])
    table = experiments.dial_table(rows)
    assert "| 1 | 0.300 ± 0.000 | 0.700 ± 0.000 | 0.700 ± 0.082 | 0.550 ± 0.000 | 0.400 ± 0.000 | 0.150 ± 0.082 |" \
        in table
    assert "| 2 | grpo | 0.300 ± 0.000 | 0.500 ± 0.000 |" in table


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_each_shipped_backbone_reads_a_same_shop_reference(k):
    """The reading check of every K's shipped backbone (toy.reading_check, 60 held-out tasks at T 0.7): a
    same-shop reference in the span lifts it far above vanilla; another shop's does not (it misleads: with K = 1 the
    other shop's single convention is the wrong one, so following it fails every task)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = toy.shipped("tools", k)
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    tasks = tool_world.make_splits(0, 1000, 60, conventions=k)[1]
    torch.manual_seed(0)
    cfg = engine.SampleConfig(temperature=0.7)
    vanilla = engine.summarize(engine.rollout(model, toy.toy_chat(tok), tasks, cfg))["reward"]
    r = toy.reading_check(model, tok, tasks, ToolWorld, seed=0)
    same, other = r["same variant"], r["other variant"]
    assert same - vanilla > 0.2 and same - other > 0.3 and other < vanilla + 0.1, (vanilla, same, other)


def test_conventions_kept_compares_the_calls_with_the_shop():
    """Shop A's oracle episode read against a task of shop B keeps exactly the conventions A and B agree on
    (brute force over the 16 × 16 pairs of K = 4); a verification after the first change does not count."""
    rng = random.Random(4)
    for a, b in itertools.product(tool_world.shops(4), repeat=2):
        task_a = tool_world.make_task(rng, "t", shop=a, schema="cancel")
        env, _ = play(task_a, oracle_calls(task_a))
        kept = tool_world.conventions_kept(dataclasses.replace(task_a, shop=b), env.trace_text())
        assert kept == {c: int(RULES[a][c] == RULES[b][c]) for c in RULES[b]}, (a, b)
    task = tool_world.make_task(rng, "t", shop="cedar", schema="cancel")            # verify, no staging
    late = [c for c in oracle_calls(task) if c[0] != "verify_customer"]       # ..., cancel_order (refused)
    late += [("verify_customer", {"customer_id": late[1][1]["customer_id"]}), late[-1]]   # verify, cancel again
    env, _ = play(task, late)
    assert env.reward() == 1.0 and tool_world.conventions_kept(task, env.trace_text()) == {"verify": 0, "commit": 1}
