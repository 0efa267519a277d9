"""Why the Stream Scheduler draws each image's noise into its row instead of ``torch.cat``-ing the draws.

A probe, not pack code. After the host has sat idle (here: 1 s, as it does while the GPU denoises), a CPU
``torch.cat`` of eight 4x128x128 float32 draws (2 MB) wakes the intra-op thread pool; on a 16-core H100 host
that measured 35-60 ms, against 3-6 ms for the eight draws themselves (session 27). The script times, after a
1 s sleep each: the eight draws (one generator per seed), their cat, and the draws written into the rows of one
tensor (``randn(out=...)``, what ``sampling.stream.scheduler.initial_noise`` does), checks that the last equals
the cat exactly, and that one intra-op thread draws the same values. Usage: ``python scripts/diag/cpu_cat_wakeup.py``
(any host; the effect needs many cores).
"""
import time

import torch

SHAPE = (1, 4, 128, 128)


def draws():
    return [torch.randn(SHAPE, generator=torch.Generator("cpu").manual_seed(1000 + i), dtype=torch.float32)
            for i in range(8)]


def into_rows():
    out = torch.empty((8,) + SHAPE[1:])
    for i in range(8):
        torch.randn(SHAPE, generator=torch.Generator("cpu").manual_seed(1000 + i), dtype=torch.float32,
                    out=out[i:i + 1])
    return out


def timed(fn):
    t = time.perf_counter()
    r = fn()
    return round((time.perf_counter() - t) * 1e3, 2), r


def main():
    res = {"threads": torch.get_num_threads(), "draws_ms": [], "cat_ms": [], "into_rows_ms": []}
    for _ in range(6):
        time.sleep(1.0)
        ms, d = timed(draws)
        res["draws_ms"].append(ms)
        time.sleep(1.0)
        ms, c = timed(lambda: torch.cat(d))
        res["cat_ms"].append(ms)
        time.sleep(1.0)
        ms, rows = timed(into_rows)
        res["into_rows_ms"].append(ms)
        assert torch.equal(rows, c)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    one = torch.cat(draws())
    torch.set_num_threads(threads)
    res["same_values_with_one_thread"] = bool(torch.equal(one, c))
    print(res)


if __name__ == "__main__":
    main()
