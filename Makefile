# The two commands that work on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install build build-faults ui-tools test-ui serve test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q 'setuptools>=68' wheel 'Cython>=3.0'

$(STAMP): $(BIN)/python pyproject.toml setup.py
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Rebuild the Cython extensions in place (after editing a .pyx).
build: install
	$(BIN)/python setup.py -q build_ext --inplace

# fastserve._faults with the test-only fault points compiled in (FASTSERVE_TEST_FAULTS=1; the only module
# that differs, so the only one built), built
# apart (never in place): tests/faults/ load them from here in child processes (tests/faults/launch.py).
FAULTS_LIB := build/faults
build-faults: install
	FASTSERVE_TEST_FAULTS=1 $(BIN)/python setup.py -q build_ext -b $(FAULTS_LIB) -t build/faults-tmp

serve: build
	$(BIN)/fastserve pull
	$(BIN)/fastserve serve --host 127.0.0.1 --port 8080

# The UI tests' programs (tests/e2e/test_webui.py: Debian's chromium; tests/examples/test_desktop_chat.py:
# xvfb-run, xdotool): installed with apt-get where missing and possible (root); else those tests skip, saying why.
UI_TOOLS := chromium xvfb-run xauth xdotool
ui-tools:
	@missing=""; for t in $(UI_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "make: installing the UI tests' programs (missing:$$missing)"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium xvfb xauth xdotool) \
	      >/dev/null || echo "make: apt-get failed: the browser and desktop tests will skip"; \
	  else echo "make: missing$$missing (not root, or no apt-get): the browser and desktop tests will skip"; fi; \
	fi

# The chat page in headless Chromium and the desktop example under Xvfb; their screenshots go to
# build/test-artifacts/ (webui.png, desktop_chat.png).
test-ui: build ui-tools
	$(BIN)/python -m pytest -q tests/e2e/test_webui.py tests/examples
	@ls -l build/test-artifacts/*.png

# The whole suite on the normal build; tests/faults/ also on the fault build.
# The models first (two workers must not both pull them), then two test files at a time, then the
# files with timing bars alone (tests/conftest.py: SERIAL_FILES).
test: build build-faults ui-tools
	$(BIN)/fastserve pull && $(BIN)/fastserve pull gemma3-270m
	FASTSERVE_FAULTS_LIB=$(FAULTS_LIB) $(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not serial" --durations=15 tests
	FASTSERVE_FAULTS_LIB=$(FAULTS_LIB) $(BIN)/python -m pytest -q -m serial tests

bench: build
	$(BIN)/python -m pytest -q bench --benchmark-only

clean:
	rm -rf build $(VENV) *.egg-info; find fastserve \( -name "*.so" -o -name "*.c" \) -delete
