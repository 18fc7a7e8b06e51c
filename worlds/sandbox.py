"""The sandbox: code nobody here wrote (a model's programs, a dataset's environment code) in a process of its own
that the kernel confines. The code world (worlds/code_world.py) and EnvScaler's worker (worlds/envscaler.py) both run on
it.

    python -m pytest tests/test_escape.py -q      # the escape suite: every way out we know of, tried for real

What the child process is, in the order it is set up (`CHILD` below runs in it before the untrusted code):
  1. a separate interpreter (`python -I`: no user site, no PYTHON* variables, no current directory on sys.path), in a
     session and process group of its own, with a fresh scratch directory as its working directory and TMPDIR;
  2. resource limits: CPU seconds (SIGXCPU), address space (memory: a MemoryError), the size of any file it writes
     (its stdout and stderr are files or pipes it inherited), no core dumps;
  3. a new, empty network namespace where the kernel allows one (a layer of its own; 4 and 5 also close the network);
  4. no capabilities: a child of a root process gives up all of them (capset), so it cannot raise its limits,
     signal other users' processes or change the machine; then no_new_privs, so nothing can give them back;
  5. Landlock (Linux 5.13+): reads only beneath the interpreter's own folders (sys.prefix, sys.base_prefix, the
     folders on sys.path) and the system's shared libraries, writes only beneath the scratch directory, /dev/null
     read and written; where the kernel's Landlock ABI has them, no TCP bind or connect (ABI 4) and no signal to a
     process outside the sandbox (ABI 6);
  6. seccomp: a filter (`seccomp_filter`) that refuses fork, vfork, clone without CLONE_THREAD (threads stay
     allowed), execve, ptrace, socket, kill and tgkill of any process but itself, setrlimit and prlimit64 with a new
     limit, unshare, setns, mount, io_uring, bpf, perf_event_open, and the calls that need a capability it no
     longer has; clone3 answers ENOSYS, so that the C library falls back to clone, whose flags the filter can read;
  7. a wall-clock limit, after which (and after every run) the whole process group is killed with SIGKILL.
Landlock and seccomp cannot be undone by the process that installed them, nor by any code it runs afterwards, so
the untrusted code runs under them whatever it does to Python: replacing builtins, ctypes, `posix`, `_io`.

Why Landlock + seccomp, through ctypes. The most trusted code-execution harnesses isolate with the kernel
(namespaces, seccomp), never by patching Python's builtins, which `io.FileIO`, `posix.open` or ctypes walk around.
Landlock restricts files with no root, mount namespace or setuid helper, and it restricts root too (this project's
machines run as root). seccomp refuses new processes, which RLIMIT_NPROC cannot do for root (and for anyone else it
would refuse threads as well). Both are a few system calls through ctypes: the filter is one screen of instructions
a reader can check against the kernel's documentation, and nothing beyond the standard library is needed
(bubblewrap would add a binary; a seccomp binding, libseccomp). The escape suite (tests/test_escape.py) is what
proves the choice, on every world that runs untrusted code.

What it does NOT cover:
  - Disk space inside the scratch directory: each file is capped (RLIMIT_FSIZE), the number of files only by the CPU
    and wall limits.
  - Side channels and denial of service through shared resources (CPU caches, memory bandwidth, the page cache).
  - System V IPC objects and reads of what the allowed folders hold (the interpreter's and the libraries' files).
  - The verdict: a program can still try to fool its own checker from inside (worlds/code_world.py, "call-based tests").
  - Kernels without Landlock or seccomp, and machines other than x86_64 and aarch64: there nothing untrusted runs,
    unless `--unsafe-no-sandbox` (the environment variable LOPD_UNSAFE_NO_SANDBOX=1) says to run it with layers 1,
    2 and 7 only, on any machine (RLIMIT_NPROC then stands against new processes, and root ignores it). That is also
    how to see the escape suite fail. The aarch64 numbers are the kernel's generic table; only x86_64 has run here.
"""
from __future__ import annotations

import ctypes
import functools
import json
import os
import platform
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from runtime import UserError

UNSAFE_ENV = "LOPD_UNSAFE_NO_SANDBOX"     # "1": run untrusted code without layers 4-6 (train.py --unsafe-no-sandbox)


