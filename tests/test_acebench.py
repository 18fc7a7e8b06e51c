"""ACEBench's English agent tasks through the project's own rendering, parsing and execution, scored by ACEBench's
own checker (worlds/acebench.py). Skipped without a clone of ACEBench: $ACEBENCH, or one beside the repository
(../ACEBench, as `git clone` names it, or an acebench/ folder in a folder beside the repository).

The replies are scripted, not sampled: ACEBench's milestone calls in its own call format, played through
engine.scripted_episode (the chat template renders the prompt and every later history line; replies are parsed;
calls run on the task's instances in the episode's confined worker), with the toy tokenizer's template; multi-turn
tasks get a scripted user. ACEBench's checker is the judge, so the replay can fail, and the end states are also
compared with the ground truth here, by hand.

The milestones are not all a path to the ground truth. Replayed as written, they pass 12 of 20 multi-step tasks and
29 of 30 multi-turn ones, and the failures are the data's (CEILING): multi_step 0 and 1 order 'Super Supreme', which
Domino's does not sell (its 'Super Supreme Pizza' is the ground truth's order); multi_step 12 and 13 never log
Helen into the food platform (the ground truth has her logged in, and the order needs it); multi_step 14-17 delete
the earliest message, where the task asks for the most recent and the ground truth deleted it (and 16, whose device
starts logged out, never calls login_device(), which every message call needs); multi_turn 6 never calls
login_device(), which the ground truth's logged_in and the reminder need. With those fixes (`fixed`) the replays
pass 20 of 20 and 30 of 30.

Run: python -m pytest tests/test_acebench.py -q
"""
import ast
import functools
import glob
import json
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CANDIDATES = [os.environ.get("ACEBENCH", ""), os.path.join(ROOT, "..", "ACEBench"),
              *sorted(glob.glob(os.path.join(ROOT, "..", "*", "acebench")))]
ACE = next((os.path.abspath(p) for p in CANDIDATES
            if os.path.isfile(os.path.join(p, "data_all", "data_en", "data_agent_multi_step.json"))), None)
if ACE is None:
    pytest.skip("ACEBench tier: no clone of ACEBench ($ACEBENCH, or beside the repository: git clone "
                "https://github.com/chenchen0103/ACEBench ../ACEBench)", allow_module_level=True)
sys.path.insert(0, ROOT)
import engine  # noqa: E402
from runtime.devices import UserError  # noqa: E402
from worlds import acebench  # noqa: E402
from worlds import toy_backbone as toy  # noqa: E402

CEILING = {"multi_step": ["agent_multi_step_0", "agent_multi_step_1", "agent_multi_step_12", "agent_multi_step_13",
                          "agent_multi_step_14", "agent_multi_step_15", "agent_multi_step_16", "agent_multi_step_17"],
           "multi_turn": ["agent_multi_turn_6"]}
TYPOS = {"ReminderAPI": "ReminderApi", "Reminderpi": "ReminderApi", "BaseAPI": "BaseApi"}   # the ground truth's


def fixed(task, replies: list[str]) -> list[str]:
    """The milestone replies of a CEILING task with the data's mistake mended (the module docstring names each)."""
    n = int(task.task_id.rsplit("_", 1)[1])
    if task.variant == "multi_turn":
        return ["[login_device()]"] + replies
    if n in (0, 1):
        return [r.replace("'product': 'Super Supreme'", "'product': 'Super Supreme Pizza'") for r in replies]
    if n in (12, 13):
        at = next(i for i, r in enumerate(replies) if r.startswith("[add_food_delivery_order"))
        return replies[:at] + ["[login_food_platform(username='Helen', password='password321')]"] + replies[at:]
    latest = [{"[get_earliest_message_id()]": "[get_latest_message_id()]",
               "[delete_message(message_id=3)]": "[delete_message(message_id=4)]"}.get(r, r) for r in replies]
    return ["[login_device()]"] * (n == 16) + latest


