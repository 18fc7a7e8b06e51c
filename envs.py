"""Environments and verifiers: the toy tool-use world (paper §4.1, A.3, A.5, B.2).

The paper trains on EnvScaler: multi-turn tasks where an agent changes a stateful database through tools and
is scored by a checklist read from the final state. This file is a small world in that spirit, small enough for
a ~1 M-parameter model on two CPU cores, and the interface (reset / step / reward) that a real environment
implements. The toy world is also a real (easy) environment for a real Qwen3: the tools come as JSON schemas.

    python envs.py                # print a sample task, its oracle episode and its observation-lite trace

The world
---------
- A shop database: customers (id, name, tier, city) and orders (id, customer, item, qty, status), with random
  ids such as C417 / O082.
- Six shops ("variants", DESIGN.md §5). Each shop has two conventions that the task text never states:
    * which lookup tool finds a customer (`find_customer`, `lookup_customer` or `search_customer`; the other two
      answer "unknown tool");
    * whether modifications are staged until `commit()` (commit shops) or applied at once.
  A successful trajectory of another task in the SAME shop shows both conventions; one from another shop misleads.
- Ten schemas (multi-step procedures: look up an id, list orders, update, cancel, add ...). The task text states
  the goal ("[cedar] Cancel Ana's pear order."), not the procedure. Tasks of one schema are "similar tasks".
- Reward in [0, 1] (EnvScaler-style checklist): the fraction of required final-state changes present in the
  committed state, minus one item for each collateral change to a record the task did not ask to change.
- Actions use the Qwen3 format `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; several calls in one
  reply are all executed (and counted: Table 3's "tool calls per step"). A malformed, unknown or wrongly-typed
  call gets an error observation; `step` never raises. A reply without a tool call ends the episode (the agent
  believes it is done; A.5 asks for exactly `Task Completed`), as does the step cap.

Deviations from the paper
-------------------------
1. EnvScaler's 2,349 tasks are replaced by this generated world (see DESIGN.md §5 and §7 for why the variants).
2. The step cap is 8 for the toy world (paper: 30 environment steps); oracle procedures take 3 to 6 steps.
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import re
from dataclasses import asdict, dataclass, field

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
# The toy backbone sees a short system prompt: a 1 M-parameter model gains nothing from 120 tokens of instructions
# it cannot read, and every token costs CPU time. Real models get AGENTIC_SYSTEM_PROMPT.
TOY_SYSTEM_PROMPT = "Use the shop tools one call per step. Reply Task Completed when done."
DONE_TEXT = "Task Completed"

# ----------------------------------------------------------------------------------------------------------------
# The world's vocabulary
# ----------------------------------------------------------------------------------------------------------------
SHOPS = {  # shop -> (lookup tool, staged-until-commit?) ; every combination occurs once
    "alder": ("find_customer", True),
    "birch": ("lookup_customer", False),
    "cedar": ("search_customer", True),
    "delta": ("find_customer", False),
    "ember": ("lookup_customer", True),
    "flint": ("search_customer", False),
}
LOOKUP_TOOLS = ("find_customer", "lookup_customer", "search_customer")
NAMES = ("Ana", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Max", "Noor",
         "Otto", "Pia", "Raj", "Sol", "Tess", "Uma")
ITEMS = ("apple", "pear", "plum", "lamp", "desk", "chair", "mug", "book", "pen", "bag")
TIERS = ("bronze", "silver", "gold")
CITIES = ("Oslo", "Lima", "Rome", "Kyiv", "Pune", "Doha")
STATUSES = ("open", "held", "shipped")

# Tool schemas in the JSON-schema form that `apply_chat_template(tools=...)` takes. The union over shops is listed,
# so the list itself does not reveal a shop's conventions.
def _tool(tool_name, desc, **params):
    props = {k: {"type": t, "description": d} for k, (t, d) in params.items()}
    return {"type": "function", "function": {"name": tool_name, "description": desc,
            "parameters": {"type": "object", "properties": props, "required": list(params)}}}

TOOLS = [
    *[_tool(t, "Find a customer's id by name (only one of the three lookup tools works in a given shop).",
            name=("string", "customer name")) for t in LOOKUP_TOOLS],
    _tool("get_customer", "Read a customer's record.", customer_id=("string", "customer id")),
    _tool("list_orders", "List a customer's orders.", customer_id=("string", "customer id")),
    _tool("update_customer", "Set a customer field (tier or city).", customer_id=("string", "customer id"),
          field=("string", "tier or city"), value=("string", "new value")),
    _tool("update_order", "Set an order field (qty: integer, status: open/held/shipped).",
          order_id=("string", "order id"), field=("string", "qty or status"), value=("string", "new value")),
    _tool("add_order", "Add an order.", customer_id=("string", "customer id"), item=("string", "item"),
          qty=("integer", "quantity")),
    _tool("cancel_order", "Cancel (remove) an order.", order_id=("string", "order id")),
    _tool("commit", "Apply staged changes (shops that stage changes)."),
]

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
    goal: dict        # the schema's parameters: name, item, value, ...
    checklist: list   # required changes: ["set", table, id, field, value] / ["removed", "orders", id] /
                      # ["added", "orders", customer_id, item, qty]


def _rid(rng: random.Random, prefix: str, used: set) -> str:
    while True:
        rid = f"{prefix}{rng.randrange(1000):03d}"
        if rid not in used:
            used.add(rid)
            return rid


def _random_db(rng: random.Random):
    used: set = set()
    customers, orders = {}, {}
    for name in rng.sample(NAMES, 4):
        cid = _rid(rng, "C", used)
        customers[cid] = {"name": name, "tier": rng.choice(TIERS), "city": rng.choice(CITIES)}
        for item in rng.sample(ITEMS, rng.randint(1, 3)):
            orders[_rid(rng, "O", used)] = {"customer": cid, "item": item, "qty": rng.randint(1, 9),
                                            "status": rng.choice(("open", "held"))}
    return {"customers": customers, "orders": orders}


def _other(rng, choices, current):
    return rng.choice([c for c in choices if c != current])


# Each schema: (goal text template, builder). A builder picks the target records and values from the database and
# returns (goal, checklist). Templates state WHAT must hold, never which tools to call.
def _pick_order(rng, db):
    oid = rng.choice(sorted(db["orders"]))
    order = db["orders"][oid]
    return oid, order, db["customers"][order["customer"]]["name"]


def _s_tier(rng, db):
    cid = rng.choice(sorted(db["customers"]))
    c = db["customers"][cid]
    v = _other(rng, TIERS, c["tier"])
    return {"name": c["name"], "value": v}, [["set", "customers", cid, "tier", v]]


def _s_city(rng, db):
    cid = rng.choice(sorted(db["customers"]))
    c = db["customers"][cid]
    v = _other(rng, CITIES, c["city"])
    return {"name": c["name"], "value": v}, [["set", "customers", cid, "city", v]]


def _s_order(rng, db):
    cid = rng.choice(sorted(db["customers"]))
    owned = {o["item"] for o in db["orders"].values() if o["customer"] == cid}
    item, qty = rng.choice([i for i in ITEMS if i not in owned]), rng.randint(1, 9)
    return ({"name": db["customers"][cid]["name"], "item": item, "qty": qty},
            [["added", "orders", cid, item, qty]])


def _s_cancel(rng, db):
    oid, o, name = _pick_order(rng, db)
    return {"name": name, "item": o["item"]}, [["removed", "orders", oid]]


def _s_qty(rng, db):
    oid, o, name = _pick_order(rng, db)
    v = _other(rng, range(1, 10), o["qty"])
    return {"name": name, "item": o["item"], "qty": v}, [["set", "orders", oid, "qty", v]]


def _s_status(status):
    def build(rng, db):
        oid, o, name = _pick_order(rng, db)
        o["status"] = "open"  # the target order starts open so that the change is a real change
        return {"name": name, "item": o["item"]}, [["set", "orders", oid, "status", status]]
    return build


def _s_swap(rng, db):
    oid, o, name = _pick_order(rng, db)
    owned = {x["item"] for x in db["orders"].values() if x["customer"] == o["customer"]}
    item2, qty = rng.choice([i for i in ITEMS if i not in owned]), rng.randint(1, 9)
    return ({"name": name, "item": o["item"], "item2": item2, "qty": qty},
            [["removed", "orders", oid], ["added", "orders", o["customer"], item2, qty]])


def _s_upgrade_order(rng, db):
    goal, check = _s_order(rng, db)
    cid = check[0][2]
    db["customers"][cid]["tier"] = "silver"
    return goal, [["set", "customers", cid, "tier", "gold"], *check]


def _s_ship_qty(rng, db):
    goal, check = _s_qty(rng, db)
    db["orders"][check[0][2]]["status"] = "open"
    return goal, [*check, ["set", "orders", check[0][2], "status", "shipped"]]


SCHEMAS = {
    "tier": ("Set {name}'s tier to {value}.", _s_tier),
    "city": ("{name} moved to {value}. Update the customer record.", _s_city),
    "order": ("Place an order of {qty} {item} for {name}.", _s_order),
    "cancel": ("Cancel {name}'s {item} order.", _s_cancel),
    "qty": ("Change the quantity of {name}'s {item} order to {qty}.", _s_qty),
    "ship": ("Mark {name}'s {item} order as shipped.", _s_status("shipped")),
    "hold": ("Put {name}'s {item} order on hold.", _s_status("held")),
    "swap": ("Replace {name}'s {item} order with {qty} {item2}.", _s_swap),
    "upgrade": ("Upgrade {name} to gold and place an order of {qty} {item}.", _s_upgrade_order),
    "rush": ("Set {name}'s {item} order to quantity {qty} and mark it shipped.", _s_ship_qty),
}


def make_task(rng: random.Random, task_id: str, shop: str | None = None, schema: str | None = None) -> Task:
    shop = shop or rng.choice(sorted(SHOPS))
    schema = schema or rng.choice(sorted(SCHEMAS))
    db = _random_db(rng)
    template, build = SCHEMAS[schema]
    goal, checklist = build(rng, db)
    text = f"[{shop} shop] " + template.format(**goal)
    return Task(task_id, shop, schema, text, db, goal, checklist)


def make_splits(seed: int = 0, n_train: int = 1000, n_test: int = 200):
    """Seeded, disjoint train and test splits (disjoint by task text, the thing a model sees)."""
    rng = random.Random(seed)
    seen, train, test = set(), [], []
    while len(train) < n_train or len(test) < n_test:
        split = "train" if len(train) < n_train else "test"
        task = make_task(rng, f"{split}-{len(train) if split == 'train' else len(test):05d}")
        if task.text in seen:
            continue
        seen.add(task.text)
        (train if split == "train" else test).append(task)
    return train, test


def save_tasks(tasks, path: str) -> None:
    with open(path, "w") as f:
        for t in tasks:
            f.write(json.dumps(asdict(t)) + "\n")


_TASK_FIELDS = {"task_id": str, "shop": str, "schema": str, "text": str, "db": dict, "goal": dict, "checklist": list}


def load_tasks(path: str) -> list[Task]:
    """Read tasks from JSONL; a bad line raises ValueError naming `path:line` and the reason."""
    tasks = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            for key, typ in _TASK_FIELDS.items():
                if key not in row:
                    raise ValueError(f"{path}:{n}: missing field '{key}'")
                if not isinstance(row[key], typ):
                    raise ValueError(f"{path}:{n}: field '{key}' must be {typ.__name__}")
            if row["shop"] not in SHOPS:
                raise ValueError(f"{path}:{n}: unknown shop '{row['shop']}' (known: {', '.join(SHOPS)})")
            tasks.append(Task(**{k: row[k] for k in _TASK_FIELDS}))
    return tasks


# ----------------------------------------------------------------------------------------------------------------
# Tool calls: parse the Qwen3 format
# ----------------------------------------------------------------------------------------------------------------
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_tool_calls(text: str):
    """Return a list of (name, arguments) or (None, error message) for each <tool_call> block in `text`."""
    calls = []
    for body in TOOL_CALL_RE.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            calls.append((None, "Error: tool call is not valid JSON"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append((None, "Error: tool call needs a string 'name'"))
            continue
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            calls.append((None, "Error: 'arguments' must be an object"))
            continue
        calls.append((obj["name"], args))
    if "<tool_call>" in text and len(calls) < text.count("<tool_call>"):
        calls.append((None, "Error: unterminated <tool_call>"))
    return calls


def format_call(name: str, args: dict) -> str:
    """The assistant text of one tool call, exactly as the Qwen3 chat template renders `tool_calls`."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


