#!/usr/bin/env bash
# One-shot, idempotent set-up for nicoffload on Debian/Ubuntu, as root.
# Installs what is missing: Debian packages (bcc, bpftool, iproute2, kernel headers), the
# kernel-headers fallback when the running kernel ships none, a virtual environment made from
# /usr/bin/python3 with system site packages (bcc lives there), and the Python packages.
# A second run does nothing but checks (a few seconds).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${NICOFFLOAD_VENV:-$here/.venv}"
extras="${NICOFFLOAD_EXTRAS:-test}"
say() { echo "setup: $*" >&2; }

if [ "$(id -u)" -ne 0 ]; then
    say "run as root (sudo): installing packages and loading XDP programs needs it"; exit 1
fi

# --- Debian packages -----------------------------------------------------------------------
need=()
for p in python3-bpfcc libbpfcc bpftool iproute2 python3-venv libbpf1 gcc libxdp-dev libbpf-dev; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
krel="$(uname -r)"
if [ ! -e "/lib/modules/$krel/build" ]; then
    # Headers for exactly this kernel, if the distribution has them; else the generic ones.
    if ! dpkg-query -W -f='${Status}' linux-headers-amd64 2>/dev/null | grep -q "install ok installed"; then
        need+=("linux-headers-amd64")
    fi
fi
if [ ${#need[@]} -gt 0 ]; then
    say "installing Debian packages: ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    # Prefer headers that match the running kernel exactly when the archive has them.
    if apt-cache show "linux-headers-$krel" >/dev/null 2>&1; then need+=("linux-headers-$krel"); fi
    apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
fi

# --- kernel headers fallback (ENVIRONMENT.md) -----------------------------------------------
if [ ! -e "/lib/modules/$krel/build" ]; then
    b=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1 || true)
    s=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n 1 || true)
    if [ -z "$b" ] || [ -z "$s" ]; then
        say "no kernel headers for $krel and no Debian headers to fall back on"; exit 1
    fi
    mkdir -p "/lib/modules/$krel"
    ln -sfn "$b" "/lib/modules/$krel/build"
    ln -sfn "$s" "/lib/modules/$krel/source"
    say "kernel $krel ships no headers: linked /lib/modules/$krel/{build,source} to $b and $s (XDP uses only stable UAPI headers)"
fi

# --- BPF filesystem ------------------------------------------------------------------------
if [ "$(stat -f -c %T /sys/fs/bpf 2>/dev/null)" != "bpf_fs" ]; then
    mount -t bpf bpf /sys/fs/bpf && say "mounted the BPF filesystem on /sys/fs/bpf"
fi

# --- virtual environment -------------------------------------------------------------------
if [ ! -x "$venv/bin/python" ]; then
    say "creating virtual environment $venv (from /usr/bin/python3, with system site packages for bcc)"
    /usr/bin/python3 -m venv --system-site-packages "$venv"
fi
stamp="$venv/.nicoffload-installed-${extras//,/-}"
want="$(sha1sum < "$here/pyproject.toml" | cut -c1-12)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    say "installing nicoffload[$extras] into $venv"
    "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    if ! "$venv/bin/python" -m pip install -q -e "$here[$extras]" >"$venv/pip.log" 2>&1; then cat "$venv/pip.log" >&2; exit 1; fi
    echo "$want" > "$stamp"
fi
"$venv/bin/python" -c "import bcc" 2>/dev/null || { say "bcc does not import in $venv"; exit 1; }
# nicoffload on PATH
ln -sfn "$venv/bin/nicoffload" /usr/local/bin/nicoffload
