"""``batch.py`` alone: the bar over a batch through several out-of-memory restarts, and ``release_frames`` along an
exception's implicit context (the tests of the loops that use them would pass with ``restart`` not recording the new
units, or ``release_frames`` following only ``__cause__``)."""
import gc
import weakref

from leandiffusion.batch import BatchProgress, release_frames
from leandiffusion.tests.kit.progress import ComfyLikeBar


def _run_image(progress, ticks):
    for _ in range(ticks):
        progress.tick()


def test_two_restarts_in_one_batch_keep_the_bar_on_the_units_done():
    """4 images of 10 units; image 0 restarts at 20 units (after 3 ticks), image 2 at 40 (after 5). Expected
    positions and totals written out by hand: each restart goes back to the finished images' units."""
    bar = ComfyLikeBar(40)
    progress = BatchProgress(bar, images=4, units=10)
    _run_image(progress, 3)
    progress.restart(20)
    assert (bar.value, bar.total) == (0, 80)  # nothing finished; 20 units x 4 images
    _run_image(progress, 20)
    progress.image_done()
    _run_image(progress, 20)
    progress.image_done()
    assert (bar.value, bar.total) == (40, 80)
    _run_image(progress, 5)
    progress.restart(40)
    assert (bar.value, bar.total) == (40, 40 + 40 * 2)  # back to images 0-1's 40 units; images 2-3 at 40 each
    _run_image(progress, 40)
    progress.image_done()
    progress.restart(40)  # a third retry on image 3 at the same size: back to images 0-2's 80 units
    assert (bar.value, bar.total) == (80, 120)
    _run_image(progress, 40)
    progress.image_done()
    assert (bar.value, bar.total) == (120, 120)


class _Held:
    pass


def _fail_holding(obj_ref_out, error=None):
    held = _Held()
    obj_ref_out.append(weakref.ref(held))
    raise error or MemoryError("first")


def _handler_that_fails(refs):
    try:
        _fail_holding(refs)
    except MemoryError:
        raise ValueError("second")  # implicit context: the MemoryError, whose frame holds ``held``


def test_release_frames_follows_the_implicit_context():
    refs = []
    try:
        _handler_that_fails(refs)
    except ValueError as exc:
        assert exc.__cause__ is None and isinstance(exc.__context__, MemoryError)
        release_frames(exc)
        gc.collect()
        assert refs[0]() is None  # the object in the context's finished frame is gone


def _raise_from_an_earlier_error_while_handling_another(refs):
    try:
        _fail_holding(refs, OSError("earlier failure"))
    except OSError as earlier:
        saved = earlier
    try:
        _fail_holding(refs)
    except MemoryError:
        raise ValueError("second") from saved  # cause: the OSError; context: the MemoryError being handled


def test_release_frames_follows_both_the_cause_and_the_context():
    """``raise X from saved`` inside another handler gives X a cause and a different context; ``release_frames`` walks
    both chains (walking one, ``__cause__ or __context__``, the context's finished frames keep their locals alive
    although the docstring promises none does)."""
    refs = []
    try:
        _raise_from_an_earlier_error_while_handling_another(refs)
    except ValueError as exc:
        assert isinstance(exc.__cause__, OSError) and isinstance(exc.__context__, MemoryError)
        release_frames(exc)
        gc.collect()
        assert [r() is None for r in refs] == [True, True]  # the cause's and the context's objects are both gone


def test_release_frames_ends_on_a_cycle_of_causes():
    """A cause chain set by hand may loop (``a.__cause__ = b; b.__cause__ = a``): each exception is visited once."""
    refs = []
    try:
        _fail_holding(refs)
    except MemoryError as exc:
        first = exc
    second = ValueError("second")
    first.__cause__, second.__cause__ = second, first
    release_frames(second)  # returns (the test would hang otherwise)
    gc.collect()
    assert refs[0]() is None