def mended(task) -> list[str]:
    """The milestone replies of a task, `fixed` where the data needs it: a path to the ground truth."""
    replies = acebench.milestone_replies(task)
    return fixed(task, replies) if task.task_id in CEILING[task.variant] else replies


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(toy.SHIPPED)


@pytest.fixture(scope="module")
def tasks():
    return acebench.load_tasks(ACE)


class ScriptedUser:
    """A user simulator that says `lines` in order, then "finish conversation"; it keeps what it was shown."""

    def __init__(self, lines):
        self.lines, self.seen = list(lines), []

    def __call__(self, messages):
        self.seen.append([dict(m) for m in messages])
        return self.lines.pop(0) if self.lines else acebench.FINISH


def replay(tok, tasks, replies_of, user_of=lambda t: None):
    """Each task's scripted episode (engine.scripted_episode) -> (the world's log by task id, the episodes)."""
    log, eps = {}, []
    for t in tasks:
        chat = engine.Chat(tok, functools.partial(acebench.AceBenchWorld, log=log, user=user_of(t)))
        eps.append(engine.scripted_episode(chat, t, replies_of(t)))
    return log, eps


def by_regime(tasks, regime):
    return [t for t in tasks if t.variant == regime]


def reaches_ground_truth(task, state) -> bool:
    """The end state against the ground truth, by hand: every ground-truth class (its misspelt names read as
    meant) has an instance whose saved attributes are all in it and equal (a dict: every key the truth holds)."""
    got = {name: attrs for entry in state for name, attrs in entry.items()}
    for entry in task.answer["ground_truth"]:
        (name, truth), = entry.items()
        mine = got.get(TYPOS.get(name, name))
        if mine is None or set(mine) - set(truth):
            return False
        for attr, want in truth.items():
            have = mine[attr]
            if (isinstance(want, dict) and any(k not in have or have[k] != v for k, v in want.items())) or \
                    (not isinstance(want, dict) and have != want):
                return False
    return True


def verdicts(log, tasks):
    return acebench.score(tasks, [log[t.task_id]["record"] for t in tasks])


def test_the_multi_step_milestones_pass_every_task_their_data_allows(tok, tasks):
    """Each milestone as ACEBench wrote it (and, where that is no Python, its calls re-quoted after it): ACEBench's
    milestone score finds every milestone (process 1.0 on all 20); end to end 12 of 20 pass, the CEILING tasks
    failing; with their fixes (`fixed`), 20 of 20, each end state the ground truth's."""
    steps = by_regime(tasks, "multi_step")
    assert len(steps) == 20
    log, eps = replay(tok, steps, lambda t: acebench.milestone_replies(t, verbatim=True) + [acebench.FINISH])
    score = verdicts(log, steps)
    assert [t.task_id for t in steps if not log[t.task_id]["passed"]] == CEILING["multi_step"]
    assert score == {"end_to_end": 0.6, "process": 1.0, "correct": 12}
    assert all(e.reward == 1.0 for e in eps) and all(log[t]["error"] is None for t in log)
    log, eps = replay(tok, steps, lambda t: mended(t) + [acebench.FINISH])
    assert verdicts(log, steps) == {"end_to_end": 1.0, "process": 1.0, "correct": 20}
    assert all(reaches_ground_truth(t, log[t.task_id]["record"]["result"]) for t in steps
               if t.task_id not in ("agent_multi_step_0", "agent_multi_step_1"))
    # 0 and 1: the reminder's title in the milestones ("Today's spending") is not the ground truth's, whose class
    # name is misspelt (ReminderAPI), so ACEBench's checker never compares it
    first = next(t for t in steps if t.task_id == "agent_multi_step_0")
    assert not reaches_ground_truth(first, log[first.task_id]["record"]["result"])


