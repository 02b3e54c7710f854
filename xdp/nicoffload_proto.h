/* nicoffload wire protocol: the ONLY place where kernel and Python agree on layout and constants.
 *
 * Python reads this file (nicoffload/proto.py) under a strict grammar: every line in the
 * "shared" block is either blank, a comment, or `#define AR_NAME <integer>` (decimal or hex,
 * optionally parenthesised, optionally negative). Anything else there is a build error.
 *
 * Byte order: every header field is in network byte order (big endian). The payload is an
 * array of little-endian int32 (the byte order of every host that runs the toolkit, so neither
 * the worker nor the XDP program converts per element).
 *
 * Header (32 bytes) after Ethernet / IPv4 (no options) / UDP (dst port AR_DEFAULT_PORT):
 *   off size field    meaning
 *    0   2   magic    AR_MAGIC
 *    2   1   version  AR_VERSION
 *    3   1   type     AR_TYPE_CONTRIB | AR_TYPE_RESULT | AR_TYPE_STATUS
 *    4   1   flags    AR_FLAG_RETX | AR_FLAG_OP_MAX
 *    5   1   set      0 or 1: which of the slot's two sets (double buffering)
 *    6   2   rank     sender rank (AR_RANK_AGG in results)
 *    8   4   job      job id
 *   12   4   slot     aggregation slot index, < slots of the job
 *   16   4   block    block index in the tensor (all contributors of a round send the same)
 *   20   4   mask     ranks expected in this round (bit r = rank r); result: ranks that contributed
 *   24   4   next_nz  sender's next non-zero block; result: minimum over the contributors
 *   28   2   count    valid elements in the payload (0: a null contribution without payload)
 *   30   2   exp      int16 quantization exponent: value = element * 2^-exp (echoed in results)
 *   32       payload  elems x int32 little endian (elems fixed per job; 0 when count == 0)
 */
#ifndef NICOFFLOAD_PROTO_H
#define NICOFFLOAD_PROTO_H

/* --- shared: begin --- */
#define AR_MAGIC 0x4E58
#define AR_VERSION 1
#define AR_DEFAULT_PORT 48879

#define AR_TYPE_CONTRIB 1
#define AR_TYPE_RESULT 2
#define AR_TYPE_STATUS 3

#define AR_FLAG_RETX 0x01
#define AR_FLAG_OP_MAX 0x02
#define AR_FLAGS_KNOWN 0x03

#define AR_RANK_AGG 0xFFFF
/* next_nz value meaning: no further non-zero block */
#define AR_NEXT_NZ_NONE 0xFFFFFFFF
#define AR_MAX_WORKERS 32

#define AR_HDR_LEN 32
#define AR_OFF_MAGIC 0
#define AR_OFF_VERSION 2
#define AR_OFF_TYPE 3
#define AR_OFF_FLAGS 4
#define AR_OFF_SET 5
#define AR_OFF_RANK 6
#define AR_OFF_JOB 8
#define AR_OFF_SLOT 12
#define AR_OFF_BLOCK 16
#define AR_OFF_MASK 20
#define AR_OFF_NEXT_NZ 24
#define AR_OFF_COUNT 28
#define AR_OFF_EXP 30

/* Ethernet + IPv4 without options + UDP, bytes before the AllReduce header */
#define AR_L2L4_LEN 42

/* Default elements per packet (int32): 256 = 1 KiB of payload */
#define AR_DEFAULT_ELEMS 256
/* Largest MTU native XDP accepts on veth (bytes); payload bound = MTU - 20 - 8 - AR_HDR_LEN */
#define AR_MAX_MTU 3506

/* Per-CPU counters (stats map index). */
#define AR_STAT_RX 0
#define AR_STAT_AGGREGATED 1
#define AR_STAT_COMPLETED 2
#define AR_STAT_RESULT_SENT 3
#define AR_STAT_RETX_ANSWERED 4
#define AR_STAT_DUP_DROPPED 5
#define AR_STAT_PASSED 6
#define AR_STAT_BAD_TRUNCATED 7
#define AR_STAT_BAD_MAGIC 8
#define AR_STAT_BAD_VERSION 9
#define AR_STAT_BAD_TYPE 10
#define AR_STAT_BAD_FLAGS 11
#define AR_STAT_BAD_JOB 12
#define AR_STAT_BAD_RANK 13
#define AR_STAT_BAD_SLOT 14
#define AR_STAT_BAD_SET 15
#define AR_STAT_BAD_LEN 16
#define AR_STAT_BAD_MASK 17
#define AR_STAT_BAD_SRC 18
#define AR_STAT_MISMATCH 19
#define AR_STAT_NO_JOB 20
#define AR_STAT_TX_FAILED 21
#define AR_STAT_NULL 22
#define AR_STAT_STATUS_SENT 23
#define AR_STAT__COUNT 24

/* Fault injector counters (testbed). */
#define AR_FAULT_SEEN 0
#define AR_FAULT_DROPPED 1
#define AR_FAULT_DUPLICATED 2
#define AR_FAULT_PASSED 3
#define AR_FAULT__COUNT 4
/* --- shared: end --- */

#endif
