"""The escape suite: every way out of the sandbox (worlds/sandbox.py) we know of, tried for real against every world that
runs untrusted code, through the world's own episode path.

    python -m pytest tests/test_escape.py -q                              # about a minute and a half
    LOPD_UNSAFE_NO_SANDBOX=1 python -m pytest tests/test_escape.py -q     # the confinement off: most of it fails

Each attempt is a piece of Python that prints (code world) or returns (EnvScaler) the word ESCAPED only if it got
out: a file written outside its scratch directory, a file read, stat'ed or watched outside it, a file's mode, owner
or times changed, a process started, a connection made, a signal that could reach its parent, memory or disk held
past its limits. The code world runs it as a model's program (CodeWorld.step,
verified against a test that expects ESCAPED: reward 1 means it escaped); EnvScaler as a tool of a dataset's
environment class (EnvScalerWorld.step: the tool's answer is the observation). Both run inside a "trainer": a
subprocess that plays the attempt's episode, then a normal episode, and reports. An attempt passes when
  - it was refused or cut (no ESCAPED, no reward for it),
  - nothing landed outside (the target file does not exist, the canaries keep contents, mode, owner and times, no
    connection arrived),
  - no process, System V object or temporary folder of it is left, and the trainer lived (it killed nobody: `os.kill(os.getppid(), 9)` is one attempt),
  - the next, normal episode scored what it always scores.
BFCL's model-text attacks (argument names that are code, calls of helpers, values that cost hours) are in
tests/test_bfcl.py; the call parsers' linear time in tests/test_envs.py; replies and answers that must never raise
in tests/test_total.py; verdicts a program must not fake in tests/test_verdicts.py. The last test runs train.py itself
on a hostile EnvScaler release.
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
# {visible}: a file in the interpreter's own folder (which the child reads) that must stay as it is; {port}: a
# listener of the trainer's; {readme}: this project's README.
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
    # metadata: a file the child can see (the interpreter's folder) and one it cannot; Landlock governs neither
    "chmod 0 of the interpreter's file": "import os\nos.chmod({visible!r}, 0)",
    "setuid bit": "import os\nos.chmod({visible!r}, 0o4755)",
    "chmod outside": "import os\nos.chmod({canary!r}, 0o777)",
    "chown": "import os\nos.chown({visible!r}, 65534, 65534)",
    "utime": "import os\nos.utime({visible!r}, (0, 0))",
    "stat the project": "import os\nassert os.stat({readme!r}).st_size > 0",
    "access the project": "import os\nassert os.access({readme!r}, os.F_OK)",
    "chdir to the project": "import os\nos.chdir(os.path.dirname({readme!r}))",
    "inotify on the interpreter's folder": "import ctypes, os\nlibc = ctypes.CDLL(None)\nfd = libc.inotify_init1(0)\n"
                                           "assert fd >= 0 and libc.inotify_add_watch(fd, os.path.dirname("
                                           "{visible!r}).encode(), 0x100) >= 0",
    # kernel memory an address-space limit does not count, and the machine's disk
    "System V memory": "import ctypes\nassert ctypes.CDLL(None).shmget(0, 800 << 20, 0o1600) >= 0",
    "socket buffers": "import socket\na, b = socket.socketpair()",
    "a thousand open files": "import os\nfds = [os.open('/dev/null', os.O_RDONLY) for _ in range(1000)]",
    "fill the disk": "import os\nn = 0\ntry:\n    while n < 300:\n        with open('f%d' % n, 'w') as f:\n"
                     "            f.write('x' * (60 << 10))\n        n += 1\nexcept OSError:\n    pass\n"
                     "assert n >= 300     # 18 MB written: more than the scratch tmpfs the suite allows",
    "a chain of folders deeper than Python's recursion": "import os\nfor _ in range(1200):\n    os.mkdir('d')\n"
                                                         "    os.chdir('d')\nassert False",
    # signals by other routes than kill: a queued signal, a file's owner (signal 0 / no O_ASYNC: nothing delivered)
    "rt_sigqueueinfo to the parent": "import ctypes, os, struct\ninfo = struct.pack('iii', 0, 0, -1) + bytes(116)\n"
                                     "assert ctypes.CDLL(None).syscall(129, os.getppid(), 0, info) == 0",
    "F_SETOWN to the parent": "import fcntl, os\nr, w = os.pipe()\nfcntl.fcntl(r, fcntl.F_SETOWN, os.getppid())",
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

def temp_folders():                                # the sandbox's own temporary folders in the trainer's TMPDIR
    import tempfile
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("lopd-")}

def ipc_objects():                                 # System V objects in the trainer's IPC namespace
    n = 0
    for kind in ("shm", "msg", "sem"):
        try:
            with open("/proc/sysvipc/" + kind) as f:
                n += len(f.read().splitlines()) - 1
        except OSError:
            pass
    return n

if world == "code":
    from worlds import code_benchmarks, code_world
    limits = sandbox.SandboxLimits(wall_s=2.0, cpu_s=1, memory_mb=256, output_kb=64, disk_mb=8)
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
    limits = sandbox.SandboxLimits(wall_s=2.0, cpu_s=5, memory_mb=256, output_kb=64, disk_mb=8)
    def task(code, env_id="hostile"):
        tools = [{"type": "function", "function": {"name": n, "description": n, "parameters": {"type": "object",
                  "properties": {}}}} for n in ("attack", "add")]          # the listed tools (deviation 3)
        meta = {"env_id": env_id, "tools": tools, "environment_introduction": "", "constraints_rules": [],
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
    folders, ipc = temp_folders(), ipc_objects()
    out = attempt(code)
    try:
        listener.accept()
        out["connected"] = True
    except OSError:
        out["connected"] = False
    out.update(name=name, left=left_behind(), after=after(), folders=sorted(temp_folders() - folders),
               ipc=ipc_objects() - ipc)
    print(json.dumps(out), flush=True)
'''
AFTER = {"code": 1.0, "envscaler": 1.0}


@pytest.fixture(scope="module", params=["code", "envscaler"])
def outcomes(request, tmp_path_factory):
    """Every attempt's outcome in one trainer process for a world: {name: outcome, with "files": what landed}."""
    if sandbox.confinement_missing() and not sandbox.unconfined():
        pytest.skip(f"no confinement here: {sandbox.confinement_missing()}")
    world, folder = request.param, tmp_path_factory.mktemp("outside")
    paths, programs, before = {}, {}, {}
    for i, (name, code) in enumerate(ATTEMPTS.items()):
        target, canary = str(folder / f"target-{i}"), str(folder / f"canary-{i}")
        visible = visible_canary(f"{world}-{i}")
        request.addfinalizer(lambda v=visible: os.path.exists(v) and os.remove(v))
        paths[name] = (target, canary, visible)
        for path in (canary, visible):
            with open(path, "w") as f:
                f.write("precious")
            os.chmod(path, 0o644)
            before[path] = fingerprint(path)
        body = code.format(target=target, canary=canary, visible=visible, readme=os.path.join(ROOT, "README.md"),
                           port="{port}")
        programs[name] = body + "\n" + ESCAPED
    tmp = tmp_path_factory.mktemp("tmp")                      # the trainer's own TMPDIR: nothing else writes there
    proc = subprocess.run([sys.executable, "-c", TRAINER, ROOT, world, json.dumps(paths)], input=json.dumps(programs),
                          capture_output=True, text=True, timeout=900, env={**os.environ, "TMPDIR": str(tmp)})
    results = {}
    for line in proc.stdout.splitlines():
        out = json.loads(line)
        target, canary, visible = paths[out["name"]]
        out["files"] = os.path.exists(target) or any(fingerprint(p) != before[p] for p in (canary, visible))
        results[out["name"]] = out
    return world, results, proc