def test_the_multi_turn_tasks_with_a_scripted_user_reach_the_ground_truth_end_states(tok, tasks):
    """The user opens with the task's instruction and ends on the agent's first prose; the agent plays the
    milestones. 29 of 30 pass as written (multi_turn_6 is the CEILING), 30 of 30 with its fix, every end state the
    ground truth's (the misspelt classes of multi_turn 7 and 9 included), and the simulator saw ACEBench's prompt."""
    turns = by_regime(tasks, "multi_turn")
    assert len(turns) == 30
    users = {t.task_id: ScriptedUser([t.text]) for t in turns}
    log, eps = replay(tok, turns, lambda t: acebench.milestone_replies(t) + ["Done."], lambda t: users[t.task_id])
    assert [t.task_id for t in turns if not log[t.task_id]["passed"]] == CEILING["multi_turn"]
    assert verdicts(log, turns)["correct"] == 29
    log, eps = replay(tok, turns, lambda t: mended(t) + ["Done."], lambda t: ScriptedUser([t.text]))
    assert verdicts(log, turns) == {"end_to_end": 1.0, "process": 1.0, "correct": 30}
    assert all(reaches_ground_truth(t, log[t.task_id]["record"]["result"]) for t in turns)
    seen = users["agent_multi_turn_0"].seen
    assert seen[0][0]["content"].startswith("You are a user interacting with an agent.")
    assert turns[0].text in seen[0][0]["content"] and seen[0][1] == {
        "role": "user", "content": "Is there anything you need help with today?"}
    assert seen[1][-1] == {"role": "user", "content": "Done."} and seen[1][2]["role"] == "assistant"
    text = tok.decode(eps[0].ids)
    assert "user:" + turns[0].text in text and "execution:[{'status': True" in text


def test_empty_replies_score_zero(tok, tasks):
    """No call at all: nothing is executed, ACEBench's result is empty, every task fails and no milestone is found;
    each episode ends at ACEBench's 40 messages (20 agent replies)."""
    some = by_regime(tasks, "multi_step")[:5] + by_regime(tasks, "multi_turn")[:5]
    log, eps = replay(tok, some, lambda t: [""] * 30, lambda t: ScriptedUser(["Please help me."] * 30))
    for regime in acebench.REGIMES:
        assert verdicts(log, by_regime(some, regime)) == {"end_to_end": 0.0, "process": 0.0, "correct": 0}
    assert all(e.steps == 20 and e.tool_calls == 0 and e.reward == 0.0 for e in eps)
    assert all(log[t]["record"] == {"result": [], "process": [""] * 20 if "step" in t else []} for t in log)


def step_task(tasks, n=4):
    return next(t for t in tasks if t.task_id == f"agent_multi_step_{n}")


@pytest.mark.parametrize("reply", [
    "[send_message(sender_name=__import__('os').system('touch {target}'), receiver_name='Frank', message='x')]",
    "[send_message(sender_name='Eve', receiver_name='Frank', message=open('{target}', 'w').write('x'))]",
    "[send_message(sender_name='Eve', receiver_name='Frank', message=1 + 2)]",
    "[send_message(sender_name=lambda: 'Eve', receiver_name='Frank', message='x')]",
    "[send_message(sender_name='Eve', receiver_name=Frank, message='x')]",
    "[send_message('Eve', 'Frank', 'x')]",
    "[os.system(command='touch {target}')]",
    "[get_all_message_times_with_ids()]",                 # a public helper of MessageApi that no schema lists
    "[_load_scenario(scenario={{'wifi': True}})]",
    "[__init__()]",
    "[send_message(sender_name='Eve', receiver_name='Frank', message='x', __class__='y')]",
])
def test_code_or_a_helper_in_a_reply_is_an_error_observation_and_never_runs(tok, tasks, tmp_path, reply):
    """ACEBench's harness evals these; here each is an error observation: nothing runs (no trace, the state the
    initial one, no file written by the episode or its scoring), and the episode goes on."""
    target = tmp_path / "X"
    env = acebench.AceBenchWorld()
    task = step_task(tasks)
    env.reset(task)
    r = env.step(reply.format(target=target))
    assert r.errors == 1 and r.n_calls == 1 and not r.done and env.trace == []
    said, = ast.literal_eval(r.user.removeprefix("execution result:"))   # ACEBench's list of results, as text
    assert said.startswith("Error: "), said
    env.step("[turn_on_wifi()]")                           # the episode goes on, and its state is read
    state = env.final_state()
    inbox = next(e["MessageApi"]["inbox"] for e in state if "MessageApi" in e)
    assert len(inbox) == 6 and env.reward() < 1.0 and not target.exists()


