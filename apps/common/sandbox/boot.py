"""The first code of a sandbox process: isolates it, then runs the program as ``__main__``. Standard library only.

Started by ``apps.common.sandbox.Sandbox`` as ``python -I -S boot.py <spec.json>`` with the work dir as cwd, stdin /
stdout / stderr already on files there, an empty environment, and a pipe on ``spec["ready_fd"]``. In order:

1. resource limits: CPU seconds, address space, file size, open files, no core files;
2. Landlock: read-only access to the interpreter's files (``spec["readable"]``), full access to the work dir, nothing
   else on the filesystem; TCP bind / connect denied; no signals to, or abstract sockets of, processes outside;
3. no capabilities (a sandbox started by root keeps none of root's privileges);
4. seccomp: no sockets (nor io_uring, whose operations would bypass the filter), no new processes (fork / vfork /
   clone without CLONE_THREAD), no exec, no ptrace or reading other processes' memory, no signals by pid (kill,
   sigqueue, fcntl F_SETOWN / F_SETSIG), no changing other processes' scheduling, no raising of limits, no chmod /
   chown / utime / xattr changes or truncation by path (Landlock does not cover those everywhere), no namespaces,
   mounts, bpf, perf or keyrings;
5. "ready" on the pipe, which is closed; then the program runs.

If a layer cannot be put in place the program does not run: the reason goes to stderr and the pipe stays silent, so
the parent reports a sandbox failure instead of a result.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import struct
import sys
from typing import Any

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.syscall.restype = ctypes.c_long

# ---- Landlock (linux/landlock.h) ---------------------------------------------------------------------------------
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_RIGHTS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2


class PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _fail(layer: str) -> None:
    errno = ctypes.get_errno()
    raise OSError(errno, f"sandbox: {layer} failed: {os.strerror(errno)}")


def _fs_rights(abi: int) -> int:
    return FS_RIGHTS_BY_ABI[max(v for v in FS_RIGHTS_BY_ABI if v <= abi)]


def landlock(readable: list[str], writable: str) -> int:
    """Restrict this process to reading ``readable`` and everything in ``writable``; returns the Landlock ABI."""
    abi = LIBC.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION)
    if abi < 1:
        _fail("Landlock (kernel >= 5.13 with Landlock enabled is needed)")
    fs = _fs_rights(abi)
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    buffer = ctypes.create_string_buffer(attr, len(attr))
    ruleset = LIBC.syscall(SYS_LANDLOCK_CREATE_RULESET, buffer, len(attr), 0)
    if ruleset < 0:
        _fail("Landlock ruleset")
    for path, rights in [*((p, FS_EXECUTE | FS_READ_FILE | FS_READ_DIR) for p in readable), (writable, fs)]:
        if not os.path.exists(path):
            continue
        if not os.path.isdir(path):
            rights &= FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | (1 << 14 if abi >= 3 else 0)
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = PathBeneath(rights, fd)
        if LIBC.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0) < 0:
            _fail(f"Landlock rule for {path}")
        os.close(fd)
    if LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        _fail("no_new_privs")
    if LIBC.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) < 0:
        _fail("Landlock restrict_self")
    os.close(ruleset)
    return int(abi)


# ---- capabilities -------------------------------------------------------------------------------------------------
def drop_capabilities() -> None:
    """Empty effective, permitted and inheritable sets (capset, _LINUX_CAPABILITY_VERSION_3)."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    if LIBC.capset(header, data) != 0:
        _fail("dropping capabilities")


