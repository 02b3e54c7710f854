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
    rings        the ring programs of a testbed's workers, ring jobs

The bench (``nicoffload bench``): the subpackage :mod:`nicoffload.lab.bench` (plan, systems,
    ranks and their adapters, the ring baselines' rank programs, the compute loop, sweep, systemrun,
    report, plot)

Other experiments
    soak         N AllReduces under drop and duplication, every result checked (``bench --soak``)
    soakreport   the soak's summary: call records, time distributions, worst call, its table
    tenants      J jobs at once on one XDP aggregator against one alone (``bench --tenants``)
    xdpbench     in-kernel cost of the XDP program and its optimizer (``nicoffload agg bench``)

Training (the subpackage :mod:`nicoffload.lab.train`): DDP/FSDP ranks, ``train-demo``, the aggregator
    service and torchrun on a testbed, the torch backend's overhead
"""