def test_a_call_list_goes_to_execution_and_prose_to_the_user_in_multi_turn(tasks):
    """Multi-turn routing as ACEBench's agent does it: `[...]` that reads as calls (a bad value included: an error
    observation) to execution; prose, and a call without brackets, to the user, who never sees execution results."""
    task = next(t for t in tasks if t.task_id == "agent_multi_turn_3")
    user = ScriptedUser(["Send a message to Frank.", "I am Grace.", "Thanks."])
    env = acebench.AceBenchWorld(user=user)
    messages = env.reset(task)
    assert messages[1]["content"].endswith("user:Send a message to Frank.\n")
    assert env.step("Who are you?").user == "user:I am Grace."
    r = env.step("[get_earliest_message_id(x=1+1)]")
    assert r.user.startswith("execution:['Error: ") and r.errors == 1 and len(user.seen) == 2
    r = env.step("get_earliest_message_id()")             # no brackets: ACEBench's agent sends it to the user
    assert r.user == "user:Thanks." and env.process == ["[get_earliest_message_id(x=1+1)]"]
    r = env.step("[get_earliest_message_id()]")
    assert r.user.startswith("execution:[{") and r.errors == 0 and not r.done
    assert env.step("All done.").done                     # the user's "finish conversation" ends it
    env.close()


def test_finish_conversation_and_the_message_cap(tasks):
    """Multi-step: "finish conversation" in the first reply is the second message, which ACEBench does not check:
    it goes to execution, which answers ACEBench's sentence for prose; in the next reply it ends the episode. A reply
    of many calls is one message; 20 replies fill the 40 messages."""
    task = step_task(tasks)
    env = acebench.AceBenchWorld()
    env.reset(task)
    r = env.step("<think>I am done</think>finish conversation")
    text = open(os.path.join(ACE, "model_inference/multi_step/execution_role_step.py")).read()
    assert not r.done and r.user.removeprefix("execution result:") in text and env.process == ["finish conversation"]
    assert env.step(" finish conversation ").done
    env.reset(task)
    results = [env.step("[turn_on_wifi(), get_latest_message_id()]") for _ in range(20)]
    assert [r.done for r in results] == [False] * 19 + [True] and env.messages == 40
    assert all(r.n_calls == 2 and r.errors == 0 for r in results)
    env.close()


def test_a_call_runs_on_every_instance_that_has_it(tasks):
    """ACEBench dispatches an inherited method to each involved instance: turn_on_wifi() turns on every one's wifi,
    and a function the schema lists but no class has is an execution error."""
    task = step_task(tasks, 1)                             # BaseApi, ReminderApi, FoodPlatform; wifi off
    env = acebench.AceBenchWorld()
    env.reset(task)
    assert env.step("[turn_on_wifi()]").user == "execution result:[{'status': True, 'message': 'Wi-Fi has been " \
                                                "turned on'}]"
    r = env.step("[search_reminders(keyword='x')]")
    assert r.errors == 1 and "Error during execution" in r.user
    state = env.final_state()
    assert [list(e) for e in state] == [["BaseApi"], ["ReminderApi"], ["FoodPlatform"]]
    assert state[0]["BaseApi"]["wifi"] is True and set(state[2]["FoodPlatform"]) == {"users", "logged_in_users",
                                                                                      "orders"}
    env.close()


