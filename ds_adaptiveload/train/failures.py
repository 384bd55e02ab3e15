"""How a multi-rank run fails (docs/reliability.md): errors agreed on every rank, a lost peer named, and the
process group torn down on every exit path (the messages that name a step's rank and samples: step_errors.py).

The rule: an error that one rank detects is only raised after a collective has told every rank, so every
rank raises the same `AgreedError` at the same point, rank 0 prints it as one line and every rank exits 2.
A rank that raised alone would exit while its peers wait in a collective, which then fails with gloo's
"Connection closed by peer" traceback and exit 1 (the launcher returns whichever code it polls first).
"""
import logging
import os
import socket
import sys

from ds_adaptiveload.errors import UserError

logger = logging.getLogger(__name__)

EXIT_FAILED = 1
"""An unexpected error (a bug) on some rank: that rank printed its traceback."""
EXIT_USER_ERROR = 2
EXIT_PEER_LOST = 3
"""A rank or one of its DataLoader workers stopped (killed, preempted, crashed): relaunch (with --resume where a
checkpoint exists); 2 means fix the input."""


class AgreedError(UserError):
    """Raised on every rank with the same message after a collective (agree); rank 0 prints it and every rank
    exits with `code` (EXIT_USER_ERROR, EXIT_PEER_LOST for a killed DataLoader worker, EXIT_FAILED for a bug)."""

    def __init__(self, message, code=EXIT_USER_ERROR):
        super().__init__(message)
        self.code = code


class Terminated(BaseException):
    """SIGTERM (on_sigterm): the launcher ends every rank once one has exited non-zero. A BaseException,
    so that no `except Exception` on the way swallows it."""


EXIT_TERMINATED = 128 + 15


def on_sigterm(signum, frame):
    """Raise Terminated in the main thread, so that a rank the launcher ends right after a peer died still
    says which rank stopped (report); a rank blocked in a collective only gets here when it returns."""
    raise Terminated()


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def error_text(e: BaseException) -> str:
    """One line for an exception. A UserError raised in a DataLoader worker arrives wrapped in the
    worker's traceback; its last line is the original message."""
    lines = str(e).strip().splitlines()
    text = lines[-1] if lines else type(e).__name__
    return text.split("UserError: ", 1)[-1]


def combine(messages) -> str:
    """Distinct per-rank messages in rank order, at most three, as one line."""
    distinct = list(dict.fromkeys(m for m in messages if m))
    more = f" (and {len(distinct) - 3} more)" if len(distinct) > 3 else ""
    return "; ".join(distinct[:3]) + more


