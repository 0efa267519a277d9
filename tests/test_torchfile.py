"""torchfile: pickle-based weights are read with weights_only=True, and every failure is one short, named line."""
import pickle

import pytest
import torch

from leandiffusion.torchfile import load_tensors, read_safetensors, refuse_non_finite


class _RunsCode:
    def __reduce__(self):
        return (exec, ("import os; os.environ['LEANDIFFUSION_PICKLE_RAN'] = '1'",))


def test_plain_tensors_load(tmp_path):
    path = tmp_path / "w.pth"
    torch.save({"a": torch.arange(4.0)}, path)
    assert torch.equal(load_tensors(path, "test file")["a"], torch.arange(4.0))


def test_a_pickle_with_code_is_refused_never_run(tmp_path, monkeypatch):
    monkeypatch.delenv("LEANDIFFUSION_PICKLE_RAN", raising=False)
    path = tmp_path / "evil.ckpt"
    path.write_bytes(pickle.dumps({"x": _RunsCode()}, protocol=2))  # torch.save's protocol
    with pytest.raises(ValueError) as err:
        load_tensors(path, "upscaler file")
    import os

    assert "LEANDIFFUSION_PICKLE_RAN" not in os.environ
    message = str(err.value)
    assert message.startswith("upscaler file 'evil.ckpt' is refused: loading it would run code (it refers to the "
                              "Python global exec), which is refused for safety; use a .safetensors file")
    assert "\n" not in message and len(message) < 400 and "weights_only" not in message


class _RunsShell:
    def __reduce__(self):
        import os

        return (os.system, ("echo LEANDIFFUSION_PICKLE_RAN",))  # pickled as posix.system on POSIX


@pytest.mark.parametrize("saver", ["torch.save", "pickle protocol 2"])
def test_a_shell_payload_is_refused_naming_the_global_without_torchs_advice(tmp_path, capfd, saver):
    """A real attack's payload: a reduce that calls ``os.system``. torch refuses it as a global of a blocked module,
    in a message with no ``WeightsUnpickler error:`` line, around advice to re-run with ``weights_only=False``: the
    refusal kept that advice and lost the reason. It must say the file would run code, name the global, point to
    ``.safetensors``, and never mention ``weights_only``."""
    import os

    path = tmp_path / "evil.pt"
    if saver == "torch.save":
        torch.save({"x": _RunsShell()}, path)
    else:
        path.write_bytes(pickle.dumps({"x": _RunsShell()}, protocol=2))
    with pytest.raises(ValueError) as err:
        load_tensors(path, "lora file")
    assert "LEANDIFFUSION_PICKLE_RAN" not in capfd.readouterr().out
    message = str(err.value)
    assert message == (f"lora file 'evil.pt' is refused: loading it would run code (it refers to the Python global "
                       f"{os.system.__module__}.system), which is refused for safety; use a .safetensors file of "
                       f"these weights instead (safetensors files hold tensors only)")


def test_reasons_never_carry_torchs_advice():
    """Every form of torch's weights-only refusal keeps its reason and drops its advice (``weights_only=False``,
    ``add_safe_globals``, "file an issue", the documentation link)."""
    from leandiffusion.torchfile import load_error_reason

    unsafe = ("In PyTorch 2.6, we changed the default value of the `weights_only` argument in `torch.load` from `False`"
              " to `True`. Re-running `torch.load` with `weights_only` set to `False` will likely succeed, but it can "
              "result in arbitrary code execution. Do it only if you got the file from a trusted source.")
    docs = "\n\nCheck the documentation of torch.load to learn more about types accepted by default with weights_only."
    cases = {
        f"Weights only load failed. {unsafe}\n\n\nTrying to load unsupported GLOBAL nt.system whose module nt is "
        f"blocked.{docs}": "loading it would run code (it refers to the Python global nt.system), which is refused "
                           "for safety",
        f"Weights only load failed. {unsafe}\nPlease file an issue with the following so that we can make "
        f"`weights_only=True` compatible with your use case: WeightsUnpickler error: \n\nUnsupported operand 149{docs}":
            "not a torch weights file, or corrupt (the safe unpickler stopped: Unsupported operand 149)",
        f"Weights only load failed. ``torch.nested`` and ``torch._dynamo`` must be imported to load nested jagged "
        f"tensors (NJTs)\n {unsafe}\n{docs}": "not a torch weights file, or corrupt (the safe unpickler stopped: "
                                              "``torch.nested`` and ``torch._dynamo`` must be imported to load nested "
                                              "jagged tensors (NJTs))",
        f"Cannot use ``weights_only=True`` with TorchScript archives passed to ``torch.load``. {unsafe}":
            "a TorchScript archive, which holds code: refused for safety",
    }
    for text, want in cases.items():
        assert load_error_reason(pickle.UnpicklingError(text)) == want