def test_acebenchs_scores_are_its_formulas(tasks):
    """ACEBench's agent_eval on hand-made records, against the formulas of its eval_main.py worked by hand: a task
    whose result is its ground truth passes (process 1.0); one with a value changed fails and scores the share of
    milestones found in order (a missed one stops the count); alternatives take the best; one whose result lacks a
    class fails; the regime's accuracies round to 3 places."""
    four, six, five = step_task(tasks, 4), step_task(tasks, 6), step_task(tasks, 5)
    changed = json.loads(json.dumps(four.answer["ground_truth"]))
    changed[0]["BaseApi"]["wifi"] = False
    stones = four.answer["mile_stone"]                                      # 4 milestones
    alt = six.answer["mile_stone"][1]                                       # the second of two alternatives
    records = [{"result": five.answer["ground_truth"], "process": []},
               {"result": changed, "process": [stones[0], "noise", stones[2]]},       # 1 in order: 0.25
               {"result": six.answer["ground_truth"][:2], "process": alt[:4]}]       # a class missing: 4/6
    got = acebench.score([five, four, six], records)
    assert got["correct"] == 1 and got["end_to_end"] == round(1 / 3, 3)
    assert got["process"] == round((1.0 + 0.25 + round(4 / 6, 3)) / 3, 3)
    assert acebench.score([four], [{"result": changed, "process": stones}])["process"] == 1.0   # text alone
    assert not [m for m in sys.modules if m.split(".")[0] in ("model_inference", "model_eval", "eval_main",
                                                              "category")]      # none of the clone ran here


def test_prompts_are_read_from_the_clone_at_run_time(tasks, tmp_path):
    """The agent's prompts are the clone's own text (cut out of its file here by string search, not by ast), and a
    clone whose prompt file says something else gives that prompt: nothing of ACEBench's text lives in the project."""
    rel = "model_inference/multi_step/common_agent_step.py"
    source = open(os.path.join(ACE, rel)).read()
    start = source.index('MULTI_TURN_AGENT_PROMPT_SYSTEM_EN = """') + len('MULTI_TURN_AGENT_PROMPT_SYSTEM_EN = """')
    task = step_task(tasks)
    messages = acebench.AceBenchWorld().reset(task)
    assert messages[0]["content"] == source[start:source.index('"""', start)]
    assert messages[1]["content"] == ("Below is the list of APIs you can call (in JSON format): "
                                      f"{task.entry['function']}. Conversation history: user:{task.text}\n\n")
    copy = tmp_path / "ACEBench"
    shutil.copytree(ACE, copy)
    (copy / rel).write_text(source.replace("You are an AI system with the role of 'system'.", "ZZZ is the role."))
    other = acebench.load_tasks(str(copy), ["multi_step"])[4]
    assert acebench.AceBenchWorld().reset(other)[0]["content"].startswith("ZZZ is the role.")
    here = open(os.path.join(ROOT, "worlds", "acebench.py")).read()
    assert "You are an AI system" not in here and "Please do not ask me any questions" not in here


def test_a_bad_clone_or_regime_is_one_line(tmp_path):
    with pytest.raises(UserError, match="no ACEBench clone there"):
        acebench.load_tasks(str(tmp_path))
    assert acebench.parse_spec(f"acebench={ACE}") == (ACE, ["multi_step", "multi_turn"])
    assert acebench.parse_spec(f"acebench={ACE}:multi_turn") == (ACE, ["multi_turn"])
    with pytest.raises(UserError, match="no ACEBench regime 'multi_stp'"):
        acebench.parse_spec(f"acebench={ACE}:multi_stp")
    broken = tmp_path / "broken"
    shutil.copytree(ACE, broken)
    os.remove(broken / "model_inference" / "prompt_en.py")
    with pytest.raises(UserError, match="cannot read model_inference/prompt_en.py"):
        acebench.load_tasks(str(broken))


