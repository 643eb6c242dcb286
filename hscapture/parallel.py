"""Jobs in processes of their own under one progress bar, sharing one queue of work: ``extract --data-parallel K``.

:func:`run_jobs` starts one ``spawn`` process per job (a fresh interpreter: no inherited CUDA state,
locks or threads), each with its own environment on top of ours (e.g. ``CUDA_VISIBLE_DEVICES``),
and calls ``target(*job.args, bar=...)`` there. The ``bar`` it is given makes tqdm-like bars whose
counts travel back over a queue, so the jobs draw one bar together in this process.

Given ``share``, the jobs also share their work (:class:`Shared`): ``share(shared)`` runs in a
thread of this process while the jobs start (they load their models meanwhile); it announces a
plan that every job reads once (``shared.plan()``) with the bar's total, puts the items of work,
then one end per job. A job takes items (``for item in shared``) whenever it is ready, so a job
that started first or runs faster takes more. ``share`` failing stops the jobs and its error is
raised here as it is.

The first job that fails stops the others and its error is raised here, prefixed with the job's
name. To stop, a job gets SIGINT (SIGKILL if it is still there after ``stop_timeout_s``); the
SIGINT interrupts it at once while it loads, and at its bar's next update or while it waits for
work when it captures (between two items, never inside a cleanup), so it finishes its store as on
Ctrl-C; once its bar is closed it ends on its own. A job outlives neither this process (it stops
itself when we die) nor a Ctrl-C here (the terminal's SIGINT reaches every job, and we wait for
them to finish their stores). A job that dies loses the item it was running; the others are stopped.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue as queues
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from hscapture.errors import HSCaptureError

#: How often the parent checks its jobs and a job checks its parent.
_POLL_S = 0.2


@dataclass
class Job:
    """One process: ``target(*args, bar=...)`` with ``env`` added to the environment."""

    #: Prefixes its errors and its progress (e.g. ``part-0-of-2``).
    name: str
    args: tuple[Any, ...]
    env: dict[str, str] = field(default_factory=dict)


class _Stop:
    """A job process's stop request (SIGINT), and how far the job is: ``loading``, ``capturing``, ``finishing``."""

    requested = False
    phase = "loading"

    @classmethod
    def check(cls) -> None:
        if cls.requested:
            raise KeyboardInterrupt


def _on_sigint(signum: int, frame: Any) -> None:
    """Interrupt a loading job at once; a capturing one stops at its bar's next update; a finishing one ends."""
    _Stop.requested = True
    if _Stop.phase == "loading":
        raise KeyboardInterrupt


class QueueBar:
    """The part of tqdm a job uses (``update``, ``set_postfix_str``, a context manager), sent to the parent.

    Made when the job starts capturing; a stop request raises KeyboardInterrupt from it.
    """

    def __init__(self, channel: Any, job: int, total: int) -> None:
        self._channel, self._job = channel, job
        _Stop.phase = "capturing"
        _Stop.check()
        self._channel.put(("total", job, total))

    def update(self, n: int = 1) -> None:
        _Stop.check()
        self._channel.put(("update", self._job, n))

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        self._channel.put(("postfix", self._job, text))

    def __enter__(self) -> QueueBar:
        return self

    def __exit__(self, *exc: object) -> None:
        _Stop.phase = "finishing"


