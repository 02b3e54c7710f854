"""``nicoffload agg serve``: the XDP aggregator as a service (jobs over an authenticated HTTP
API, leases, Prometheus metrics) until SIGTERM/SIGINT; the service itself is
:mod:`nicoffload.service` (docs/service.md)."""
from __future__ import annotations

from nicoffload.cli.app import add_examples
from nicoffload.cli.xdp import MODES, where_arguments
from nicoffload.jobspec import DEFAULT


def register(asub) -> None:
    q = asub.add_parser("serve", help="run the aggregator as a service: jobs over an HTTP API, leases, metrics",
                        description="Load the XDP aggregator on --iface as a shared pool (or take over the one an "
                                    "earlier service left there) and serve its jobs over an authenticated HTTP API "
                                    "until SIGTERM/SIGINT; then unload and leave nothing (docs/service.md).")
    add_examples(q, "sudo nicoffload agg serve --iface eth0 --listen 10.0.0.100:7470 "
                    "--token-file /etc/nicoffload/token --tls-cert /etc/nicoffload/tls.crt "
                    "--tls-key /etc/nicoffload/tls.key",
                 "sudo nicoffload agg serve --netns nco-tb-agg --iface eth0 --listen 10.199.0.100:7470 "
                 "--token-file token --slots 8192",
                 "curl --cacert ca.crt -H \"Authorization: Bearer $(cat token)\" https://10.0.0.100:7470/v1/jobs")
    where_arguments(q, "interface the aggregator runs on")
    q.add_argument("--listen", required=True, metavar="ADDR:PORT",
                   help="where the HTTP API listens (inside --netns when given)")
    q.add_argument("--token-file", required=True, metavar="FILE",
                   help="the bearer token every control request must carry (one word, 16+ characters)")
    q.add_argument("--slots", type=int, default=4096, help="slots of the shared pool (default 4096)")
    q.add_argument("--job-slots", type=int, default=DEFAULT.slots,
                   help=f"a job's share unless it asks for one (default {DEFAULT.slots}; less if less is free)")
    q.add_argument("--elems", type=int, default=DEFAULT.elems,
                   help=f"int32 elements per packet (default {DEFAULT.elems})")
    q.add_argument("--port", type=int, default=DEFAULT.port, help=f"the aggregator's UDP port (default {DEFAULT.port})")
    q.add_argument("--mode", choices=MODES, default="auto", help="XDP attach mode")
    q.add_argument("--lease", type=float, default=30.0, metavar="SECONDS",
                   help="a job whose owner neither renews nor sends for this long is removed (default 30)")
    q.add_argument("--no-optimizer", action="store_true",
                   help="no room for optimizer state (jobs cannot carry an optimizer)")
    q.add_argument("--keep-loaded", action="store_true",
                   help="on SIGTERM/SIGINT leave the aggregator and its jobs pinned for the next service")
    q.add_argument("--no-multicast", action="store_true",
                   help="the network carries no multicast: every job gets unicast delivery (a copy of each result "
                        "to every rank's address, cloned in the aggregator's kernel)")
    q.add_argument("--fallback", choices=["afxdp"], default=None,
                   help="a job the XDP pool refuses (no free slots or job entry) is served by the AF_XDP engine "
                        "beside the aggregator instead of refused (its grant says engine \"afxdp\"; optimizer "
                        "jobs are still refused)")
    q.add_argument("--tls-cert", default=None, metavar="FILE",
                   help="the service's certificate chain (PEM): the API speaks HTTPS; clients verify it against "
                        "NICOFFLOAD_CA_FILE or the system's CAs (without TLS the token crosses the network in clear)")
    q.add_argument("--tls-key", default=None, metavar="FILE", help="the certificate's private key (PEM)")
    q.add_argument("--verbose", action="store_true")
    q.set_defaults(func=_serve)


def _serve(args) -> int:
    from nicoffload.service.run import ServeOptions, configure_logging, serve

    configure_logging(args.verbose)
    o = ServeOptions(iface=args.iface, netns=args.netns, listen=args.listen, token_file=args.token_file,
                     slots=args.slots, job_slots=args.job_slots, elems=args.elems, port=args.port, mode=args.mode,
                     lease_s=args.lease, optimizer=not args.no_optimizer, keep_loaded=args.keep_loaded,
                     multicast=not args.no_multicast, fallback=args.fallback, tls_cert=args.tls_cert,
                     tls_key=args.tls_key)
    if args.fallback == "afxdp":
        from nicoffload.afxdp import build

        build.library_path()  # built (or found) now: a host that cannot build it says so before serving
    return serve(o, ready=lambda url: print(f"nicoffload agg serve: ready at {url}", flush=True))
