/* nicoffload wire protocol: the ONLY place where kernel and Python agree on layout and constants.
 *
 * Python reads this file (nicoffload/wire/proto.py) under a strict grammar: every line in the
 * "shared" block is either blank, a comment, or `#define AR_NAME <integer>` (decimal or hex,
 * optionally parenthesised, optionally negative). Anything else there is a build error.
 *
 * Byte order: every header field is in network byte order (big endian). The payload is an
 * array of little-endian int32 (the byte order of every host that runs the toolkit, so neither
 * the worker nor the XDP program converts per element).
 *
 * A datagram (UDP payload, destination port AR_DEFAULT_PORT or the one the aggregator was
 * built with) is one or more RECORDS of equal size, back to back: a worker's UDP_SEGMENT send
 * is such a batch until something segments it. Record = header (48 bytes) + payload.
 *   off size field    meaning
 *    0   2   magic    AR_MAGIC
 *    2   1   version  AR_VERSION
 *    3   1   type     AR_TYPE_*
 *    4   1   flags    AR_FLAG_RETX | AR_FLAG_PULL
 *    5   1   set      0 or 1: which of the slot's two sets (double buffering)
 *    6   2   rank     sender rank (AR_RANK_AGG in results; the requester's rank in a STATUS)
 *    8   4   job      job id (the aggregator's job table)
 *   12   4   epoch    the run this record belongs to (JOINED hands it out; 0 in a JOIN)
 *   16   4   slot     slot index inside the job's share of the pool, < slots of the job
 *   20   4   round    round number within the epoch (running counter; JOIN: nonce low word)
 *   24   4   mask     ranks expected in the round (bit r = rank r); RESULT/STATUS: ranks that
 *                     contributed; JOIN: every rank of the job as the worker sees it
 *   28   4   ack      sender's head: it holds the result of every round below this one
 *                     (RESULT: the job's gate, the lowest head of its ranks: a worker sends no
 *                     round at or beyond gate + 2 * slots; JOIN: nonce high word). An ACK with
 *                     RETX asks for the gate: the answer is the ACK from AR_RANK_AGG with it
 *   32   2   count    valid elements in the payload (results: as contributed)
 *   34   2   exp      int16 quantization exponent, echoed in results
 *   36   1   op       AR_OP_*: how the round combines payloads
 *   37   1   detail   STATUS only: AR_DETAIL_*, why the round cannot be answered
 *   38   2   pad      0
 *   40   8   key      the job's secret (the job table holds it): a record whose key is not its
 *                     job's is dropped (bad_key) before it touches a slot; the aggregator's
 *                     answers keep it. 0: a job registered without a key (and ring records)
 *   48       payload  CONTRIB/RESULT/STATUS: elems x int32 (elems fixed per aggregator build);
 *                     JOIN/JOINED: AR_JOIN_PAYLOAD bytes (JOINED: the nonce of every rank,
 *                     u64 little endian, index = rank); ACK: none
 *
 * A PROBE is a PULL without payload (a datagram of exactly one header): it asks what the round
 * lacks, and is answered by a header-only STATUS (WAITING with the contributors so far, DONE,
 * GONE, MISMATCH or EPOCH), never by a result. A rank that finds a round lost probes first and
 * resends its record only if its own bit is missing: one lost record costs one resend, not one
 * per rank (docs/protocol.md, "Probes").
 */
#ifndef NICOFFLOAD_PROTO_H
#define NICOFFLOAD_PROTO_H

/* --- shared: begin --- */
#define AR_MAGIC 0x4E58
#define AR_VERSION 3
#define AR_DEFAULT_PORT 48879

/* record types */
#define AR_TYPE_CONTRIB 1
#define AR_TYPE_RESULT 2
#define AR_TYPE_STATUS 3
#define AR_TYPE_JOIN 4
#define AR_TYPE_JOINED 5
#define AR_TYPE_ACK 6
/* a record of a batch that needs no answer: every receiver skips it */
#define AR_TYPE_NOP 7

