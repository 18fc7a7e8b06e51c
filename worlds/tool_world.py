"""The toy tool-use world, the default run's (paper §4.1, A.3, A.5, B.2), behind the interface every world shares
(common.py: `Environment`).

The paper trains on EnvScaler: multi-turn tasks where an agent changes a stateful database through tools and
is scored by a checklist read from the final state. This file is a small world in that spirit, small enough for
a 0.5 M-parameter model on two CPU cores. It is also a real (easy) environment for a real Qwen3: the tools come as
JSON schemas.

    python -m worlds.tool_world    # print a sample task, its oracle episode and its observation-lite trace

The world
---------
- A shop database: three customers (random id such as C4, account code such as A5, tier) and their orders (random
  id such as O8, customer, item code such as K7, qty, status).
- Four shops ("variants"; docs/design.md, "The toy world"), each with its own pair of conventions that the task
  text never states:
    * whether a customer must be confirmed with `verify_customer` before any change to them or their orders
      (otherwise the change is refused: "Error: verify the customer first");
    * whether changes are staged until `commit()` or applied at once. Uncommitted changes are lost, and an
      accepted change answers the same either way ("Updated"), so the observations do not tell.
  A shop without a convention lacks its tool, and calling it aborts the session and rolls back its changes. So no
  convention is free to apply everywhere: "always verify and commit" solves one shop in four, and a composer cannot
  win with one task-independent prompt (docs/toy-world.md, "What each failed design taught").
  A successful trajectory of another task in the SAME shop shows both conventions; one from another shop misleads.
- The difficulty dial (`train.py --conventions K`, K = 1..4; `scripts/experiments.py dial`): 2^K shops, one for each
  combination of K conventions. K = 2 is the world above, task for task. K = 1 keeps commit alone; K = 3 adds
  `open_ticket()` (changes before it answer as usual and are dropped), K = 4 `notify_customer` (a session that
  leaves a changed customer un-notified is void). Commit, ticket and notice cannot be read off observations;
  verification's refusal names it. A success needs all K right, and the base applies each at chance.
- Ten schemas (multi-step procedures: look up the customer id, find an order, update, cancel, add ...). The task
  text states the goal ("Cancel an order: item K7, account A5. Shop: cedar."), not the procedure. Tasks of one
  schema are "similar tasks". Entities are codes of one letter and one digit (A5, K7) rather than names, so that a
  0.5 M-parameter model can copy them into its calls: copying "A" + "5" needs one induction step, and the model
  learns it in a few hundred steps. It could not learn to copy "Ana" into {"name": "Ana"} in minutes of training,
  and two-digit codes took up to twice as long (the second digit matches many places).
- Reward in [0, 1] (EnvScaler-style checklist): the fraction of required final-state changes present in the
  committed state, minus one item for each collateral change to a record the task did not ask to change.
- Actions use the Qwen3 format `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Llama 3's bare JSON and
  Olmo 3's `<function_calls>` parse too: "Tool calls" below); several calls in one reply are all executed (and
  counted: Table 3's "tool calls per step"). A malformed, unknown or wrongly-typed call gets an error observation;
  `step` never raises. A reply without a tool call ends the episode (the agent believes it is done; A.5 asks for
  exactly `Task Completed`), as does the step cap.

Deviations from the paper
-------------------------
1. EnvScaler's 2,349 tasks are replaced by this generated world (docs/design.md, "The toy world", says why the
   variants).
2. The step cap is 10 for the toy world (paper: 30 environment steps); oracle procedures take 2 to 6 calls.
3. Every task involves one customer and at most one item: a 0.5 M-parameter model trained for minutes cannot tell
   two item codes of one task apart ("item K3, new item K9" failed in every episode); such schemas would only
   cap every row of the table without testing the method.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import random
import re
from dataclasses import asdict, dataclass, field

import inject
from worlds.common import (DONE_TEXT, Environment, StepResult, format_call, lite_trace, parse_tool_calls, read_jsonl,
                           reply_end, scripted_replies)

# ----------------------------------------------------------------------------------------------------------------
# Prompts (A.5, word for word) and the toy's short system prompt
# ----------------------------------------------------------------------------------------------------------------
AGENTIC_SYSTEM_PROMPT = (
    "You are a helpful assistant. When given a specific task, your goal is to complete it in an interactive "
    "environment by making step-by-step use of available tools.\n\n"
    "- Before completing the task, at each step, select a tool from the tool list and fill in all required "
    "parameters, making sure that the values are valid. Avoid making parallel tool calls in one step.\n\n"
    "- When you believe the task has been completed, respond only with 'Task Completed' to end the trajectory, "
    "without adding any other content or making any tool calls.\n\n"
    "- It is recommended to first call query tools to gather sufficient information, then use modification tools "
    "to complete the task. Adjust actions promptly based on the feedback from the environment."
)
# The toy backbone sees a short system prompt: a 0.5 M-parameter model gains nothing from 120 tokens of instructions
# it cannot read, and every token costs CPU time. Real models get AGENTIC_SYSTEM_PROMPT.
TOY_SYSTEM_PROMPT = "Use the tools. Reply Task Completed when done."
ACCEPTED = {"set": "Updated", "removed": "Cancelled", "added": "Added"}   # staged or written, the same answer
ABORTED = "Error: this shop has no '{}'; the session is aborted and its changes are rolled back"

# ----------------------------------------------------------------------------------------------------------------
# The world's vocabulary
# ----------------------------------------------------------------------------------------------------------------
# Four shops, one for each pair of conventions (verify before changes?, staged until commit?).
CONVENTIONS = ((True, True), (True, False), (False, True), (False, False))
SHOP_NAMES = ("alder", "cedar", "delta", "flint")
SHOPS = dict(zip(SHOP_NAMES, CONVENTIONS))   # alder (T, T), cedar (T, F), delta (F, T), flint (F, F)

# The difficulty dial (train.py --conventions K, scripts/experiments.py dial): K hidden conventions per shop and 2^K
# shops, one for each combination. K = 2 is the world above, shop for shop. Each convention is a step to take or to
# skip, and its tool aborts the session in a shop without it. Two more of the same kind for K = 3 and 4:
#   ticket: changes count only after `open_ticket()`; before it a change answers as usual and is dropped;
#   notify: a session ends void (rolled back) unless `notify_customer` follows the customer's last change.
# Neither answers differently when forgotten, so neither can be read off observations; commit cannot either.
# Verification can: its refusal names it ("verify the customer first"). So K = 1 keeps commit, not verify.
WORLD_CONVENTIONS = {1: ("commit",), 2: ("verify", "commit"), 3: ("verify", "commit", "ticket"),
                     4: ("verify", "commit", "ticket", "notify")}
CHANGE_TOOLS = ("update_customer", "update_order", "add_order", "cancel_order")   # the calls that change records
CONVENTION_TOOLS = {"verify": "verify_customer", "commit": "commit", "ticket": "open_ticket",
                    "notify": "notify_customer"}
_DIAL_NAMES = {1: ("gorse", "hazel"),
               3: ("aspen", "briar", "cobalt", "dune", "ember", "fern", "grove", "heath"),
               4: ("ivy", "jade", "kelp", "larch", "maple", "nettle", "onyx", "pine", "quartz", "reed", "sage",
                   "thorn", "umber", "vale", "willow", "yarrow")}


def _dial_shops(k: int, names) -> dict:
    """{shop: {convention: required}}: shop i takes the i-th combination, all required first (as SHOPS)."""
    return {n: dict(zip(WORLD_CONVENTIONS[k], bits))
            for n, bits in zip(names, itertools.product((True, False), repeat=k))}


# The many-shops world (train.py --shops N, N > 4; scripts/experiments.py figure4 --shops N): the K = 2 world with N
# shops instead of 4, each shop's two conventions drawn by two fair coins of its own (seeded by its name, so a shop
# keeps its rules in every N; the N-shop world is the first N of MANY_SHOP_NAMES). With 4 shops, outcome RL learns
# the 4 rule pairs from any few hundred rollouts; with N shops it must learn each shop's pair from that shop's own
# rollouts, about 1/N of its budget, while a same-shop reference in the bank shows the pair from the first step.
# The base still applies each convention at chance, so its success rate does not depend on N.
def _many_shop_names(n: int = 64) -> tuple:
    """n pronounceable names (consonant-vowel-consonant-vowel), seeded, none shared with another world's."""
    cv = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    names = sorted({a + b for a in cv for b in cv} - set(SHOP_NAMES) - {x for v in _DIAL_NAMES.values() for x in v})
    return tuple(random.Random(0).sample(names, n))