def visible_canary(tag: str) -> str:
    """A file in the interpreter's site-packages: a folder every sandboxed child can read (worlds/sandbox.py,
    read_paths), so that metadata calls meet a file they can name."""
    import sysconfig
    return os.path.join(sysconfig.get_paths()["purelib"], f"lopd-escape-canary-{tag}-{os.getpid()}.txt")


def fingerprint(path: str):
    """What must not change: contents, mode, owner, group, modification time (None: the file is gone)."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            return f.read(), st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns
    except OSError:
        return None


@pytest.mark.parametrize("name", list(ATTEMPTS))
def test_the_attempt_is_refused_nothing_lands_and_the_trainer_goes_on(outcomes, name):
    world, results, proc = outcomes
    assert name in results, f"the trainer died before or at {name!r} (exit {proc.returncode}): {proc.stderr[-500:]}"
    out = results[name]
    assert not out["escaped"], (world, name, out)
    assert not out["files"], f"{name}: something landed outside the sandbox"
    assert not out["connected"], f"{name}: a connection reached the trainer's listener"
    assert out["left"] == 0, f"{name}: {out['left']} process(es) of the sandbox left behind"
    assert not out["folders"], f"{name}: temporary folders left behind: {out['folders']}"
    assert out["ipc"] <= 0, f"{name}: {out['ipc']} System V object(s) left behind"
    assert out["after"] == AFTER[world], f"{name}: the next episode scored {out['after']}"


# A dataset whose environment attacks as it is made (so the toy backbone's replies need not call a tool): metadata of
# a file it can see, System V memory, socket pairs, a full disk, a folder chain past Python's recursion limit.
HOSTILE_RELEASE_ENV = """
class Hostile:
    def __init__(self, config):
        import ctypes, os, socket
        self.n = 0
        for attack in (lambda: os.chmod(config["visible"], 0o4777), lambda: os.utime(config["visible"], (0, 0)),
                       lambda: ctypes.CDLL(None).shmget(0, 800 << 20, 0o1600), socket.socketpair):
            try:
                attack()
            except Exception:
                pass
        try:
            for i in range(2000):
                with open("f%d" % i, "w") as f:
                    f.write("x" * (60 << 10))
        except OSError:
            pass
        for _ in range(1200):
            os.mkdir("d")
            os.chdir("d")

    def add(self):
        self.n += 1
        return "ok"