/* flags of a CONTRIB */
#define AR_FLAG_RETX 0x01
/* a request for a round's result from a rank that does not contribute to it (payload ignored) */
#define AR_FLAG_PULL 0x02
#define AR_FLAGS_KNOWN 0x03
/* set by the aggregator on a RESULT or JOINED that answers a retransmission or a pull (a */
/* repeat for one rank, by unicast), never on a round's first delivery: a worker that gets */
/* only answers learns that first deliveries do not reach it */
#define AR_FLAG_ANSWER 0x04

/* how a job's results reach its ranks: one frame to its multicast group, which the fabric */
/* fans out; or one copy per rank to its registered address, cloned in the aggregator's tc */
#define AR_DELIVERY_MULTICAST 0
#define AR_DELIVERY_UNICAST 1

/* ops: how a round combines the contributors' payloads */
/* int32 lanes, wrapping modulo 2^32 */
#define AR_OP_SUM 0
/* 64-bit words (two int32 lanes each); the sender guarantees that no lane carries */
#define AR_OP_SUM64 1
/* signed int32 maximum */
#define AR_OP_MAX 2
/* bitwise or */
#define AR_OP_OR 3
/* SUM64 of pre-averaged gradients, then the job's optimizer on the round's block: */
/* the RESULT carries the updated parameters (int32 lanes, value = lane * 2^exp) */
#define AR_OP_SGD 4
/* 64-bit words of four offset-binary 16-bit lanes, added as SUM64 (the sender guarantees that no */
/* lane carries); a record carries up to 2 * AR_ELEMS elements */
#define AR_OP_SUM16 5
#define AR_OP__COUNT 6

/* optimizers a job can be registered with (nicoffload/optim.py has the arithmetic) */
#define AR_OPT_NONE 0
#define AR_OPT_SGD 1
#define AR_OPT_ADAMW 2
/* optimizer flags */
#define AR_OPT_NESTEROV 1
#define AR_OPT_AMSGRAD 2
#define AR_OPT_MAXIMIZE 4
/* fractional bits of the master weights, the momentum and the hyperparameters (int64 fixed point) */
#define AR_OPT_FRAC 32
/* gradients and parameters an optimizer job accepts: |value| < 2^AR_OPT_RANGE */
#define AR_OPT_RANGE 20
/* AdamW: fractional bits of the first moment m and of s = sqrt(second moment) (|m|, s < 2^62) */
#define AR_ADAM_FRAC 42
/* AdamW: fractional bits of eps (eps < 1) */
#define AR_ADAM_EPS_FRAC 62

/* STATUS details */
/* the round has not completed: mask = who has contributed */
#define AR_DETAIL_WAITING 1
/* the record's epoch is not the job's current one (the job was restarted or reloaded) */
#define AR_DETAIL_EPOCH 2
/* a JOIN whose mask is not the job's set of ranks */
#define AR_DETAIL_WORLD 3
/* a JOIN from an older process of a rank that a newer process has taken over */
#define AR_DETAIL_SUPERSEDED 4
/* the round's result was overwritten by a later round of the slot */
#define AR_DETAIL_GONE 5
/* an epoch is forming: mask = the ranks that have joined */
#define AR_DETAIL_JOINING 6
/* the ranks disagree on the round (op, exp, count or mask differ): mask = who it took; it never completes */
#define AR_DETAIL_MISMATCH 7
/* a PROBE's answer: the round is complete (its result was lost on the way: pull it in full) */
#define AR_DETAIL_DONE 8

#define AR_RANK_AGG 0xFFFF
#define AR_MAX_WORKERS 32
/* jobs one aggregator serves at once (job table entries) */
#define AR_MAX_JOBS 16