MANY_SHOP_NAMES = _many_shop_names()


def _many_shops(names) -> dict:
    """{shop: {"verify": bool, "commit": bool}}: two fair coins per shop, seeded by its name."""
    coins = {n: random.Random(f"shop {n}") for n in names}
    return {n: {"verify": coins[n].random() < 0.5, "commit": coins[n].random() < 0.5} for n in names}


# RULES[shop] for the shops of every world (names are unique across worlds, so a task's shop names its world).
RULES = {n: r for k in WORLD_CONVENTIONS
         for n, r in _dial_shops(k, SHOP_NAMES if k == 2 else _DIAL_NAMES[k]).items()}
RULES.update(_many_shops(MANY_SHOP_NAMES))


def shops(conventions: int = 2, n_shops: int = 0) -> list[str]:
    """The shops of the world with `conventions` hidden conventions, sorted (K = 2: sorted(SHOPS)); with
    n_shops > 2^K the many-shops world's first n_shops (K = 2 only). n_shops 0 or 2^K: the dial's world."""
    if conventions not in WORLD_CONVENTIONS:
        raise ValueError(f"--conventions {conventions}: the tool world has 1 to 4 conventions per shop")
    if n_shops in (0, 2 ** conventions):
        return sorted(n for n, r in RULES.items() if len(r) == conventions and n not in MANY_SHOP_NAMES)
    if conventions != 2 or not 4 < n_shops <= len(MANY_SHOP_NAMES):
        raise ValueError(f"--shops {n_shops}: the many-shops world takes 5 to {len(MANY_SHOP_NAMES)} shops and "
                         f"--conventions 2 (0 or 4: the default world)")
    return sorted(MANY_SHOP_NAMES[:n_shops])


