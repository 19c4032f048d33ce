# Entry points. `make run` and `make test` do all set-up on a fresh Debian 12 machine.
JOBS ?= $(shell nproc)
PY := /usr/bin/python3

.PHONY: all build dev tsan tsan-test bootstrap run example test test-unit test-e2e bench fuzz format \
	format-check thread-safety-check clean

all: build

bootstrap:
	@bash scripts/bootstrap

build:
	@[ -f build/build.ninja ] || cmake --preset release
	cmake --build build -j$(JOBS)

dev:
	@[ -f build-dev/build.ninja ] || cmake --preset dev
	cmake --build build-dev -j$(JOBS)

# clang with ThreadSanitizer, in build-tsan/. `make tsan-test` runs the gateway's end-to-end
# suites with it (scripts/tsan-test says how reports are collected).
tsan:
	@[ -f build-tsan/build.ninja ] || cmake --preset tsan
	cmake --build build-tsan -j$(JOBS) --target nbos

tsan-test: tsan
	bash scripts/tsan-test

# Starts the platform on its embedded default: a gateway and UP_HOSTS daemons with virtual GPUs on
# this machine (`nbos up`) with Jupyter Notebook on it for the browser (--frontend), serving until
# Ctrl-C. UP_ARGS passes more options (--port, --token...).
UP_HOSTS ?= 4
run: bootstrap build
	build/bin/nbos up --hosts $(UP_HOSTS) --frontend $(UP_ARGS)

# The standalone kernel as a local kernelspec, executing examples/hello.ipynb.
example: bootstrap build
	@bash scripts/run-example

test: bootstrap build
	cd build && ctest --output-on-failure -j$(JOBS) --timeout 600

test-unit: build
	cd build && ctest --output-on-failure -j$(JOBS) -L unit

test-e2e: build
	cd build && ctest --output-on-failure -L e2e

bench: bootstrap build
	$(PY) bench/kernel_roundtrip.py --nbos build/bin/nbos
	$(PY) bench/replication_bench.py --nbos build/bin/nbos
	$(PY) bench/gateway_bench.py --nbos build/bin/nbos
	$(PY) bench/kernel_start_bench.py --nbos build/bin/nbos
	$(PY) bench/migration_bench.py --nbos build/bin/nbos
	$(PY) bench/healing_bench.py --nbos build/bin/nbos
	$(PY) bench/suspend_bench.py --nbos build/bin/nbos
	$(PY) bench/sim_bench.py --nbos build/bin/nbos
	build/bin/store_throughput
	build/bin/s3_throughput

fuzz:
	@[ -f build-fuzz/build.ninja ] || cmake --preset fuzz
	cmake --build build-fuzz -j$(JOBS) --target wire_fuzz websocket_fuzz connection_file_fuzz router_fuzz
	bash fuzz/run-all build-fuzz/bin $(or $(FUZZ_SECONDS),30)

format:
	git ls-files '*.cc' '*.h' | xargs clang-format -i

# Fails when a C++ file is not formatted as `make format` would leave it (run by CI).
format-check:
	git ls-files '*.cc' '*.h' | xargs clang-format --dry-run -Werror

# Fails when a locking contract (GUARDED_BY, REQUIRES, EXCLUDES: common/thread_annotations.h) is
# broken: clang -fsyntax-only -Werror=thread-safety over every project .cc file, with the flags of
# the clang tree build-tsa/ (configured on first use; only generated headers are built). Run by CI.
thread-safety-check:
	JOBS=$(JOBS) bash scripts/check-thread-safety

clean:
	rm -rf build build-dev build-fuzz build-tsan build-tsa
