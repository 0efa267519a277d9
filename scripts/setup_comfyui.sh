#!/usr/bin/env bash
# Sets up a ComfyUI tree and its own virtual environment (CPU torch pinned) able to load this pack from
# outside ComfyUI's tree. Re-running it is cheap: it only adds what is missing.
#
#   COMFYUI_PATH     where the ComfyUI tree lives (default: ~/.cache/leandiffusion/ComfyUI). When it already holds
#                    main.py it is used as it is; otherwise the tree is fetched there.
#   COMFYUI_SOURCE   where to fetch ComfyUI from when COMFYUI_PATH has no tree: a git URL (default: the official
#                    GitHub repository, cloned at COMFYUI_REF) or a local git directory, bare or not (exported at
#                    COMFYUI_REF with `git archive`; objects missing from a partial mirror are left out and named).
#   COMFYUI_REF      tag/commit to use (default: v0.3.64 for a URL, HEAD for a local git directory).
#   COMFYUI_PYTHON   interpreter that creates the venv (default: python3). The venv is $COMFYUI_PATH/.venv.
#
# The venv gets ComfyUI's requirements.txt (less torchaudio: PyPI has no torchaudio for the pinned CPU torch; only
# ComfyUI's audio nodes need it), `requests` (imported by ComfyUI but missing from its requirements), this pack's
# runtime dependencies and the runner's (websocket-client, tqdm). PyPI's torchvision is a CUDA build whose compiled
# ops cannot load next to the CPU torch; when `import torchvision` fails for that reason a tiny import hook
# (scripts/torchvision_cpu_shim.py) is installed into this venv only (see that file). Last line printed:
# COMFYUI_PATH=<path>.
set -euo pipefail
PACK="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${COMFYUI_PATH:-${XDG_CACHE_HOME:-$HOME/.cache}/leandiffusion/ComfyUI}"
SOURCE="${COMFYUI_SOURCE:-https://github.com/comfyanonymous/ComfyUI.git}"
BASE_PY="${COMFYUI_PYTHON:-python3}"
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
    git clone --quiet --depth 1 --branch "$REF" "$SOURCE" "$DEST"
  fi
fi
[ -f "$DEST/main.py" ] || { say "no ComfyUI main.py in $DEST"; exit 1; }
[ -f "$DEST/requirements.txt" ] || { say "no requirements.txt in $DEST"; exit 1; }

# ------------------------------------------------------------------------------------------------ the venv
VENV="$DEST/.venv"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  say "creating $VENV"
  "$BASE_PY" -m venv "$VENV"
fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cp "$PACK/scripts/constraints-cpu.txt" "$WORK/constraints.txt"
echo "torchvision==0.28.0" >> "$WORK/constraints.txt"   # the torchvision release built against torch 2.13.0
grep -v -i -E '^[[:space:]]*torchaudio([^a-z0-9_-]|$)' "$DEST/requirements.txt" > "$WORK/requirements.txt"
"$PY" - "$PACK/pyproject.toml" > "$WORK/pack-requirements.txt" <<'EOF'
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()
try:
    import tomllib
    deps = tomllib.loads(text)["project"]["dependencies"]
except ImportError:  # Python 3.10: read the dependencies array by hand
    block = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.S | re.M).group(1)
    deps = re.findall(r'"([^"]+)"', block)
print("\n".join(deps))
EOF
say "installing ComfyUI's requirements, the pack's and the runner's dependencies (CPU torch pinned)"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q -c "$WORK/constraints.txt" \
  -r "$WORK/requirements.txt" -r "$WORK/pack-requirements.txt" requests "websocket-client>=1.7" "tqdm>=4.60" pyyaml

# ------------------------------------------------------------------------------------------------ torchvision
if ! "$PY" -c "import torchvision" 2>/dev/null; then
  SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  say "torchvision's compiled ops do not load next to the CPU torch: installing the import hook into $SITE"
  cp "$PACK/scripts/torchvision_cpu_shim.py" "$SITE/_leandiffusion_tv_shim.py"
  echo "import _leandiffusion_tv_shim" > "$SITE/_leandiffusion_tv_shim.pth"
fi
"$PY" -c "import torch, torchvision, aiohttp, yaml, requests, diffusers, transformers, safetensors, websocket" \
  || { say "the ComfyUI venv cannot import its dependencies"; exit 1; }
say "ready: $("$PY" -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__)')"
echo "COMFYUI_PATH=$DEST"
