"""What bcc is given to compile (loader.main_file): the project's own headers spliced into the
source, once each, between #line markers; system headers left as includes. bcc rewrites map
accesses and compiles programs and bpf_loop callbacks only in its main file, so this is what lets
xdp/'s headers hold them (tests/bpf loads the programs built this way)."""
from __future__ import annotations

import re

from nicoffload.ebpf.loader import main_file
from nicoffload.wire import proto


def test_own_headers_are_spliced_once_between_line_markers(tmp_path):
    (tmp_path / "a.h").write_text('#include "b.h"\nint a;\n')
    (tmp_path / "b.h").write_text("int b;")  # no newline at the end
    src = '#include <uapi/linux/bpf.h>\n#include "a.h"\n#include "b.h"\n  #  include "missing.h"\nint main_;\n'
    out = main_file(src, "p.c", tmp_path)
    assert out == ('#include <uapi/linux/bpf.h>\n'
                   '#line 1 "a.h"\n#line 1 "b.h"\nint b;\n#line 2 "a.h"\nint a;\n'
                   '#line 3 "p.c"\n'
                   '\n'  # b.h again: already spliced, the line stays for the line numbers
                   '  #  include "missing.h"\n'  # not one of ours: the compiler looks for it
                   'int main_;\n')


def test_every_program_is_one_file_for_bcc():
    xdp = proto.xdp_dir()
    for c in sorted(xdp.glob("*.c")):
        text = main_file(c.read_text(), c.name)
        left = [m for m in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.M) if (xdp / m).is_file()]
        assert not left, f"{c.name}: {left} not spliced"
    agg = main_file((xdp / "aggregator.c").read_text(), "aggregator.c")
    for h in ("parse.h", "agg_maps.h", "optim.h", "fixed.h", "slots.h", "sender.h", "verdict.h", "join.h", "contrib.h"):
        assert agg.count(f'#line 1 "{h}"\n') == 1, h
    # the callbacks and every map access are in the text bcc compiles as its main file
    assert re.search(r"^long ar_record\(u64 i\)$", agg, re.M) and re.search(r"^long ar_sgd\(u64 i\)$", agg, re.M)
    ring = main_file((xdp / "ring.c").read_text(), "ring.c")
    for h in ("parse.h", "ring_maps.h", "ring_records.h"):
        assert ring.count(f'#line 1 "{h}"\n') == 1, h
    assert re.search(r"^long ring_record\(u64 i\)$", ring, re.M)
