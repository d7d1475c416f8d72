# `make test` on a fresh machine: build .venv (CPU tool chain, SGLang 0.5.23, FlyDSL 0.4.2 + LLD 19
# for the gfx950 compile check, the GPU host's Triton for the Gluon compile check), then run every test.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test venv demo clean

test: $(STAMP)
	$(VPY) -m pytest -q tests

demo: $(STAMP)
	$(VPY) -m sglang_nvfp4.demo

venv: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu.txt requirements/sglang-cpu.txt requirements/gpu-host-triton.txt \
		scripts/setup_flydsl.sh
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -r requirements/cpu.txt
	$(VPY) -m pip install -q --no-deps sglang==0.5.23
	$(VPY) -m pip install -q -r requirements/sglang-cpu.txt
	$(VPY) -m pip install -q --no-deps -e .
	$(VPY) -m pip install -q --no-deps --upgrade --target $(VENV)/gpu-host-triton -r requirements/gpu-host-triton.txt
	bash scripts/setup_flydsl.sh $(VENV)
	touch $(STAMP)

clean:
	rm -rf $(VENV)