def test_a_bad_task_file_is_one_line_naming_its_line(tmp_path):
    """The clone's JSON Lines files through common.read_jsonl: a line that is not JSON, a record without a field
    and a file that is not there are each one UserError naming the file (and line) and what to change."""
    rel = os.path.join(acebench.DATA, "data_agent_multi_step.json")
    os.makedirs(tmp_path / acebench.DATA)
    where = str(tmp_path / rel)
    for text, line in (('{"id": 1}\n\n{"id": 2\n', f"{where}:3: not valid JSON"),
                       ('{"id": 1}\n["id"]\n', f"{where}:2: lacks id; ACEBench's records carry id")):
        (tmp_path / rel).write_text(text)
        with pytest.raises(UserError) as err:
            acebench._jsonl(str(tmp_path), rel, ("id",))
        assert str(err.value).startswith(line) and "git clone" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UserError, match="cannot read data_all/data_en/possible_answer/x.json"):
        acebench._jsonl(str(tmp_path), os.path.join(acebench.DATA, "possible_answer", "x.json"), ("id",))


def test_milestone_text_is_requoted_only_where_it_is_no_python(tasks):
    """'Domino's' inside single quotes is no Python: its calls come back re-quoted, with the same values a reader
    sees (read here with ast from a hand-quoted copy); a milestone that parses is played as written."""
    task = step_task(tasks, 0)
    replies = acebench.milestone_replies(task)
    assert replies[0] == task.answer["mile_stone"][0]
    node = ast.parse(replies[1], mode="eval").body.elts[0]
    assert {k.arg: ast.literal_eval(k.value) for k in node.keywords} == {
        "username": "Eve", "merchant_name": "Domino's", "items": [{"product": "Super Supreme", "quantity": 1}]}
    assert acebench.milestone_replies(task, verbatim=True)[1:3] == [task.answer["mile_stone"][1], replies[1]]


def test_eval_py_reports_both_regimes_and_overall(tmp_path, capsys, monkeypatch):
    """eval.py --tasks acebench=PATH on a toy run folder (no checkpoint: the backbone is the student and the user)
    with replies scripted to the ground truth of the first two tasks of each regime: the table's rows, the overall
    over the four tasks, and the files; a regime that does not exist is one line."""
    import eval as ev
    import train
    run = tmp_path / "run"
    args = train.parse_args(["--out", str(run), "--device", "cpu", "--max-new-tokens", "8", "--max-len", "100000"])
    run.mkdir()
    (run / "args.json").write_text(json.dumps(train.dataclasses.asdict(args)))
    script = {t.task_id: mended(t) + [acebench.FINISH] for t in acebench.load_tasks(ACE)}
    live = []

    def scripted(model, tokenizer, contexts, cfg, conversations=None, keys=None, **_):
        if keys is None:                                 # the user simulator (acebench.ModelUser): one context
            return [(engine.reply_ids(tokenizer, "I need help."), [], True)]
        batch = live[-2:]                                # this regime's rollout: its two episodes (--n-test 2)
        return [(engine.reply_ids(tokenizer, script[batch[k].task.task_id].pop(0)), [], True) for k in keys]
    episode = engine.Episode
    monkeypatch.setattr(engine, "generate_replies", scripted)
    monkeypatch.setattr(engine, "Episode", lambda task: live.append(episode(task)) or live[-1])
    rows = ev.main(["--run", str(run), "--tasks", f"acebench={ACE}", "--n-test", "2"])
    out = capsys.readouterr().out
    assert [(r["regime"], r["tasks"], r["correct"]) for r in rows] == [("multi_step", 2, 2), ("multi_turn", 2, 2),
                                                                        ("overall", 4, 4)]
    assert "| M-Step | 2 | 100.0 | 100.0 | 56.6 |" in out and "| overall | 4 | 100.0 | 100.0 | 60.6 |" in out
    assert json.load(open(run / "acebench_first2.json"))["rows"] == rows
    assert len(open(run / "acebench_first2.records.jsonl").readlines()) == 4
    with pytest.raises(SystemExit) as stop:
        ev.main(["--run", str(run), "--tasks", f"acebench={ACE}:multi_stp"])
    assert stop.value.code == 2 and "no ACEBench regime 'multi_stp'" in capsys.readouterr().err


