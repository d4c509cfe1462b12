#!/usr/bin/env bash
# A local base image for docker/Dockerfile where images cannot be pulled: Debian bookworm (Python 3.11)
# made by debootstrap from the Debian mirror, imported as qevolve-base:bookworm. Needs root, debootstrap
# and a Docker engine. The host's CA bundle goes in too, so HTTPS through a proxy with its own CA works.
#   sudo docker/base.sh [TAG]
set -euo pipefail
tag=${1:-qevolve-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
chmod 755 "$root"  # the image's / (mktemp's 0700 would shut every user but root out of the whole system)
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror"
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import --change 'CMD ["python3"]' - "$tag"
echo "built $tag"