@dataclass
class SandboxLimits:
    wall_s: float = 5.0        # wall-clock seconds per run (per request, for a worker)
    cpu_s: int = 4             # CPU seconds per run (per worker, for a worker)
    memory_mb: int = 512       # address-space cap
    output_kb: int = 256       # cap on stdout, stderr, any file written, and one answer of a worker


@dataclass
class RunResult:
    status: str                # ok | error (non-zero exit) | timeout | cpu limit | output limit | killed
    returncode: int
    stdout: str
    stderr: str
    seconds: float


# ----------------------------------------------------------------------------------------------------------------
# The kernel's numbers (include/uapi/linux/landlock.h, seccomp.h, filter.h, capability.h, sched.h; arch tables)
# ----------------------------------------------------------------------------------------------------------------
# System calls by machine: x86_64 from arch/x86/entry/syscalls/syscall_64.tbl, aarch64 from include/uapi/asm-generic/
# unistd.h. None: the machine has no such call (aarch64 has no fork: clone does it).
SYSCALLS = {
    "x86_64": dict(arch=0xC000003E, fork=57, vfork=58, execve=59, execveat=322, clone=56, clone3=435, kill=62,
                   tkill=200, tgkill=234, ptrace=101, socket=41, setrlimit=160, prlimit64=302, unshare=272,
                   setns=308, mount=165, umount2=166, pivot_root=155, chroot=161, truncate=76, process_vm_readv=310,
                   process_vm_writev=311, pidfd_open=434, pidfd_send_signal=424, pidfd_getfd=438,
                   io_uring_setup=425, io_uring_enter=426, io_uring_register=427, bpf=321, perf_event_open=298,
                   userfaultfd=323, keyctl=250, add_key=248, request_key=249, reboot=169, swapon=167, swapoff=168,
                   kexec_load=246, kexec_file_load=320, init_module=175, finit_module=313, delete_module=176,
                   acct=163, settimeofday=164, clock_settime=227, adjtimex=159, capset=126,
                   landlock_create_ruleset=444, landlock_add_rule=445, landlock_restrict_self=446, seccomp=317),
    "aarch64": dict(arch=0xC00000B7, fork=None, vfork=None, execve=221, execveat=281, clone=220, clone3=435,
                    kill=129, tkill=130, tgkill=131, ptrace=117, socket=198, setrlimit=164, prlimit64=261,
                    unshare=97, setns=268, mount=40, umount2=39, pivot_root=41, chroot=51, truncate=45,
                    process_vm_readv=270, process_vm_writev=271, pidfd_open=434, pidfd_send_signal=424,
                    pidfd_getfd=438, io_uring_setup=425, io_uring_enter=426, io_uring_register=427, bpf=280,
                    perf_event_open=241, userfaultfd=282, keyctl=219, add_key=217, request_key=218, reboot=142,
                    swapon=224, swapoff=225, kexec_load=104, kexec_file_load=294, init_module=105, finit_module=273,
                    delete_module=106, acct=89, settimeofday=170, clock_settime=112, adjtimex=171, capset=91,
                    landlock_create_ruleset=444, landlock_add_rule=445, landlock_restrict_self=446, seccomp=277),
}
# Refused outright (EPERM): new processes, other processes, the network, the limits, the machine itself.
DENIED = ("fork", "vfork", "execve", "execveat", "tkill", "ptrace", "socket", "setrlimit", "unshare", "setns",
          "mount", "umount2", "pivot_root", "chroot", "truncate", "process_vm_readv", "process_vm_writev",
          "pidfd_open", "pidfd_send_signal", "pidfd_getfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
          "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key", "reboot", "swapon", "swapoff",
          "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "acct", "settimeofday",
          "clock_settime", "adjtimex")
CLONE_THREAD = 0x00010000
EPERM, ENOSYS = 1, 38
RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06     # BPF_LD|W|ABS, BPF_JMP|JEQ|K, ...|JGE, ...|JSET, RET|K
X32_BIT = 0x40000000                                            # x86_64's x32 calls: refused