def test_smollm2_runs_both_regimes_with_itself_as_the_user(smollm2, tmp_path, capsys):
    """The real-model tier: eval.py --tasks acebench=PATH on SmolLM2-135M-Instruct (no checkpoint: it is the agent
    and the user simulator), two tasks of each regime, short replies. Whether it solves anything is not tested."""
    import eval as ev
    import train
    run = tmp_path / "smol"
    args = train.parse_args(["--model", smollm2, "--out", str(run), "--device", "cpu", "--max-new-tokens", "8",
                             "--no-thinking"])
    run.mkdir()
    (run / "args.json").write_text(json.dumps(train.dataclasses.asdict(args)))
    rows = ev.main(["--run", str(run), "--tasks", f"acebench={ACE}", "--n-test", "2"])
    out = capsys.readouterr().out
    assert [(r["regime"], r["tasks"]) for r in rows] == [("multi_step", 2), ("multi_turn", 2), ("overall", 4)]
    assert all(0.0 <= r["end_to_end"] <= 1.0 and 0.0 <= r["process"] <= 1.0 for r in rows)
    assert "| M-Step | 2 |" in out and "| M-Turn | 2 |" in out and "| overall | 4 |" in out
    records = [json.loads(line) for line in open(run / "acebench_first2.records.jsonl")]
    turn = next(r for r in records if r["benchmark"] == "acebench:multi_turn")
    opening = turn["prompt"].split("Conversation history 1..t:\nuser:")[1]       # SmolLM2's line as the user
    assert opening.strip() and acebench.load_tasks(ACE, ["multi_turn"])[0].text not in opening


def test_an_episodes_reward_is_its_in_order_milestone_share_or_1_when_it_passes(tasks):
    """reward() is ACEBench's process score (worlds/acebench.py's Scoring; eval_main.agent_eval_process): multi_step 4
    (4 milestones) with the first two as written, prose between them (recorded, matching nothing) and a wrong third
    call fails end to end and scores 2/4 = 0.5; its replayed milestones pass end to end and score 1.0, though the
    fourth, re-quoted, is not the milestone's text (3/4 by text)."""
    task, log = step_task(tasks), {}
    stones = task.answer["mile_stone"]
    env = acebench.AceBenchWorld(log=log)
    env.reset(task)
    for reply in (stones[0], "Let me look.", stones[1], "[delete_message(message_id=3)]"):
        assert not env.step(reply).done
    assert env.step("finish conversation").done
    assert env.process == [stones[0], "Let me look.", stones[1], "[delete_message(message_id=3)]"]
    assert env.reward() == 0.5 and log[task.task_id]["passed"] is False and log[task.task_id]["process"] == 0.5
    replies = acebench.milestone_replies(task)
    assert replies[:3] == stones[:3] and replies[3] != stones[3]
    env.reset(task)
    for reply in replies:
        env.step(reply)
    assert env.step("finish conversation").done
    assert env.reward() == 1.0 and log[task.task_id]["passed"] is True


def test_multi_turn_keeps_the_state_only_once_a_call_list_ran_clean(tasks):
    """Multi-turn: ACEBench's result (the state the checker reads) stays empty until a call list runs without an error
    (worlds/acebench.py: "ACEBench keeps the state"), so an episode whose calls all failed is scored on no state."""
    task = next(t for t in tasks if t.task_id == "agent_multi_turn_3")
    env = acebench.AceBenchWorld(user=ScriptedUser(["Send a message to Frank."]))
    env.reset(task)
    r = env.step("[get_earliest_message_id(x=1)]")                       # an undeclared argument: an error
    assert r.errors == 1 and env.final_state() == []
    r = env.step("[get_earliest_message_id()]")
    assert r.errors == 0 and any("MessageApi" in e for e in env.final_state())
    env.close()
