"""The eBPF plumbing every program's control plane stands on.

    loader     bcc: compile with a job's constants, load with the verifier log captured, attach
               XDP inside a network namespace, an attachment that detaches idempotently, pin
               directories (bcc is imported lazily)
    linker     programs with bpf_loop callbacks, which bcc cannot link: link and load them
    tc         the toolkit's tc ingress filters (unicast delivery's clones): attach, list, detach
    libbpf     the one ctypes binding of Debian's libbpf.so.1: load with func_info, attach by
               fd, BPF_PROG_TEST_RUN, pins, raw maps by fd, run-time stats
    iface      an interface inside a namespace: addresses, MTU, driver, the XDP mode that suits it
    loadstate  the state file that records a program loaded on an interface, for other processes

The XDP aggregator (:mod:`nicoffload.agg`) and the ring offload (:mod:`nicoffload.ring`) both
use these; nothing here knows either program.
"""
