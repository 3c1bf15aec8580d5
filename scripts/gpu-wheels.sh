#!/usr/bin/env bash
# Wheels for a lent GPU machine, which reaches no registry: what `import ridge` and the CUDA tests need that its
# image lacks (llguidance; pydantic and its three; gguf), and transformers at this checkout's version (the
# families the tests hold against HF need it). Run here, in the repository root; `.whl` is ignored by git, and
# the device call carries it (`carry: [".whl"]`), where scripts/gpu-check.sh installs it before anything runs.
set -eu
PY=${PYTHON:-.venv/bin/python}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
platforms=()
for n in 17 24 27 28 31 34 35 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
wanted=()
for name in llguidance pydantic pydantic_core annotated-types typing-inspection gguf transformers; do
  wanted+=("$name==$(version "$name")")
done
# the image's Python is 3.12 (KINDS.md of the device tool)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl "${wanted[@]}"
ls .whl
