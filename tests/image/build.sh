#!/usr/bin/env bash
# Build the sparkd test image: a Debian bookworm minbase rootfs with python3 and
# fakevllm.py (a stdlib-only stand-in for a vLLM OpenAI server), imported with
# `docker import` (no registry needed).
#
# Tags: sparkd-test-vllm:<content hash> and sparkd-test-vllm:latest.
# The content hash covers every file in tests/image/ plus the rootfs recipe, so
# an edit to fakevllm.py gives a new tag.
#
# Usage:
#   tests/image/build.sh            build unless the hash tag already exists
#   tests/image/build.sh --force    rebuild even if the tag exists
#   tests/image/build.sh --tag      print the image name with its hash tag, build nothing
#
# Environment:
#   SPARKD_DEBIAN_MIRROR   mirror for debootstrap (default http://deb.debian.org/debian)
#   SPARKD_TEST_CACHE      cache dir for the rootfs tarball (default /var/cache/sparkd-test)
#
# Needs root (debootstrap, device nodes), docker and debootstrap.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
IMAGE_REPO="sparkd-test-vllm"
SUITE="bookworm"
VARIANT="minbase"
INCLUDE="python3"
MIRROR="${SPARKD_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CACHE="${SPARKD_TEST_CACHE:-/var/cache/sparkd-test}"
ROOTFS_TAR="$CACHE/rootfs-$SUITE-$VARIANT-$INCLUDE.tar"
# Exec form: the python server is PID 1 and receives SIGTERM itself.
ENTRYPOINT='ENTRYPOINT ["/usr/bin/python3", "-u", "/opt/fakevllm/fakevllm.py"]'

die() { echo "build.sh: error: $*" >&2; exit 1; }
log() { echo "build.sh: $*"; }

content_hash() {
    # Stable over file order; includes the recipe so a changed suite/include rebuilds.
    {
        printf '%s\n' "$SUITE" "$VARIANT" "$INCLUDE" "$ENTRYPOINT"
        (cd "$HERE" && find . -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 \
            | LC_ALL=C sort -z | xargs -0 sha256sum)
    } | sha256sum | cut -c1-12
}

TAG="$(content_hash)"
IMAGE="$IMAGE_REPO:$TAG"

case "${1:-}" in
    --tag) echo "$IMAGE"; exit 0 ;;
    --force) FORCE=1 ;;
    "") FORCE=0 ;;
    *) die "unknown argument ${1} (allowed: --tag, --force)" ;;
esac

command -v docker >/dev/null || die "docker CLI not found (apt-get install docker.io)"
docker info >/dev/null 2>&1 || die "docker engine not reachable (is dockerd running?)"

if [[ "$FORCE" == 0 ]] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    docker tag "$IMAGE" "$IMAGE_REPO:latest"
    log "image $IMAGE already present (tagged :latest), nothing to build"
    exit 0
fi

[[ "$(id -u)" == 0 ]] || die "must run as root (debootstrap creates device nodes)"

WORK="$(mktemp -d /tmp/sparkd-image.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT

if [[ -s "$ROOTFS_TAR" ]]; then
    log "using cached rootfs $ROOTFS_TAR"
else
    command -v debootstrap >/dev/null || die "debootstrap not found (apt-get install debootstrap)"
    mkdir -p "$CACHE"
    log "debootstrap --variant=$VARIANT --include=$INCLUDE $SUITE from $MIRROR (a few minutes)"
    t0=$SECONDS
    if ! debootstrap --variant="$VARIANT" --include="$INCLUDE" "$SUITE" "$WORK/rootfs" "$MIRROR" \
            >"$WORK/debootstrap.log" 2>&1; then
        tail -n 30 "$WORK/debootstrap.log" >&2
        die "debootstrap failed (the last 30 lines of its log are above)"
    fi
    # Trim what a test image never needs: apt lists and package caches.
    rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb "$WORK/rootfs/var/lib/apt/lists/"*
    tar -C "$WORK/rootfs" --numeric-owner -cf "$ROOTFS_TAR.tmp" .
    mv "$ROOTFS_TAR.tmp" "$ROOTFS_TAR"
    rm -rf "$WORK/rootfs"
    log "rootfs cached at $ROOTFS_TAR ($((SECONDS - t0)) s)"
fi

# Base rootfs + /opt/fakevllm, re-tarred into `docker import`.
mkdir -p "$WORK/rootfs"
tar -C "$WORK/rootfs" --numeric-owner -xf "$ROOTFS_TAR"
# Under the vfs storage driver every container start copies the whole rootfs:
# drop what a test never reads (~50 MB of 173) to keep container starts quick.
rm -rf "$WORK/rootfs/usr/share/"{doc,man,info,locale} "$WORK/rootfs/var/cache/"*
mkdir -p "$WORK/rootfs/opt/fakevllm"
install -m 0755 "$HERE/fakevllm.py" "$WORK/rootfs/opt/fakevllm/fakevllm.py"
install -m 0644 "$HERE/startup.log" "$WORK/rootfs/opt/fakevllm/startup.log"

log "docker import -> $IMAGE"
tar -C "$WORK/rootfs" --numeric-owner -c . \
    | docker import \
        -c "$ENTRYPOINT" \
        -c 'ENV PYTHONDONTWRITEBYTECODE=1' \
        -c 'EXPOSE 8000' \
        -c "LABEL sparkd.test.image=$TAG" \
        -m "sparkd test image (fakevllm), content hash $TAG" \
        - "$IMAGE" >/dev/null \
    || die "docker import failed"
docker tag "$IMAGE" "$IMAGE_REPO:latest"
log "built $IMAGE (also tagged $IMAGE_REPO:latest)"