def world_of(shop: str) -> int:
    """How many conventions the world of `shop` has."""
    return len(RULES[shop])


ITEMS = tuple(f"K{i}" for i in range(10))        # item codes (SKUs)
TIERS = ("bronze", "silver", "gold")
STATUSES = ("open", "held", "shipped")

# Tool schemas in the JSON-schema form that `apply_chat_template(tools=...)` takes. The union over shops is listed,
# so the list itself does not reveal a shop's conventions.
def _tool(tool_name, desc, **params):
    props = {k: {"type": t, "description": d} for k, (t, d) in params.items()}
    return {"type": "function", "function": {"name": tool_name, "description": desc,
            "parameters": {"type": "object", "properties": props, "required": list(params)}}}

TOOLS = [
    _tool("find_customer", "Find a customer's id from the account code.", account=("string", "account code, e.g. A5")),
    _tool("get_customer", "Read a customer's record.", customer_id=("string", "customer id")),
    _tool("verify_customer", "Confirm a customer before changing them or their orders (only shops that require it; "
          "elsewhere the call aborts the session).",
          customer_id=("string", "customer id")),
    _tool("find_order", "Find a customer's order of an item.", customer_id=("string", "customer id"),
          item=("string", "item code, e.g. K7")),
    _tool("update_customer", "Set a customer's tier.", customer_id=("string", "customer id"),
          field=("string", "tier"), value=("string", "bronze, silver or gold")),
    _tool("update_order", "Set an order's status.", order_id=("string", "order id"),
          field=("string", "status"), value=("string", "open, held or shipped")),
    _tool("add_order", "Add an order.", customer_id=("string", "customer id"), item=("string", "item code"),
          qty=("integer", "quantity")),
    _tool("cancel_order", "Cancel (remove) an order.", order_id=("string", "order id")),
    _tool("commit", "Apply staged changes (only shops that stage changes; elsewhere the call aborts the session)."),
]
# The dial's two further conventions (K = 3, 4); TOOLS stays K = 2's list.
DIAL_TOOLS = [
    _tool("open_ticket", "Open a ticket before changes (only shops that require it; elsewhere the call aborts the "
          "session)."),
    _tool("notify_customer", "Notify a customer of their changes (only shops that require it; elsewhere the call "
          "aborts the session).", customer_id=("string", "customer id")),
]


def tools_for(conventions: int = 2) -> list:
    """The tool list of the world with `conventions` conventions: every shop's tools (K = 2: TOOLS)."""
    world = WORLD_CONVENTIONS[conventions]
    return [t for t in TOOLS + DIAL_TOOLS if t["function"]["name"] not in
            {tool for c, tool in CONVENTION_TOOLS.items() if c not in world}]

# ----------------------------------------------------------------------------------------------------------------
# Tasks
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Task:
    """One task: the goal text, the initial database, and the checklist of required final-state changes."""
    task_id: str
    shop: str
    schema: str
    text: str
    db: dict          # {"customers": {id: {...}}, "orders": {id: {...}}}
    goal: dict        # the schema's parameters: account, item, ...
    checklist: list   # required changes: ["set", table, id, field, value] / ["removed", "orders", id] /
                      # ["added", "orders", customer_id, item, qty]

    @property
    def variant(self) -> str:
        """The world variant whose conventions the task follows: its shop."""
        return self.shop


def _rid(rng: random.Random, prefix: str, used: set, digits: int) -> str:
    while True:
        rid = f"{prefix}{rng.randrange(10 ** digits):0{digits}d}"
        if rid not in used:
            used.add(rid)
            return rid


