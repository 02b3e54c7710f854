"""The lab: everything that runs experiments on top of the core (the wire format, worker,
aggregators and testbed), and nothing the core needs. The ``nicoffload`` commands that run jobs
(``allreduce``, ``demo``, ``bench``, ``train-demo``, ``agg bench``) only parse their arguments and
call these modules.

Jobs on a testbed
    launcher     start rank processes in testbed namespaces; deadlines; failures by exit code
    aggregators  the aggregator of a job: XDP loaded here, or the user-space aggregator process
    jobs         one AllReduce job: ``nicoffload worker`` ranks + an aggregator, reports gathered
    links        GRO on the workers' links; a record of every link's offloads and XDP
    counters     CPU ticks, interface bytes, BPF run time, timed AllReduces
    inputs       sizes, .npy inputs read and checked, seeded gradients
    reference    expected results and error bounds (the one home of both)
    allreduce    ``allreduce`` and ``demo``: arrays through a testbed, checked

The bench (``nicoffload bench``)
    plan         configuration, the points of each testbed, rates, shaped bounds (pure)
    systems      xdp, userspace, ring, gloo, mpi: can it run here, how its ranks start
    ranks        one rank of a bench run, an adapter per system (``python -m nicoffload.lab.ranks``)
    tcpring      the TCP Ring AllReduce baseline (``python -m nicoffload.lab.tcpring``)
    rankprog     the command line tcpring's and udpring's rank programs share
    sweep        every system over the points of each testbed
    report       rows, results.json/csv, meta.json, tables, progress
    plot         the bench's plots

Other experiments
    soak         N AllReduces under drop and duplication, every result checked (``bench --soak``)
    soakreport   the soak's summary: call records, time distributions, worst call, its table
    tenants      J jobs at once on one XDP aggregator against one alone (``bench --tenants``)
    xdpbench     in-kernel cost of the XDP program and its optimizer (``nicoffload agg bench``)
    ddp_rank     one DDP training rank (``python -m nicoffload.lab.ddp_rank``), also with the
                 optimizer in the aggregator
    ddp_train    N DDP ranks on a testbed: gloo vs nicoffload, or torch.optim.SGD vs the optimizer
                 in the XDP and user-space aggregators, summarized and plotted
"""
