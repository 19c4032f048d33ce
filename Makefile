# Entry points. `make run` and `make test` do all set-up on a fresh Debian 12 machine.
JOBS ?= $(shell nproc)
PY := /usr/bin/python3

.PHONY: all build dev bootstrap run example test test-unit test-e2e bench fuzz format clean

all: build

bootstrap:
	@bash scripts/bootstrap

build:
	@[ -f build/build.ninja ] || cmake --preset release
	cmake --build build -j$(JOBS)

dev:
	@[ -f build-dev/build.ninja ] || cmake --preset dev
	cmake --build build-dev -j$(JOBS)

# Starts the platform on its embedded default: a gateway and UP_HOSTS daemons with virtual GPUs on
# this machine (`nbos up`), serving until Ctrl-C. UP_ARGS passes more options (--port, --token...).
UP_HOSTS ?= 4
run: bootstrap build
	build/bin/nbos up --hosts $(UP_HOSTS) $(UP_ARGS)

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
	$(PY) bench/sim_bench.py --nbos build/bin/nbos
	build/bin/store_throughput

fuzz:
	@[ -f build-fuzz/build.ninja ] || cmake --preset fuzz
	cmake --build build-fuzz -j$(JOBS)
	bash fuzz/run-all build-fuzz/bin $(or $(FUZZ_SECONDS),30)

format:
	git ls-files '*.cc' '*.h' | xargs clang-format -i

clean:
	rm -rf build build-dev build-fuzz
