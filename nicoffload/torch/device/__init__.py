"""Tensors on a device (CUDA) in the backend: the fixed point encoded where the tensor lives, and
only integers crossing to the host (issue 34).

    codec   the aggregator's fixed point as torch operations on any device, bit for bit the numba
            kernels': block metadata, the lanes given the group's exponents, the decode of sums
    path    the backend's (and the DDP hook's) all-reduce of a device tensor: metadata and lanes
            encoded on the device, copied once to pinned host memory, summed through the
            communicator's int32 MAX and SUM, copied back once and decoded there, chunks
            pipelined on a CUDA stream (a group of one host: straight into and out of its shared
            segment); NICOFFLOAD_DEVICE_PATH=auto|host|device
    pinning the shared segment registered with the GPU, so its copies are DMA
    gloo    device tensors on the internal gloo group: the calls gloo copies through the host
            itself, and host copies of ours for the others

Nothing here is imported by this package's ``__init__`` (the backend imports ``path``, the gloo
path imports ``gloo``).
"""