class Shared:
    """Work the jobs share (see the module docstring): made by :func:`run_jobs`, given to ``share`` in this
    process and to each job as ``shared``."""

    def __init__(self, context: Any, jobs: int, channel: Any) -> None:
        self._jobs, self._channel = jobs, channel
        self._plans, self._items = context.Queue(), context.Queue()
        for queue in (self._plans, self._items):
            queue.cancel_join_thread()  # stopped jobs leave items unread: never wait for them at exit

    def announce(self, plan: Any, total: int) -> None:
        """Parent side: give every job ``plan`` and add ``total`` to the bar."""
        self._channel.put(("total", -1, total))
        for _ in range(self._jobs):
            self._plans.put(plan)

    def put(self, item: Any) -> None:
        """Parent side: one item of work (not None), for the first job that asks."""
        self._items.put(item)

    def end(self) -> None:
        """Parent side: no more items; each job ends its iteration when it meets one of these ends."""
        for _ in range(self._jobs):
            self._items.put(None)

    def plan(self) -> Any:
        """Job side: the plan, waiting for it (interruptible)."""
        return self._take(self._plans)

    def __iter__(self) -> Iterator[Any]:
        """Job side: items of work, waited for (a stop request interrupts the wait), until an end."""
        while (item := self._take(self._items)) is not None:
            yield item

    @staticmethod
    def _take(source: Any) -> Any:
        while True:
            _Stop.check()
            try:
                return source.get(timeout=_POLL_S)
            except queues.Empty:
                continue


def run_jobs(
    target: Callable[..., Any],
    jobs: Sequence[Job],
    show: bool = True,
    unit: str = "tok",
    stop_timeout_s: float = 120.0,
    share: Callable[[Shared], None] | None = None,
) -> list[Any]:
    """Run every job in its own process; return their results in job order.

    Args:
        share: feeds the jobs' shared work (see the module docstring); None: jobs share nothing.

    Raises:
        ValueError, TypeError: a job's bad input (the message names the job).
        HSCaptureError: a job failed otherwise, or died without a word (its exit status).
        KeyboardInterrupt: Ctrl-C; every job was let finish its store first.
        Exception: what ``share`` raised, as it is.
    """
    context = multiprocessing.get_context("spawn")
    channel = context.Queue()
    shared = Shared(context, len(jobs), channel) if share is not None else None
    processes = []
    for index, job in enumerate(jobs):
        process = context.Process(
            target=_job_main, args=(target, job, index, channel, shared), name=f"hscapture-{job.name}"
        )
        with _environment(job.env):
            process.start()
        processes.append(process)
    feeding: list[BaseException] = []  # share's failure, if any
    if share is not None and shared is not None:
        feeder = threading.Thread(target=_feed, args=(share, shared, channel, feeding), name="hscapture-share")
        feeder.daemon = True  # a failure here must not wait for it (e.g. on its tokenizing processes)
        feeder.start()
    results: dict[int, Any] = {}
    said: set[int] = set()  # jobs that reported their failure (they exit by themselves)
    postfix = [""] * len(jobs)
    bar = tqdm(total=0, unit=unit, unit_scale=True, disable=not show)

    def take(kind: str, index: int, value: Any) -> None:
        """One message of a job's: its bar, its result, or its failure (raised)."""
        if kind == "total":
            bar.total += value
            bar.refresh()
        elif kind == "update":
            bar.update(value)
        elif kind == "postfix":
            postfix[index] = value
            bar.set_postfix_str(" | ".join(f"{jobs[i].name}: {text}" for i, text in enumerate(postfix) if text))
        elif kind == "done":
            results[index] = value
        elif kind == "share-failed":
            raise feeding[0]
        else:
            said.add(index)
            raise _job_error(jobs[index].name, value)

    next_check = time.monotonic() + _POLL_S
    try:
        while len(results) < len(jobs):
            # The jobs' liveness every _POLL_S, whether or not messages come: a sibling's stream of bar updates
            # must not hide a job that died (it ran on to the end of the work before).
            if time.monotonic() >= next_check:
                _check_alive(jobs, processes, results, channel, take)
                next_check = time.monotonic() + _POLL_S
            try:
                message = channel.get(timeout=_POLL_S)
            except queues.Empty:
                continue
            take(*message)
    except BaseException:
        _stop(processes, said | set(results), stop_timeout_s)
        raise
    finally:
        bar.close()
    for process in processes:
        process.join()
    return [results[i] for i in range(len(jobs))]


