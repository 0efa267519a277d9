"""bench.gpu_clocks: nvidia-smi's samples parsed and summarised; the sampler runs the CLI for the block only."""
import os
import stat
import time

import pytest
import torch

from leandiffusion.bench import gpu_clocks
from leandiffusion.bench.gpu_clocks import clock_sampler, parse_samples, smi_index, summarize


def test_parse_skips_lines_without_three_numbers():
    text = "1980, 658.20, 700.00\n[N/A], 650.1, 700.00\n1605, 699.9\n\n1740, 690.00, 700.00\n"
    assert parse_samples(text) == [(1980.0, 658.2, 700.0), (1740.0, 690.0, 700.0)]


def test_summarize_means_and_minimum():
    got = summarize([(1980.0, 650.0, 700.0), (1600.0, 700.0, 700.0)])
    assert got == {"sm_mhz": 1790.0, "sm_mhz_min": 1600.0, "power_w": 675.0, "power_limit_w": 700.0, "samples": 2}
    assert summarize([]) == {}


def test_smi_index_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert smi_index(torch.device("cuda", 1)) == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    assert smi_index(torch.device("cuda", 1)) == "5"
    assert smi_index(torch.device("cpu")) is None


def test_no_cuda_device_samples_nothing():
    with clock_sampler(torch.device("cpu")) as got:
        pass
    assert got == {}


def test_missing_cli_samples_nothing(monkeypatch):
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    with clock_sampler(torch.device("cuda", 0)) as got:
        pass
    assert got == {}


@pytest.mark.skipif(os.name != "posix", reason="fake CLI is a shell script")
def test_sampler_reads_a_cli_for_the_block(tmp_path, monkeypatch):
    args_file = tmp_path / "args"
    fake = tmp_path / "nvidia-smi"
    # prints one sample every 20 ms until terminated, like `nvidia-smi -lms`
    fake.write_text(f'#!/bin/sh\necho "$@" > {args_file}\nwhile true; do echo "1750, 690.00, 700.00"; '
                    f'sleep 0.02; done\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with clock_sampler(torch.device("cuda", 0), interval_ms=20) as got:
        time.sleep(0.3)
        assert got == {}  # filled on exit only
    assert got["samples"] >= 3
    assert got["sm_mhz"] == got["sm_mhz_min"] == 1750.0
    assert (got["power_w"], got["power_limit_w"]) == (690.0, 700.0)
    args = args_file.read_text().split()
    assert args[:2] == ["-i", "0"] and "-lms" in args and "20" in args
    assert not any(a.startswith(("-pl", "-lgc", "-ac", "-r")) for a in args)  # reads only
