#!/usr/bin/env bash
# Sets up a ComfyUI tree and the Python environment that runs it, able to load this pack from outside ComfyUI's
# tree (the runner links it in at start). Re-running it is cheap: it only adds what is missing.
#
#   COMFYUI_PATH        where the ComfyUI tree lives (default: ~/.cache/leandiffusion/ComfyUI). When it already
#                       holds main.py it is used as it is; otherwise the tree is fetched there.
#   COMFYUI_SOURCE      where to fetch ComfyUI from when COMFYUI_PATH has no tree: a git URL (default: the official
#                       GitHub repository, cloned at COMFYUI_REF) or a local git directory, bare or not (exported at
#                       COMFYUI_REF with `git archive`; blobs missing from a partial mirror are left out and named).
#   COMFYUI_REF         tag/commit to use (default: v0.3.64 for a URL, HEAD for a local git directory).
#   COMFYUI_PYTHON      the interpreter that runs ComfyUI, when you already have one (e.g. your ComfyUI's own venv):
#                       dependencies are added to it and its torch/torchvision are kept as they are. Default: the
#                       venv $COMFYUI_PATH/.venv, created with COMFYUI_BASE_PYTHON (default: python3) if missing.
#
# torch: an interpreter that already has torch keeps its build (CUDA or CPU); a new venv gets torch pinned by
# scripts/constraints-cpu.txt (the CPU wheel on our machines) and the matching torchvision.
# The environment gets ComfyUI's requirements.txt less torchaudio (PyPI has no torchaudio for the pinned CPU torch;
# only ComfyUI's audio nodes need it, and ComfyUI starts without them), `requests` (imported by ComfyUI but missing
# from its requirements), this pack's runtime dependencies and the runner's (websocket-client, tqdm).
# PyPI's torchvision is a CUDA build whose compiled ops cannot load next to the CPU torch; when `import torchvision`
# fails for that reason, a tiny import hook (scripts/torchvision_cpu_shim.py) is installed into that environment
# only (see that file). The last line printed is COMFYUI_PATH=<path>.
set -euo pipefail
PACK="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${COMFYUI_PATH:-${XDG_CACHE_HOME:-$HOME/.cache}/leandiffusion/ComfyUI}"
SOURCE="${COMFYUI_SOURCE:-https://github.com/comfyanonymous/ComfyUI.git}"
BASE_PY="${COMFYUI_BASE_PYTHON:-python3}"
say() { echo "[setup_comfyui] $*" >&2; }

# ------------------------------------------------------------------------------------------------ the tree
if [ ! -f "$DEST/main.py" ]; then
  mkdir -p "$DEST"
  if [ -d "$SOURCE" ]; then
    REF="${COMFYUI_REF:-HEAD}"
    say "exporting ComfyUI $REF from the local git directory $SOURCE into $DEST"
    # Partial mirrors can lack a blob or two (e.g. an LLM tokenizer): export everything else and say what was left.
    mapfile -t MISSING < <(git -C "$SOURCE" ls-tree -r "$REF" \
      | awk -F'\t' '{split($1, a, " "); if (a[2] == "blob") print a[3] "\t" $2}' \
      | while IFS=$'\t' read -r sha path; do
          if ! git -C "$SOURCE" cat-file -e "$sha" 2>/dev/null; then printf '%s\n' "$path"; fi
        done)
    EXCLUDES=()
    for path in "${MISSING[@]}"; do
      say "left out (object missing from the mirror): $path"
      EXCLUDES+=(":(exclude)$path")
    done
    git -C "$SOURCE" archive --format=tar "$REF" -- . "${EXCLUDES[@]}" | tar -x -C "$DEST"
  else
    REF="${COMFYUI_REF:-v0.3.64}"
    say "cloning ComfyUI $REF from $SOURCE into $DEST"
    rmdir "$DEST" 2>/dev/null || true
    if ! git clone --quiet --depth 1 --branch "$REF" "$SOURCE" "$DEST"; then
      say "could not clone ComfyUI $REF from $SOURCE into $DEST (offline, or no such ref?)."
      say "Set COMFYUI_PATH to an existing ComfyUI folder (one with main.py), or COMFYUI_SOURCE to a local git"
      say "directory holding ComfyUI (COMFYUI_REF picks the tag or commit), and run this again."
      exit 1
    fi
  fi
