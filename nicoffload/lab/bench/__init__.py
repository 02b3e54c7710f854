"""The bench (``nicoffload bench``): systems side by side on one testbed, every result checked.

    plan      configuration, the points of each testbed, rates, shaped bounds (pure)
    systems   xdp, userspace, ring, xdpring, udpring, gloo, mpi: can it run here, how its ranks start
    ranks     one rank of a bench run: its points, timed or driven (``python -m nicoffload.lab.bench.ranks``)
    adapters  the adapter per system a rank drives: an AllReduce, the go-on barrier, counters
    hostranks K ranks per worker host (``--ranks-per-host``): shared memory inside, lanes across
    tcpring   the TCP Ring AllReduce baseline (``python -m nicoffload.lab.bench.tcpring``)
    udpring   the user-space UDP ring's rank program (``python -m nicoffload.lab.bench.udpring``)
    rankprog  the command line both ring baselines' rank programs share
    compute   a compute loop beside every rank: the share of its throughput AllReduces take
    sweep     every system over the points of each testbed, side by side (driven) or alone
    systemrun one system's ranks on one testbed: start, rows as records arrive, check, stop
    report    rows, results.json/csv, meta.json, tables, progress
    plot      the bench's plots
"""