# ----------------------------------------------------------------------------------------------------------------
# The environment: reset / step / reward
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class StepResult:
    observations: list            # one tool-result string per call (empty when the episode ended)
    done: bool
    n_calls: int = 0
    errors: int = 0


@dataclass
class ToolWorld:
    """The toy shop world. The interface a real environment implements:

        messages = env.reset(task)      # [system, user] chat messages
        result = env.step(reply_text)   # execute the tool calls in one assistant reply
        r = env.reward()                # checklist reward of the current committed state, in [0, 1]
    """
    system_prompt: str = TOY_SYSTEM_PROMPT
    max_steps: int = 8
    task: Task | None = None
    db: dict = field(default_factory=dict)
    staged: list = field(default_factory=list)
    steps: int = 0
    trace: list = field(default_factory=list)     # [(name, args, result)] for the observation-lite trace
    tools = TOOLS

    def reset(self, task: Task) -> list[dict]:
        self.task, self.db, self.staged = task, copy.deepcopy(task.db), []
        self.steps, self.trace = 0, []
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": task.text}]

    def step(self, reply: str) -> StepResult:
        """Execute every tool call in one assistant reply. Never raises on any reply text."""
        self.steps += 1
        calls = parse_tool_calls(reply)
        if not calls:  # 'Task Completed', or any reply without a tool call, ends the episode
            return StepResult([], True)
        obs, errors = [], 0
        for name, args in calls:
            result = args if name is None else self._call(name, args)  # args holds the parse error
            errors += result.startswith("Error")
            obs.append(result)
            self.trace.append((name or "invalid", args if name else {}, result))
        return StepResult(obs, self.steps >= self.max_steps, len(calls), errors)

    # -- tools ---------------------------------------------------------------------------------------------------
    def _call(self, name: str, args: dict) -> str:
        shop_lookup, staged = SHOPS[self.task.shop]
        spec = next((t["function"] for t in TOOLS if t["function"]["name"] == name), None)
        if spec is None or (name in LOOKUP_TOOLS and name != shop_lookup) or (name == "commit" and not staged):
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
        return getattr(self, "_t_" + ("lookup" if name in LOOKUP_TOOLS else name))(**args)

    def _t_lookup(self, name):
        ids = [cid for cid, c in self.db["customers"].items() if c["name"] == name]
        return ids[0] if ids else f"Error: no customer named {name}"

    def _t_get_customer(self, customer_id):
        c = self.db["customers"].get(customer_id)
        return f"{c['name']} {c['tier']} {c['city']}" if c else f"Error: no customer {customer_id}"

    def _t_list_orders(self, customer_id):
        if customer_id not in self.db["customers"]:
            return f"Error: no customer {customer_id}"
        rows = [f"{oid} {o['item']} x{o['qty']} {o['status']}" for oid, o in sorted(self.db["orders"].items())
                if o["customer"] == customer_id]
        return "; ".join(rows) or "no orders"

    def _t_update_customer(self, customer_id, field, value):
        if customer_id not in self.db["customers"]:
            return f"Error: no customer {customer_id}"
        allowed = {"tier": TIERS, "city": CITIES}.get(field)
        if allowed is None or value not in allowed:
            return f"Error: invalid {field} value" if allowed else f"Error: unknown field '{field}'"
        return self._apply(("set", "customers", customer_id, field, value))

    def _t_update_order(self, order_id, field, value):
        if order_id not in self.db["orders"]:
            return f"Error: no order {order_id}"
        if field == "qty":
            if not value.isdigit() or not 1 <= int(value) <= 99:
                return "Error: qty must be an integer from 1 to 99"
            return self._apply(("set", "orders", order_id, "qty", int(value)))
        if field == "status" and value in STATUSES:
            return self._apply(("set", "orders", order_id, "status", value))
        return f"Error: invalid {field} value" if field == "status" else f"Error: unknown field '{field}'"

    def _t_add_order(self, customer_id, item, qty):
        if customer_id not in self.db["customers"]:
            return f"Error: no customer {customer_id}"
        if item not in ITEMS or not 1 <= qty <= 99:
            return "Error: invalid item or qty"
        return self._apply(("added", "orders", customer_id, item, qty))

    def _t_cancel_order(self, order_id):
        if order_id not in self.db["orders"]:
            return f"Error: no order {order_id}"
        return self._apply(("removed", "orders", order_id))

    def _t_commit(self):
        for change in self.staged:
            self._write(change)
        n, self.staged = len(self.staged), []
        return f"Committed {n} change(s)"

    def _apply(self, change) -> str:
        if SHOPS[self.task.shop][1]:
            self.staged.append(change)
            return "Staged"
        return self._write(change)

    def _write(self, change) -> str:
        kind, table = change[0], change[1]
        if kind == "set":
            row = self.db[table].get(change[2])
            if row is None:  # removed after staging
                return "Error: record is gone"
            row[change[3]] = change[4]
            return "Updated"
        if kind == "removed":
            self.db[table].pop(change[2], None)
            return "Cancelled"
        used = set(self.db["orders"]) | set(self.db["customers"])
        oid = next(f"O{n:03d}" for n in range(1000) if f"O{n:03d}" not in used)
        self.db["orders"][oid] = {"customer": change[2], "item": change[3], "qty": change[4], "status": "open"}
        return f"Added {oid}"

    # -- reward --------------------------------------------------------------------------------------------------
    def reward(self) -> float:
        return checklist_reward(self.task, self.db)


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
def oracle_calls(task: Task, db: dict | None = None) -> list[tuple[str, dict]]:
    """The intended procedure as a list of tool calls (ids read from the initial database)."""
    db = db or task.db
    g, s = task.goal, task.schema
    lookup, staged = SHOPS[task.shop]
    cid = next(c for c, row in db["customers"].items() if row["name"] == g["name"])
    calls = [(lookup, {"name": g["name"]})]
    oid = next((o for o, row in sorted(db["orders"].items()) if row["customer"] == cid
                and row["item"] == g.get("item")), None)
    if s in ("cancel", "qty", "ship", "hold", "swap", "rush"):
        calls.append(("list_orders", {"customer_id": cid}))
    edit = lambda f, v: ("update_order", {"order_id": oid, "field": f, "value": str(v)})  # noqa: E731
    calls += {
        "tier": lambda: [("update_customer", {"customer_id": cid, "field": "tier", "value": g["value"]})],
        "city": lambda: [("update_customer", {"customer_id": cid, "field": "city", "value": g["value"]})],
        "order": lambda: [("add_order", {"customer_id": cid, "item": g["item"], "qty": g["qty"]})],
        "cancel": lambda: [("cancel_order", {"order_id": oid})],
        "qty": lambda: [edit("qty", g["qty"])],
        "ship": lambda: [edit("status", "shipped")],
        "hold": lambda: [edit("status", "held")],
        "swap": lambda: [("cancel_order", {"order_id": oid}),
                         ("add_order", {"customer_id": cid, "item": g["item2"], "qty": g["qty"]})],
        "upgrade": lambda: [("update_customer", {"customer_id": cid, "field": "tier", "value": "gold"}),
                            ("add_order", {"customer_id": cid, "item": g["item"], "qty": g["qty"]})],
        "rush": lambda: [edit("qty", g["qty"]), edit("status", "shipped")],
    }[s]()
    if staged:
        calls.append(("commit", {}))
    return calls


def lite_trace(trace: list) -> str:
    """Observation-lite action-result trace (A.3): `1. tool(k="v") -> result`, one line per call."""
    lines = []
    for n, (name, args, result) in enumerate(trace, 1):
        arg_text = ", ".join(f"{k}={json.dumps(v)}" for k, v in args.items())
        lines.append(f"{n}. {name}({arg_text}) -> {result}")
    return "\n".join(lines)


def _demo():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0, help="task seed")
    args = p.parse_args()
    task = make_task(random.Random(args.seed), "demo")
    env = ToolWorld()
    print(env.reset(task))
    for name, a in oracle_calls(task):
        print(format_call(name, a), "->", env.step(format_call(name, a)).observations)
    env.step(DONE_TEXT)
    print("reward", env.reward())
    print(lite_trace(env.trace))


if __name__ == "__main__":
    _demo()
