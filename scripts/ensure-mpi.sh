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
bash "$(dirname "$0")/apt-install.sh" ensure-mpi $packages
case $? in
    0) exit 0 ;;
    1) exit 1 ;;
esac
echo "ensure-mpi: MPI not found and cannot install it here (needs apt-get and root):" \
    "install $packages (or your platform's MPI and libclang) for the MPI tests" >&2
exit 0
