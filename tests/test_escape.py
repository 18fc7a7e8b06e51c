"""The escape suite: every way out of the sandbox (worlds/sandbox.py) we know of, tried for real against every world that
runs untrusted code, through the world's own episode path.

    python -m pytest tests/test_escape.py -q                              # about a minute
    LOPD_UNSAFE_NO_SANDBOX=1 python -m pytest tests/test_escape.py -q     # the confinement off: most of it fails

Each attempt is a piece of Python that prints (code world) or returns (EnvScaler) the word ESCAPED only if it got
out: a file written outside its scratch directory, a file read from /etc or from this project, a process started,
a connection made, a signal delivered to its parent. The code world runs it as a model's program (CodeWorld.step,
verified against a test that expects ESCAPED: reward 1 means it escaped); EnvScaler as a tool of a dataset's
environment class (EnvScalerWorld.step: the tool's answer is the observation). Both run inside a "trainer": a
subprocess that plays the attempt's episode, then a normal episode, and reports. An attempt passes when
  - it was refused or cut (no ESCAPED, no reward for it),
  - nothing landed outside (the target file does not exist, the canary file is intact, no connection arrived),
  - no process of it is left, and the trainer lived (it killed nobody: `os.kill(os.getppid(), 9)` is one attempt),
  - the next, normal episode scored what it always scores.
BFCL's model-text attacks (argument names that are code, calls of helpers, values that cost hours) are in
tests/test_bfcl.py; the call parsers' linear time in tests/test_envs.py.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from worlds import sandbox  # noqa: E402

# {target}: a path outside the sandbox that must not appear; {canary}: a file outside that must stay as it is;
# {port}: a listener of the trainer's; {readme}: this project's README.
ATTEMPTS = {
    "open": "open({target!r}, 'w').write('x')",
    "io.FileIO": "import io\nio.FileIO({target!r}, 'w').write(b'x')",
    "_io.open": "import _io\n_io.open({target!r}, 'w').write('x')",
    "posix.open": "import posix\nposix.close(posix.open({target!r}, posix.O_WRONLY | posix.O_CREAT))",
    "os.open": "import os\nos.close(os.open({target!r}, os.O_WRONLY | os.O_CREAT))",
    "pathlib": "import pathlib\npathlib.Path({target!r}).write_text('x')",
    "remove": "import posix\nposix.unlink({canary!r})",
    "rename": "import os\nos.rename({canary!r}, {target!r})",
    "ctypes open": "import ctypes\nassert ctypes.CDLL(None).open({target!r}.encode(), 0o101, 0o644) >= 0",
    "ctypes system": "import ctypes, os\nctypes.CDLL(None).system(('touch ' + {target!r}).encode())\n"
                     "assert os.path.exists({target!r})",
    "read /etc/hostname": "assert open('/etc/hostname').read() is not None",
    "read the project": "assert 'LOPD' in open({readme!r}).read()",
    "list the project": "import os\nassert os.listdir(os.path.dirname({readme!r}))",
    "posix.system": "import posix\nassert posix.system('exit 0') == 0",
    "subprocess": "import subprocess\nsubprocess.Popen(['sleep', '987654'])",
    "os.fork": "import os\nif os.fork() == 0:\n    import time\n    time.sleep(60)",
    "os.execv": "import os\nos.execv('/bin/sh', ['sh', '-c', 'touch ' + {target!r}])",
    "posix_spawn": "import os\nos.posix_spawn('/bin/sh', ['sh', '-c', 'touch ' + {target!r}], {{}})",
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'x')",
    "raw socket through ctypes": "import ctypes\nassert ctypes.CDLL(None).socket(2, 1, 0) >= 0",
    "fork bomb": "import os\nwhile True:\n    os.fork()",
    "memory": "x = bytearray(8 << 30)",
    "cpu": "while True:\n    pass",
    "sleep": "import time\ntime.sleep(600)",
    "a class body that never returns": "class Forever:\n    while True:\n        pass",
    "kill the parent": "import os\nos.kill(os.getppid(), 9)",
    "raise the limits": "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
    "ptrace the parent": "import ctypes, os\nassert ctypes.CDLL(None).ptrace(16, os.getppid(), 0, 0) == 0",
}
ESCAPED = "print('ESCAPED')"


# The trainer: plays each attempt's episode in a world, then a normal episode, and reports one JSON line each.
TRAINER = r'''
import json, os, socket, sys, textwrap, time
sys.path.insert(0, sys.argv[1])
world, attempts, paths = sys.argv[2], json.loads(sys.stdin.read()), json.loads(sys.argv[3])
from worlds import sandbox
MARK = "sandbox: cannot confine the program"        # in every sandbox child's command line (the CHILD source)

def sandbox_processes():
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():                 # this trainer: its own command line holds MARK too
            continue
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                cmd = f.read()
            with open("/proc/%s/stat" % pid) as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        n += (MARK.encode() in cmd or b"987654" in cmd) and state not in "ZX"
    return n

def left_behind():
    deadline = time.time() + 10                    # a loaded machine may take seconds to reap a killed group
    while sandbox_processes() and time.time() < deadline:
        time.sleep(0.05)
    return sandbox_processes()

if world == "code":
    from worlds import code_benchmarks, code_world
    limits = sandbox.SandboxLimits(wall_s=2.0, cpu_s=1, memory_mb=256, output_kb=64)
    hostile = code_benchmarks.CodeProblem("hostile", "escape", tests=[{"input": "", "output": "ESCAPED\n"}])
    normal = code_benchmarks.CodeProblem("sum", "add", tests=[{"input": "1 2\n", "output": "3\n"}])
    def attempt(code):
        env = code_world.CodeWorld(limits=limits)
        env.reset(hostile)
        env.step("```python\n" + code + "\n```")
        return {"escaped": env.reward() == 1.0, "detail": env.trace[0][2]}
    def after():
        env = code_world.CodeWorld(limits=limits)
        env.reset(normal)
        env.step("```python\na, b = map(int, input().split())\nprint(a + b)\n```")
        return env.reward()
else:
    from worlds import common, envscaler as es
    limits = sandbox.SandboxLimits(wall_s=2.0, cpu_s=5, memory_mb=256, output_kb=64)
    def task(code, env_id="hostile"):
        meta = {"env_id": env_id, "tools": [], "environment_introduction": "", "constraints_rules": [],
                "env_class_code": code}
        scenario = {"task_id": env_id, "env_id": env_id, "env_class_name": "Hostile", "task": "go",
                    "init_config": {}, "checklist_with_func": [{"check_item": "c", "check_func":
                        "def check_func(final_state):\n    return final_state.get('n') == 1\n"}]}
        return es.EnvScalerTask(env_id, "go", env_id, env_id, scenario, meta)
    def attempt(code):
        if code.startswith("class Forever"):                     # the class code itself never returns
            cls = "class Hostile:\n" + textwrap.indent(code, "    ") + "\n"
        else:                                                    # a tool answers; what it prints is swallowed
            code = code.replace("print('ESCAPED')", "return 'ESCAPED'")
            cls = ("class Hostile:\n    def __init__(self, config):\n        self.n = 0\n"
                   "    def attack(self):\n" + textwrap.indent(code, "        ") + "\n")
        env = es.EnvScalerWorld(limits=limits)
        env.reset(task(cls))
        obs = env.step(common.format_call("attack", {})).observations
        env.step("Task Completed")
        return {"escaped": any("ESCAPED" in o for o in obs), "reward": env.reward(), "detail": obs[0][-300:]}
    def after():
        cls = "class Hostile:\n    def __init__(self, config):\n        self.n = 0\n    def add(self):\n        self.n += 1\n        return 'ok'\n"
        env = es.EnvScalerWorld(limits=limits)
        env.reset(task(cls, "normal"))
        env.step(common.format_call("add", {}))
        env.step("Task Completed")
        return env.reward()

listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(1)
listener.settimeout(0.2)
for name, code in attempts.items():
    code = code.replace("{port}", str(listener.getsockname()[1]))
    out = attempt(code)
    try:
        listener.accept()
        out["connected"] = True
    except OSError:
        out["connected"] = False
    out.update(name=name, left=left_behind(), after=after())
    print(json.dumps(out), flush=True)
'''
AFTER = {"code": 1.0, "envscaler": 1.0}


@pytest.fixture(scope="module", params=["code", "envscaler"])
def outcomes(request, tmp_path_factory):
    """Every attempt's outcome in one trainer process for a world: {name: outcome, with "files": what landed}."""
    if sandbox.confinement_missing() and not sandbox.unconfined():
        pytest.skip(f"no confinement here: {sandbox.confinement_missing()}")
    world, folder = request.param, tmp_path_factory.mktemp("outside")
    paths, programs = {}, {}
    for i, (name, code) in enumerate(ATTEMPTS.items()):
        target, canary = str(folder / f"target-{i}"), str(folder / f"canary-{i}")
        with open(canary, "w") as f:
            f.write("precious")
        paths[name] = (target, canary)
        body = code.format(target=target, canary=canary, readme=os.path.join(ROOT, "README.md"), port="{port}")
        programs[name] = body + "\n" + ESCAPED
    proc = subprocess.run([sys.executable, "-c", TRAINER, ROOT, world, json.dumps(paths)], input=json.dumps(programs),
                          capture_output=True, text=True, timeout=600)
    results = {}
    for line in proc.stdout.splitlines():
        out = json.loads(line)
        target, canary = paths[out["name"]]
        out["files"] = os.path.exists(target) or not os.path.exists(canary) or open(canary).read() != "precious"
        results[out["name"]] = out
    return world, results, proc


