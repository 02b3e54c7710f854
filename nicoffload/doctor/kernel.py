"""The kernel and the process: the kernel's version and BPF features (the JIT, bpffs, BTF,
``bpf_loop``, multi-buffer XDP: probed by loading a tiny program, never attaching it), what bcc
needs (itself, kernel headers), the process's privileges and its locked-memory limit.

Each ``check_*`` is a pure function of what was read, so that the unit tests can feed it
synthetic input; :func:`kernel_checks` reads the live system and calls them."""
from __future__ import annotations

import importlib.util
import os
import re
import resource
from pathlib import Path

from nicoffload.doctor import probe
from nicoffload.doctor.report import Check, fail, ok, warn

#: capability bits (linux/capability.h)
CAP_NET_ADMIN, CAP_IPC_LOCK, CAP_SYS_ADMIN, CAP_BPF = 12, 14, 21, 39
#: the kernel that brought each feature the programs use
SINCE = {"bpf_loop": (5, 17), "xdp_frags": (5, 18), "memcg_maps": (5, 11), "udp_gro": (5, 0)}
MIB = 1 << 20


def version(release: str) -> tuple[int, int]:
    """(major, minor) of a kernel release string such as ``6.18.44-fc-v657``; (0, 0) if unreadable."""
    m = re.match(r"(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _v(t: tuple[int, int]) -> str:
    return f"{t[0]}.{t[1]}"


def check_kernel(release: str, role: str | None) -> Check:
    v = version(release)
    need = SINCE["udp_gro"] if role == "worker" else SINCE["bpf_loop"]
    if v < need:
        what = "UDP GRO for the results" if role == "worker" else "bpf_loop for the aggregator's batches"
        return fail("kernel", f"Linux {release}: older than {_v(need)}, which {what} needs",
                    f"run a kernel of {_v(need)} or later (Debian 12 backports, Ubuntu 22.04 HWE)")
    extra = "" if v >= SINCE["xdp_frags"] else f"; multi-buffer XDP needs {_v(SINCE['xdp_frags'])}"
    return ok("kernel", f"Linux {release} (bpf_loop from 5.17, multi-buffer XDP from 5.18){extra}")


def check_jit(value: str | None) -> Check:
    if value is not None and value.strip() in ("1", "2"):
        return ok("bpf-jit", "the BPF JIT is on")
    return warn("bpf-jit", "the BPF JIT is off: the interpreter runs the programs several times slower",
                "sysctl -w net.core.bpf_jit_enable=1")


def bpffs_mounted(mounts: str, where: str = "/sys/fs/bpf") -> bool:
    return any(len(f) > 2 and f[1] == where and f[2] == "bpf" for f in (line.split() for line in mounts.splitlines()))


def check_bpffs(mounts: str, root: bool) -> Check:
    if bpffs_mounted(mounts):
        return ok("bpffs", "the BPF filesystem is mounted on /sys/fs/bpf")
    if root:
        return ok("bpffs", "/sys/fs/bpf is not mounted yet: agg load and agg serve mount it (as root) to pin")
    return warn("bpffs", "/sys/fs/bpf is not mounted, and this process may not mount it",
                "mount -t bpf bpf /sys/fs/bpf (or an /etc/fstab line: bpf /sys/fs/bpf bpf defaults 0 0)")


def check_btf(vmlinux: bool) -> Check:
    if vmlinux:
        return ok("btf", "kernel BTF at /sys/kernel/btf/vmlinux")
    return warn("btf", "no /sys/kernel/btf/vmlinux (CONFIG_DEBUG_INFO_BTF): bcc still emits the BTF of the "
                       "spin-locked maps, which the bpf_loop probe below loads",
                "a kernel built with CONFIG_DEBUG_INFO_BTF=y (every major distribution's)")


def check_probe(name: str, result: bool | None, release: str, need: tuple[int, int], what: str,
                required: bool) -> Check:
    """A probe's verdict; where it could not run (no privilege), the kernel version's."""
    if result:
        return ok(name, f"a program using it loads (probed, never attached): {what}")
    if result is None:
        have = version(release) >= need
        how = f"not probed (no privilege to load a program): Linux {_v(version(release))} " \
              f"{'has' if have else 'lacks'} it (since {_v(need)})"
        if have:
            return ok(name, f"{how}: {what}")
    else:
        how = f"the kernel refused a program using it (since {_v(need)})"
    status = fail if required else warn
    return status(name, f"{how}: {what}", f"a kernel of {_v(need)} or later")


def check_bcc(spec_origin: str | None) -> Check:
    if spec_origin and (Path(spec_origin).parent / "libbcc.py").exists():
        return ok("bcc", f"bcc is importable ({Path(spec_origin).parent})")
    if spec_origin:
        return fail("bcc", f"the module named bcc at {spec_origin} is not BCC (the PyPI package bcc is unrelated)",
                    "pip uninstall bcc; apt-get install python3-bpfcc; a venv made with --system-site-packages")
    return fail("bcc", "bcc is not importable: the aggregator's programs are compiled and loaded with it",
                "apt-get install python3-bpfcc, and a venv made from /usr/bin/python3 --system-site-packages "
                "(scripts/setup.sh does both)")


def check_headers(release: str, build: bool) -> Check:
    if build:
        return ok("headers", f"kernel headers at /lib/modules/{release}/build (bcc compiles against them)")
    return fail("headers", f"no /lib/modules/{release}/build: bcc cannot compile the programs",
                f"apt-get install linux-headers-{release}, or scripts/setup.sh (links Debian's headers "
                f"when none match the running kernel)")


def cap_eff(status: str) -> int:
    """The effective capabilities (CapEff) of a /proc/PID/status text."""
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", status, re.M)
    return int(m.group(1), 16) if m else 0


def has(caps: int, bit: int) -> bool:
    return bool(caps >> bit & 1)


def check_privileges(caps: int, euid: int, role: str | None) -> Check:
    names = {"CAP_BPF": CAP_BPF, "CAP_NET_ADMIN": CAP_NET_ADMIN, "CAP_SYS_ADMIN": CAP_SYS_ADMIN}
    missing = [n for n, b in names.items() if not has(caps, b)]
    who = "root" if euid == 0 else f"uid {euid}"
    if not missing:
        return ok("privileges", f"{who} with CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN")
    if role == "worker":
        return ok("privileges", f"{who} without {', '.join(missing)}: enough for a worker in aggregator mode "
                                f"(the ring mode loads XDP: it needs CAP_BPF and CAP_NET_ADMIN)")
    return fail("privileges", f"{who} without {', '.join(missing)}: the aggregator loads and attaches XDP, pins "
                              f"maps and enters namespaces", "run it as root (sudo), or under systemd as User=root")


def umem_bytes(source: str) -> int:
    """Bytes of one queue's UMEM in the AF_XDP engine's C source (AFX_FRAMES x AFX_FRAME)."""
    defs = dict(re.findall(r"#define\s+(AFX_FRAMES?)\s+(\d+)u?", source))
    return int(defs.get("AFX_FRAMES", 0)) * int(defs.get("AFX_FRAME", 0))


def check_memlock(soft: int, caps: int, release: str, umem: int, queues: int, role: str | None) -> Check:
    """RLIMIT_MEMLOCK: maps are charged to it before 5.11 (to the memory cgroup since); the
    AF_XDP engine's UMEM (``umem`` bytes per receive queue) still is, without CAP_IPC_LOCK."""
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"
    need = umem * max(queues, 1)
    if role == "worker":
        return ok("memlock", f"RLIMIT_MEMLOCK {limit}: a worker locks no memory")
    if soft == resource.RLIM_INFINITY or has(caps, CAP_IPC_LOCK):
        why = "unlimited" if soft == resource.RLIM_INFINITY else f"{limit}, but CAP_IPC_LOCK lifts it"
        return ok("memlock", f"RLIMIT_MEMLOCK {why}: maps and the AF_XDP engine's UMEM "
                             f"({need // MIB} MiB for {max(queues, 1)} queue(s)) fit")
    short = []
    if version(release) < SINCE["memcg_maps"] and soft < 64 * MIB:
        short.append("the aggregator's maps (charged to it before 5.11)")
    if soft < need:
        short.append(f"the AF_XDP engine's UMEM ({need // MIB} MiB for {max(queues, 1)} queue(s))")
    if not short:
        return ok("memlock", f"RLIMIT_MEMLOCK {limit}: enough for the maps and the UMEM")
    return warn("memlock", f"RLIMIT_MEMLOCK {limit} is too small for {' and '.join(short)}",
                "ulimit -l unlimited, or LimitMEMLOCK=infinity in the systemd unit (the example has it)")


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def kernel_checks(role: str | None, queues: int = 1) -> list[Check]:
    """The kernel's and the process's checks, read from the live system."""
    from nicoffload.afxdp import build

    release = os.uname().release
    caps = cap_eff(_read("/proc/self/status") or "")
    aggregator = role != "worker"
    may_load = has(caps, CAP_BPF) or has(caps, CAP_SYS_ADMIN)  # else the probes are not tried (None)
    out = [check_kernel(release, role), check_privileges(caps, os.geteuid(), role)]
    out += [check_jit(_read("/proc/sys/net/core/bpf_jit_enable")),
            check_bpffs(_read("/proc/mounts") or "", os.geteuid() == 0),
            check_btf(Path("/sys/kernel/btf/vmlinux").exists()),
            check_probe("bpf_loop", probe.bpf_loop() if may_load else None, release, SINCE["bpf_loop"],
                        "the aggregator walks a frame's records with it" if aggregator else
                        "the ring mode's program walks a frame's records with it (aggregator mode needs none)",
                        required=aggregator),
            check_probe("xdp-frags", probe.xdp_frags() if may_load else None, release, SINCE["xdp_frags"],
                        "multi-buffer XDP: native mode above a ~3.5 KB MTU (jumbo frames), the AF_XDP engine's "
                        "large frames", required=False)]
    if aggregator:
        spec = importlib.util.find_spec("bcc")
        out += [check_bcc(spec.origin if spec else None),
                check_headers(release, Path(f"/lib/modules/{release}/build").exists())]
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    out.append(check_memlock(soft, caps, release, umem_bytes(_read(str(build.LIMITS)) or ""), queues, role))
    return out
