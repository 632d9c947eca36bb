#!/usr/bin/env bash
# Build the Docker image the `docker` sandbox backend runs tool code in, without a registry: a root
# file system holding only this machine's Debian python3 (interpreter, standard library, the shared
# libraries they link), imported with `docker import`. No shell, no package manager, no pip.
# Idempotent: does nothing when the image exists (ASYNCRL_SANDBOX_REBUILD=1 forces a rebuild).
#
#   ASYNCRL_SANDBOX_IMAGE   tag to build (default asyncrl-sandbox:py3, the SandboxConfig default)
#   ASYNCRL_SANDBOX_PYTHON  interpreter to copy (default /usr/bin/python3; apt installs python3-minimal
#                           when it is missing)
set -euo pipefail

IMAGE="${ASYNCRL_SANDBOX_IMAGE:-asyncrl-sandbox:py3}"
PY_LINK="${ASYNCRL_SANDBOX_PYTHON:-/usr/bin/python3}"

if [ "${ASYNCRL_SANDBOX_REBUILD:-0}" != "1" ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "[sandbox-image] $IMAGE exists"
    exit 0
fi
if [ ! -x "$PY_LINK" ]; then
    echo "[sandbox-image] $PY_LINK missing: installing python3-minimal"
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-minimal >/dev/null
fi

PY="$(readlink -f "$PY_LINK")"
STDLIB="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')"
DYNLOAD="$("$PY" -c 'import sysconfig, os; print(os.path.join(sysconfig.get_path("platstdlib"), "lib-dynload"))')"

ROOTFS="$(mktemp -d /tmp/asyncrl-sandbox-rootfs.XXXXXX)"
trap 'rm -rf "$ROOTFS"' EXIT

# The standard library without its test suite and installers; compiled .pyc files stay because the
# root is read-only in the sandbox and Python could not write them there.
mkdir -p "$ROOTFS$STDLIB"
tar -C "$STDLIB" --exclude=./test --exclude=./idlelib --exclude=./ensurepip --exclude=./tkinter \
    --exclude=./turtledemo --exclude=./lib2to3/tests -cf - . | tar -C "$ROOTFS$STDLIB" -xf -
if [ -d "$DYNLOAD" ] && [ ! -d "$ROOTFS$DYNLOAD" ]; then
    mkdir -p "$ROOTFS$DYNLOAD" && cp -a "$DYNLOAD/." "$ROOTFS$DYNLOAD/"
fi
mkdir -p "$ROOTFS/usr/bin"
cp "$PY" "$ROOTFS/usr/bin/python3"

# Every shared library the interpreter and its extension modules load, with the loader itself.
# `ldd` prints "name => /path (addr)" or "/path (addr)"; the path is the field that starts with /.
libs="$(for f in "$PY" "$DYNLOAD"/*.so; do ldd "$f" 2>/dev/null || true; done \
    | awk '{for (i = 1; i <= NF; i++) if ($i ~ /^\//) print $i}' | sort -u)"
for lib in $libs; do
    mkdir -p "$ROOTFS$(dirname "$lib")"
    cp -L "$lib" "$ROOTFS$lib"
done
# Debian's merged /usr: /lib and /lib64 are links into /usr, and the loader path is absolute.
for dir in lib lib64; do
    if [ -L "/$dir" ]; then
        target="$(readlink "/$dir")"
        if [ -d "$ROOTFS/$dir" ] && [ ! -L "$ROOTFS/$dir" ]; then
            mkdir -p "$ROOTFS/$target" && cp -a "$ROOTFS/$dir/." "$ROOTFS/$target/" && rm -rf "${ROOTFS:?}/$dir"
        fi
        ln -s "$target" "$ROOTFS/$dir"
    fi
done

# An unprivileged user for tool code, and the mount points the backend puts tmpfs on.
mkdir -p "$ROOTFS/etc" "$ROOTFS/tmp" "$ROOTFS/scratch" "$ROOTFS/proc" "$ROOTFS/dev" "$ROOTFS/sys"
printf 'root:x:0:0:root:/root:/nonexistent\nnobody:x:65534:65534:nobody:/scratch:/nonexistent\n' >"$ROOTFS/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$ROOTFS/etc/group"
chmod 1777 "$ROOTFS/tmp" "$ROOTFS/scratch"

"$ROOTFS/usr/bin/python3" -c 'print("ok")' >/dev/null  # the copied interpreter runs at all
tar -C "$ROOTFS" --numeric-owner -cf - . | docker import \
    --change 'CMD ["/usr/bin/python3"]' \
    --change 'ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 LANG=C.UTF-8' \
    --change 'WORKDIR /scratch' \
    - "$IMAGE" >/dev/null
echo "[sandbox-image] built $IMAGE ($(docker image inspect -f '{{.Size}}' "$IMAGE") bytes) from $PY"