@pytest.mark.parametrize("name", list(ATTEMPTS))
def test_the_attempt_is_refused_nothing_lands_and_the_trainer_goes_on(outcomes, name):
    world, results, proc = outcomes
    assert name in results, f"the trainer died before or at {name!r} (exit {proc.returncode}): {proc.stderr[-500:]}"
    out = results[name]
    assert not out["escaped"], (world, name, out)
    assert not out["files"], f"{name}: something landed outside the sandbox"
    assert not out["connected"], f"{name}: a connection reached the trainer's listener"
    assert out["left"] == 0, f"{name}: {out['left']} process(es) of the sandbox left behind"
    assert out["after"] == AFTER[world], f"{name}: the next episode scored {out['after']}"


def test_the_trainer_outlives_every_attempt(outcomes):
    world, results, proc = outcomes
    assert proc.returncode == 0 and set(results) == set(ATTEMPTS), proc.stderr[-2000:]


def test_without_confinement_the_same_attempts_escape(tmp_path, monkeypatch):
    """The suite can fail: with --unsafe-no-sandbox's variable set, a write, a read of /etc and a process each get
    out of the very same sandbox (`run_sandboxed`), so the assertions above are not vacuous."""
    target = tmp_path / "written"
    monkeypatch.setenv(sandbox.UNSAFE_ENV, "1")
    for code in (f"io_ = __import__('io')\nio_.FileIO({str(target)!r}, 'w')\n",
                 "print(open('/etc/hostname').read() is not None)\n",
                 "import os\nprint(os.fork() >= 0)\n"):
        r = sandbox.run_sandboxed(code, limits=sandbox.SandboxLimits(wall_s=3.0))
        assert r.status == "ok", (code, r)
    assert target.exists()


