"""The host's data path, shared by both communicators (the aggregator mode's
:class:`nicoffload.worker.Communicator` and the ring's :class:`nicoffload.ring.RingCommunicator`).

    kernels    numba kernels (compiled once, cached on disk): the record's byte helpers, block
               metadata in one pass, a call's rounds (speculative plan and verdict)
    encode     quantization straight into the records about to be sent (encode_float, _half, _int)
    pump       sendmmsg/recvmmsg from compiled code, results decoded straight into the output
    transport  one UDP socket per rank: UDP_SEGMENT batches out, UDP_GRO batches in, buffers
               allocated once
    tensors    what a collective takes and gives: the dtypes it sums, the input as a
               C-contiguous array with its output, the blocks' exponents (NaN/Inf refused)

Every compiled kernel here (and in local/, ring/) releases the GIL (``nogil=True``): a rank's
other threads run while it encodes, decodes or sits in sendmmsg (where, on the testbed, the
aggregator's program runs too). Those threads are torch's main thread beside the backend's, a
sharded job's one per aggregator, and ranks as threads in tests and benches.
"""
