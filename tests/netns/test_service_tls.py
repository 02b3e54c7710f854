"""``nicoffload agg serve --tls-cert FILE --tls-key FILE``: the API over HTTPS, with a CA and a
server certificate made here (``openssl``): the client verifies the certificate against
``NICOFFLOAD_CA_FILE`` (or ``--ca-file``) and then works as over HTTP (a granted job sums
exactly, its key derived from the grant and the token); a certificate another CA signed, or one
the system's CAs do not know, is refused with one line; plain HTTP to the TLS port is not
answered."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from e2ekit import run_ranks

from nicoffload.errors import SetupError
from nicoffload.lab.train.torchrun import ServiceProcess, write_token
from nicoffload.service.api import JobRequest
from nicoffload.service.client import ServiceClient, ServiceUnreachable
from nicoffload.worker import Communicator

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA: (its certificate, its key)."""
    crt, key = d / f"{name}.crt", d / f"{name}.key"
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
            "-subj", f"/CN=nicoffload test {name}", "-keyout", str(key), "-out", str(crt))
    return crt, key


def make_server_cert(d: Path, ca: tuple[Path, Path], ip: str) -> tuple[Path, Path]:
    """A certificate for the service at ``ip`` (its subjectAltName), signed by ``ca``."""
    crt, key, csr, ext = d / "service.crt", d / "service.key", d / "service.csr", d / "service.ext"
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", "/CN=aggregator",
            "-keyout", str(key), "-out", str(csr))
    ext.write_text(f"subjectAltName = IP:{ip}\nextendedKeyUsage = serverAuth\n")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial", "-days", "1",
            "-extfile", str(ext), "-out", str(crt))
    key.chmod(0o600)
    return crt, key


def test_the_service_over_https_verified_against_its_ca(make_testbed, tmp_path):
    tb = make_testbed(2)
    ca, other = make_ca(tmp_path, "ca"), make_ca(tmp_path, "other-ca")
    crt, key = make_server_cert(tmp_path, ca, tb.agg.ip)
    token_file = write_token(tmp_path)
    token = token_file.read_text().strip()
    svc = ServiceProcess(tb, token_file, tls=(crt, key, ca[0])).start()
    try:
        assert svc.url.startswith("https://") and not any("plain HTTP" in line for line in svc.log), svc.log

        def call(fn, ca_file):
            with tb.in_host(tb.workers[0]):
                return fn(ServiceClient(svc.url, token, ca_file=ca_file))

        assert call(lambda c: c.health(), ca[0])["ok"] is True
        g = call(lambda c: c.create_job(JobRequest(world=2, workers=[w.ip for w in tb.workers])), ca[0])
        xs = [np.arange(3000, dtype=np.int32) * (r + 1) for r in range(2)]
        comms = []
        for r, w in enumerate(tb.workers):
            with tb.in_host(w):
                comms.append(Communicator.from_spec(r, 2, g.aggregator, g.spec(10.0, token=token), local_ip=w.ip))
        try:
            outs, errs = run_ranks(lambda r: comms[r].allreduce(xs[r]), 2, 30)
        finally:
            for c in comms:
                c.close()
        assert not errs and all(np.array_equal(o, xs[0] + xs[1]) for o in outs), errs
        # another CA's certificate: refused in one line, naming the CA file; the system's CAs too
        for ca_file, against in ((other[0], str(other[0])), (None, "the system's CAs")):
            with pytest.raises(SetupError) as e:
                call(lambda c: c.jobs(), ca_file)
            msg = str(e.value)
            assert "\n" not in msg and "does not verify" in msg and against in msg, msg
        # plain HTTP to the TLS port gets no answer a client takes
        with pytest.raises(ServiceUnreachable), tb.in_host(tb.workers[0]):
            ServiceClient(svc.url.replace("https://", "http://"), timeout=5).health()
        # the CLI: --ca-file, and NICOFFLOAD_CA_FILE
        cli = [sys.executable, "-m", "nicoffload.cli", "agg", "job", "list", "--service", svc.url, "--token-file",
               str(token_file)]
        r = tb.run(tb.workers[0], [*cli, "--ca-file", str(ca[0])], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and str(g.job) in r.stdout, r.stderr
        r = tb.run(tb.workers[0], [*cli, "--ca-file", str(other[0])], capture_output=True, text=True, timeout=60)
        assert r.returncode == SetupError.exit_code and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "does not verify" in r.stderr and "Traceback" not in r.stderr
        r = tb.run(tb.workers[0], cli, capture_output=True, text=True, timeout=60,
                   env={**os.environ, "NICOFFLOAD_CA_FILE": str(ca[0])})
        assert r.returncode == 0, r.stderr
    finally:
        assert svc.stop() == 0


def test_tls_files_that_do_not_load_are_refused_in_one_line(make_testbed, tmp_path):
    tb = make_testbed(1)
    ca = make_ca(tmp_path, "ca")
    crt, key = make_server_cert(tmp_path, ca, tb.agg.ip)
    cli = [sys.executable, "-m", "nicoffload.cli", "agg", "serve", "--netns", tb.agg.netns, "--iface", "eth0",
           "--listen", f"{tb.agg.ip}:7470", "--token-file", str(write_token(tmp_path))]
    for extra, words in ((["--tls-cert", str(crt)], "both --tls-cert"),
                         (["--tls-cert", str(crt), "--tls-key", str(tmp_path / "none.key")], "does not exist"),
                         (["--tls-cert", str(key), "--tls-key", str(crt)], "do not load")):
        r = subprocess.run([*cli, *extra], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and words in r.stderr, r.stderr
    from nicoffload.agg import control

    assert control.loaded(tb.agg.netns) == []  # refused before anything was loaded