def _random_db(rng: random.Random):
    """Three customers (random id C#, account A#, tier), each with one to three orders (id O#, item K#)."""
    used: set = set()
    customers, orders = {}, {}
    for _ in range(3):
        cid = _rid(rng, "C", used, 1)
        customers[cid] = {"account": _rid(rng, "A", used, 1), "tier": rng.choice(TIERS)}
        for item in rng.sample(ITEMS, rng.randint(1, 3)):
            orders[_rid(rng, "O", used, 1)] = {"customer": cid, "item": item, "qty": rng.randint(1, 9),
                                            "status": rng.choice(STATUSES[:2])}
    return {"customers": customers, "orders": orders}


# Each schema: (goal text template, builder). A builder picks the target records from the database, adjusts their
# initial values so that the change is a real change, and returns (goal, checklist). Templates state WHAT must
# hold, never which tools to call. Values that a call must carry (account, item codes) appear in the text.
def _customer(rng, db):
    cid = rng.choice(sorted(db["customers"]))
    return cid, db["customers"][cid]["account"]


def _order(rng, db, cid, skip=()):
    oid = rng.choice(sorted(o for o, row in db["orders"].items() if row["customer"] == cid and o not in skip))
    return oid, db["orders"][oid]["item"]


def _s_tier(value):
    def build(rng, db):
        cid, acc = _customer(rng, db)
        db["customers"][cid]["tier"] = "silver"
        return {"account": acc}, [["set", "customers", cid, "tier", value]]
    return build


def _s_status(value, start):
    def build(rng, db):
        cid, acc = _customer(rng, db)
        oid, item = _order(rng, db, cid)
        db["orders"][oid]["status"] = start
        return {"account": acc, "item": item}, [["set", "orders", oid, "status", value]]
    return build


def _s_order(rng, db):
    cid, acc = _customer(rng, db)
    owned = {o["item"] for o in db["orders"].values() if o["customer"] == cid}
    item = rng.choice([i for i in ITEMS if i not in owned])
    return {"account": acc, "item2": item}, [["added", "orders", cid, item, 1]]


def _s_cancel(rng, db):
    cid, acc = _customer(rng, db)
    oid, item = _order(rng, db, cid)
    return {"account": acc, "item": item}, [["removed", "orders", oid]]


def _s_reorder(rng, db):
    goal, check = _s_cancel(rng, db)
    cid = db["orders"][check[0][2]]["customer"]
    return goal, [*check, ["added", "orders", cid, goal["item"], 1]]


def _s_bulk(rng, db):
    goal, _ = _s_order(rng, db)
    cid = next(c for c, row in db["customers"].items() if row["account"] == goal["account"])
    qty = rng.randint(2, 9)
    return {**goal, "qty": qty}, [["added", "orders", cid, goal["item2"], qty]]


def _s_vip(rng, db):
    goal, check = _s_status("shipped", "open")(rng, db)
    cid = db["orders"][check[0][2]]["customer"]
    db["customers"][cid]["tier"] = "silver"
    return goal, [["set", "customers", cid, "tier", "gold"], *check]


# Every task ends with the values a call must carry, then the shop: "<goal>: item K7, account A5. Shop: cedar."
# A tiny model reads a token most easily at a fixed distance from where it is needed; a pretrained one does not care.
# Every tier or status a call sets is written in the task as the very word the call carries ("to shipped"): a
# tiny model learns one "copy the value word" skill far sooner than a mapping from each verb to its value.
SCHEMAS = {
    "upgrade": ("Upgrade the customer to gold: account {account}.", _s_tier("gold")),
    "downgrade": ("Downgrade the customer to bronze: account {account}.", _s_tier("bronze")),
    "order": ("Place a new order: item {item2}, account {account}.", _s_order),
    "bulk": ("Buy in bulk, {qty} units in one new order: item {item2}, account {account}.", _s_bulk),
    "cancel": ("Cancel an order: item {item}, account {account}.", _s_cancel),
    "reorder": ("Replace an order with a fresh one (cancel, then order again): item {item}, account {account}.",
                _s_reorder),
    "ship": ("Set an order to shipped: item {item}, account {account}.", _s_status("shipped", "open")),
    "hold": ("Put an order on hold, status held: item {item}, account {account}.", _s_status("held", "open")),
    "reopen": ("Set an order back to open: item {item}, account {account}.", _s_status("open", "held")),
    "vip": ("Upgrade the customer to gold and set an order to shipped: item {item}, account {account}.", _s_vip),
}