def _feed(share: Callable[[Shared], None], shared: Shared, channel: Any, failure: list[BaseException]) -> None:
    """``share`` in its own thread; its exception is kept for the parent's loop, told over the channel."""
    try:
        share(shared)
    except BaseException as exc:
        failure.append(exc)
        channel.put(("share-failed", -1, None))


def _check_alive(
    jobs: Sequence[Job], processes: list[Any], results: dict[int, Any], channel: Any, take: Callable[..., None]
) -> None:
    """Raise for a job whose process ended without sending its result (killed, or crashed in C).

    A job sends its last message before it exits: once one is seen exited, every message already there is taken
    (``take``), its result among them if it sent one; if it still has none, it sent none.
    """
    exited = [i for i, process in enumerate(processes) if i not in results and process.exitcode is not None]
    if not exited:
        return
    while True:
        try:
            message = channel.get_nowait()
        except queues.Empty:
            break
        take(*message)
    for index in exited:
        if index not in results:
            raise HSCaptureError(
                f"{jobs[index].name}: its process exited with status {processes[index].exitcode} and no result"
            )


def _job_error(name: str, failure: tuple[str, str]) -> BaseException:
    """The parent's exception for a job's failure, of a class the command line maps to the right exit status."""
    kind, text = failure
    if kind == "KeyboardInterrupt":
        return KeyboardInterrupt()
    if kind in ("ValueError", "TypeError"):
        return {"ValueError": ValueError, "TypeError": TypeError}[kind](f"{name}: {text}")
    return HSCaptureError(f"{name}: {text}")


def _stop(processes: list[Any], ending: set[int], timeout_s: float) -> None:
    """SIGINT every running job but those ``ending`` on their own (each finishes its store), then
    SIGKILL what is left after ``timeout_s``."""
    for index, process in enumerate(processes):
        if index not in ending and process.exitcode is None and process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGINT)
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.exitcode is None:
            process.kill()
            process.join()


class _environment:
    """``os.environ`` with ``extra`` set while a process starts (spawn copies the environment then)."""

    def __init__(self, extra: dict[str, str]) -> None:
        self.extra = extra
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        self.saved = {name: os.environ.get(name) for name in self.extra}
        os.environ.update(self.extra)

    def __exit__(self, *exc: object) -> None:
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _job_main(target: Callable[..., Any], job: Job, index: int, channel: Any, shared: Shared | None) -> None:
    """A job's process: run it, send its result or its failure; stop when the parent dies."""
    signal.signal(signal.SIGINT, _on_sigint)
    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(_POLL_S)
        channel.cancel_join_thread()  # nobody reads the queue any more: never hang at exit on it
        signal.raise_signal(signal.SIGINT)  # orphaned: finish the store and exit, as on Ctrl-C

    threading.Thread(target=watch_parent, name="hscapture-watch-parent", daemon=True).start()
    try:
        more = {"shared": shared} if shared is not None else {}
        result = target(*job.args, bar=lambda total: QueueBar(channel, index, total), **more)
    except BaseException as exc:  # every failure goes to the parent, which decides
        _Stop.phase = "finishing"
        if not isinstance(exc, (ValueError, TypeError, HSCaptureError, KeyboardInterrupt)):
            traceback.print_exc(file=sys.stderr)  # unexpected: the parent gets the message, stderr the trace
        _send(channel, ("failed", index, (type(exc).__name__, _text(exc))))
        sys.exit(1)
    _Stop.phase = "finishing"
    _send(channel, ("done", index, result))


def _send(channel: Any, message: tuple[str, int, Any]) -> None:
    """Put the job's last message and wait until it is in the pipe (the process may exit right after)."""
    channel.put(message)
    channel.close()
    channel.join_thread()


def _text(exc: BaseException) -> str:
    known = isinstance(exc, (ValueError, TypeError, HSCaptureError, KeyboardInterrupt))
    return str(exc) if known else f"{type(exc).__name__}: {exc}"
