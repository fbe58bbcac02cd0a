#!/usr/bin/env bash
# Installs lingvo_pipe as a user does and checks what issue 12 promised:
#
#   1. builds the wheel of this checkout (pip wheel, build isolation);
#   2. makes a fresh venv OUTSIDE the checkout and installs the wheel, not
#      editable, with the [cpu] extra; `pip check` passes;
#   3. from an empty directory: `lingvo_pipe_trainer --help` lists --model;
#      README's own-model file (mymodel.py) trains for 5 steps through the
#      console script; `import tasks` and `import params` fail (nothing of
#      that name is installed at the top of site-packages);
#   4. with --all_extras, adds each extra in turn ([mt], [plots],
#      [tensorboard]; then [gpu] in a second venv) and runs `pip check` after
#      each.
#
# Usage: bash tools/check_wheel.sh [--all_extras] [--keep]
# Needs python3.11 with venv and PyPI (TensorFlow is downloaded: a few
# minutes, ~250 MB for [cpu], ~600 MB more for [gpu]). Works in a temporary
# directory, removed at the end unless --keep. Not part of the test suite
# (downloads, minutes); prints PASS or the first failure.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${LINGVO_PIPE_PYTHON:-python3.11}"
all_extras=0 keep=0
for arg in "$@"; do
  case "$arg" in
    --all_extras) all_extras=1 ;;
    --keep) keep=1 ;;
    *) echo "usage: $0 [--all_extras] [--keep]" >&2; exit 2 ;;
  esac
done
work="$(mktemp -d /tmp/lingvo_pipe_wheel.XXXXXX)"
[[ "$keep" == 1 ]] || trap 'rm -rf "$work"' EXIT

step() { echo "=== [${SECONDS}s] $*"; }
fail() { echo "FAIL: $*" >&2; exit 1; }
pip_quiet() { "$@" --disable-pip-version-check -q 2>&1 | grep -v '^WARNING: Location' || true; }

step "pip wheel $repo"
"$python" -m pip wheel --disable-pip-version-check -q --no-deps \
  -w "$work/dist" "$repo" >/dev/null
wheel="$(ls "$work"/dist/lingvo_pipe-*.whl)"
echo "$wheel"
unzip -l "$wheel" | awk '{print $4}' | grep -E '^(tasks|params)/' \
  && fail "the wheel has top-level tasks/ or params/"

step "fresh venv, pip install '$(basename "$wheel")[cpu]'"
"$python" -m venv "$work/venv"
bin="$work/venv/bin"
pip_quiet "$bin/pip" install "$wheel[cpu]"
"$bin/pip" check || fail "pip check after [cpu]"

mkdir "$work/empty"
cd "$work/empty"
step "lingvo_pipe_trainer --help lists --model"
help="$("$bin/lingvo_pipe_trainer" --help 2>&1 || true)"
grep -q -- '--model:' <<<"$help" || fail "--help does not list --model"

step "a user's model file in an empty directory trains for 5 steps"
"$python" - "$repo/README.md" >mymodel.py <<'EOF'
import re, sys
text = open(sys.argv[1], encoding='utf-8').read()
print(re.search(r'<!-- own-model example[^>]*-->\s*```python\n(.*?)```',
                text, re.S).group(1), end='')
EOF
"$bin/lingvo_pipe_trainer" --model=mymodel.WideMlp --logdir="$work/log" \
  --max_steps=5 2>"$work/train.log" || { cat "$work/train.log"; fail "training"; }
grep -q 'step 5/5' "$work/train.log" || fail "no 'step 5/5' line"
[[ -f "$work/log/ckpt-5.index" ]] || fail "no checkpoint of step 5"
tail -n 2 "$work/train.log"

step "import tasks / import params fail"
for name in tasks params; do
  if "$bin/python" -c "import $name" 2>/dev/null; then
    fail "'import $name' works: a top-level $name is installed"
  fi
done
"$bin/python" -c 'import lingvo_pipe.tasks, lingvo_pipe.params, lingvo_pipe
print("lingvo_pipe", lingvo_pipe.__version__)'

if [[ "$all_extras" == 1 ]]; then
  for extra in mt plots tensorboard; do
    step "pip install '[cpu,$extra]'; pip check"
    pip_quiet "$bin/pip" install "$wheel[cpu,$extra]"
    "$bin/pip" check || fail "pip check after [$extra]"
  done
  step "second fresh venv: pip install '[gpu]'; pip check"
  "$python" -m venv "$work/venv_gpu"
  pip_quiet "$work/venv_gpu/bin/pip" install "$wheel[gpu]"
  "$work/venv_gpu/bin/pip" check || fail "pip check after [gpu]"
  "$work/venv_gpu/bin/pip" list 2>/dev/null | grep -i '^tensorflow' || true
fi
step "PASS"
