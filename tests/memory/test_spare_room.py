"""A run holds streamed blocks only in the activation room its shape leaves unused, by the plan's own estimate."""
import pytest
import torch

from leandiffusion.memory.plan import WORKSPACE_CUDA
from leandiffusion.memory.spare_room import run_activation_bytes, streamed_blocks_held

MiB = 2 ** 20


def test_the_estimate_scales_with_the_rows_and_keeps_the_workspace():
    plan = WORKSPACE_CUDA + 1000 * MiB
    assert run_activation_bytes(plan, (2, 128, 128), (2, 128, 128)) == plan
    assert run_activation_bytes(plan, (2, 128, 128), (1, 128, 128)) == WORKSPACE_CUDA + 500 * MiB
    assert run_activation_bytes(plan, (2, 128, 128), (1, 64, 96)) == WORKSPACE_CUDA + 500 * MiB  # rows bound it


@pytest.mark.parametrize("working", [(3, 128, 128), (1, 136, 128), (1, 128, 129)])
def test_a_run_larger_than_the_plan_in_any_dimension_gets_no_estimate(working):
    assert run_activation_bytes(WORKSPACE_CUDA + MiB, (2, 128, 128), working) is None


class _Streamer:
    def __init__(self):
        self.asked, self.released = [], 0

    def hold(self, room):
        self.asked.append(room)
        return 0

    def release_held(self):
        self.released += 1


class _Budget:
    def __init__(self, hard):
        self.hard, self.activation_bytes, self.headroom_bytes = hard, WORKSPACE_CUDA + 1000 * MiB, 0


class _Engine:
    def __init__(self, hard, device):
        self.device = torch.device(device)
        self.placement = type("P", (), {})()
        self.placement.streamer, self.placement.budget = _Streamer(), _Budget(hard)
        self.placement.plan = type("Plan", (), {"working_shape": (2, 128, 128)})()


@pytest.mark.parametrize("hard, device, working", [(False, "cuda", (1, 128, 128)), (True, "cpu", (1, 128, 128)),
                                                   (True, "cuda", None)])
def test_nothing_is_held_without_a_hard_budget_on_cuda_or_without_a_working_shape(hard, device, working):
    engine = _Engine(hard, device)
    with streamed_blocks_held(engine, working) as held:
        assert held == 0
    assert engine.placement.streamer.asked == []


def test_the_room_asked_for_is_what_the_cap_leaves_less_the_run_s_need_and_is_given_back(monkeypatch):
    from leandiffusion.memory import spare_room

    engine = _Engine(True, "cuda")
    monkeypatch.setattr(spare_room, "cap_bytes", lambda placement: 3200 * MiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 200 * MiB)
    with pytest.raises(RuntimeError):
        with streamed_blocks_held(engine, (1, 128, 128)):
            raise RuntimeError("a step failed")
    assert engine.placement.streamer.asked == [3000 * MiB - WORKSPACE_CUDA - 500 * MiB - spare_room.MARGIN_BYTES]
    assert engine.placement.streamer.released == 1