def seccomp_filter(machine: str, pid: int) -> list[tuple[int, int, int, int]]:
    """The seccomp program for `machine`, as (code, jt, jf, k) BPF instructions over struct seccomp_data (nr at
    offset 0, arch at 4, argument i's low 32 bits at 16 + 8 i, its high bits at 20 + 8 i). `pid`: the only process
    kill and tgkill may signal. Each rule is a comparison whose false branch skips to the next rule."""
    nr = SYSCALLS[machine]
    arg_lo, arg_hi = (lambda i: 16 + 8 * i), (lambda i: 20 + 8 * i)
    deny, enosys = RET_ERRNO | EPERM, RET_ERRNO | ENOSYS
    prog = [(LD_ABS, 0, 0, 4), (JEQ, 1, 0, nr["arch"]), (RET, 0, 0, RET_KILL_PROCESS),   # another ABI: killed
            (LD_ABS, 0, 0, 0)]                                                          # A = the call's number
    if machine == "x86_64":
        prog += [(JGE, 0, 1, X32_BIT), (RET, 0, 0, deny)]
    for name in DENIED:
        if nr[name] is not None:
            prog += [(JEQ, 0, 1, nr[name]), (RET, 0, 0, deny)]
    prog += [(JEQ, 0, 1, nr["clone3"]), (RET, 0, 0, enosys)]
    # clone: only threads (CLONE_THREAD in flags, the first argument)
    prog += [(JEQ, 0, 4, nr["clone"]), (LD_ABS, 0, 0, arg_lo(0)), (JSET, 0, 1, CLONE_THREAD),
             (RET, 0, 0, RET_ALLOW), (RET, 0, 0, deny)]
    # kill(pid, sig), tgkill(tgid, tid, sig): only itself (the filter is written for the process that installs it)
    for name in ("kill", "tgkill"):
        prog += [(JEQ, 0, 4, nr[name]), (LD_ABS, 0, 0, arg_lo(0)), (JEQ, 0, 1, pid), (RET, 0, 0, RET_ALLOW),
                 (RET, 0, 0, deny)]
    # prlimit64(pid, resource, new, old): reading a limit (new == NULL) only
    prog += [(JEQ, 0, 6, nr["prlimit64"]), (LD_ABS, 0, 0, arg_lo(2)), (JEQ, 0, 3, 0), (LD_ABS, 0, 0, arg_hi(2)),
             (JEQ, 0, 1, 0), (RET, 0, 0, RET_ALLOW), (RET, 0, 0, deny)]
    return prog + [(RET, 0, 0, RET_ALLOW)]


# Landlock: filesystem rights by ABI (bits 0-12 since ABI 1, REFER 2, TRUNCATE 3, IOCTL_DEV 5), TCP (ABI 4), scopes
# (ABI 6). A right the ruleset handles is refused everywhere except beneath a rule that grants it.
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_MAKE_CHAR, FS_MAKE_BLOCK, FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 6, 1 << 11, 1 << 13, 1 << 14, 1 << 15
FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV   # what a rule on a file may hold
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1 << 0, 1 << 1
SYSTEM_LIBRARIES = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib")   # what dlopen reads


