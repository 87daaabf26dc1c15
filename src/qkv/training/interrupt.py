"""Ctrl-C while a run trains (:func:`qkv.training.session.train_gpt`): stop after the step and save;
again: abort, never mid-save. Installed only where the main thread's default SIGINT handler is."""
from __future__ import annotations

import signal
import sys
from contextlib import contextmanager


class CtrlC:
    """Ctrl-C while training: the first stops the run after the current step (``pressed()``
    says so) and saves it; a second aborts at once (KeyboardInterrupt), keeping the last
    checkpoint. While ``with ctrl_c.saving():`` writes files, Ctrl-C waits for them to be
    complete: a checkpoint or a plot is written whole or not at all, never in part. Twice
    during a save of a running run aborts once that save is complete; during the save of a
    stopping run (the last one) it changes nothing."""

    def __init__(self):
        self.presses, self.depth, self.abort = 0, 0, False

    def pressed(self) -> bool:
        return self.presses > 0

    def handler(self, signum, frame):
        self.presses += 1
        if self.depth:
            self.abort = self.presses > 1
            print("\nsaving: Ctrl-C takes effect once the files are complete", file=sys.stderr)
        elif self.presses > 1:
            raise KeyboardInterrupt
        else:
            print("\nstopping after this step and saving (Ctrl-C again to abort)", file=sys.stderr)

    @contextmanager
    def saving(self, last: bool = False):
        last = last or self.presses > 0  # the run is ending: this save is its last, let it finish the rest
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if self.abort and not last and not self.depth:
            raise KeyboardInterrupt

    @classmethod
    @contextmanager
    def installed(cls):
        """A CtrlC handling SIGINT meanwhile (where the main thread's default handler is in place;
        elsewhere one that never fires)."""
        ctrl_c = cls()
        if sys.platform == "win32" or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            yield ctrl_c  # not the main thread's default handler: leave it alone
            return
        signal.signal(signal.SIGINT, ctrl_c.handler)
        try:
            yield ctrl_c
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
