"""The job's key without a network: its derivation from the service's token and a nonce (the
HMAC written out here with the standard library, independently of the module), how people write
it, how a grant turns into the key every rank derives, how the command lines carry it, and the
user-space aggregator's check."""
from __future__ import annotations

import argparse
import hashlib
import hmac
import json

import pytest
from wirecheck import udp_of

from nicoffload.errors import InputError
from nicoffload.jobspec import DEFAULT, JobSpec
from nicoffload.packets import generators as g
from nicoffload.service.api import JobGrant
from nicoffload.wire import keys, proto

TOKEN = "a-service-token-of-24-chars"


def test_derive_is_hmac_sha256_of_label_job_and_nonce_truncated_to_64_bits():
    nonce = bytes(range(16))
    mac = hmac.new(TOKEN.encode(), b"nicoffload job key" + (7).to_bytes(4, "big") + nonce, hashlib.sha256).digest()
    assert keys.derive(TOKEN, 7, nonce) == keys.derive(TOKEN.encode(), 7, nonce.hex()) == int.from_bytes(mac[:8], "big")
    # every input matters
    others = {keys.derive(TOKEN + "x", 7, nonce), keys.derive(TOKEN, 8, nonce), keys.derive(TOKEN, 7, nonce[::-1])}
    assert keys.derive(TOKEN, 7, nonce) not in others and len(others) == 3
    with pytest.raises(InputError):
        keys.derive("", 7, nonce)
    with pytest.raises(InputError, match="not hex"):
        keys.derive(TOKEN, 7, "zz")


def test_a_fresh_nonce_derives_its_key_and_never_key_zero():
    seen = set()
    for _ in range(50):
        nonce, key = keys.new_nonce(TOKEN, 3)
        assert key and keys.derive(TOKEN, 3, nonce) == key and len(bytes.fromhex(nonce)) == keys.NONCE_BYTES
        seen.add(nonce)
    assert len(seen) == 50 and all(keys.new_key() for _ in range(50))


def test_how_people_write_a_key():
    k = 0x0123456789ABCDEF
    assert keys.show(k) == "0123456789abcdef" and keys.parse(keys.show(k)) == k
    for text in ("0x0123456789abcdef", "01234567-89abcdef", "01:23:45:67:89:ab:cd:ef", " 0123456789ABCDEF\n"):
        assert keys.parse(text) == k
    for bad in ("", "0x", "xyz", "1" * 17):
        with pytest.raises(InputError) as e:
            keys.parse(bad)
        assert bad.strip() not in str(e.value) or not bad.strip()  # a key is never echoed back
    assert keys.from_env({}) == 0 and keys.from_env({keys.ENV: "ff"}) == 0xFF
    assert keys.wire(k).to_bytes(8, "little") == k.to_bytes(8, "big")  # the table's u64 is the wire's bytes


def test_a_grant_carries_the_nonce_and_every_rank_derives_the_same_key():
    nonce, key = keys.new_nonce(TOKEN, 4)
    grant = JobGrant(job=4, world=2, aggregator="10.0.0.100", port=48879, local_port=48884, group="239.77.0.4",
                     slot_base=0, slots=64, elems=256, lease_s=30.0, key_nonce=nonce)
    text = json.dumps(grant.to_json())
    assert nonce in text and keys.show(key) not in text and str(key) not in text
    back = JobGrant.from_json(json.loads(text))  # what a rank reads from the store
    assert back.spec(10.0, token=TOKEN).key == key and back.spec(10.0, shard=1, token=TOKEN).key == key
    with pytest.raises(InputError, match="NICOFFLOAD_TOKEN_FILE"):
        back.spec(10.0)
    assert back.spec(10.0, token="another-token").key != key
    old = {k: v for k, v in grant.to_json().items() if k != "key_nonce"}  # a service without keys
    assert JobGrant.from_json(old).spec(10.0).key == 0


def test_command_lines_carry_the_key():
    p = argparse.ArgumentParser()
    JobSpec.add_arguments(p)
    assert "HEX" in p.format_help()
    k = keys.new_key()
    spec = JobSpec.from_args(p.parse_args(["--key", keys.show(k)]))
    assert spec.key == k and JobSpec.from_args(p.parse_args(spec.argv())) == spec
    assert JobSpec.from_args(p.parse_args([])).key == keys.from_env()
    assert "key" not in DEFAULT.replace(key=k).public() and DEFAULT.argv().count("--key") == 0
    with pytest.raises(SystemExit):
        p.parse_args(["--key", "not-hex"])
    with pytest.raises(InputError):
        DEFAULT.replace(key=1 << 64).validate()


def test_the_userspace_aggregator_drops_a_record_without_the_key():
    """Through its datagram handler (no socket traffic): nothing without the key touches the
    epoch or a slot, it is counted as bad_key, and the results carry the job's key."""
    from nicoffload.userspace.aggregator import UserspaceAggregator

    agg = UserspaceAggregator(workers=2, port=0, slots=8, job=1, group=g.GROUP_IP,
                              worker_ips=[g.worker_ip(r) for r in range(2)], key=g.KEY)
    sent = []
    agg._send = lambda data, dst, port: sent.append(bytes(data))
    feed = lambda f: agg.handle_datagram(memoryview(bytearray(udp_of(f)[0])), (udp_of(f)[1], proto.DEFAULT_PORT))
    try:
        for f in g.join_frames(2, key=g.KEY ^ 1):
            feed(f)
        assert agg.live == 0 and agg.stats["bad_key"] == 2 and sent == []
        for f in g.join_frames(2):
            feed(f)
        epoch = agg.live
        assert epoch and sent
        arrays = g.sample_arrays(2, 256, seed=1)
        for f in g.contributions(arrays, slots=8, epoch=epoch, key=0):
            feed(f)
        assert agg.stats["bad_key"] == 4 and agg.stats["aggregated"] == 0 and not agg._sets[0][0].epoch
        n = len(sent)
        for f in g.contributions(arrays, slots=8, epoch=epoch):
            feed(f)
        assert sent[n:] == g.expected_results(arrays, slots=8, epoch=epoch)  # with the key, as sent
    finally:
        agg.close()