fi
[ -f "$DEST/main.py" ] || { say "no ComfyUI main.py in $DEST"; exit 1; }
[ -f "$DEST/requirements.txt" ] || { say "no requirements.txt in $DEST"; exit 1; }

# ------------------------------------------------------------------------------------------------ the interpreter
if [ -n "${COMFYUI_PYTHON:-}" ]; then
  PY="$COMFYUI_PYTHON"
else
  PY="$DEST/.venv/bin/python"
  if [ ! -x "$PY" ]; then
    say "creating $DEST/.venv"
    "$BASE_PY" -m venv "$DEST/.venv"
  fi
fi

# ------------------------------------------------------------------------------------------------ dependencies
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
if TORCH_VERSION="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null)"; then
  echo "torch==$TORCH_VERSION" > "$WORK/constraints.txt"   # keep the interpreter's own torch build
else
  cp "$PACK/scripts/constraints-cpu.txt" "$WORK/constraints.txt"
  TORCH_VERSION="$(sed -n 's/^torch==//p' "$WORK/constraints.txt")"
fi
if TV_VERSION="$("$PY" -c 'import importlib.metadata as m; print(m.version("torchvision"))' 2>/dev/null)"; then
  echo "torchvision==$TV_VERSION" >> "$WORK/constraints.txt"
elif [ "${TORCH_VERSION%%+*}" = "2.13.0" ]; then
  echo "torchvision==0.28.0" >> "$WORK/constraints.txt"   # the torchvision release built against torch 2.13.0
fi
grep -v -i -E '^[[:space:]]*torchaudio([^a-z0-9_-]|$)' "$DEST/requirements.txt" > "$WORK/requirements.txt"
"$PY" "$PACK/scripts/pack_requirements.py" "$PACK/pyproject.toml" > "$WORK/pack-requirements.txt"
printf '%s\n' requests "websocket-client>=1.7" "tqdm>=4.60" pyyaml >> "$WORK/pack-requirements.txt"
# The stamp hashes what is asked for: torch's release without its local label (the first run pins `torch==2.13.0`,
# the next reads back the installed `2.13.0+cpu`) and the requirement files. The torchvision pin is left out: it
# follows torch, and it is known on the first run only when torch is 2.13.0 but read back from the interpreter after.
STAMP="$("$PY" -c 'import sys; print(sys.prefix)')/.leandiffusion-setup"
WANT="$({ echo "torch==${TORCH_VERSION%%+*}"; cat "$WORK/requirements.txt" "$WORK/pack-requirements.txt"; } \
  | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
  say "installing ComfyUI's requirements and the pack's and the runner's dependencies (torch $TORCH_VERSION)"
  "$PY" -m pip install -q -c "$WORK/constraints.txt" -r "$WORK/requirements.txt" -r "$WORK/pack-requirements.txt"
  echo "$WANT" > "$STAMP"
else
  say "dependencies already installed (stamp: $STAMP)"
fi

# ------------------------------------------------------------------------------------------------ torchvision
if ! "$PY" -c "import torchvision" 2>/dev/null; then
  SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  say "torchvision's compiled ops do not load next to this torch: installing the import hook into $SITE"
  cp "$PACK/scripts/torchvision_cpu_shim.py" "$SITE/_leandiffusion_tv_shim.py"
  echo "import _leandiffusion_tv_shim" > "$SITE/_leandiffusion_tv_shim.pth"
fi
"$PY" - <<'PYEOF' || { say "the ComfyUI environment cannot import its dependencies"; exit 1; }
import importlib.metadata as m, importlib.util, sys
import torch, torchvision, aiohttp, yaml, requests, websocket  # what ComfyUI and the runner import at start
missing = [name for name in ("diffusers", "transformers", "safetensors") if importlib.util.find_spec(name) is None]
if missing:
    sys.exit(f"missing: {', '.join(missing)}")
print(f"[setup_comfyui] ready: torch {m.version('torch')}, torchvision {m.version('torchvision')}, "
      f"diffusers {m.version('diffusers')}", file=sys.stderr)
PYEOF
echo "COMFYUI_PATH=$DEST"
