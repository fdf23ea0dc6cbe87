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

test: driver
	$(CARGO) run --release --bin wgrad -- adapters
	$(CARGO) test --release
	$(CARGO) run --release --example linear_regression
	# Training across processes (the optional `mpi` feature), when MPI is
	# installed (scripts/ensure-mpi.sh installs it on Debian as root).
	@if command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1 && \
		ldconfig -p 2>/dev/null | grep -q libclang; then \
		$(CARGO) test --release --features mpi,fault-injection --test mpi -- --test-threads=1; \
	else \
		echo "MPI (mpirun, mpicc, libclang) not installed: skipping the multi-process tests (see scripts/ensure-mpi.sh)"; \
	fi

bench: driver
	$(CARGO) bench --bench matmul
	$(CARGO) bench --bench kernels
	$(CARGO) bench --bench steps
	$(CARGO) bench --bench parallel

adapters: driver
	$(CARGO) run --release --bin wgrad -- adapters