# ---- seccomp ------------------------------------------------------------------------------------------------------
EPERM, EAGAIN, ENOSYS = 1, 11, 38
CLONE_THREAD = 0x10000
# audit arch, clone, clone3, fcntl, and the denied syscalls, per machine (errno EPERM unless given)
SECCOMP_TABLES: dict[str, tuple[int, int, int, int, list[Any]]] = {
    "x86_64": (0xC000003E, 56, 435, 72, [
        41, 53,  # socket, socketpair
        (57, EAGAIN), (58, EAGAIN),  # fork, vfork
        59, 322,  # execve, execveat
        101, 310, 311, 312, 438,  # ptrace, process_vm_readv / writev, kcmp, pidfd_getfd
        62, 200, 234, 424, 129, 297,  # kill, tkill, tgkill, pidfd_send_signal, rt_(tg)sigqueueinfo
        160, 302,  # setrlimit, prlimit64
        141, 142, 144, 203, 314, 251,  # setpriority, sched_setparam / setscheduler / setaffinity / setattr, ioprio_set
        90, 91, 268, 452, 92, 93, 94, 260,  # chmod, fchmod, fchmodat(2), chown, fchown, lchown, fchownat
        132, 235, 261, 280,  # utime, utimes, futimesat, utimensat
        188, 189, 190, 197, 198, 199,  # set / remove xattr
        76,  # truncate (by path)
        425, 426, 427,  # io_uring: its ops would bypass this filter
        272, 308, 165, 166, 155, 161, 169,  # unshare, setns, mount, umount2, pivot_root, chroot, reboot
        321, 298, 323, 250, 248, 249,  # bpf, perf_event_open, userfaultfd, keyctl, add_key, request_key
    ]),
    "aarch64": (0xC00000B7, 220, 435, 25, [
        198, 199, 221, 281, 117, 270, 271, 272, 438,
        129, 130, 131, 424, 138, 240, 164, 261,
        140, 118, 119, 122, 274, 30,
        52, 53, 452, 54, 55, 88, 5, 6, 7, 14, 15, 16, 45,
        425, 426, 427, 97, 268, 40, 39, 41, 51, 142,
        280, 241, 282, 219, 217, 218,
    ]),
}  # fmt: skip
F_SETOWN, F_SETSIG, F_SETOWN_EX = 8, 10, 15
"""fcntl commands that would make the kernel signal another process (fcntl itself stays allowed)."""
RET_ALLOW, RET_KILL, RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
LD_ABS_W, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06


def seccomp() -> None:
    """Install the syscall filter (no_new_privs is already set by Landlock)."""
    machine = platform.machine()
    if machine not in SECCOMP_TABLES:
        raise OSError(f"sandbox: no seccomp table for {machine!r} (x86_64 and aarch64 are supported)")
    arch, clone, clone3, fcntl, denied = SECCOMP_TABLES[machine]
    program = [(LD_ABS_W, 0, 0, 4), (JEQ_K, 1, 0, arch), (RET_K, 0, 0, RET_KILL), (LD_ABS_W, 0, 0, 0)]
    if machine == "x86_64":  # the x32 ABI's numbers
        program += [(JGE_K, 0, 1, 0x40000000), (RET_K, 0, 0, RET_ERRNO | EPERM)]
    for entry in [*denied, (clone3, ENOSYS)]:  # clone3: glibc falls back to clone, checked below
        number, errno = entry if isinstance(entry, tuple) else (entry, EPERM)
        program += [(JEQ_K, 0, 1, number), (RET_K, 0, 0, RET_ERRNO | errno)]
    program += [  # fcntl: no F_SETOWN / F_SETSIG / F_SETOWN_EX (the command is args[1], at offset 24)
        (JEQ_K, 0, 6, fcntl), (LD_ABS_W, 0, 0, 24), (JEQ_K, 3, 0, F_SETOWN), (JEQ_K, 2, 0, F_SETSIG),
        (JEQ_K, 1, 0, F_SETOWN_EX), (RET_K, 0, 0, RET_ALLOW), (RET_K, 0, 0, RET_ERRNO | EPERM),
    ]  # fmt: skip
    program += [
        (JEQ_K, 0, 4, clone), (LD_ABS_W, 0, 0, 16), (JSET_K, 0, 1, CLONE_THREAD),  # clone: threads only
        (RET_K, 0, 0, RET_ALLOW), (RET_K, 0, 0, RET_ERRNO | EAGAIN), (RET_K, 0, 0, RET_ALLOW),
    ]  # fmt: skip
    filters = b"".join(struct.pack("HBBI", *instruction) for instruction in program)
    buffer = ctypes.create_string_buffer(filters, len(filters))
    prog = struct.pack("HxxxxxxP", len(program), ctypes.addressof(buffer))
    prog_buffer = ctypes.create_string_buffer(prog, len(prog))
    if LIBC.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, prog_buffer, 0, 0) != 0:
        _fail("seccomp")


def limit_resources(limits: dict[str, int]) -> None:
    """Hard limits (the soft CPU limit one second earlier: SIGXCPU, then SIGKILL)."""
    cpu = int(limits["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"], limits["open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def main() -> None:
    with open(sys.argv[1]) as file:
        spec = json.load(file)
    workdir = os.getcwd()
    with open(spec["program"]) as file:
        source = file.read()
    os.remove(spec["program"])  # what the program can read of itself is its code object, not this file
    os.remove(sys.argv[1])
    limit_resources(spec["limits"])
    landlock(spec["readable"], workdir)
    drop_capabilities()
    seccomp()
    os.write(spec["ready_fd"], b"ready\n")
    os.close(spec["ready_fd"])
    sys.argv = [spec["program"]]
    sys.path.insert(0, workdir)
    code = compile(source, spec["program"], "exec")  # isolated already: a syntax error is the program's failure
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