# ----------------------------------------------------------------------------------------------------------------
# The parent's side: can this machine confine, and how a child is started
# ----------------------------------------------------------------------------------------------------------------
def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none), asked as landlock_create_ruleset(NULL, 0, VERSION)."""
    machine = platform.machine()
    if sys.platform != "linux" or machine not in SYSCALLS:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return max(0, libc.syscall(SYSCALLS[machine]["landlock_create_ruleset"], None, ctypes.c_size_t(0), 1))


@functools.lru_cache(maxsize=None)
def confinement_missing() -> str | None:
    """Why this machine cannot confine a child (Landlock, seccomp, a known system call table), or None."""
    machine = platform.machine()
    if sys.platform != "linux":
        return f"the sandbox needs Linux's Landlock and seccomp; this is {sys.platform}"
    if machine not in SYSCALLS:
        return f"the sandbox's seccomp filter knows {' and '.join(SYSCALLS)} only; this machine is {machine}"
    if landlock_abi() < 1:
        return "this kernel has no Landlock (Linux 5.13+, enabled in the lsm= boot list)"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(21, 0, 0, 0, 0) < 0:                         # PR_GET_SECCOMP: EINVAL without seccomp
        return "this kernel has no seccomp filters"
    return None


def unconfined() -> bool:
    """--unsafe-no-sandbox (UNSAFE_ENV=1): untrusted code runs without layers 3-6, here and in every child process."""
    return os.environ.get(UNSAFE_ENV) == "1"


def check_confinement(what: str = "untrusted code") -> None:
    """A one-line UserError when `what` cannot be confined here and running it unconfined was not asked for; one
    line of warning, once, when it was."""
    why = confinement_missing()
    if unconfined():
        _warn_unconfined()
    elif why:
        raise UserError(f"{what} runs only under the kernel's confinement, and {why}; run it unconfined, at your "
                        f"own risk, with --unsafe-no-sandbox ({UNSAFE_ENV}=1)")


@functools.lru_cache(maxsize=None)
def _warn_unconfined():
    print(f"sandbox: {UNSAFE_ENV}=1: untrusted code runs UNCONFINED (process limits only)", file=sys.stderr)


def require_for(env_cls, unsafe: bool, what: str) -> None:
    """Before a run or an evaluation: --unsafe-no-sandbox (`unsafe`) sets UNSAFE_ENV, so that every process of it,
    workers and torchrun ranks included, reads the same; a world that runs untrusted code
    (`Environment.untrusted_code`) then needs the confinement: a one-line UserError before any model loads where
    this machine has none (`check_confinement`)."""
    if unsafe:
        os.environ[UNSAFE_ENV] = "1"
    if env_cls.untrusted_code:
        check_confinement(what)


PID_SLOT = 0xFFFFFFFF         # the filter's "itself": the child writes its own pid here (no pid has this value)


def read_paths() -> list[str]:
    """What a confined child may read: the interpreter's own folders (its prefixes, standard library and
    site-packages, as `python -I` sees them: not this process's sys.path, which holds the project) and the system's
    shared libraries. Nothing of the project, /etc, /proc or /home."""
    import site
    import sysconfig
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *SYSTEM_LIBRARIES,
             *site.getsitepackages(), *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib",
                                                                           "platlib"))}
    return sorted(p for p in paths if os.path.exists(p))


def landlock_rules(work: str, abi: int) -> dict:
    """The Landlock ruleset for a child whose scratch directory is `work`: the rights it handles (all the kernel
    knows: refused unless a rule grants them) and the rules [path, rights]: reads beneath `read_paths`, everything
    but device nodes and device ioctls beneath `work`, reads and writes of /dev/null."""
    fs = FS_BY_ABI[min(abi, 5)]
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL if abi >= 6 else 0
    read = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
    write = fs & ~(FS_MAKE_CHAR | FS_MAKE_BLOCK | FS_IOCTL_DEV)
    rules = [(p, read) for p in read_paths()] + [(work, write), ("/dev/null", FS_READ_FILE | FS_WRITE_FILE)]
    rules = [[p, r & (fs if os.path.isdir(p) else fs & FILE_RIGHTS)] for p, r in rules]   # a file takes file rights
    return {"handled": [fs, net, scoped], "attr_size": 8 if abi < 4 else 16 if abi < 6 else 24, "rules": rules}


def child_settings(work: str, limits: SandboxLimits) -> dict:
    """Everything the child needs, worked out here so that the child only makes the system calls: its limits and,
    unless running unconfined was asked for on a machine that cannot confine, the calls' numbers, the Landlock
    ruleset and the seccomp program."""
    check_confinement()
    settings = {"cpu": limits.cpu_s, "mem": limits.memory_mb << 20, "fsize": limits.output_kb * 1024}
    if unconfined():
        return settings                                      # --unsafe-no-sandbox: layers 1, 2 and 7 only
    machine = platform.machine()
    nr = {k: SYSCALLS[machine][k] for k in ("capset", "landlock_create_ruleset", "landlock_add_rule",
                                           "landlock_restrict_self", "seccomp")}
    return {**settings, "nr": nr, "landlock": landlock_rules(work, landlock_abi()),
            "filter": seccomp_filter(machine, PID_SLOT)}


def start_child(work: str, limits: SandboxLimits, **popen) -> subprocess.Popen:
    """Start `work`/prog.py in a confined child (its own session, the scratch `work` as cwd and TMPDIR)."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "TMPDIR": work}
    cmd = [sys.executable, "-I", "-c", CHILD, json.dumps(child_settings(work, limits))]
    return subprocess.Popen(cmd, cwd=work, start_new_session=True, env=env, **popen)


