"""The many-shops world (train.py --shops N, scripts/experiments.py figure4 --shops N): N shops of the K = 2 world,
each with its own two conventions drawn by fair coins; the 4-shop world unchanged; the statistics its tables print."""
import dataclasses
import hashlib
import json
import math
import os
import random
import subprocess
import sys

import pytest

import engine
import train
from runtime import devices
from scripts import experiments, tables
from worlds import tool_world
from worlds import toy_backbone as toy
from worlds.common import format_call
from worlds.tool_world import CONVENTION_TOOLS, RULES, ToolWorld, oracle_calls

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def play(task, calls):
    env = ToolWorld()
    env.reset(task)
    for name, args in calls:
        env.step(format_call(name, args))
    return env.reward()


def test_the_four_shop_world_is_unchanged():
    """Digest of the default splits taken before --shops existed (test_dial's, commit 5ff9b1b); --shops 0 and 4 are it."""
    split = tool_world.make_splits(0, 100, 50)
    digest = hashlib.sha256(json.dumps([dataclasses.asdict(t) for t in split[0] + split[1]], sort_keys=True)
                            .encode()).hexdigest()[:16]
    assert digest == "717599b265d56b68"
    assert tool_world.make_splits(0, 100, 50, n_shops=4) == split
    assert tool_world.shops(2) == tool_world.shops(2, 4) == ["alder", "cedar", "delta", "flint"]
    assert len(tool_world.shops(3)) == 8 and len(tool_world.shops(4)) == 16    # the dial's worlds keep theirs


def test_many_shops_draw_their_conventions_independently():
    """64 names, unique across every world; each shop's rules are two booleans; over the 64, each convention is
    required in about half the shops (binomial(64, 1/2): 32 ± 4, so 20-44 is beyond 3 sd), and every one of the four
    pairs occurs. A world of N shops is the first N of 64 (sorted): the 16-shop world inside the 32-shop one."""
    names = tool_world.MANY_SHOP_NAMES
    others = [n for n in RULES if n not in names]
    assert len(set(names)) == 64 and not set(names) & set(others)
    for n in names:
        assert set(RULES[n]) == {"verify", "commit"} and all(isinstance(v, bool) for v in RULES[n].values())
    for conv in ("verify", "commit"):
        assert 20 <= sum(RULES[n][conv] for n in names) <= 44, conv
    assert len({(RULES[n]["verify"], RULES[n]["commit"]) for n in tool_world.shops(2, 16)}) == 4
    assert set(tool_world.shops(2, 16)) < set(tool_world.shops(2, 32)) and len(tool_world.shops(2, 16)) == 16


def test_a_many_shop_task_is_scored_by_its_own_shops_rules():
    """For every shop of the 16-shop world and a schema: the oracle scores 1; dropping a required convention's call
    or adding one the shop lacks scores 0 (the 4-shop world's rules, applied to the shop's own pair)."""
    rng = random.Random(3)
    for shop in tool_world.shops(2, 16):
        task = tool_world.make_task(rng, "t", shop=shop, schema="cancel")
        calls = oracle_calls(task)
        assert play(task, calls) == 1.0 and task.text.endswith(f"Shop: {shop}.")
        cid = next(c for c, r in task.db["customers"].items() if r["account"] == task.goal["account"])
        for conv, required in RULES[shop].items():
            tool = CONVENTION_TOOLS[conv]
            wrong = ([c for c in calls if c[0] != tool] if required else
                     calls[:1] + [(tool, {} if tool == "commit" else {"customer_id": cid})] + calls[1:])
            assert play(task, wrong) == 0.0, (shop, conv)


def test_splits_spread_over_the_shops():
    train_tasks, test_tasks = tool_world.make_splits(0, 1000, 200, n_shops=16)
    counts = {s: sum(t.shop == s for t in train_tasks) for s in tool_world.shops(2, 16)}
    assert set(counts) == {t.shop for t in train_tasks} and min(counts.values()) > 1000 / 16 / 2
    assert {t.shop for t in test_tasks} <= set(counts)


def test_shops_flag_checks(tmp_path, toy_backbone_dir):
    for bad, says in ((["--shops", "3"], "--shops 3: the many-shops world takes 5 to 64 shops"),
                      (["--shops", "16", "--conventions", "3"], "and --conventions 2"),
                      (["--shops", "16", "--env", "code"], "takes --env tools")):
        r = subprocess.run([sys.executable, "train.py", "--out", str(tmp_path), *bad], cwd=ROOT,
                           capture_output=True, text=True)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    args = train.parse_args(["--model", toy_backbone_dir, "--out", str(tmp_path / "a"), "--shops", "16"])
    with pytest.raises(devices.UserError, match="built for the tool world with 4 shops, not --shops 16; .* "
                                                "worlds.toy_backbone --conventions 2 --shops 16"):
        train.load_backbone(args, "cpu", None)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "args.json").write_text(json.dumps({"shops": 0}))
    with pytest.raises(devices.UserError, match="another world"):
        train.prepare(dataclasses.replace(args, out=str(tmp_path / "b")))