def test_the_seccomp_program_is_what_it_says():
    """The filter read back as a decision table, by an interpreter of the few BPF instructions it uses: each refused
    call answers EPERM, clone3 ENOSYS, clone only with CLONE_THREAD, kill only of itself, prlimit64 only to read, any
    other call (read, openat, mmap) passes, and another architecture is killed."""
    machine = "x86_64"
    nr, pid = sandbox.SYSCALLS[machine], 4242
    prog = sandbox.seccomp_filter(machine, pid)

    def run(call, args=(0,) * 6, arch=nr["arch"]):
        data = {0: call, 4: arch}
        for i, a in enumerate(args):
            data[16 + 8 * i], data[20 + 8 * i] = a & 0xFFFFFFFF, a >> 32
        acc, pc = 0, 0
        while True:
            code, jt, jf, k = prog[pc]
            if code == sandbox.LD_ABS:
                acc, pc = data.get(k, 0), pc + 1
            elif code == sandbox.RET:
                return k
            else:
                hit = {sandbox.JEQ: acc == k, sandbox.JGE: acc >= k, sandbox.JSET: bool(acc & k)}[code]
                pc += 1 + (jt if hit else jf)
    deny, allow = sandbox.RET_ERRNO | sandbox.EPERM, sandbox.RET_ALLOW
    for name in sandbox.DENIED:
        assert run(nr[name]) == deny, name
    assert run(nr["clone3"]) == sandbox.RET_ERRNO | sandbox.ENOSYS
    assert run(nr["clone"], (0x3D0F00,)) == allow and run(nr["clone"], (0x11,)) == deny   # a thread; a fork
    assert run(nr["kill"], (pid, 9)) == allow and run(nr["kill"], (pid + 1, 9)) == deny
    assert run(nr["kill"], ((1 << 32) - 1, 9)) == deny                                   # kill(-1, 9)
    assert run(nr["tgkill"], (pid, pid, 6)) == allow and run(nr["tgkill"], (1, 1, 9)) == deny
    assert run(nr["prlimit64"], (0, 9, 0, 1234)) == allow and run(nr["prlimit64"], (0, 9, 1234, 0)) == deny
    assert run(nr["prlimit64"], (0, 9, 1 << 40, 0)) == deny                             # a pointer above 4 GB
    for other in (0, 1, 9, 257):                                                         # read, write, mmap, openat
        assert run(other) == allow
    assert run(0x40000000 + 2) == deny                                                   # x32's open
    assert run(2, arch=0xC00000B7) == sandbox.RET_KILL_PROCESS


def test_a_machine_that_cannot_confine_gets_one_line(monkeypatch):
    """Where the kernel has no Landlock, untrusted code does not run: a one-line UserError naming the flag."""
    from runtime import UserError
    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)
    monkeypatch.setattr(sandbox, "confinement_missing", lambda: "this kernel has no Landlock")
    with pytest.raises(UserError) as err:
        sandbox.run_sandboxed("print(1)\n")
    assert "--unsafe-no-sandbox" in str(err.value) and "\n" not in str(err.value)
    monkeypatch.setenv(sandbox.UNSAFE_ENV, "1")
    assert sandbox.run_sandboxed("print(1)\n").stdout == "1\n"        # asked for: it runs, with limits only