"""


def write_hostile_release(folder, visible: str) -> str:
    """EnvScaler's published layout (env_metadata.json, train.jsonl, test.jsonl) with one hostile environment."""
    os.makedirs(folder)
    tool = {"name": "add", "description": "add one", "parameters": {"type": "object", "properties": {}}}
    meta = [{"env_id": "hostile", "env_class_code": HOSTILE_RELEASE_ENV, "environment_introduction": "A counter.",
             "constraints_rules": [], "tools": [tool]}]
    with open(os.path.join(folder, "env_metadata.json"), "w") as f:
        json.dump(meta, f)
    check = [{"check_item": "added", "check_func": "def check_func(s):\n    return s['n'] == 1\n"}]
    for split, n in (("train", 6), ("test", 3)):
        with open(os.path.join(folder, split + ".jsonl"), "w") as f:
            for i in range(n):
                f.write(json.dumps({"task_id": f"{split}-{i}", "task": "Add one.", "env_id": "hostile",
                                    "env_class_name": "Hostile", "init_config": {"visible": visible},
                                    "checklist_with_func": check}) + "\n")
    return str(folder)


def test_train_py_on_a_hostile_release_finishes_and_leaves_nothing(tmp_path, toy_backbone_dir):
    """The CLI as a user runs it (`train.py --env envscaler --tasks DIR`, at the smallest size) on a release whose
    environment attacks in every episode: the run ends with exit 0, the file it named is as it was, and no
    temporary folder, System V object or sandbox process is left."""
    if sandbox.confinement_missing() and not sandbox.unconfined():
        pytest.skip(f"no confinement here: {sandbox.confinement_missing()}")
    visible, tmp = visible_canary("cli"), tmp_path / "tmp"          # the run's own TMPDIR: nothing else writes there
    tmp.mkdir()
    with open(visible, "w") as f:
        f.write("precious")
    before = fingerprint(visible)
    try:
        release = write_hostile_release(tmp_path / "release", visible)
        cmd = [sys.executable, "train.py", "--env", "envscaler", "--tasks", release, "--model", toy_backbone_dir,
               "--out", str(tmp_path / "run"), "--bank-threshold", "0", "--cold-steps", "1", "--steps", "1",
               "--rollouts-per-step", "2", "--micro-batch", "1", "--latents", "2", "--max-new-tokens", "12",
               "--max-env-steps", "2", "--embedder", "backbone"]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                           env={**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-2000:]
        assert fingerprint(visible) == before
    finally:
        os.remove(visible)
    assert not os.listdir(tmp), f"temporary folders left behind: {os.listdir(tmp)}"
    with open("/proc/sysvipc/shm") as f:
        assert not [x for x in f.read().splitlines()[1:] if " 838860800 " in x], "a System V segment outlived the run"


def test_the_trainer_outlives_every_attempt(outcomes):
    world, results, proc = outcomes
    assert proc.returncode == 0 and set(results) == set(ATTEMPTS), proc.stderr[-2000:]


