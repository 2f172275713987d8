# Thin front for CMake. `make demo` and `make test` install what is missing, build, and run.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
DEMO_DIR ?= $(BUILD)/demo-model

.PHONY: all deps build demo test test-asan fuzz clean

all: build

deps:
	@bash tools/deps.sh

build: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

demo: build
	@$(BUILD)/keel synth configs/demo.json $(DEMO_DIR) --seed 1 --mtp-bits 6 >/dev/null
	@$(BUILD)/keel info $(DEMO_DIR) | head -n 9
	@echo "--- keel run $(DEMO_DIR) --prompt 'Hello from keel' -n 32 --greedy (random weights: the text is noise)"
	@$(BUILD)/keel run $(DEMO_DIR) --prompt "Hello from keel" -n 32 --greedy

test: build
	@cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

test-asan: deps
	@cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DKEEL_SANITIZE=ON -DKEEL_CUDA=OFF >/dev/null
	@cmake --build build-asan -j $(JOBS)
	@cd build-asan && ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j $(JOBS)

# make fuzz FUZZ_SECONDS=600 runs the safetensors header fuzzer; new crashes land in fuzz/<target>/regressions.
FUZZ_SECONDS ?= 60
fuzz: deps
	@CC=clang cmake -S . -B build-fuzz -DKEEL_FUZZ=ON -DKEEL_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug >/dev/null
	@cmake --build build-fuzz -j $(JOBS) --target fuzz_safetensors
	@mkdir -p build-fuzz/corpus-safetensors
	@build-fuzz/fuzz/fuzz_safetensors -max_total_time=$(FUZZ_SECONDS) -artifact_prefix=fuzz/fuzz_safetensors/regressions/ \
	  -dict=fuzz/fuzz_safetensors/dict build-fuzz/corpus-safetensors fuzz/fuzz_safetensors/corpus

clean:
	rm -rf $(BUILD) build-asan build-fuzz