def agree(message, code=EXIT_USER_ERROR) -> None:
    """Collective: every rank calls it with its error message or None (and the exit code it asks for). When any
    rank has one, every rank raises the same AgreedError (the ranks' messages combined, the lowest failing rank's
    code); otherwise returns on every rank."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        if message:
            raise AgreedError(message, code)
        return
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (message, code) if message else None)
    failed = [m for m in everyone if m]
    if failed:
        raise AgreedError(combine(m for m, _ in failed), failed[0][1])


def own_error(e: Exception) -> tuple:
    """(message, exit code) of an error this rank hit on its own, for agree: bad input, a full disk or out of memory
    exit 2 (fix what the line names); anything else is a bug, whose traceback this rank prints now (exit 1)."""
    import traceback

    if isinstance(e, UserError):
        return error_text(e), EXIT_USER_ERROR
    if isinstance(e, OSError) or "out of memory" in str(e).lower():
        return f"rank {_rank()}: {cause_line(e)}", EXIT_USER_ERROR
    traceback.print_exc()
    return f"rank {_rank()}: {cause_line(e)} (its traceback is above)", EXIT_FAILED


def agreed(fn, *args, **kwargs):
    """Run fn on every rank, then agree on its error (own_error): every rank raises the same AgreedError (fn must
    issue no collective: a rank that failed inside it would leave its peers' collective unmatched). Returns fn's
    result."""
    try:
        out, err = fn(*args, **kwargs), None
    except Exception as e:
        out, err = None, own_error(e)
    agree(*(err or (None,)))
    return out


def sum_over_ranks(values, device) -> list:
    """All-reduce (sum) of a few per-rank integers: every rank gets the same answer, so every rank
    takes the same branch."""
    import torch

    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    dist = _dist()
    if dist is not None:
        dist.all_reduce(t)
    return [int(v) for v in t.tolist()]


# ----------------------------------------------------------------------------------------------------
# A lost peer: which rank stopped answering


_PEER_ERRORS = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket timeout",
                "timed out", "connection refused", "remote worker crashing", "nccl communicator was aborted",
                "watchdog caught collective operation timeout")


def register_rank() -> None:
    """Publish this rank's host and pid in the process group's store, so a survivor can tell which peer
    is gone (stopped_ranks). Best effort: without a store the message names no rank."""
    store = _store()
    if store is not None:
        store.set(f"ds_adaptiveload/pid/{_rank()}", f"{socket.gethostname()}:{os.getpid()}")
        _watch_sigterm()


# What the SIGTERM watcher read from the store while it was up: the peers that marked a SIGTERM, and whether a rank
# already printed the run's SIGTERM line; also the group it reads (store, world size, rank) and the thread.
_seen = {"marked": set(), "said": False, "group": None, "thread": None}
_SAID = "ds_adaptiveload/sigterm/said"


def _watch_sigterm() -> None:
    """A rank blocked in a collective runs its SIGTERM handler only once the collective fails, and for a peer of
    rank 0 that is when rank 0's process has ended (destroying the group does not close gloo's connections), taking
    the store and rank 0's mark with it: such a peer named rank 0 as lost beside rank 0's SIGTERM line. A thread
    woken by the signal itself (signal.set_wakeup_fd) marks this rank at once and copies the peers' marks while the
    store is up. Main thread only (set_wakeup_fd's rule); the DataLoader's workers drop the fd (die_with_parent)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or _dist().get_world_size() == 1:
        return
    # this group's store, size and rank: the thread may run on after the group is destroyed
    _seen.update(marked=set(), said=False, group=(_store(), _dist().get_world_size(), _rank()))
    if _seen.get("thread") is None:  # one per process, also where a process sets up several groups (tests)
        r, w = socket.socketpair()
        w.setblocking(False)
        # Both ends live as long as the process: with the read end closed (the watcher done, its socket collected),
        # the next signal's write to w failed and Python printed a traceback ("Exception ignored when trying to
        # write to the signal wakeup fd"); the launcher forwards a group SIGTERM, so a rank gets it twice.
        _seen["sockets"] = (r, w)
        signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        _seen["thread"] = threading.Thread(target=_sigterm_watcher, args=(r,), name="ds_adaptiveload-sigterm",
                                           daemon=True)
        _seen["thread"].start()


def _sigterm_watcher(r, poll_s: float = 0.05, limit_s: float = 60.0) -> None:
    """The watcher's loop: wait for a SIGTERM byte (other signals' bytes are skipped), read the store until every
    peer has marked and a rank has printed, or the store is gone; then drain the socket, so later signals' bytes
    never fill it."""
    import signal
    import time

    while True:
        data = r.recv(256)
        if not data:
            return
        if signal.SIGTERM in data:
            break
    store, world, me = _seen["group"]
    _mark_sigterm(store, me)
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        try:
            marked, said = _read_marks(store, world, me)
            _seen["marked"] |= marked
            _seen["said"] = _seen["said"] or said
            if _seen["said"] and len(_seen["marked"]) == world - 1:
                store.set(_ack_key(me), "1")  # rank 0 may leave now (_outlive_peers)
                break
        except Exception:  # the store is served by rank 0's process, which has left
            break
        time.sleep(poll_s)
    while r.recv(256):
        pass


def _store():
    dist = _dist()
    try:
        return dist.distributed_c10d._get_default_store() if dist is not None else None
    except Exception:  # private API; absent in some torch versions
        return None


def _rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist is not None else int(os.environ.get("RANK", 0))


def die_with_parent(parent_pid: int, worker_id: int = 0) -> None:
    """DataLoader worker_init_fn (functools.partial with the rank's pid): the worker gets SIGKILL when its
    rank dies. Workers are forked after the process group exists and hold copies of its sockets; a
    killed rank's orphaned worker would keep them open until its watchdog notices (~5 s), so the peers
    would see nothing and the launcher would end them before they could say which rank stopped."""
    import ctypes
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the rank's on_sigterm is not the worker's
    signal.set_wakeup_fd(-1)  # nor its SIGTERM watcher's socket (_watch_sigterm)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the rank died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def is_peer_failure(e: BaseException) -> bool:
    """A collective's error that means another rank is gone (gloo: the pair's connection closed; NCCL:
    the watchdog aborted the communicator)."""
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistNetworkError", ())):
        return True
    return _dist() is not None and any(p in str(e).lower() for p in _PEER_ERRORS)


def stopped_ranks() -> list:
    """Ranks whose process is gone, from the pids register_rank published (same host: checked; the
    store lives in rank 0, so an unreachable store means rank 0 is gone). [] when unknown."""
    import psutil

    dist, store = _dist(), _store()
    if dist is None or store is None:
        return []
    host, gone = socket.gethostname(), []
    for r in range(dist.get_world_size()):
        if r == dist.get_rank():
            continue
        key = f"ds_adaptiveload/pid/{r}"
        try:
            if not store.check([key]):  # get() would wait for the key; a rank that never registered
                continue
            h, pid = store.get(key).decode().rsplit(":", 1)
        except Exception:  # the store is served by rank 0's process
            return [0] if dist.get_rank() != 0 else []
        if h == host and not _alive(psutil, int(pid)):
            gone.append(r)
    return gone


def _alive(psutil, pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # killed, not yet reaped by the launcher
    except psutil.Error:
        return False


RELAUNCH = "Relaunch (docs/reliability.md)"
"""What a lost peer's line advises where no checkpoint exists to resume from (the trainer passes --resume's form)."""


def peer_lost_message(step, advice=RELAUNCH, gone=None) -> tuple:
    """(message, whether this rank prints it, the ranks found gone): the lowest rank still running prints, once.
    gone: the ranks whose process ended (default: stopped_ranks())."""
    gone, me = stopped_ranks() if gone is None else gone, _rank()
    when = f"step {step}: " if step else ""
    if gone:
        who = f"rank {gone[0]}" if len(gone) == 1 else f"ranks {', '.join(map(str, gone))}"
        msg = f"{when}{who} stopped answering (its process ended; its own output says why)"
    else:
        msg = f"{when}another rank stopped answering (a collective failed)"
    first_alive = min(r for r in range(me + 1) if r not in gone)
    return msg + f"; rank {me} stops too. {advice}", me == first_alive, gone


def _sigterm_key(rank: int) -> str:
    return f"ds_adaptiveload/sigterm/{rank}"


def _ack_key(rank: int) -> str:
    """Set by a rank's SIGTERM watcher once it has read every peer's mark and the printed line from the store."""
    return f"ds_adaptiveload/sigterm/ack/{rank}"


def _set_flag(key: str, store=None) -> None:
    """Set `key` in the store (default: the process group's); best effort, as rank 0, which serves it, may be gone."""
    store = store if store is not None else _store()
    try:
        if store is not None:
            store.set(key, "1")
    except Exception:
        pass


def _mark_sigterm(store=None, me=None) -> None:
    """Tell the other ranks (in the store) that this rank got SIGTERM, so that its exit is not taken for a crash."""
    _set_flag(_sigterm_key(_rank() if me is None else me), store)


def _read_marks(store=None, world=None, me=None) -> tuple:
    """(the other ranks that marked a SIGTERM, whether a rank printed the SIGTERM line), from the store (default:
    the process group's); raises when the store is unreachable."""
    if store is None:
        dist, store = _dist(), _store()
        if dist is None or store is None:
            return set(), False
        world, me = dist.get_world_size(), _rank()
    marked = {r for r in range(world) if r != me and store.check([_sigterm_key(r)])}
    return marked, store.check([_SAID])


def _sigtermed() -> set:
    """The other ranks that marked a SIGTERM (_mark_sigterm), read now or earlier by the watcher."""
    if _dist() is None:  # no group: nothing the watcher read belongs to this run
        return set()
    try:
        marked, _ = _read_marks()
    except Exception:  # the store is unreachable: rank 0 is gone
        marked = set()
    return marked | _seen["marked"]


def _sigterm_said() -> bool:
    """Whether a rank already printed the SIGTERM line (read now, or earlier by the watcher)."""
    if _dist() is None or _dist().get_world_size() == 1:  # no peer to print it twice (and no watcher's reads)
        return False
    try:
        return _read_marks()[1] or _seen["said"]
    except Exception:
        return _seen["said"]


def _outlive_peers(timeout_s: float = 5.0) -> None:
    """Rank 0 serves the store: it keeps it up until every peer has left (same host: its process ended) or its
    SIGTERM watcher has read what it needs (_ack_key), at most timeout_s, since the peers read the store to tell a
    SIGTERM from a crash. Had it left first, a SIGTERMed peer found the store gone and named rank 0 as a lost rank
    (1 run in 4 of a group SIGTERM). Destroying the group here does not end a peer's wait in a collective: gloo's
    connections close when this process ends."""
    import time

    dist, store = _dist(), _store()
    if dist is None or store is None or _rank() != 0 or dist.get_world_size() == 1:
        return
    import psutil

    host, pids = socket.gethostname(), {}
    for r in range(1, dist.get_world_size()):
        try:
            if store.check([f"ds_adaptiveload/pid/{r}"]):
                h, pid = store.get(f"ds_adaptiveload/pid/{r}").decode().rsplit(":", 1)
                pids[r] = int(pid) if h == host else None
        except Exception:
            return
    teardown()  # `store` still holds the store, which keeps serving
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and any((p is None or _alive(psutil, p)) and not store.check([_ack_key(r)])
                                         for r, p in pids.items()):
        time.sleep(0.05)


def _stopped_or_sigtermed(terminated: bool, wait_s: float = 3.0):
    """(ranks gone without a SIGTERM, whether the run is being ended by SIGTERM). A failed collective with no peer
    gone yet is looked at again for up to wait_s: a peer that just left may still be exiting."""
    import time

    end = time.monotonic() + wait_s
    while True:
        gone, marked = stopped_ranks(), _sigtermed()
        lost = [r for r in gone if r not in marked]
        if lost or terminated or marked or time.monotonic() >= end:
            return lost, terminated or bool(marked), gone
        time.sleep(0.1)


# ----------------------------------------------------------------------------------------------------
# Ending a run


def hold_signals() -> None:
    """Once a rank is failing: ignore SIGTERM and the DataLoader's SIGCHLD check until it has said why and left.
    The launcher SIGTERMs a rank's workers before the rank itself; either signal, landing while an error is
    handled, replaced it with `Terminated` or "DataLoader worker ... killed by signal: Terminated" and the
    rank printed a traceback instead of its line (one CI run of test_rank_killed_mid_step_...). Main thread only."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the rank leaves by itself; the launcher SIGKILLs after 30 s
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # not SIG_IGN: that would reap the workers before their join


def _ended(e: BaseException) -> bool:
    """SIGTERM, or the DataLoader's error for a worker that the launcher's SIGTERM ended (its rank is next)."""
    text = str(e) if isinstance(e, RuntimeError) else ""
    return isinstance(e, Terminated) or ("DataLoader worker" in text and "killed by signal: Terminated" in text)


def worker_killed(e: BaseException) -> bool:
    """The DataLoader's error for a worker a signal ended or that exited unexpectedly: killed from outside (the kernel's
    OOM killer, a scheduler), which a relaunch survives; not bad input."""
    text = str(e) if isinstance(e, RuntimeError) else ""
    return "DataLoader worker" in text and ("killed by signal" in text or "exited unexpectedly" in text)


def _known(e: BaseException) -> bool:
    return isinstance(e, UserError) or _ended(e) or is_peer_failure(e) or worker_killed(e)


def first_cause(e: BaseException) -> BaseException:
    """The oldest exception in e's chain (__context__) that report knows, else e. A signal or a worker's death
    that lands while an error is handled raises anew from the handling code; the first error says what happened."""
    chain = [e]
    while chain[-1].__context__ is not None and len(chain) < 32:
        chain.append(chain[-1].__context__)
    return next((x for x in reversed(chain) if _known(x)), e)


def report(e: BaseException, step=None, bar=None, advice=RELAUNCH) -> int:
    """Print the error line (once over all ranks) and return the exit code; re-raises anything that is
    neither bad input nor a lost peer nor SIGTERM (a bug: its traceback is wanted). bar: the run's progress bar,
    closed first so that the line starts a line (the loop's `finally` closes it, unless a signal cut it short).
    advice: what a lost peer's line tells the user to do (RELAUNCH, or --resume's form once a checkpoint exists)."""
    hold_signals()
    if bar is not None:
        bar.close()
    first = first_cause(e)
    if not _known(e) and not _ended(first):
        raise e  # a bug, also one raised while a known error was handled: its traceback is wanted
    e = first
    dist = _dist()
    if isinstance(e, UserError):
        agreed_ = isinstance(e, AgreedError) or dist is None or dist.get_world_size() == 1
        if _rank() == 0 or not agreed_:  # an error one rank raised alone is printed by that rank
            print(f"error: {error_text(e)}", file=sys.stderr, flush=True)
        if agreed_ and dist is not None:
            _barrier()  # no rank exits (and gets its peers killed by the launcher) before rank 0 printed
        return getattr(e, "code", EXIT_USER_ERROR)
    terminated = _ended(e)
    if terminated or is_peer_failure(e):
        try:
            return _lost_or_terminated(e, step, advice, terminated)
        finally:
            _outlive_peers()
    if worker_killed(e):  # the DataLoader's SIGCHLD check raised outside a step's read
        print(f"error: {f'step {step}, ' if step else ''}rank {_rank()}: {error_text(e)}; the data is not at fault: "
              f"{advice}", file=sys.stderr, flush=True)
        return EXIT_PEER_LOST
    raise e


def _lost_or_terminated(e, step, advice, terminated) -> int:
    """A failed collective, or SIGTERM. A peer whose process ended without marking a SIGTERM stopped answering (killed,
    crashed): the lowest rank still running names it, exit 3. Otherwise SIGTERM reached this rank or a peer (a
    scheduler ending the job, or the launcher once a rank failed): every rank exits 143 and the lowest rank still
    running prints the one line (a group SIGTERM gave exit codes 3 and 143 and two lines before)."""
    if terminated:
        _mark_sigterm()
    lost, sigterm, gone = _stopped_or_sigtermed(terminated)
    if lost or not sigterm:
        msg, mine, _ = peer_lost_message(step, advice, lost)
        if not lost:
            # every peer still runs: what failed is the clue (which rank failed first shows in these notes)
            logger.warning(f"note: rank {_rank()}: the collective failed with: {cause_line(e)}")
        if mine:
            print(f"error: {msg}", file=sys.stderr, flush=True)
        return EXIT_PEER_LOST
    me = _rank() if _dist() is not None else int(os.environ.get("RANK", 0))
    if me == min(r for r in range(me + 1) if r not in gone) and not _sigterm_said():
        _say_sigterm()
        print(f"error: {f'step {step}: ' if step else ''}stopped by SIGTERM (from a scheduler, or from the launcher "
              f"once a rank failed: then the first error above says why). {advice}", file=sys.stderr, flush=True)
    return EXIT_TERMINATED


def _say_sigterm() -> None:
    """Mark in the store that the SIGTERM line is printed: a peer that finds this rank gone later (it waited in a
    collective until this process ended) must not print it again."""
    _set_flag(_SAID)


def cause_line(e: BaseException, width: int = 300) -> str:
    """The exception's type and the first line of its text, at most `width` characters."""
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text}"[:width]


def _barrier():
    try:
        _dist().barrier()
    except Exception:  # a peer gone meanwhile: nothing left to wait for
        pass


def teardown() -> None:
    """Destroy the process group (every exit path): left alive, its threads abort the interpreter's exit
    with `terminate called without an active exception`."""
    dist = _dist()
    if dist is not None:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def leave(code: int) -> None:
    """End a finished script's process with `code`: atexit handlers run (logging, a bench's stats file), then
    os._exit skips the interpreter's teardown, where a rank now and then still aborted with `terminate called
    without an active exception` (SIGABRT) after a complete run under the test suite, turning success into
    a failed launch. Only for a script's __main__: everything is written and the group destroyed by then."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
