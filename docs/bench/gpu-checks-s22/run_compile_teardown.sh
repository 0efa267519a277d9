#!/bin/bash
# needs the conftest before the fix beside it: git show fbffb33:tests/conftest.py > s22_conftest_old.py
# session 22 (not committed): the compile tests' teardown errors when the conftest's tiny compile is an Inductor cache hit
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
rm -rf /tmp/old && mkdir -p /tmp/old/leandiffusion && tar --exclude=./.whl -cf - . | tar -xf - -C /tmp/old/leandiffusion
cp s22_conftest_old.py /tmp/old/leandiffusion/tests/conftest.py
mkdir -p /tmp/links && ln -sfn "$PWD" /tmp/links/leandiffusion
T="tests/sampling/test_compile_scope.py tests/sampling/test_graph_runner.py"
run() {  # $1 label, $2 root, $3 inductor cache dir; the old conftest's tiny compile warms the cache first
  export TORCHINDUCTOR_CACHE_DIR=$3
  (cd /tmp/old/leandiffusion && PYTHONPATH=/tmp/old:/tmp/site python3 -m pytest -q -p no:cacheprovider tests/memory/test_hostmem.py > $OUT/$1_warm.txt 2>&1)
  export PYTHONPATH=$2:/tmp/site
  (cd $2/leandiffusion && timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu $T -rE --tb=line > $OUT/$1.txt 2>&1; echo rc=$? >> $OUT/$1.txt)
}
run old /tmp/old /tmp/ic_old
run new /tmp/links /tmp/ic_new
for f in old new; do echo "== $f"; grep -E "left process|recursion|TRITON|ERROR|passed|failed|rc=" $OUT/$f.txt | head -12; done
