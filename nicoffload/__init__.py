"""nicoffload: eBPF/XDP in-network AllReduce on any Linux NIC."""

__version__ = "0.1.0"
