"""The host around the interface: how the interface's interrupts spread over the CPUs
(/proc/interrupts), the CPU frequency governor, huge pages and the clock source. Parsers and
checks are pure functions of the text read, for the unit tests; :func:`host_checks` reads."""
from __future__ import annotations

import re
from pathlib import Path

from nicoffload.doctor.link import LinkFacts
from nicoffload.doctor.report import Check, ok, warn

SYS = Path("/sys")
#: clock sources read through the vDSO, without a system call
FAST_CLOCKS = ("tsc", "kvm-clock", "arch_sys_counter", "hyperv_clocksource_tsc_page", "riscv_clocksource")
VIRTUAL_KINDS = ("veth", "dummy", "bridge", "bond", "vlan", "macvlan", "ipvlan", "vxlan", "ifb", "tun")


def parse_interrupts(text: str) -> tuple[int, list[tuple[str, list[int], str]]]:
    """(CPUs, rows): each row of /proc/interrupts as (irq, counts per CPU, the rest: chip and names)."""
    lines = text.splitlines()
    if not lines:
        return 0, []
    ncpu = len(lines[0].split())
    rows = []
    for line in lines[1:]:
        irq, _, rest = line.partition(":")
        parts = rest.split()
        counts = []
        for p in parts[:ncpu]:
            if not p.isdigit():
                break
            counts.append(int(p))
        if len(counts) == ncpu:
            rows.append((irq.strip(), counts, " ".join(parts[ncpu:])))
    return ncpu, rows


def device_irqs(rows, ifname: str, bus: str) -> list[tuple[str, list[int], str]]:
    """The rows of a device: its name as a word of the row (eth0, eth0-TxRx-3), or its bus
    address (PCI-MSIX-0000:00:03.0, mlx5_comp0@pci:0000:3b:00.0)."""
    word = re.compile(rf"(^|[\s,]){re.escape(ifname)}([-_.:\s,]|$)")
    return [r for r in rows if word.search(r[2]) or (bus and bus in r[2])]


def check_irqs(f: LinkFacts, text: str) -> Check:
    if f.kind in VIRTUAL_KINDS or (not f.bus and f.kind):
        return ok("irq-spread", f"{f.name} is a virtual device ({f.kind}): no IRQs; its packets are processed on "
                                f"the sending CPU ({f.rx_queues} receive queue(s))")
    ncpu, rows = parse_interrupts(text)
    mine = device_irqs(rows, f.name, f.bus)
    if not mine:
        return ok("irq-spread", f"no IRQ of {f.name} in /proc/interrupts (a polling or virtual driver)")
    per_cpu = [sum(r[1][c] for r in mine) for c in range(ncpu)]
    busy = [c for c, n in enumerate(per_cpu) if n]
    detail = (f"{len(mine)} IRQ(s) of {f.name}, {f.rx_queues} receive queue(s); interrupts on CPU(s) "
              f"{', '.join(map(str, busy)) or 'none yet'} of {ncpu}")
    if ncpu > 1 and f.rx_queues == 1:
        mask = format((1 << ncpu) - 1, "x")
        return warn("irq-spread", detail + ": one receive queue, so one CPU takes every packet's softirq",
                    f"ethtool -L {f.name} combined {ncpu} where the NIC has more queues; else RPS: "
                    f"echo {mask} > /sys/class/net/{f.name}/queues/rx-0/rps_cpus")
    if ncpu > 1 and len(busy) == 1 and sum(per_cpu) > 1000:
        return warn("irq-spread", detail + f": every interrupt lands on CPU {busy[0]}",
                    "run irqbalance, or spread /proc/irq/N/smp_affinity_list over the CPUs")
    return ok("irq-spread", detail)


def check_governor(governors: list[str]) -> Check:
    if not governors:
        return ok("cpu-governor", "no cpufreq here (a VM, or a fixed clock)")
    kinds = sorted(set(governors))
    if kinds == ["performance"]:
        return ok("cpu-governor", f"performance on {len(governors)} CPU(s)")
    return warn("cpu-governor", f"{', '.join(kinds)} on {len(governors)} CPU(s): the clock ramps up under each "
                                f"burst of encoding, so call latencies vary",
                "cpupower frequency-set -g performance (or echo performance > "
                "/sys/devices/system/cpu/cpu*/cpufreq/scaling_governor)")


def selected(text: str) -> str:
    """The bracketed choice of a sysfs setting such as ``always [madvise] never``."""
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else text.strip()


def meminfo(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if v.split():
            out[k.strip()] = int(v.split()[0])
    return out


def check_hugepages(thp: str | None, mem: dict[str, int]) -> Check:
    reserved = mem.get("HugePages_Total", 0)
    pool = f"{reserved} hugetlb page(s) of {mem.get('Hugepagesize', 0)} kB reserved (nothing here needs them)"
    if thp is None:
        return ok("hugepages", f"no transparent huge pages in this kernel; {pool}")
    mode = selected(thp)
    if mode == "never":
        return warn("hugepages", f"transparent huge pages: never; {pool}: the worker's large buffers fault in 4 KiB "
                                 f"pages", "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled")
    return ok("hugepages", f"transparent huge pages: {mode} (numpy asks for them on large arrays); {pool}")


def check_clocksource(current: str | None, available: str = "") -> Check:
    cur = (current or "").strip()
    if not cur or cur in FAST_CLOCKS:
        return ok("clocksource", f"{cur or 'unknown'}: clock reads through the vDSO, without a system call")
    fix = ("clocksource=tsc on the kernel command line where the TSC is stable" if "tsc" in available.split()
           else "a host whose TSC is stable (or kvm-clock in a VM)")
    return warn("clocksource", f"{cur}: every clock read is a system call, and the worker reads the clock for "
                               f"its timeouts on every loop", fix)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def host_checks(f: LinkFacts | None) -> list[Check]:
    cpu = SYS / "devices/system/cpu"
    governors = [g.read_text().strip() for g in sorted(cpu.glob("cpu[0-9]*/cpufreq/scaling_governor"))]
    clock = SYS / "devices/system/clocksource/clocksource0"
    out = []
    if f is not None and f.exists:
        out.append(check_irqs(f, _read(Path("/proc/interrupts")) or ""))
    out += [check_governor(governors),
            check_hugepages(_read(SYS / "kernel/mm/transparent_hugepage/enabled"),
                            meminfo(_read(Path("/proc/meminfo")) or "")),
            check_clocksource(_read(clock / "current_clocksource"), _read(clock / "available_clocksource") or "")]
    return out
