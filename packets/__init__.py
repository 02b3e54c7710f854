"""Scapy layers for the nicoffload wire format and deterministic packet generators.

    layers       the AllReduce scapy layer (enums, typed fields, computed fields in post_build)
    frames       default addressing; a datagram framed as a worker or the aggregator sends it
    generators   contributions, expected results, records, pulls, batches, an optimizer step
    handshake    JOIN / JOINED of the epoch handshake, ACKs
    hostile      malformed packets (one per reason the program counts) and foreign traffic
    attacks      hostile traffic sent from an attacker's own address, each with its counter
    bench_codec  the codec's speed (``python -m nicoffload.packets.bench_codec``)

Importing :mod:`nicoffload.packets.layers` registers the ``AllReduce`` layer with scapy (UDP port
``AR_DEFAULT_PORT``, source or destination).
"""
