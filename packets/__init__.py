"""Scapy layers for the nicoffload wire format and deterministic packet generators.

Importing :mod:`nicoffload.packets.layers` registers the ``AllReduce`` layer with scapy (UDP port
``AR_DEFAULT_PORT``, source or destination).
"""