#define AR_HDR_LEN 48
#define AR_OFF_MAGIC 0
#define AR_OFF_VERSION 2
#define AR_OFF_TYPE 3
#define AR_OFF_FLAGS 4
#define AR_OFF_SET 5
#define AR_OFF_RANK 6
#define AR_OFF_JOB 8
#define AR_OFF_EPOCH 12
#define AR_OFF_SLOT 16
#define AR_OFF_ROUND 20
#define AR_OFF_MASK 24
#define AR_OFF_ACK 28
#define AR_OFF_COUNT 32
#define AR_OFF_EXP 34
#define AR_OFF_OP 36
#define AR_OFF_DETAIL 37
#define AR_OFF_PAD 38
#define AR_OFF_KEY 40
/* JOIN and JOINED carry the nonce table: AR_MAX_WORKERS x u64 (bytes) */
#define AR_JOIN_PAYLOAD 256

/* Ethernet + IPv4 without options + UDP, bytes before the first record */
#define AR_L2L4_LEN 42
/* the largest offset the verifier lets a program reach in a packet (bytes) */
#define AR_MAX_PACKET_OFF 65535

/* Default elements per record (int32): 256 = 1 KiB of payload; elems must be even */
#define AR_DEFAULT_ELEMS 256
/* Largest MTU native XDP accepts on veth (bytes); payload bound = MTU - 20 - 8 - AR_HDR_LEN */
#define AR_MAX_MTU 3506

/* Counters, per job and per CPU (stats map row = job index + 1; row 0: no job known). */
#define AR_STAT_RX 0
#define AR_STAT_RECORDS 1
#define AR_STAT_AGGREGATED 2
#define AR_STAT_COMPLETED 3
#define AR_STAT_RESULT_SENT 4
#define AR_STAT_RETX_ANSWERED 5
#define AR_STAT_PULL_ANSWERED 6
#define AR_STAT_STATUS_SENT 7
#define AR_STAT_DUP_DROPPED 8
#define AR_STAT_PASSED 9
#define AR_STAT_JOIN 10
#define AR_STAT_EPOCH_FORMED 11
#define AR_STAT_ACK 12
#define AR_STAT_BAD_TRUNCATED 13
#define AR_STAT_BAD_MAGIC 14
#define AR_STAT_BAD_VERSION 15
#define AR_STAT_BAD_TYPE 16
#define AR_STAT_BAD_FLAGS 17
#define AR_STAT_BAD_JOB 18
#define AR_STAT_BAD_RANK 19
#define AR_STAT_BAD_SLOT 20
#define AR_STAT_BAD_SET 21
#define AR_STAT_BAD_LEN 22
#define AR_STAT_BAD_MASK 23
#define AR_STAT_BAD_SRC 24
#define AR_STAT_BAD_OP 25
#define AR_STAT_BAD_MIXED 26
#define AR_STAT_STALE_EPOCH 27
#define AR_STAT_STALE_ROUND 28
#define AR_STAT_STALE_JOIN 29
#define AR_STAT_EARLY 30
#define AR_STAT_MISMATCH 31
#define AR_STAT_TX_FAILED 32
/* optimizer updates applied (one per completed round of an optimizer job) */
#define AR_STAT_UPDATED 33
/* unicast copies of a result frame sent to the ranks (unicast delivery, ar_fanout) */
#define AR_STAT_COPIES 34
/* records whose key is not their job's (a host that lacks the job's secret), dropped */
#define AR_STAT_BAD_KEY 35
/* PROBEs answered with what their round lacks (each also counts in status_sent) */
#define AR_STAT_PROBED 36
#define AR_STAT__COUNT 37

/* Fault injector counters (testbed). */
#define AR_FAULT_SEEN 0
#define AR_FAULT_DROPPED 1
#define AR_FAULT_DUPLICATED 2
#define AR_FAULT_PASSED 3
#define AR_FAULT__COUNT 4

