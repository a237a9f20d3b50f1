"""A run's progress on stderr: a tqdm bar redrawn in place on a terminal, a line now and then in a
log. `hetpipe run` and the baselines (`mode: ddp`, `mode: torch-pipeline`) show it alike."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Bar:
    """Progress on a terminal: a tqdm bar, redrawn in place."""

    def __init__(self, total: int, desc: str, start: int = 0) -> None:
        # initial: tqdm's rate and ETA count from the samples already there (a resumed run starts at
        # its cut's, a baseline's first report comes after its ranks' start-up), not as if they had
        # all been trained in this bar's first moment.
        self._bar = tqdm(total=total, initial=start, unit="sample", file=sys.stderr, dynamic_ncols=True, desc=desc)

    def show(self, samples: int, total: int, loss: float | None, samples_per_second: float | None, *,
             last: bool) -> None:
        """samples_per_second: None where no rate is known yet (a baseline's first report)."""
        self._bar.total = total   # less once a VW has left the job (parallel.on_vw_failure: continue)
        self._bar.n = samples
        postfix = {"loss": f"{loss:.4f}"} if loss is not None else {}
        if samples_per_second is not None:
            postfix["samples_s"] = f"{samples_per_second:.0f}"
        self._bar.set_postfix(**postfix, refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


class Lines:
    """Progress into a log (stderr is no terminal): a line at each tenth of the run, at least
    every LINE_S while it moves, and the last; a bar redrawn with carriage returns would fill a
    log file with thousands of them."""

    LINE_S = 30.0

    def __init__(self, total: int, desc: str, start: int = 0) -> None:
        self._total, self._desc = total, desc
        self._tenth, self._at, self._printed, self._text = -1, 0.0, -1, ""

    def show(self, samples: int, total: int, loss: float | None, samples_per_second: float | None, *,
             last: bool) -> None:
        self._total = total   # less once a VW has left the job (parallel.on_vw_failure: continue)
        tenth = 10 * samples // max(self._total, 1)
        now = time.monotonic()
        if not last and tenth <= self._tenth and (now - self._at < self.LINE_S or samples == self._printed):
            return
        percent = 100 * samples // max(self._total, 1)
        text = f"{self._desc}: {percent}% ({samples}/{self._total} samples)"
        text += f", {samples_per_second:.0f} samples/s" if samples_per_second is not None else ""
        text += f", loss {loss:.4f}" if loss is not None else ""
        if text == self._text:   # the final status repeats the last report
            return
        self._tenth, self._at, self._printed, self._text = tenth, now, samples, text
        print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def shown(total: int, desc: str, start: int = 0) -> Bar | Lines:
    """A bar where stderr is a terminal, else lines."""
    return (Bar if sys.stderr.isatty() else Lines)(total, desc, start)