def make_task(rng: random.Random, task_id: str, shop: str | None = None, schema: str | None = None,
              conventions: int = 2, n_shops: int = 0) -> Task:
    shop = shop or rng.choice(shops(conventions, n_shops))
    schema = schema or rng.choice(sorted(SCHEMAS))
    db = _random_db(rng)
    template, build = SCHEMAS[schema]
    goal, checklist = build(rng, db)
    text = template.format(**goal) + f" Shop: {shop}."
    return Task(task_id, shop, schema, text, db, goal, checklist)


def make_splits(seed: int = 0, n_train: int = 1000, n_test: int = 200, conventions: int = 2, n_shops: int = 0):
    """Seeded, disjoint train and test splits (disjoint by task text, the thing a model sees) of the world with
    `conventions` conventions per shop (and `n_shops` shops: see `shops`). The test split is drawn first, so that its schemas stay balanced: a schema
    with few distinct texts (upgrade: 4 shops × 10 accounts) runs out in the training split, not in the test split."""
    rng = random.Random(seed)
    seen, splits = set(), {"test": [], "train": []}
    for split, n in (("test", n_test), ("train", n_train)):
        while len(splits[split]) < n:
            task = make_task(rng, f"{split}-{len(splits[split]):05d}", conventions=conventions, n_shops=n_shops)
            if task.text not in seen:
                seen.add(task.text)
                splits[split].append(task)
    return splits["train"], splits["test"]


def save_tasks(tasks, path: str) -> None:
    with open(path, "w") as f:
        for t in tasks:
            f.write(json.dumps(asdict(t)) + "\n")


_TASK_FIELDS = {"task_id": str, "shop": str, "schema": str, "text": str, "db": dict, "goal": dict, "checklist": list}


