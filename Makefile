# The two set-up commands of the README:
#   make lab    create .venv on first use, install minienv + the lab extra, open the series in JupyterLab
#   make test   create .venv on first use, install minienv + lab and test extras, run every test tier
# make student re-runs every notebook as a student's machine would (no browser, no servers, only the lab extra).
# MINIENV_TIERS=all make test also installs the reference (CPU torch, transformers) and browser (playwright)
# extras and makes a missing tier a failure instead of a skip; CI (.ci/run) runs it that way.

comma := ,
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LAB_ARGS ?=
# minienv's matrices are tiny: a second OpenBLAS thread costs more in hand-off than it saves, and on a busy machine
# spinning BLAS threads made small matmuls 10-300x slower (measured; see benchmarks/). Kernels and tests inherit it.
export OPENBLAS_NUM_THREADS ?= 1
# Jupyter refuses to run as root without --allow-root (containers, CI); never needed otherwise.
ROOT_FLAG := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)
MINIENV_TIERS ?=

ifeq ($(MINIENV_TIERS),all)
EXTRAS := lab,test,reference,browser,binder
export MINIENV_REQUIRE_TIERS := 1
# the install tier (tests that create a venv and pip-install, e.g. `make lab`): required too
export MINIENV_INSTALL_TESTS := 1
else
EXTRAS := lab,test
endif
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: lab test student venv notebooks check-notebooks binder-links clean

$(PY):
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "minienv needs Python >= 3.10, found " + sys.version.split()[0]'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Reinstall when pyproject.toml changes (new pins or extras).
$(VENV)/.installed-%: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[$(subst -,$(comma),$*)]"
	@touch $@

venv: $(STAMP)

lab: $(VENV)/.installed-lab
	$(PY) -m jupyterlab --ServerApp.root_dir=notebooks --ServerApp.ip=127.0.0.1 $(ROOT_FLAG) $(LAB_ARGS)

test: $(STAMP)
	$(PY) -m pytest --durations=25

# The student's-machine tier: every notebook Run All in a fresh venv with only the lab extra (environment.yml's
# pins), with no browser, redis-server or prometheus visible (a private mount namespace: root or user namespaces).
student:
	$(PYTHON) tools/student_machine.py

notebooks: $(STAMP)  ## re-execute every notebook from its .py pair
	$(PY) tools/nb.py build --all

check-notebooks: $(STAMP)
	$(PY) tools/nb.py check

binder-links:
	@$(PYTHON) tools/binder_links.py

clean:
	rm -rf $(VENV) .pytest_cache tests/browser/screenshots
