# kvbudget developer targets. Everything runs inside the project's own .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= smollm2-135m

.PHONY: install fetch test demo lint peer ov ov-model llama

# The stamp is rebuilt only when pyproject.toml changes, so `make install` is quick on rerun.
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,eval,ray,serve]'
	touch $@

# Downloads, verifies and converts the default model once, and every evaluation data artifact
# (idempotent: quick when already fetched).
fetch: install
	$(BIN)/kvbudget fetch model $(MODEL)
	$(BIN)/kvbudget fetch data

# The suite includes the kvpress oracle tests (kvbudget's presses against kvpress's own), so the
# test set-up builds .venv-peer too: without it those tests would skip and check nothing.
# The suite runs on TEST_WORKERS pytest-xdist workers, which share the CPU's torch threads
# (tests/conftest.py); a test stuck past pyproject.toml's timeout fails instead of stalling the run.
# A run that collects no test exits 5 and fails. `-m "not slow"` leaves out the soak-style tests
# (CI runs them all). The 25 slowest tests are listed at the end: the suite has a 10-minute budget
# on a 2-core CPU.
TEST_WORKERS ?= 2

test: fetch peer
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=25

# The demo runs on the 0.5B model in bf16, where methods separate (kvbudget.demo.DEMO_MODEL).
DEMO_MODEL := qwen2.5-coder-0.5b

demo: fetch
	$(BIN)/kvbudget fetch model $(DEMO_MODEL)
	$(BIN)/python -m kvbudget.demo

lint: install
	$(BIN)/ruff check src tests

# A separate environment with NVIDIA's kvpress for the side-by-side benchmark
# (`kvbudget bench peer`). kvpress 0.5.5 needs transformers < 5.3, so it never shares the main
# .venv; torch is pinned to the same CPU build (any other spec may pull a multi-GB CUDA build).
PEER_VENV := .venv-peer
# optimum-quanto: transformers' QuantizedCache (quanto backend), the equal-bytes anchors (`NAME+quanto4`).
PEER_REQUIREMENTS := torch==2.13.0 "transformers>=4.56,<5.3" kvpress==0.5.5 optimum-quanto==0.2.7

peer: $(PEER_VENV)/.installed

$(PEER_VENV)/.installed: Makefile
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PEER_VENV)/bin/python -m pip install --quiet $(PEER_REQUIREMENTS)
	$(PEER_VENV)/bin/python -c "import kvpress, transformers, torch; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5', 'transformers', transformers.__version__, 'torch', torch.__version__)"
	touch $@

# A separate environment with OpenVINO GenAI, the anchor of `kvbudget bench serve --openvino
# .venv-ov/bin/python` (docs/serving.md): its continuous-batching pipeline and cache eviction run in
# src/kvbudget/peer/openvino_runner.py, which imports no kvbudget module. optimum-intel exports the
# model to OpenVINO IR (`make ov-model`). torch is the same CPU build as the main .venv; PyPI's
# torchvision 0.28.0, which optimum-intel pulls in, is a CUDA build that fails to load against it
# ("operator torchvision::nms does not exist") and breaks transformers' imports, and nothing here
# needs it, so it is removed.
OV_VENV := .venv-ov
OV_REQUIREMENTS := torch==2.13.0 openvino-genai==2026.4.1.0 "optimum-intel[openvino]==2.2.0" optimum==2.3.0 \
	nncf==3.4.0 transformers==5.5.4
OV_MODEL ?= qwen2.5-coder-0.5b

ov: $(OV_VENV)/.installed

$(OV_VENV)/.installed: Makefile
	test -x $(OV_VENV)/bin/python || $(PYTHON) -m venv $(OV_VENV)
	$(OV_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(OV_VENV)/bin/python -m pip install --quiet $(OV_REQUIREMENTS)
	$(OV_VENV)/bin/python -m pip uninstall --quiet --yes torchvision
	$(OV_VENV)/bin/python -c "import openvino, openvino_genai, optimum.intel, transformers, torch; print('openvino_genai', openvino_genai.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
	touch $@

# The registry model's Hugging Face folder (its GGUF weights dequantized) exported once to OpenVINO IR
# with fp16 weights, beside it in $KVBUDGET_HOME/models/<name>/openvino (skipped when already there).
ov-model: ov install
	$(BIN)/kvbudget fetch model $(OV_MODEL)
	$(BIN)/python -c "from kvbudget.models import model_dir; d = model_dir('$(OV_MODEL)'); print(d / 'hf', d / 'openvino')" | \
	{ read hf ir; test -f $$ir/openvino_model.xml || $(OV_VENV)/bin/optimum-cli export openvino --model $$hf \
	  --task text-generation-with-past --weight-format fp16 $$ir; }

# llama.cpp's own server (`llama-server`), built here from the source llama-cpp-python's sdist carries
# (CPU only, this machine's compilers; about 40 minutes on 2 cores): what a CPU user would run
# instead, serving the same GGUF file with its KV cache at f16 / q8_0 / q4_0 (`kvbudget bench serve
# --llama-server .llama/bin/llama-server`, the byte budget's serving comparison).
LLAMA_DIR := .llama
LLAMA_SDIST := llama-cpp-python==0.3.36
LLAMA_CMAKE := -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF

llama: $(LLAMA_DIR)/bin/llama-server

$(LLAMA_DIR)/src/CMakeLists.txt: | $(VENV)/.installed
	rm -rf $(LLAMA_DIR)/sdist && mkdir -p $(LLAMA_DIR)/sdist
	$(BIN)/python -m pip download --quiet --no-deps --no-binary :all: $(LLAMA_SDIST) -d $(LLAMA_DIR)/sdist
	tar xzf $(LLAMA_DIR)/sdist/*.tar.gz -C $(LLAMA_DIR)/sdist
	rm -rf $(LLAMA_DIR)/src && mv $(LLAMA_DIR)/sdist/llama_cpp_python-*/vendor/llama.cpp $(LLAMA_DIR)/src
	rm -rf $(LLAMA_DIR)/sdist

$(LLAMA_DIR)/bin/llama-server: $(LLAMA_DIR)/src/CMakeLists.txt
	cmake -S $(LLAMA_DIR)/src -B $(LLAMA_DIR)/build $(LLAMA_CMAKE)
	cmake --build $(LLAMA_DIR)/build --target llama-server -j 2
	mkdir -p $(LLAMA_DIR)/bin && cp $(LLAMA_DIR)/build/bin/llama-server $@
	$@ --version