def task_from_row(row, where: str) -> Task:
    """One tool-world task from a JSON object; a bad one raises ValueError naming `where` and the reason."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key, typ in _TASK_FIELDS.items():
        if key not in row:
            raise ValueError(f"{where}: missing field '{key}'")
        if not isinstance(row[key], typ):
            raise ValueError(f"{where}: field '{key}' must be {typ.__name__}")
    if row["shop"] not in RULES:
        raise ValueError(f"{where}: unknown shop '{row['shop']}' (known: {', '.join(SHOPS)}; the dial's: "
                         f"{', '.join(n for n in RULES if n not in SHOPS)})")
    return Task(**{k: row[k] for k in _TASK_FIELDS})


def load_tasks(path: str) -> list[Task]:
    """Read tasks from JSONL; a bad line raises ValueError naming `path:line` and the reason."""
    return read_jsonl(path, task_from_row)


@dataclass
class ToolWorld(Environment):
    """The toy shop world (`Environment`'s interface):

        messages = env.reset(task)      # [system, user] chat messages
        result = env.step(reply_text)   # execute the tool calls in one assistant reply
        r = env.reward()                # checklist reward of the current committed state, in [0, 1]

    It also names its prompts: the system prompt and the framing (before, after) around the teacher's latent block
    (inject.py). The toy backbone gets short ones, real models A.5's (`for_run`).
    """
    system_prompt: str = TOY_SYSTEM_PROMPT
    framing: tuple = inject.TOY_FRAMING
    results: str = "table3"            # beside the paper's EnvScaler values (Table 3), the world it stands in for
    # The retriever's query prompt (eq. 15). With MiniLM on the default run's bank (4 shops, 200 held-out tasks),
    # same-schema / same-shop recall@3 is 0.98 / 0.997. On a 20-shop oracle bank retrieval.DEFAULT_INSTRUCTION
    # gave 0.97 / 0.61 and this one 0.96 / 0.78.
    retrieval_instruction: str = "Task in the same shop"
    max_steps: int = 10
    task: Task | None = None
    db: dict = field(default_factory=dict)
    staged: list = field(default_factory=list)
    verified: set = field(default_factory=set)    # customers confirmed with verify_customer
    ticket: bool = False                          # open_ticket was called (the dial's K >= 3)
    unnotified: set = field(default_factory=set)  # customers changed since their last notice (the dial's K = 4)
    aborted: bool = False                         # a call to a tool the shop lacks ended the session
    steps: int = 0
    trace: list = field(default_factory=list)     # [(name, args, result)] for the observation-lite trace
    tools: list | None = field(default_factory=lambda: TOOLS)   # schemas for the chat template; None: not listed
    response_template: dict | None = None   # the tokenizer's reply parser, if it has one (engine.rollout sets it)

    def reset(self, task: Task) -> list[dict]:
        self.task, self.db, self.staged, self.verified = task, copy.deepcopy(task.db), [], set()
        self.steps, self.trace, self.aborted, self.ticket, self.unnotified = 0, [], False, False, set()
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": task.text}]

    def step(self, reply: str) -> StepResult:
        """Execute every tool call in one assistant reply. Never raises on any reply text."""
        self.steps += 1
        if self.aborted:   # nothing runs after an abort
            return StepResult(["Error: the session was aborted"], True, 0, 1, end="error")
        calls = parse_tool_calls(reply, self.response_template)
        if not calls:  # 'Task Completed', or any reply without a tool call, ends the episode
            return StepResult([], True, end=reply_end(reply))
        obs, errors = [], 0
        for name, args in calls:
            if self.lacks(name):   # over-applying a convention: the session is aborted and rolled back
                self.db, self.staged, self.aborted = copy.deepcopy(self.task.db), [], True
                result = ABORTED.format(name)
            else:
                result = args if name is None else self._call(name, args)  # args holds the parse error
            errors += result.startswith("Error")
            obs.append(result)
            self.trace.append((name or "invalid", args if name else {}, result))
            if self.aborted:
                break
        end = "error" if self.aborted else "step cap" if self.steps >= self.max_steps else ""
        return StepResult(obs, bool(end), len(calls), errors, end=end)

    def lacks(self, name) -> bool:
        """Is `name` a convention's tool (verify_customer, commit; the dial's open_ticket, notify_customer) of this
        task's world that its shop does not have?"""
        return any(name == CONVENTION_TOOLS[c] and not required for c, required in RULES[self.task.shop].items())

    # -- tools ---------------------------------------------------------------------------------------------------
    def _call(self, name: str, args: dict) -> str:
        world = tools_for(world_of(self.task.shop))
        spec = next((t["function"] for t in world if t["function"]["name"] == name), None)
        if spec is None:
            return f"Error: unknown tool '{name}'"
        params = spec["parameters"]["properties"]
        for key, p in params.items():
            want = int if p["type"] == "integer" else str
            if key not in args:
                return f"Error: missing argument '{key}'"
            if not isinstance(args[key], want) or isinstance(args[key], bool):
                return f"Error: argument '{key}' must be {p['type']}"
        if set(args) - set(params):
            return f"Error: unexpected argument '{sorted(set(args) - set(params))[0]}'"
        return getattr(self, "_t_" + name)(**args)

    def _t_find_customer(self, account):
        ids = [cid for cid, c in self.db["customers"].items() if c["account"] == account]
        return ids[0] if ids else f"Error: no account {account}"

    def _t_get_customer(self, customer_id):
        c = self.db["customers"].get(customer_id)
        return f"{c['account']} {c['tier']}" if c else f"Error: no customer {customer_id}"

    def _t_verify_customer(self, customer_id):
        if customer_id not in self.db["customers"]:
            return f"Error: no customer {customer_id}"
        self.verified.add(customer_id)
        return "Verified"

    def _t_open_ticket(self):
        self.ticket = True
        return "Ticket open"

    def _t_notify_customer(self, customer_id):
        if customer_id not in self.db["customers"]:
            return f"Error: no customer {customer_id}"
        self.unnotified.discard(customer_id)
        return "Notified"

    def _t_find_order(self, customer_id, item):
        if customer_id not in self.db["customers"]:
            return f"Error: no customer {customer_id}"
        ids = [oid for oid, o in sorted(self.db["orders"].items()) if o["customer"] == customer_id
               and o["item"] == item]
        return ids[0] if ids else f"Error: no {item} order"

    def _t_update_customer(self, customer_id, field, value):
        if customer_id not in self.db["customers"]:
            return f"Error: no customer {customer_id}"
        if field != "tier":
            return f"Error: unknown field '{field}'"
        if value not in TIERS:
            return "Error: invalid tier"
        return self._apply(("set", "customers", customer_id, "tier", value), customer_id)

    def _t_update_order(self, order_id, field, value):
        if order_id not in self.db["orders"]:
            return f"Error: no order {order_id}"
        if field != "status":
            return f"Error: unknown field '{field}'"
        if value not in STATUSES:
            return "Error: invalid status"
        return self._apply(("set", "orders", order_id, "status", value), self.db["orders"][order_id]["customer"])

    def _t_add_order(self, customer_id, item, qty):
        if customer_id not in self.db["customers"]:
            return f"Error: no customer {customer_id}"
        if item not in ITEMS or not 1 <= qty <= 99:
            return "Error: invalid item or qty"
        return self._apply(("added", "orders", customer_id, item, qty), customer_id)

    def _t_cancel_order(self, order_id):
        if order_id not in self.db["orders"]:
            return f"Error: no order {order_id}"
        return self._apply(("removed", "orders", order_id), self.db["orders"][order_id]["customer"])

    def _t_commit(self):
        for change in self.staged:
            self._write(change)
        n, self.staged = len(self.staged), []
        return f"Committed {n} change(s)"

    def _apply(self, change, customer_id: str) -> str:
        """A change to `customer_id` or one of their orders: refused in a verify shop until the customer is
        verified, staged in a commit shop, written at once elsewhere. An accepted change answers the same either
        way ("Updated", "Cancelled", "Added"), so that whether to commit cannot be read off the observations (a
        reactive "commit after 'Staged'" policy would need no experience). One word for every change ("OK") sank
        the base to 0.12: a tiny model tracks its place in a procedure by these words."""
        rules, answer = RULES[self.task.shop], ACCEPTED[change[0]]
        if rules.get("verify") and customer_id not in self.verified:
            return "Error: verify the customer first"
        if rules.get("ticket") and not self.ticket:     # dropped, with the answer of an accepted change ...
            change = ("dropped", change)                   # ... and staged as one, so commit's count is the same
            if not rules.get("commit"):
                return answer
        if rules.get("notify"):
            self.unnotified.add(customer_id)
        if rules.get("commit"):
            self.staged.append(change)
            return answer
        return self._write(change)

    def _write(self, change) -> str:
        """Write one change to the database: its ACCEPTED answer, or an error."""
        kind, table = change[0], change[1]
        if kind == "dropped":                              # the dial's ticket shops: staged without a ticket
            return ACCEPTED[change[1][0]]
        if kind == "set":
            row = self.db[table].get(change[2])
            if row is None:  # removed after staging
                return "Error: record is gone"
            row[change[3]] = change[4]
        elif kind == "removed":
            self.db[table].pop(change[2], None)
        else:
            used = set(self.db["orders"]) | set(self.task.db["orders"])  # never reuse an id, even a cancelled one
            oid = next((f"O{n}" for n in range(10) if f"O{n}" not in used), None)
            if oid is None:
                return "Error: no free order id"
            self.db["orders"][oid] = {"customer": change[2], "item": change[3], "qty": change[4], "status": "open"}
        return ACCEPTED[kind]

    # -- reward --------------------------------------------------------------------------------------------------
    def reward(self) -> float:
        # the dial's notify shops void a session that leaves a changed customer un-notified
        return checklist_reward(self.task, self.task.db if self.unnotified else self.db)

    def trace_text(self) -> str:
        """The experience the bank keeps: the observation-lite trace (A.3)."""
        return lite_trace(self.trace)

    # -- optional: ground truth for the OPSD baseline (a real environment may not offer it) ------------------------
    def oracle_trace(self, task: Task) -> str:
        """The observation-lite trace of the intended procedure on `task` (baselines.opsd_pool's fallback: B.1 has
        stronger models write the pool's missing trajectories; the toy world knows them)."""
        self.reset(task)
        for name, args in oracle_calls(task):
            self.step(format_call(name, args))
        return lite_trace(self.trace)

    # -- the run -------------------------------------------------------------------------------------------------
    toy_world = "tools"

    @classmethod
    def for_run(cls, args, toy: bool) -> "ToolWorld":
        """The toy backbone learned its tools from demonstrations: its prompt is short and lists none. A real model
        reads A.5's system prompt and framing, and the tools of the run's world as JSON schemas."""
        if toy:
            return cls(system_prompt=TOY_SYSTEM_PROMPT, framing=inject.TOY_FRAMING, max_steps=args.max_env_steps,
                       tools=None)
        return cls(system_prompt=AGENTIC_SYSTEM_PROMPT, framing=inject.AGENTIC_FRAMING,
                   max_steps=args.max_env_steps, tools=tools_for(args.conventions))

    @classmethod
    def make_splits(cls, args) -> tuple[list, list]:
        return make_splits(args.seed, args.n_train, args.n_test, conventions=args.conventions, n_shops=args.shops)

    @classmethod
    def load_tasks(cls, path: str) -> list:
        return load_tasks(path)

    @classmethod
    def save_tasks(cls, tasks, path: str) -> None:
        save_tasks(tasks, path)

    @classmethod
    def check_args(cls, args) -> str | None:
        if (args.conventions != 2 or args.shops) and args.tasks:
            return "--conventions and --shops set the generated tool world: each takes no --tasks"
        try:
            shops(args.conventions, args.shops)
        except ValueError as e:
            return str(e)
        return None


