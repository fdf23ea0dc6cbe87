#!/usr/bin/env bash
# Installs what the optional `mpi` feature needs to build and run (OpenMPI,
# and libclang for the bindings' bindgen) on Debian/Ubuntu as root. CI calls
# it; `make test` runs the MPI tests only when mpirun and mpicc are present.
set -u

if command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1 &&
    ldconfig -p 2>/dev/null | grep -q 'libclang'; then
    exit 0
fi
packages="libopenmpi-dev openmpi-bin libclang-dev"
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "ensure-mpi: installing $packages" >&2
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y --no-install-recommends $packages >/dev/null 2>&1; then
        apt-get update >/dev/null 2>&1 || true
        apt-get install -y --no-install-recommends $packages >/dev/null || {
            echo "ensure-mpi: apt-get install $packages failed" >&2
            exit 1
        }
    fi
    exit 0
fi
echo "ensure-mpi: MPI not found and cannot install it here (needs apt-get and root):" \
    "install $packages (or your platform's MPI and libclang) for the MPI tests" >&2
exit 0