# Attempts that get out of a sandbox without its confinement and leave the test process alive (signal 0, no O_ASYNC)
ESCAPE_UNCONFINED = ("io.FileIO", "read /etc/hostname", "os.fork", "chmod 0 of the interpreter's file", "setuid bit",
                     "utime", "stat the project", "access the project", "inotify on the interpreter's folder",
                     "System V memory", "socket buffers", "fill the disk",
                     "rt_sigqueueinfo to the parent", "F_SETOWN to the parent")


def test_without_confinement_the_same_attempts_escape(tmp_path, monkeypatch):
    """The suite can fail: with --unsafe-no-sandbox's variable set, the very same sandbox (`run_sandboxed`) lets a
    write, a read of /etc, a process, metadata changes, watches, System V memory and queued signals through, so the
    assertions above are not vacuous. A folder chain past Python's recursion limit is still removed."""
    monkeypatch.setenv(sandbox.UNSAFE_ENV, "1")
    visible = visible_canary("unconfined")
    try:
        for name in ESCAPE_UNCONFINED:
            with open(visible, "w") as f:
                f.write("precious")
            code = ATTEMPTS[name].format(target=str(tmp_path / name), canary=str(tmp_path / "canary"),
                                         visible=visible, readme=os.path.join(ROOT, "README.md"), port=0)
            if name == "System V memory":                        # escaped, then removed (IPC_RMID)
                code = code.replace("assert ctypes.CDLL(None).shmget(0, 800 << 20, 0o1600) >= 0",
                                    "i = ctypes.CDLL(None).shmget(0, 800 << 20, 0o1600)\n"
                                    "ctypes.CDLL(None).shmctl(i, 0, None)\nassert i >= 0")
            r = sandbox.run_sandboxed(code + "\n" + ESCAPED, limits=sandbox.SandboxLimits(wall_s=5.0, disk_mb=8))
            assert "ESCAPED" in r.stdout, (name, r)
    finally:
        os.remove(visible)
    import tempfile
    before = set(os.listdir(tempfile.gettempdir()))
    deep = ATTEMPTS["a chain of folders deeper than Python's recursion"]
    assert sandbox.run_sandboxed(deep, limits=sandbox.SandboxLimits(wall_s=10.0, cpu_s=10)).status == "error"
    assert set(os.listdir(tempfile.gettempdir())) <= before


def test_the_seccomp_program_is_what_it_says():
    """The filter read back as a decision table, by an interpreter of the few BPF instructions it uses: each refused
    call answers EPERM, clone3 ENOSYS, clone only with CLONE_THREAD, kill only of itself, prlimit64 only to read,
    chmod's kin only without the setuid and setgid bits, fcntl but for a file's owner, signal, lease and notify, any
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
    for call, i in (("chmod", 1), ("fchmod", 1), ("fchmodat", 2), ("fchmodat2", 2)):   # no setuid / setgid bit
        mode = lambda m: tuple(m if j == i else 3 for j in range(6))                    # noqa: E731
        assert run(nr[call], mode(0o4755)) == deny and run(nr[call], mode(0o2700)) == deny, call
        assert run(nr[call], mode(0o755)) == allow and run(nr[call], mode(0o1777)) == allow, call
    for cmd, verdict in ((8, deny), (10, deny), (15, deny), (1024, deny), (1026, deny),   # owner, signal, lease,
                         (1, allow), (2, allow), (3, allow), (4, allow), (1030, allow)):  # notify; FD/FL, DUPFD
        assert run(nr["fcntl"], (5, cmd)) == verdict, cmd
    assert run(0x40000000 + 2) == deny                                                   # x32's open
    assert run(2, arch=0xC00000B7) == sandbox.RET_KILL_PROCESS


def test_a_machine_that_cannot_confine_gets_one_line(monkeypatch):
    """Where the kernel has no Landlock, untrusted code does not run: a one-line UserError naming the flag."""
    from runtime.devices import UserError
    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)
    monkeypatch.setattr(sandbox, "confinement_missing", lambda: "this kernel has no Landlock")
    with pytest.raises(UserError) as err:
        sandbox.run_sandboxed("print(1)\n")
    assert "--unsafe-no-sandbox" in str(err.value) and "\n" not in str(err.value)
    monkeypatch.setenv(sandbox.UNSAFE_ENV, "1")
    assert sandbox.run_sandboxed("print(1)\n").stdout == "1\n"        # asked for: it runs, with limits only