def checklist_reward(task: Task, db: dict) -> float:
    """EnvScaler-style checklist on the final state: (#required changes present − #collateral changes) / #required,
    clipped to [0, 1]. A collateral change is any difference from the initial state not asked for by the task."""
    init, hit = task.db, 0
    expected = {"customers": copy.deepcopy(init["customers"]), "orders": copy.deepcopy(init["orders"])}
    added_want = []
    for item in task.checklist:
        if item[0] == "set":
            _, table, rid, key, value = item
            hit += db[table].get(rid, {}).get(key) == value
            expected[table][rid][key] = value
        elif item[0] == "removed":
            hit += item[2] not in db[item[1]]
            expected[item[1]].pop(item[2])
        else:
            added_want.append((item[2], item[3], item[4]))
    new = [(o["customer"], o["item"], o["qty"]) for oid, o in db["orders"].items() if oid not in init["orders"]]
    for want in added_want:
        if want in new:
            hit += 1
            new.remove(want)
    collateral = len(new)  # orders added that nobody asked for
    for table in ("customers", "orders"):
        for rid, row in expected[table].items():
            now = db[table].get(rid)
            collateral += now is None or any(now[k] != v for k, v in row.items())
    return max(0.0, min(1.0, (hit - collateral) / len(task.checklist)))


