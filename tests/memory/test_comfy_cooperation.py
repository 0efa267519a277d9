"""ComfyUI cooperation through the bridge: a pack memory owner is freed by ComfyUI's memory manager.

ComfyUI 0.3.64's ``free_memory`` walks ``current_loaded_models`` for the device, calls ``model_unload`` on each
entry until enough is free and pops the unloaded ones; ``cleanup_models`` drops entries whose ``real_model()`` is
None; ``/free`` runs ``unload_all_models`` = ``free_memory(1e30, device)``. The fake module below reproduces that
behaviour (not ComfyUI's code) so the bridge entry is exercised without a ComfyUI install.
"""
import gc
import sys
import types

import pytest
import torch

from leandiffusion import bridge


class _FakeMM(types.ModuleType):
    def __init__(self):
        super().__init__("comfy.model_management")
        self.current_loaded_models = []
        self.freed = []

    def free_memory(self, memory_required, device, keep_loaded=()):
        for i in range(len(self.current_loaded_models) - 1, -1, -1):
            entry = self.current_loaded_models[i]
            if entry.device == device and not entry.is_dead():
                _ = (-entry.model_offloaded_memory(), sys.getrefcount(entry.model), entry.model_memory(), i)
                _ = entry.model.model.__class__.__name__  # ComfyUI logs this for every unloaded model
                entry.currently_used = False
                if entry.model_unload(None):
                    self.current_loaded_models.pop(i)

    def cleanup_models(self):
        self.current_loaded_models[:] = [e for e in self.current_loaded_models if e.real_model() is not None]

    def soft_empty_cache(self):
        return None

    def loaded_models(self, only_currently_used=False):
        return [m.model for m in self.current_loaded_models if m.currently_used or not only_currently_used]


@pytest.fixture()
def fake_comfy(monkeypatch):
    mm = _FakeMM()
    comfy = types.ModuleType("comfy")
    comfy.model_management = mm
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    return mm


class _Owner:
    def __init__(self):
        self.released = 0

    def release(self):
        self.released += 1


def test_free_releases_pack_memory(fake_comfy):
    owner = _Owner()
    dev = torch.device("cuda", 0)
    handle = bridge.register_memory_owner(owner, dev, lambda: 123, owner.release)
    assert handle in fake_comfy.current_loaded_models
    assert fake_comfy.loaded_models(only_currently_used=True) == []  # never looks "in use" to ComfyUI
    fake_comfy.free_memory(1e30, dev)  # what /free (unload_all_models) does
    assert owner.released == 1 and handle not in fake_comfy.current_loaded_models


def test_dead_owner_is_cleaned_and_unregister_is_idempotent(fake_comfy):
    owner = _Owner()
    handle = bridge.register_memory_owner(owner, torch.device("cuda", 0), lambda: 1, owner.release)
    bridge.unregister_memory_owner(handle)
    bridge.unregister_memory_owner(handle)
    assert fake_comfy.current_loaded_models == []
    owner2 = _Owner()
    bridge.register_memory_owner(owner2, torch.device("cuda", 0), lambda: 1, owner2.release)
    del owner2
    gc.collect()
    fake_comfy.cleanup_models()
    assert fake_comfy.current_loaded_models == []


def test_outside_comfyui_registration_is_a_no_op(monkeypatch):
    monkeypatch.delitem(sys.modules, "comfy", raising=False)
    monkeypatch.delitem(sys.modules, "comfy.model_management", raising=False)
    assert bridge.register_memory_owner(_Owner(), torch.device("cpu"), lambda: 0, lambda: None) is None


def test_a_dead_owner_reports_no_memory_and_is_not_released(fake_comfy):
    """Between the owner's collection and ComfyUI's next ``cleanup_models`` the entry still sits in ComfyUI's list: it
    reports 0 bytes (nothing is held any more) and unloading it calls nothing, also where ``size_fn`` / ``release``
    are plain functions rather than the owner's bound methods (the liveness test in ``model_memory``)."""
    owner, released = _Owner(), []
    handle = bridge.register_memory_owner(owner, torch.device("cuda", 0), lambda: 123, lambda: released.append(1))
    assert handle.model_memory() == 123 and handle.model.model_size() == 123
    del owner
    gc.collect()
    assert handle.model_memory() == 0 and handle.model.loaded_size() == 0
    assert handle.model_unload() is True and released == []
