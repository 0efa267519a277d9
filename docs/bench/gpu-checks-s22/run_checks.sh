#!/bin/bash
# session 22 device script (not committed): new GPU tests, the three GPU-only mutants, the whole GPU suite
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
mkdir -p /tmp/links && ln -sfn "$PWD" /tmp/links/leandiffusion
export PYTHONPATH=/tmp/links:/tmp/site
nvidia-smi --query-gpu=name,power.limit,driver_version --format=csv > $OUT/device.txt
NEW="tests/memory/test_gpu_policy_rules.py tests/kernels/test_cfg_ddim.py"
python3 -m pytest -q -p no:cacheprovider -m gpu $NEW -rs > $OUT/new_tests.txt 2>&1; echo "rc=$?" >> $OUT/new_tests.txt
for m in P12 P14 D01; do
  rm -rf /tmp/mut && mkdir -p /tmp/mut/leandiffusion && tar --exclude=./.whl --exclude=./.carry -cf - . | tar -xf - -C /tmp/mut/leandiffusion
  (cd /tmp/mut/leandiffusion && python3 - "$m" <<'PY'
import sys
m = sys.argv[1]
f, old, new = {
 "P12": ("memory/policies.py", 'vae_dtype = torch.float32 if (dev.type == "cpu" or (overflows and dtype == torch.float16)) else dtype',
         'vae_dtype = torch.float32 if (dev.type == "cpu" or overflows) else dtype'),
 "P14": ("memory/policies.py", 'if stage == "text" and self.plan.text_mode == "cpu":\n            return torch.device("cpu")',
         'if False:\n            return torch.device("cpu")'),
 "D01": ("kernels/cfg_ddim.py", "all(t.is_cuda and t.is_contiguous() for t in tensors)", "all(t.is_cuda for t in tensors)"),
}[m]
s = open(f).read(); assert s.count(old) == 1, (m, s.count(old)); open(f, "w").write(s.replace(old, new))
PY
  PYTHONPATH=/tmp/mut:/tmp/site python3 -m pytest -q -p no:cacheprovider -m gpu $NEW tests/sampling/test_sampler_policies.py > $OUT/mutant_$m.txt 2>&1; echo "rc=$?" >> $OUT/mutant_$m.txt
  )
done
timeout 480 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ --timeout=400 -rs > $OUT/gpu_tests.txt 2>&1; echo "rc=$?" >> $OUT/gpu_tests.txt
for f in $OUT/*.txt; do echo "== $f"; tail -n 4 "$f"; done