def test_the_many_shops_backbone_is_shipped_beside_the_others():
    assert toy.shipped("tools", 2, 16).endswith("toy-backbone-s16") and toy.shipped("tools", 2, 4) == toy.SHIPPED
    folder = toy.shipped("tools", 2, 16)
    if os.path.isdir(folder):
        assert toy.backbone_shops(folder) == 16 and toy.backbone_conventions(folder) == 2
    assert toy.backbone_shops(toy.SHIPPED) == 4


def test_the_many_shops_backbone_reads_a_same_shop_reference():
    """The reading check on 60 held-out tasks of the 16-shop world (T 0.7): a same-shop reference lifts the
    backbone far above vanilla, another shop's does not."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = toy.shipped("tools", 2, 16)
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    tasks = tool_world.make_splits(0, 1000, 60, n_shops=16)[1]
    torch.manual_seed(0)
    vanilla = engine.summarize(engine.rollout(model, toy.toy_chat(tok), tasks,
                                              engine.SampleConfig(temperature=0.7)))["reward"]
    r = toy.reading_check(model, tok, tasks, ToolWorld, seed=0)
    assert r["same variant"] - vanilla > 0.2 and r["same variant"] - r["other variant"] > 0.2, (vanilla, r)


# -- the statistics over seeds ------------------------------------------------------------------------------------
def test_interval_is_the_t_interval_with_the_sample_std():
    """Seeds 0.60, 0.64, 0.71: mean 0.65, s = sqrt(((-0.05)² + (-0.01)² + 0.06²) / 2) = sqrt(0.0031), and the 95%
    half-width t(0.975, 2) · s / sqrt(3) with t = 4.303 (a t table)."""
    mean, s, half = tables.interval([0.60, 0.64, 0.71])
    assert mean == pytest.approx(0.65) and s == pytest.approx(math.sqrt(0.0031))
    assert half == pytest.approx(4.303 * math.sqrt(0.0031) / math.sqrt(3))
    assert math.isnan(tables.interval([0.5])[2])


def test_figure4_table_pairs_the_seeds_and_names_the_pools():
    """LOPD beats GRPO by 0.10, 0.12, 0.08 on seeds 0-2 (paired mean 0.10, s 0.02, interval 0.10 ± 4.303·0.02/√3
    = [0.050, 0.150]); their unpaired spreads (0.1 apart per seed) would not separate them. The bank's rollouts
    are named for LOPD and not for GRPO."""
    rows = []
    for seed, (lo, gr) in enumerate(((0.60, 0.50), (0.82, 0.70), (0.68, 0.60))):
        for step, frac in ((0, 0.0), (10, 1.0)):
            rows.append(dict(method="lopd", seed=seed, step=step, generations=2000 + 320 * step // 10,
                             training_generations=320 * step // 10, reward=0.4 + frac * (lo - 0.4)))
            rows.append(dict(method="grpo", seed=seed, step=step, generations=320 * step // 10,
                             training_generations=320 * step // 10, reward=0.4 + frac * (gr - 0.4)))
    table = experiments.figure4_table(rows)
    half = 4.303 * 0.02 / math.sqrt(3)
    assert (f"LOPD − GRPO at the end, paired over 3 seeds: +0.100 ± 0.020, 95% interval [{0.1 - half:+.3f}, "
            f"{0.1 + half:+.3f}] (above 0: LOPD ahead).") in table
    pools = next(line for line in table.splitlines() if line.startswith("Rollouts made before the first step"))
    assert pools.endswith(": LOPD 2000 (the base's rollouts that built the bank; the other methods read none).")
    assert "sample std" in table


def test_table_gaps_are_paired_per_column():
    rows = [dict(row=r, seed=s, heading="held-out (tools)", column="reward", value=v, tasks=200)
            for r, vals in (("lopd", (60, 70, 65)), ("grpo", (62, 69, 66))) for s, v in enumerate(vals)]
    (line,) = tables.paired_gaps(rows)
    # differences -2, +1, -1: mean -0.667, s = sqrt(((-4/3)² + (5/3)² + (-1/3)²) / 2) = sqrt(7/3)
    s = math.sqrt(7 / 3)
    half = 4.303 * s / math.sqrt(3)
    assert line == (f"LOPD − GRPO, held-out (tools): reward: {-2 / 3:+.1f} ± {s:.1f} over 3 seeds, 95% interval "
                    f"[{-2 / 3 - half:+.1f}, {-2 / 3 + half:+.1f}] (contains 0: not separated).")