# ----------------------------------------------------------------------------------------------------------------
# Oracle procedures and the observation-lite trace (A.3)
# ----------------------------------------------------------------------------------------------------------------
def oracle_calls(task: Task) -> list[tuple[str, dict]]:
    """The intended procedure as a list of tool calls (ids read from the initial database)."""
    db, g, s = task.db, task.goal, task.schema
    rules = RULES[task.shop]
    cid = next(c for c, row in db["customers"].items() if row["account"] == g["account"])
    oid = lambda item: next(o for o, r in sorted(db["orders"].items())                       # noqa: E731
                            if r["customer"] == cid and r["item"] == item)
    find = lambda item: ("find_order", {"customer_id": cid, "item": item})                     # noqa: E731
    status = lambda item, v: ("update_order", {"order_id": oid(item), "field": "status", "value": v})  # noqa: E731
    tier = lambda v: ("update_customer", {"customer_id": cid, "field": "tier", "value": v})   # noqa: E731
    add = ("add_order", {"customer_id": cid, "item": g.get("item2"), "qty": 1})
    calls = [("find_customer", {"account": g["account"]})]
    if rules.get("verify"):
        calls.append(("verify_customer", {"customer_id": cid}))
    if rules.get("ticket"):
        calls.append(("open_ticket", {}))
    calls += {
        "upgrade": lambda: [tier("gold")],
        "downgrade": lambda: [tier("bronze")],
        "order": lambda: [add],
        "bulk": lambda: [("add_order", {"customer_id": cid, "item": g["item2"], "qty": g["qty"]})],
        "cancel": lambda: [find(g["item"]), ("cancel_order", {"order_id": oid(g["item"])})],
        "reorder": lambda: [find(g["item"]), ("cancel_order", {"order_id": oid(g["item"])}),
                            ("add_order", {"customer_id": cid, "item": g["item"], "qty": 1})],
        "ship": lambda: [find(g["item"]), status(g["item"], "shipped")],
        "hold": lambda: [find(g["item"]), status(g["item"], "held")],
        "reopen": lambda: [find(g["item"]), status(g["item"], "open")],
        "vip": lambda: [tier("gold"), find(g["item"]), status(g["item"], "shipped")],
    }[s]()
    if rules.get("commit"):
        calls.append(("commit", {}))
    if rules.get("notify"):
        calls.append(("notify_customer", {"customer_id": cid}))
    return calls


def oracle_replies(task: Task) -> list[str]:
    """The intended procedure as the replies of a scripted episode (engine.scripted_episode), "Task Completed" last."""
    return scripted_replies(oracle_calls(task))


def conventions_kept(task: Task, trace: str) -> dict:
    """{convention: 1 if the episode took its step exactly when the task's shop requires it, else 0}, for each
    convention of the task's world, read from the episode's observation-lite trace (`lite_trace`). Verification
    counts as taken only up front, before the first change: a retry after the refusal is the readable way round."""
    names = re.findall(r"^\d+\. (\w+)\(", trace, flags=re.M)                      # the calls, in order
    first_change = next((i for i, n in enumerate(names) if n in CHANGE_TOOLS), len(names))
    took = {c: tool in names for c, tool in CONVENTION_TOOLS.items()}
    took["verify"] = "verify_customer" in names[:first_change]
    return {c: int(took[c] == required) for c, required in RULES[task.shop].items()}


def _demo():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0, help="task seed")
    p.add_argument("--schema", default=None, choices=sorted(SCHEMAS), help="task family (default: random)")
    args = p.parse_args()
    task = make_task(random.Random(args.seed), "demo", schema=args.schema)
    env = ToolWorld()
    print(env.reset(task))
    for name, a in oracle_calls(task):
        print(format_call(name, a), "->", env.step(format_call(name, a)).observations)
    env.step(DONE_TEXT)
    print("reward", env.reward())
    print(lite_trace(env.trace))


if __name__ == "__main__":
    _demo()