/* --- ring offload (DirectReduce, docs/ring.md): records between the workers' ring programs --- */
/* A ring record has the header above: rank = the node that sent this hop, epoch = the call */
/* (the AllReduce pass both hosts count), slot = round = the record's index in the call's tensor, */
/* mask = 1 << origin (the node whose chunk it is: its reduce starts there), count/exp/op as in */
/* a CONTRIB. PING and PONG are header only; the others have the full record size. */
/* a partial sum on its reduce-scatter journey: each node adds its own record and sends it on */
#define AR_TYPE_RING_REDUCE 16
/* the final sum on its all-gather journey: each node stores it and sends it on */
#define AR_TYPE_RING_GATHER 17
/* a request for a record the sender misses; the answerer fills it in and sends it on */
#define AR_TYPE_RING_NACK 18
/* a host asks a node's ring program for its state */
#define AR_TYPE_RING_PING 19
/* the answer: epoch = the node's call, slot = records stored, round = records expected */
#define AR_TYPE_RING_PONG 20
/* NACK flag: restart the record's reduce at its origin (else: send the stored final) */
#define AR_RING_FLAG_RESTART 0x01
/* a record of a frame that needs nothing any more (a node dropped it and left it in place) */
#define AR_RING_FLAG_SKIP 0x02
/* records a ring program holds per call unless built with another capacity */
#define AR_RING_DEFAULT_CAPACITY 16384
/* Ring program counters, per CPU (one row). Every record examined ends in exactly one of the */
/* outcomes reduced .. bad_mixed; rx, records, forwarded, wakeups and passed count besides. */
#define AR_RING_STAT_RX 0
#define AR_RING_STAT_RECORDS 1
#define AR_RING_STAT_FORWARDED 2
#define AR_RING_STAT_WAKEUPS 3
#define AR_RING_STAT_PASSED 4
#define AR_RING_STAT_REDUCED 5
#define AR_RING_STAT_FINAL 6
#define AR_RING_STAT_GATHERED 7
#define AR_RING_STAT_DUP 8
#define AR_RING_STAT_PARKED 9
#define AR_RING_STAT_STALE 10
#define AR_RING_STAT_RESTARTED 11
#define AR_RING_STAT_RESENT 12
#define AR_RING_STAT_UNANSWERED 13
#define AR_RING_STAT_PING 14
#define AR_RING_STAT_RACE 15
#define AR_RING_STAT_MISMATCH 16
#define AR_RING_STAT_BAD_TRUNCATED 17
#define AR_RING_STAT_BAD_MAGIC 18
#define AR_RING_STAT_BAD_VERSION 19
#define AR_RING_STAT_BAD_FLAGS 20
#define AR_RING_STAT_BAD_JOB 21
#define AR_RING_STAT_BAD_RANK 22
#define AR_RING_STAT_BAD_SRC 23
#define AR_RING_STAT_BAD_HOP 24
#define AR_RING_STAT_BAD_SLOT 25
#define AR_RING_STAT_BAD_ORIGIN 26
#define AR_RING_STAT_BAD_LEN 27
#define AR_RING_STAT_BAD_OP 28
#define AR_RING_STAT_BAD_MIXED 29
#define AR_RING_STAT__COUNT 30
/* The ring program's state shared with its host (an mmap-able map of u32 words, index AR_RING_ST_*) */
/* the call this node's host is in (host) */
#define AR_RING_ST_CALL 0
/* records of the call every node stores (host) */
#define AR_RING_ST_EXPECTED 1
/* records of the call stored by the program (program, atomic) */
#define AR_RING_ST_STORED 2
/* ... stored by the host (records it took over, see docs/ring.md) */
#define AR_RING_ST_HOST_STORED 3
/* finals of this node's own chunk stored by the program (program, atomic) */
#define AR_RING_ST_OWN_STORED 4
/* ... by the host */
#define AR_RING_ST_HOST_OWN 5
/* wake the host once this many finals of its own chunk are stored (its send window) */
#define AR_RING_ST_OWN_WAKE 6
#define AR_RING_ST__WORDS 16
/* events the program puts in its ring buffer (u32 call, u32 what: a mask of these) */
#define AR_RING_EV_DONE 1
#define AR_RING_EV_WINDOW 2
/* --- shared: end --- */

#endif
