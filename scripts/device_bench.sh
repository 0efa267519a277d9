#!/usr/bin/env bash
# The benchmark command for the GPU device machine (docs/bench.md). Run from the repository root, e.g. through
# the device tool:  run(command="bash scripts/device_bench.sh --quick", carry=[".whl"])
#   full suite in four calls:  bash scripts/device_bench.sh --part 1/4   (... --part 4/4)
#   with ComfyUI's own nodes as peers: carry a ComfyUI tree too and add  --comfyui .comfyui
#   parts outside the default sets are asked for through the suites' environment variables (inherited by the
#   suites' processes), one call each:
#     LEANDIFFUSION_BENCH_ZIMAGE_CASES=cuda_graph,fp8,stream_fp8 bash scripts/device_bench.sh --quick --suite zimage --budget 400
#     LEANDIFFUSION_BENCH_SAMPLER_CASES=sdxl_fp8,sdxl_fp8_4gb bash scripts/device_bench.sh --quick --suite sampler --budget 240
#     LEANDIFFUSION_BENCH_QWEN_CASES=stream,stream_fp8,peer_offload bash scripts/device_bench.sh --quick --suite qwen --budget 580
# 1. installs the carried wheels (.whl/*.whl: diffusers and what it lacks there, spandrel) into /tmp/site;
# 2. makes this checkout importable as `leandiffusion` (a symlink in a temp dir on PYTHONPATH);
# 3. runs `python3 -m leandiffusion.bench "$@" --out $OUT/bench` unbuffered (the device returns $OUT's files).
# Exit status: the CLI's (0 ok, 1 a suite failed, 2 with --strict a target failed); 3 if the wheels fail.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 3
OUT_DIR="${OUT:-$ROOT/bench_out}/bench"
SITE="${LEAN_SITE:-/tmp/site}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "device_bench: wheel install failed" >&2; exit 3; }
fi
LINK="$(mktemp -d /tmp/leanpkg.XXXXXX)"
ln -s "$ROOT" "$LINK/leandiffusion"
export PYTHONPATH="$LINK:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__)" \
  || echo "device_bench: diffusers does not import (carry .whl, see docs/bench.md)" >&2
mkdir -p "$OUT_DIR"
python3 -m leandiffusion.bench "$@" --out "$OUT_DIR"
rc=$?
rm -rf "$LINK"
exit $rc
