#!/usr/bin/env bash
# apt-install.sh NAME PACKAGE...: installs Debian/Ubuntu packages when this
# is such a machine and we are root (apt's lists refreshed only if the first
# try fails). Exit 0: installed; 1: the install failed; 2: no apt-get or not
# root, so the caller explains what to install.
set -u
name=$1
shift
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    exit 2
fi
echo "$name: installing $*" >&2
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y --no-install-recommends "$@" >/dev/null 2>&1; then
    apt-get update >/dev/null 2>&1 || true
    apt-get install -y --no-install-recommends "$@" >/dev/null || {
        echo "$name: apt-get install $* failed" >&2
        exit 1
    }
fi
exit 0
