"""The code world (paper §4.1 "coding", A.5, B.3): single-turn problems behind the interface every world shares
(common.py: `Environment`), and the toy code world the default code run trains on.

An episode is one reply: the A.5 coding system prompt (none for EvalPlus, B.3), the problem, then the last fenced
program of the reply, verified in the sandbox (code_benchmarks.py: each benchmark's own rules; worlds/sandbox.py: a
process the kernel confines). Reward 1 if every test passes, else 0: the mean reward is pass@1 (Table 2). The verdict is
the harness's, never the program's exit code or a result's own __eq__ (tests/test_verdicts.py).

    python train.py --env code                         # the toy code world, its shipped toy backbone, CPU
    python train.py --env code --tasks DIR --model M   # TACO, LiveCodeBench or EvalPlus as released
    python -m pytest tests/test_code.py -q

Deviation from the paper: the toy code world stands in for TACO at toy scale (docs/toy-world.md gives what its
toy backbone passes alone and with a same-judge solved program in its prompt).
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

import inject
from worlds.code_benchmarks import NO_SYSTEM_PROMPT, CodeProblem, load_problems, save_problems, verify_detail
from worlds.common import Environment, StepResult
from worlds.sandbox import SandboxLimits
from worlds.tool_world import CONVENTIONS, SHOP_NAMES

TOY_CODE_SYSTEM_PROMPT = "Write the Python program only."


# A.5, word for word (TACO and LiveCodeBench; EvalPlus uses no system prompt).
CODING_SYSTEM_PROMPT = (
    "You are an expert Python programmer. You will be given a question (problem specification) and will generate "
    "a correct Python program that matches the specification and passes all tests.")


FENCE_OPEN_RE = re.compile(r"```(?:python|py)?\s*\n")


def extract_code(reply: str) -> str:
    """The program in a reply: the last fenced block, else the whole reply (thinking stripped). What the regexes
    <think>.*?</think> and ```(?:python|py)?\\s*\\n(.*?)``` find, in time linear in the reply (`without_thinking`,
    `fenced_blocks`): a reply of many unclosed fences or tags costs one pass, not one per fence."""
    blocks = fenced_blocks(without_thinking(reply))
    return blocks[-1] if blocks else without_thinking(reply)


def without_thinking(reply: str) -> str:
    """The reply with each <think>...</think> block removed (an unclosed one is kept)."""
    out, i = [], 0
    while (start := reply.find("<think>", i)) >= 0 and (end := reply.find("</think>", start + 7)) >= 0:
        out.append(reply[i:start])
        i = end + len("</think>")
    return "".join(out) + reply[i:]


def fenced_blocks(text: str) -> list[str]:
    """The body of each fenced code block (an opening fence, optionally python or py, then a newline; the body up to
    the next fence), left to right."""
    blocks, i = [], 0
    while (m := FENCE_OPEN_RE.search(text, i)) and (end := text.find("```", m.end())) >= 0:
        blocks.append(text[m.end():end])
        i = end + 3
    return blocks


@dataclass
class CodeWorld(Environment):
    """The code environment (`common.Environment`), single-turn: reset -> [system, user]; step(reply) extracts the
    program, verifies it in the sandbox and ends the episode; reward is 1 if all tests passed.
    Its trace (for the experience bank) is the program that passed."""
    system_prompt: str = CODING_SYSTEM_PROMPT
    framing: tuple = inject.CODING_FRAMING
    retrieval_instruction: str = "Given a programming problem, retrieve a solved problem that needs a similar program"
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    max_steps: int = 1
    parallel_steps = True          # engine.rollout verifies a batch's programs in threads (one process each)
    untrusted_code = True          # the model's programs, and a benchmark's reference solutions
    task: CodeProblem | None = None
    steps: int = 0
    passed: bool = False
    trace: list = field(default_factory=list)
    parts: dict = field(default_factory=dict)    # EvalPlus: {"base": bool, "plus": bool} of the last step
    log: dict | None = None                      # if given: task_id -> {passed, detail, base, plus} (eval.py)
    tools = None

    def reset(self, task: CodeProblem) -> list[dict]:
        self.task, self.steps, self.passed, self.trace, self.parts = task, 0, False, [], {}
        system = [] if task.benchmark in NO_SYSTEM_PROMPT else [{"role": "system", "content": self.system_prompt}]
        return system + [{"role": "user", "content": task.text}]   # B.3: EvalPlus has no system prompt

    def step(self, reply: str) -> StepResult:
        self.steps += 1
        code = extract_code(reply)
        self.passed, detail, self.parts = verify_detail(self.task, code, self.limits)
        self.trace = [("program", {"code": code}, detail)]
        if self.log is not None:
            self.log[self.task.task_id] = {"passed": self.passed, "detail": detail, **self.parts,
                                           "reason": "" if self.passed else detail[:300]}
        return StepResult([], True, 0, int(not self.passed), end="done")     # one program: the task's end

    def reward(self) -> float:
        return float(self.passed)

    def trace_text(self) -> str:
        """The experience the bank keeps: the program (A.3's code analogue of the observation-lite trace)."""
        return self.trace[0][1]["code"] if self.trace else ""

    # -- the run -------------------------------------------------------------------------------------------------
    toy_world = "code"
    results = "pass@1"      # one program per problem: the mean reward is pass@1 (Table 2), steps and calls say nothing
    # The toy code world's student learns a mapping its base never used: the judge named in the problem decides the
    # output conventions, which the base's demonstrations wrote at chance (worlds/toy_backbone.py). At lr 1e-4 the
    # student sat on that plateau for all 60 steps (seed 0: distillation loss flat at 0.29, student 0.26 against its
    # teacher's 0.75); at 3e-4 it left it after about 40 steps (student 0.525, teacher 0.74, 200 held-out problems).
    toy_defaults = {"lr": 3e-4}
    paper_defaults = {"max_new_tokens": 16384}   # B.3: a program after up to 16k tokens of thinking

    @classmethod
    def for_run(cls, args, toy: bool) -> "CodeWorld":
        """The toy backbone reads a short system prompt and framing; real models A.5's coding prompt and framing."""
        if toy:
            return cls(system_prompt=TOY_CODE_SYSTEM_PROMPT, framing=inject.TOY_FRAMING)
        return cls(framing=inject.CODING_FRAMING)

    @classmethod
    def make_splits(cls, args) -> tuple[list, list]:
        return make_code_splits(args.seed, args.n_train, args.n_test)

    @classmethod
    def load_tasks(cls, path: str) -> list:
        return load_problems(path)

    @classmethod
    def save_tasks(cls, tasks, path: str) -> None:
        save_problems(tasks, path)


# -- the toy code world: families of one-line programs, judges with unstated output conventions -------------------
# It mirrors the tool world. A problem states WHAT to compute from one input line ("Print the line reversed.
# Judge: cedar."); each judge ("variant") has its own pair of output conventions that the statement never states:
# whether the answer is prefixed with "Answer: ", and whether a last line "END" follows. The tests compare outputs
# exactly, so a convention applied where the judge does not want it fails as surely as a missing one. A solved
# problem of the same judge shows both conventions; one from another judge misleads.
# Its toy backbone: python -m worlds.toy_backbone --world code.
CODE_FAMILIES = {   # family: (statement, the expression of the answer from the line s, the same as a function)
    "reverse": ("Print the line reversed.", "s[::-1]", lambda s, c: s[::-1]),
    "upper": ("Print the line in capitals.", "s.upper()", lambda s, c: s.upper()),
    "lower": ("Print the line in small letters.", "s.lower()", lambda s, c: s.lower()),
    "words": ("Print how many words the line has.", "len(s.split())", lambda s, c: len(s.split())),
    "first": ("Print the first word of the line.", "s.split()[0]", lambda s, c: s.split()[0]),
    "last": ("Print the last word of the line.", "s.split()[-1]", lambda s, c: s.split()[-1]),
    "sum": ("The line holds integers: print their sum.", "sum(map(int, s.split()))",
            lambda s, c: sum(map(int, s.split()))),
    "max": ("The line holds integers: print the largest.", "max(map(int, s.split()))",
            lambda s, c: max(map(int, s.split()))),
    "sort": ("The line holds integers: print them sorted, space separated.",
             "' '.join(sorted(s.split(), key=int))", lambda s, c: " ".join(sorted(s.split(), key=int))),
    "count": ("Print how many times the letter {char} occurs in the line.", "s.count({char!r})",
              lambda s, c: s.count(c)),
}
JUDGES = dict(zip(SHOP_NAMES, CONVENTIONS))      # judge: (answer prefixed with "Answer: ", a last line "END")


def _code_input(rng: random.Random, family: str) -> str:
    if family in ("sum", "max", "sort"):
        return " ".join(str(rng.randrange(-9, 10)) for _ in range(rng.randrange(2, 6)))
    letters = "abcdeKLMN"
    word = lambda: "".join(rng.choice(letters) for _ in range(rng.randrange(1, 5)))   # noqa: E731
    return " ".join(word() for _ in range(rng.randrange(1, 4)))


def code_oracle(problem: CodeProblem) -> str:
    """The program that passes: the family's expression, with the judge's conventions."""
    prefix, end = JUDGES[problem.variant]
    char = re.search(r"letter (\w)", problem.text)                 # the "count" family names its letter
    expr = CODE_FAMILIES[problem.schema][1].format(char=char.group(1) if char else "")
    lines = ["s = input()", f"print('Answer:', {expr})" if prefix else f"print({expr})"]
    return "\n".join(lines + (["print('END')"] if end else [])) + "\n"


def code_conventions(problem: CodeProblem, reply: str) -> dict:
    """Which of its judge's output conventions a reply to a toy code problem writes, and whether each is right for
    that judge (eval.py --conventions: did a student learn WHEN to write them, or only how often?)."""
    want_prefix, want_end = JUDGES[problem.variant]
    prefix, end = "Answer" in reply, "END" in reply
    return {"prefix": prefix, "end": end, "prefix_right": prefix == want_prefix, "end_right": end == want_end}


def make_code_problem(rng: random.Random, task_id: str, judge: str | None = None, family: str | None = None,
                      n_tests: int = 3) -> CodeProblem:
    """One toy code problem; its tests are the oracle's outputs on random lines (computed here, not run)."""
    judge, family = judge or rng.choice(SHOP_NAMES), family or rng.choice(sorted(CODE_FAMILIES))
    char = rng.choice("abcde")
    text = CODE_FAMILIES[family][0].format(char=char) + f" Judge: {judge}."
    prefix, end = JUDGES[judge]
    tests = []
    for _ in range(n_tests):
        s = _code_input(rng, family)
        value = CODE_FAMILIES[family][2](s, char)              # what the oracle's program prints (tested equal)
        out = ("Answer: " if prefix else "") + str(value) + ("\nEND" if end else "")
        tests.append({"input": s + "\n", "output": out + "\n"})
    return CodeProblem(task_id, text, tests, schema=family, variant=judge)


def make_code_splits(seed: int = 0, n_train: int = 400, n_test: int = 100):
    """Seeded train and test splits of toy code problems, disjoint by statement AND tests."""
    rng = random.Random(seed)
    seen, splits = set(), {"test": [], "train": []}
    for split, n in (("test", n_test), ("train", n_train)):
        while len(splits[split]) < n:
            p = make_code_problem(rng, f"code-{split}-{len(splits[split]):05d}")
            key = p.text + json.dumps(p.tests)
            if key not in seen:
                seen.add(key)
                splits[split].append(p)
    return splits["train"], splits["test"]
