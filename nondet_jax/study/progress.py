"""Progress of a study: a bar on a terminal, a line every 30 s in a log."""

from __future__ import annotations

import time

import jax


class Progress:
    """Progress of the arms in replica-epochs: a rich bar per arm (with ETA) on a terminal, else a log
    line every ``every`` seconds (batch jobs, Slurm logs), or nothing at all (``log=None``).

    Until an arm's first epoch is done the bar says what it waits for: XLA compiling (seconds and
    programs so far, from JAX's compile events as they come) and programs loaded from the persistent
    compilation cache, which lets the next identical run skip the compile. Without a bar, the
    compile is summarised in one line once the first epoch is done."""

    COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
    CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

    def __init__(self, enabled: bool, log=None, every: float = 30.0):
        self.enabled, self.log, self.every = enabled, log, every
        self._bar = None
        self._listening = False
        self._waiting = None  # the task still before its first epoch
        self._tasks = 0
        self._compiled, self._seconds, self._cached = 0, 0.0, 0

    def __enter__(self):
        if self.enabled or self.log is not None:
            import jax

            jax.monitoring.register_event_duration_secs_listener(self._on_duration)
            jax.monitoring.register_event_listener(self._on_event)
            self._listening = True
        if self.enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as Bar

            self._bar = Bar(TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("replica-epochs"), TimeElapsedColumn(), TimeRemainingColumn(),
                            TextColumn("[dim]{task.fields[note]}"), transient=False)
            self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self._listening:
            import jax

            jax.monitoring.unregister_event_duration_listener(self._on_duration)
            jax.monitoring.unregister_event_listener(self._on_event)
            self._listening = False
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def _on_duration(self, event: str, duration_secs: float, **kwargs):
        if event == self.COMPILE_EVENT and self._waiting is not None:
            self._compiled, self._seconds = self._compiled + 1, self._seconds + duration_secs
            self._note()

    def _on_event(self, event: str, **kwargs):
        if event == self.CACHE_HIT_EVENT and self._waiting is not None:
            self._cached += 1
            self._note()

    def _counts(self) -> str:
        """'N XLA programs compiled, M loaded from the compilation cache' so far. JAX's compile event times
        each program's compile-or-load, so programs found in the cache are counted there too."""
        fresh = max(self._compiled - self._cached, 0)
        parts = [f"{fresh} compiled"] if fresh else []
        parts += [f"{self._cached} loaded from the compilation cache"] if self._cached else []
        first = fresh or self._cached
        return f"{first} XLA program{'s' * (first != 1)} " + ", ".join(parts).removeprefix(f"{first} ")

    def compile_note(self) -> str:
        """What the arm waited for before its first epoch, so far ('' when nothing was compiled or loaded)."""
        return f"compiling: {self._seconds:.0f} s, {self._counts()}" if self._compiled else ""

    def _note(self):
        if self._bar is not None:
            self._bar.update(self._waiting, note=self.compile_note())

    @staticmethod
    def first_note() -> str:

        cache = jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None
        return "compiling" + (" (once: the compilation cache keeps it for later runs)" if cache else "")

    def arm(self, name: str, total: int):
        """The callback that advances arm ``name`` by n replica-epochs (of ``total``)."""
        if self._bar is None and self.log is None:
            return lambda n: None
        first = self._tasks == 0  # later arms mostly reuse the programs the first one compiled
        self._tasks += 1
        self._compiled, self._seconds, self._cached = 0, 0.0, 0
        task = self._waiting = (self._bar.add_task(name, total=total, note=self.first_note() if first else "")
                                if self._bar is not None else name)
        done, t0 = [0], time.perf_counter()
        last = [t0]

        def advance(n: int):
            if self._waiting == task:
                self._waiting = None
                if self._bar is not None:
                    self._bar.update(task, note="")
                elif self._seconds >= 1:  # worth a line: the wait the user just had
                    self.log(f"arm {name}: {self._counts()} in {self._seconds:.0f} s before epoch 1")
            done[0] += n
            if self._bar is not None:
                self._bar.advance(task, n)
            elif time.perf_counter() - last[0] >= self.every and done[0] < total:
                last[0] = time.perf_counter()
                self.log(f"arm {name}: {done[0]}/{total} replica-epochs, {last[0] - t0:.0f} s")

        return advance