def exited_within(proc: subprocess.Popen, seconds: float) -> bool:
    """Wait for the child to exit, at most `seconds`: on its pidfd (woken the moment it exits), else by polling."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):                   # Linux < 5.3: Popen.wait's polling
        try:
            proc.wait(timeout=seconds)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            return bool(sel.select(seconds))
    finally:
        os.close(fd)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the child's whole process group (whatever it managed to start), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


# The child: limits, namespace, capabilities, Landlock, seccomp (layers 2-6, as `child_settings` gives them), then
# the program (prog.py in its working directory). A step that fails ends the child before the program runs (exit
# 125, "sandbox: ..." on stderr), so a program never runs with less than was asked.
CHILD = r'''
import ctypes, json, os, resource, struct, sys
cfg = json.loads(sys.argv[1])
def fail(why):
    sys.stderr.write("sandbox: cannot confine the program: %s (errno %d)\n" % (why, ctypes.get_errno()))
    os._exit(125)
resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu"], cfg["cpu"] + 1))
resource.setrlimit(resource.RLIMIT_AS, (cfg["mem"], cfg["mem"]))
resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["fsize"], cfg["fsize"]))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if "nr" not in cfg:         # unconfined: no seccomp, so RLIMIT_NPROC against new processes (root ignores it)
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
if "nr" in cfg:
    nr, libc = cfg["nr"], ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # 3. a new network namespace: CLONE_NEWNET, else CLONE_NEWUSER | CLONE_NEWNET (unprivileged); either may fail
    if libc.unshare(0x40000000) != 0:
        libc.unshare(0x10000000 | 0x40000000)
    # 4. no capabilities (capset, _LINUX_CAPABILITY_VERSION_3: a header, two empty sets), then PR_SET_NO_NEW_PRIVS
    if libc.syscall(nr["capset"], struct.pack("Ii", 0x20080522, 0), bytes(24)) != 0:
        fail("capset")
    if libc.prctl(38, 1, 0, 0, 0) != 0:
        fail("no_new_privs")
    # 5. Landlock: the ruleset (landlock_ruleset_attr), a rule per path (landlock_path_beneath_attr, packed)
    ll = cfg["landlock"]
    attr = struct.pack("QQQ", *ll["handled"])[:ll["attr_size"]]
    ruleset = libc.syscall(nr["landlock_create_ruleset"], attr, ctypes.c_size_t(len(attr)), 0)
    if ruleset < 0:
        fail("landlock_create_ruleset")
    for path, rights in ll["rules"]:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        if libc.syscall(nr["landlock_add_rule"], ruleset, 1, struct.pack("=Qi", rights, fd), 0) != 0:
            fail("landlock_add_rule " + path)
        os.close(fd)
    if libc.syscall(nr["landlock_restrict_self"], ruleset, 0) != 0:
        fail("landlock_restrict_self")
    os.close(ruleset)
    # 6. seccomp for every thread (SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC), "itself" = this pid
    prog = [(c, jt, jf, os.getpid() if k == 0xFFFFFFFF else k) for c, jt, jf, k in cfg["filter"]]
    insns = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
    if libc.syscall(nr["seccomp"], 1, 1, struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(insns))) != 0:
        fail("seccomp")
sys.argv = ["prog.py"]
with open("prog.py") as f:
    src = f.read()
exec(compile(src, "prog.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
'''


# ----------------------------------------------------------------------------------------------------------------
# One program, one run
# ----------------------------------------------------------------------------------------------------------------
def run_sandboxed(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> RunResult:
    """Run `code` as a Python program in a confined child with `stdin`; never raises on anything the program does
    (a confinement the kernel refused at start is status "error", exit 125, "sandbox: ..." in stderr)."""
    cap = limits.output_kb * 1024
    with tempfile.TemporaryDirectory(prefix="lopd-run-") as io_dir, \
            tempfile.TemporaryDirectory(prefix="lopd-sandbox-") as work:
        with open(os.path.join(work, "prog.py"), "w") as f:
            f.write(code)
        paths = {k: os.path.join(io_dir, k) for k in ("stdin", "stdout", "stderr")}
        with open(paths["stdin"], "w") as f:
            f.write(stdin)
        t0 = time.time()
        with open(paths["stdin"]) as fin, open(paths["stdout"], "w") as fout, open(paths["stderr"], "w") as ferr:
            proc = start_child(work, limits, stdin=fin, stdout=fout, stderr=ferr)
            try:
                timed_out = not exited_within(proc, limits.wall_s)
            finally:
                kill_group(proc)
        seconds = time.time() - t0
        sizes = [os.path.getsize(paths[k]) for k in ("stdout", "stderr")]
        out, err = (_read_capped(paths[k], cap) for k in ("stdout", "stderr"))
    rc = proc.returncode
    status = ("timeout" if timed_out else "output limit" if max(sizes) >= cap else "ok" if rc == 0 else
              "error" if rc > 0 else {-signal.SIGXCPU: "cpu limit", -signal.SIGXFSZ: "output limit"}.get(rc, "killed"))
    return RunResult(status, rc, out, err, seconds)


def _read_capped(path: str, cap: int) -> str:
    with open(path, "rb") as f:
        return f.read(cap).decode("utf-8", "replace")


# ----------------------------------------------------------------------------------------------------------------
# A worker: one confined process that answers JSON requests, one line each (EnvScaler's environments)
# ----------------------------------------------------------------------------------------------------------------
class Worker:
    """`program` (Python source) in a confined child that reads one JSON request a line on stdin and answers one
    JSON line on stdout. `request` returns the answer as a dict, or None once the worker is gone: it hung past
    limits.wall_s (reading the request or answering it), died, broke a limit, answered more than limits.output_kb,
    or answered something that is not a JSON object. Whatever the child does, the caller gets a dict or None, within
    about limits.wall_s; a worker that gave None has been killed."""

    def __init__(self, program: str, limits: SandboxLimits):
        self.limits, self.work = limits, tempfile.TemporaryDirectory(prefix="lopd-worker-")
        with open(os.path.join(self.work.name, "prog.py"), "w") as f:
            f.write(program)
        self.proc = start_child(self.work.name, limits, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
        self.fds = self.proc.stdin.fileno(), self.proc.stdout.fileno()   # used raw, never through Python's buffers
        for fd in self.fds:
            os.set_blocking(fd, False)
        self.pending = b""

    def request(self, **req) -> dict | None:
        if self.proc is None:
            return None
        deadline = time.monotonic() + self.limits.wall_s
        try:
            line = self._line(deadline) if self._send((json.dumps(req) + "\n").encode(), deadline) else None
            answer = json.loads(line) if line is not None else None
        except (OSError, ValueError, RecursionError):
            answer = None
        return answer if isinstance(answer, dict) else self.close()

    def _send(self, data: bytes, deadline: float) -> bool:
        """Write the request, without blocking past `deadline` on a worker that stopped reading."""
        view = memoryview(data)
        with selectors.DefaultSelector() as sel:
            sel.register(self.fds[0], selectors.EVENT_WRITE)
            while view:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return False
                view = view[os.write(self.fds[0], view):]
        return True

    def _line(self, deadline: float) -> bytes | None:
        """The next line the worker writes, read without blocking past `deadline` or beyond the output cap."""
        cap = self.limits.output_kb * 1024
        with selectors.DefaultSelector() as sel:
            sel.register(self.fds[1], selectors.EVENT_READ)
            while b"\n" not in self.pending:
                left = deadline - time.monotonic()
                if left <= 0 or len(self.pending) > cap or not sel.select(left):
                    return None
                chunk = os.read(self.fds[1], 1 << 16)
                if not chunk:                                    # the worker is gone
                    return None
                self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line if len(line) <= cap else None

    def close(self) -> None:
        """Kill the worker's whole process group and remove its directory (None, for `request`)."""
        if self.proc is not None:
            kill_group(self.proc)
            for stream in (self.proc.stdin, self.proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
            self.proc = None
            self.work.cleanup()
        return None
