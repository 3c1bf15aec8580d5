"""The engine core's heap trimming: once when it goes idle after work, and periodically while busy."""

from ridge.engine import native_memory
from ridge.engine.native_memory import HeapTrimmer


def test_trims_on_going_idle_once_and_every_period_while_busy(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(native_memory.time, "monotonic", lambda: clock[0])
    trimmer = HeapTrimmer()
    calls = []
    trimmer._trim = calls.append  # the C call, counted
    trimmer.after_step(idle=True)
    assert calls == []  # idle from the start: nothing to give back
    trimmer.after_step(idle=False)
    trimmer.after_step(idle=True)
    trimmer.after_step(idle=True)
    assert calls == [0]  # once per busy -> idle edge
    for _ in range(3):
        clock[0] += native_memory.TRIM_EVERY_S / 2 + 1
        trimmer.after_step(idle=False)
    assert calls == [0, 0]  # one more within the busy stretch, after TRIM_EVERY_S


def test_the_c_library_has_malloc_trim_here():
    assert HeapTrimmer()._trim is not None  # glibc: the trimming is real on this machine, not a no-op
