# The two commands a fresh machine needs: `make train` and `make test`.
# Both first make sure a Vulkan driver is present (installing Mesa's software
# driver on Debian/Ubuntu when run as root).

CARGO ?= cargo
# Silences a harmless "XDG_RUNTIME_DIR is invalid" line from Mesa.
export XDG_RUNTIME_DIR ?= /tmp

.PHONY: train test bench driver adapters

driver:
	@bash scripts/ensure-vulkan.sh

train: driver
	$(CARGO) run --release --bin wgrad -- train

# With MPI installed (scripts/ensure-mpi.sh installs it on Debian as root),
# the suite is built once with the `mpi` and `fault-injection` features, so
# the multi-process tests run too, without a second build of the crate.
comma := ,
MPI_READY := $(shell command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1 && \
	ldconfig -p 2>/dev/null | grep -q libclang && echo yes)
TEST_FEATURES := $(if $(MPI_READY),--features mpi$(comma)fault-injection)

test: driver
	@$(if $(MPI_READY),,echo "MPI (mpirun, mpicc, libclang) not installed: skipping the multi-process tests (see scripts/ensure-mpi.sh)")
	$(CARGO) run --release $(TEST_FEATURES) --bin wgrad -- adapters
	$(CARGO) test --release $(TEST_FEATURES)
	$(CARGO) run --release $(TEST_FEATURES) --example linear_regression

bench: driver
	$(CARGO) bench --bench matmul
	$(CARGO) bench --bench kernels
	$(CARGO) bench --bench steps
	$(CARGO) bench --bench parallel

adapters: driver
	$(CARGO) run --release --bin wgrad -- adapters
