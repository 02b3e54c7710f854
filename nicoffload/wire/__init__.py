"""The wire format: what workers, the XDP programs and the user-space aggregator agree on.

    proto    the shared constants, read from xdp/nicoffload_proto.h (the one source of truth)
             under a strict grammar: header layout, record types, ops, flags, counters
    codec    numpy encoder/decoder of records (48-byte header + int32 lanes) in batches
    quant    the fixed point that cannot overflow N ranks' int32 sum, and its error bound
    addr     IPv4 and Ethernet addresses as the wire and the BPF maps hold them
    keys     the job's 64-bit key: drawn, derived from the service's token and a nonce, parsed

Nothing here opens a socket or loads a program; everything above imports it.
"""
