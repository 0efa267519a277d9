"""Reference-counted attach/detach (``lora/binding.py``), on a stand-in binding that logs its (de)activations.

Guards: components the binding does not know are skipped; a failed attach undoes every component it had already
counted, nested ones included, also for a ``KeyboardInterrupt``; a detach of an inactive component changes nothing;
only the last detach deactivates. The refusal of a second strength is covered by ``test_unmerged.py``.
"""
from __future__ import annotations

import pytest

from leandiffusion.lora.binding import RefCountedBinding


class Logged(RefCountedBinding):
    label = "style"

    def __init__(self, components=("unet", "text_encoder"), fail=None, exc=RuntimeError):
        self._init_refcounts(components)
        self.log, self.fail, self.exc = [], fail, exc

    def _activate(self, comp, strength):
        if comp == self.fail:
            raise self.exc(f"{comp} cannot be activated")
        self.log.append(("on", comp, strength))

    def _deactivate(self, comp):
        self.log.append(("off", comp))


def test_nested_attaches_share_one_activation_and_the_last_detach_ends_it():
    b = Logged()
    for _ in range(3):
        b.attach({"unet": 0.5, "vae": 1.0})  # "vae" is not one of its components: skipped
    assert b.log == [("on", "unet", 0.5)] and b._depth == {"unet": 3, "text_encoder": 0}
    b.detach({"unet": 0.5})
    b.detach({"unet": 0.5})
    assert b.log == [("on", "unet", 0.5)]
    b.detach({"unet": 0.5})
    assert b.log == [("on", "unet", 0.5), ("off", "unet")]
    b.detach({"unet": 0.5, "text_encoder": 1.0})  # nothing active: nothing happens
    assert b.log == [("on", "unet", 0.5), ("off", "unet")] and b._depth == {"unet": 0, "text_encoder": 0}
    b.attach({"unet": 0.8})  # a new activation after the last detach may take another strength
    assert b.log[-1] == ("on", "unet", 0.8)


def test_another_strength_while_active_is_refused_and_undoes_the_attach():
    b = Logged()
    b.attach({"unet": 0.5})
    b.attach({"text_encoder": 1.0, "unet": 0.5})
    with pytest.raises(RuntimeError, match="'style' is already attached to the text_encoder with strength 1.0"):
        b.attach({"unet": 0.5, "text_encoder": 0.3})  # unet counted, then refused: the count is undone
    assert b._depth == {"unet": 2, "text_encoder": 1} and b._active == {"unet": 0.5, "text_encoder": 1.0}
    assert b.log == [("on", "unet", 0.5), ("on", "text_encoder", 1.0)]


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_a_failed_attach_leaves_every_component_as_it_was(exc):
    b = Logged(components=("unet", "text_encoder", "text_encoder_2"), fail="text_encoder_2", exc=exc)
    b.attach({"unet": 0.5})
    with pytest.raises(exc, match="text_encoder_2 cannot be activated"):
        b.attach({"unet": 0.5, "text_encoder": 1.0, "text_encoder_2": 1.0})
    assert b._depth == {"unet": 1, "text_encoder": 0, "text_encoder_2": 0}
    assert b.log == [("on", "unet", 0.5), ("on", "text_encoder", 1.0), ("off", "text_encoder")]
