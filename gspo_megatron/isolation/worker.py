"""A worker process: `python -m gspo_megatron.isolation.worker PARENT_PID`.

Started by a `ProcessPool` (rewards with reward.executor=process, environments with
env.executor=process). Protocol over stdin/stdout, each message a frame of an 8-byte
big-endian length followed by a pickle:

    parent -> worker  first: (sys_path, pickled function); then per call: its arguments (a tuple)
    worker -> parent  first: ("ready", None) or ("init_error", message);
                      then per call: ("ok", value) or ("error", message)

The worker runs each call in its main thread, so libraries that time themselves out with
SIGALRM (math-verify does) work. Anything the function prints goes to stderr, never into the
protocol stream. The worker dies with its parent (Linux PR_SET_PDEATHSIG), so a call stuck in a
loop never outlives the run.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback

from gspo_megatron.isolation.protocol import read_frame, write_frame


def die_with_parent(parent_pid: int | None) -> None:
    """Be killed (SIGKILL) when the parent process ends (Linux PR_SET_PDEATHSIG); exit at once
    if the parent `parent_pid` (when known) already ended before that took effect."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:  # not Linux / no glibc: the callers' own checks remain (this worker's
        pass  # stdin EOF, the trainer's peer watchdog)
    if parent_pid is not None and os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(1)


def _send_result(out, value) -> None:
    try:
        write_frame(out, ("ok", value))
    except Exception as exc:  # an unpicklable return value
        write_frame(out, ("error", f"cannot send the value {type(value).__name__}: {exc}"))


def main() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    die_with_parent(int(sys.argv[1]))
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the function's prints go to stderr, not into the protocol
    sys.stdout = sys.stderr

    frame = read_frame(inp)
    if frame is None:
        return
    try:
        sys_path, fn_bytes = pickle.loads(frame)
        sys.path[:] = sys_path
        fn = pickle.loads(fn_bytes)
    except BaseException as exc:
        write_frame(out, ("init_error", f"cannot load the function: {exc!r}"))
        return
    write_frame(out, ("ready", None))

    while (frame := read_frame(inp)) is not None:
        try:
            value = fn(*pickle.loads(frame))
        except BaseException as exc:
            tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
            write_frame(out, ("error", tb))
            continue
        _send_result(out, value)


if __name__ == "__main__":
    main()