@pytest.mark.parametrize("content", [b"", b"\x80\x04garbage", "half"])
def test_cut_short_or_garbage_is_one_named_line(tmp_path, content):
    path = tmp_path / "w.pt"
    if content == "half":
        torch.save({"a": torch.zeros(1000)}, path)
        path.write_bytes(path.read_bytes()[:700])
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=r"^lora file 'w.pt' could not be read as a torch weights file: ") as err:
        load_tensors(path, "lora file")
    message = str(err.value)
    assert "\n" not in message and message.endswith("Re-download it if it is cut short, or convert it to .safetensors")
    if content in ("half", b""):  # b"": torch raises a bare EOFError, a branch of its own
        assert "cut short or corrupt" in message
    if content == b"\x80\x04garbage":
        assert "not a torch weights file, or corrupt" in message


def test_safetensors_tensors_and_metadata_or_one_named_line(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(6.0).reshape(2, 3)}, str(path), metadata={"arch": "x"})
    tensors, metadata = read_safetensors(path, "lora file")
    assert torch.equal(tensors["a"], torch.arange(6.0).reshape(2, 3)) and metadata == {"arch": "x"}
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"^lora file 'w\.safetensors' could not be read as a safetensors file "
                                         r"\(cut short or corrupt: .+\); re-download it") as info:
        read_safetensors(path, "lora file")
    assert "\n" not in str(info.value)



def test_safetensors_tensors_survive_the_file_being_overwritten_in_place(tmp_path):
    """safe_open's tensors are views of the mapped file: ``cp other.safetensors a.safetensors`` (same inode, same
    size) changed tensors already read, with every safetensors version tested (0.4.2 to 0.8.0; a shorter file killed
    the process with SIGBUS instead, so this test keeps the size). The data read must stay what was read."""
    from safetensors.torch import save

    path = tmp_path / "a.safetensors"
    path.write_bytes(save({"a": torch.full((4, 8), 0.25)}))
    got = read_safetensors(path, "lora file")[0]["a"]
    inode = path.stat().st_ino
    with open(path, "r+b") as f:  # what cp does to an existing file: rewrite the bytes of the same inode
        f.write(save({"a": torch.full((4, 8), -0.25)}))
    assert path.stat().st_ino == inode
    assert torch.equal(got, torch.full((4, 8), 0.25)), "the tensor read changed with the file: a view of the mapping"


def test_large_finite_values_are_not_refused_as_non_finite():
    """``refuse_non_finite`` screens each tensor by its fp32 sum, which overflows for large finite values, so the exact
    ``isfinite`` check behind the screen decides (tests whose non-finite tensors hold NaN or inf would pass without it).
    Finite values whose sum overflows fp32 (an fp32 tensor near its maximum, an fp64 one beyond it) pass; a NaN or inf
    beside them is still named."""
    big = {"f32": torch.full((4,), 3e38), "f64": torch.tensor([1e300, -1e300, 1e300], dtype=torch.float64),
           "f16": torch.full((8,), 65504.0, dtype=torch.float16)}
    assert not torch.isfinite(big["f32"].sum(dtype=torch.float32))  # the screen alone would refuse it
    refuse_non_finite(big, "test file", "outputs bad", "re-export it")
    with pytest.raises(ValueError, match=r"test file: 1 tensors hold NaN or infinite values \(bad has 1 NaN and 1 "
                                         r"infinite of 3 values\)"):
        refuse_non_finite(dict(big, bad=torch.tensor([1.0, float("nan"), float("inf")])), "test file", "outputs bad",
                          "re-export it")


def test_refuse_non_finite_names_ten_tensors_then_elides():
    """The docstring's "up to ten": twelve bad tensors give the first ten in key order, then `` ...`` (tests with at
    most one bad tensor would pass naming only the first one)."""
    bad = {f"k{i:02d}": torch.tensor([float("nan")]) for i in range(12)}
    with pytest.raises(ValueError) as err:
        refuse_non_finite(bad, "test file", "outputs bad", "re-export it")
    named = "; ".join(f"k{i:02d} = nan" for i in range(10))
    assert str(err.value).startswith(f"test file: 12 tensors hold NaN or infinite values ({named} ...); they would "
                                     f"turn outputs bad;")


def test_a_long_reason_is_cut_to_one_short_line():
    """A reason is its first line, at most 200 characters (197 and ``...``), whitespace folded (short reasons would pass
    without the cut)."""
    from leandiffusion.torchfile import load_error_reason

    reason = load_error_reason(OSError("x" * 150 + " \t " + "y" * 150 + "\nsecond line"))
    assert reason == ("x" * 150 + " " + "y" * 46 + "...")


def test_a_legacy_protocol_4_pickle_is_refused_without_torchs_warning(tmp_path):
    """A legacy (non-zip) torch file pickled with protocol 4 is refused by the safe unpickler; torch first warns
    "Detected pickle protocol 4", noise beside the one-line refusal, which the loader silences."""
    import warnings

    path = tmp_path / "old.pt"
    torch.save({"a": torch.ones(2)}, path, _use_new_zipfile_serialization=False, pickle_protocol=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r"^lora file 'old\.pt' could not be read as a torch weights file"):
            load_tensors(path, "lora file")
    assert [str(w.message)[:40] for w in caught if "pickle protocol" in str(w.message)] == []
