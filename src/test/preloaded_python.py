"""Python commands for the tests, started without importing torch again.

A test that runs ``python script.py``, ``python -m olmolike ...`` or ``python -c ...`` as a
subprocess pays for a fresh interpreter importing torch and olmolike: about 5 CPU seconds per
command, for a hundred commands per run of the suite on 2 cores. :func:`command` gives the
command line of a stand-in for ``sys.executable``: the same Python code runs in a process
forked from a server that imported torch and olmolike once per test process, with what the
command would have had: its arguments, environment, working directory, standard input,
output and error, ``sys.path``, a fresh ``__main__`` and ``multiprocessing`` main process, its
``atexit`` handlers at the end, and its exit status (a code, or the signal that ended it,
SIGKILL included). The stand-in is a small client process (``python -S`` running this file,
milliseconds) that forwards the signals it gets (SIGINT, SIGTERM, ...) to the command and
exits as the command did; killed, it takes the command with it.

What a forked command does not have is a fresh interpreter's start: modules are imported
before its environment is set (olmolike reads no environment at import; torch's thread count
is set from ``OMP_NUM_THREADS``), the hash seed is the server's. A test about how a process
starts (what an import pulls in, a fresh process's memory, the environment read at import)
runs the real ``sys.executable``.

How it ends depends on the server. By default (:func:`command`) the server is a fork
server's child and a command ends with ``os._exit`` after its threads and ``atexit``
handlers (~0.2 CPU s a command), without the interpreter's finalisation. With
``real_exit=True`` the server is a plain main interpreter (``python preloaded_python.py
--serve``), and a forked command runs at that script's top level and leaves as ``python``
leaves: its ``SystemExit`` propagates, so CPython's own ``Py_FinalizeEx`` (threads,
``atexit``, module teardown, garbage collection) and C ``exit()`` (C stdio flushed, C++
static destructors, gloo's) run as in a spawned process; an uncaught exception is printed
by ``sys.excepthook`` from the command's first frame, kept in ``sys.last_*`` and ends it
with status 1; an uncaught ``KeyboardInterrupt`` ends it by SIGINT after the finalisation
(as CPython's ``exit_sigint``; where the finalisation itself fails, CPython still dies by
SIGINT, this one exits 120). ~1.6 CPU s a command (the finalisation of a process that
imported torch: module teardown and the last collection; a fresh interpreter pays it too,
after ~4.5 s of imports). Tests about how a process ends (exit statuses at interpreter exit,
SIGABRT at exit, one line at exit) use it; ``test_preloaded_python`` compares its endings
with the real interpreter's.

Without a server (``OLMOLIKE_TEST_PYTHON_SERVER`` unset or gone), or for interpreter options
other than ``-c``, ``-m`` and ``-u``, the stand-in runs the real interpreter instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
from typing import Any

SERVER_ENV = "OLMOLIKE_TEST_PYTHON_SERVER"
"""Where the stand-in finds the server: the path of its UNIX socket."""

EXIT_SERVER_ENV = "OLMOLIKE_TEST_PYTHON_EXIT_SERVER"
"""Where the stand-in finds the server whose commands end as the interpreter ends
(``real_exit=True``)."""

_REAL_EXIT = "--real-exit"

_PRELOAD = [
    "olmolike.cli",
    "olmolike.experiment",
    "olmolike.inference",
    "olmolike.distributed.unshard",
    "olmolike.data.prepare",
    "olmolike.plot",
]
"""Imported by the server (besides :mod:`testutils`, which the fork server preloads): what
the ``olmolike`` subcommands and the example scripts import."""

_HEADER = struct.Struct("!I")


# -- the test side ------------------------------------------------------------------------------

_server: Any = None
_exit_server: Any = None


def command(*, real_exit: bool = False) -> list[str]:
    """The command line that stands in for ``sys.executable`` (its arguments follow), the
    server started for this test process if it is not running. Subprocesses find it through
    :data:`SERVER_ENV` (:data:`EXIT_SERVER_ENV`), set in this process's environment.

    ``real_exit``: the command ends as a fresh interpreter's does (its server is a plain
    main interpreter; the command's ``SystemExit`` or uncaught exception ends it through the
    interpreter's finalisation and C ``exit()``), for tests about how a process ends."""
    global _server, _exit_server
    if real_exit:
        if _exit_server is None or _exit_server.poll() is not None:
            _exit_server = _start_exit_server()
        return [sys.executable, "-S", "-E", os.path.abspath(__file__), _REAL_EXIT]
    if _server is None or not _server.is_alive():
        _server = _start_server()
    return [sys.executable, "-S", "-E", os.path.abspath(__file__)]


def torchrun(*options: str, real_exit: bool = False) -> list[str]:
    """``torchrun OPTIONS`` whose launcher and ranks run under the stand-in: the script (or
    ``-m module``) and its arguments follow. torchrun runs each rank as ``python -u`` does
    (``--no-python`` and the stand-in, unbuffered)."""
    python = command(real_exit=real_exit)
    return [*python, "-m", "torch.distributed.run", *options, "--no-python", *python, "-u"]


def _start_server() -> Any:
    import atexit
    import tempfile

    import rank_processes

    folder = tempfile.mkdtemp(prefix="olmolike-python-")
    path = os.path.join(folder, "server")
    ctx = rank_processes.context()
    ready, ready_child = ctx.Pipe(duplex=False)
    server = ctx.Process(
        target=_serve_forked, args=(rank_processes.AsSpawned(), path, ready_child), daemon=True
    )
    server.start()
    ready_child.close()
    if not ready.poll(120) or ready.recv() != "ready":
        server.kill()
        raise RuntimeError("the preloaded Python server did not start")
    os.environ[SERVER_ENV] = path
    atexit.register(_stop_server, server, folder)
    return server


def _start_exit_server() -> Any:
    """The server of ``real_exit`` commands: ``python preloaded_python.py`` started afresh
    (a main interpreter, not a fork server's child), told its socket and a pipe to say it
    is ready on."""
    import atexit
    import select
    import subprocess
    import tempfile

    folder = tempfile.mkdtemp(prefix="olmolike-python-")
    path = os.path.join(folder, "server")
    ready, ready_child = os.pipe()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    server = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve", path, str(ready_child)],
        env=env, pass_fds=[ready_child], stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    os.close(ready_child)
    said = os.read(ready, 16) if select.select([ready], [], [], 120)[0] else b""
    os.close(ready)
    if said != b"ready":
        server.kill()
        raise RuntimeError("the preloaded Python server (real exit) did not start")
    os.environ[EXIT_SERVER_ENV] = path
    atexit.register(_stop_server, server, folder)
    return server


def _stop_server(server: Any, folder: str) -> None:
    import shutil

    if hasattr(server, "is_alive"):  # a fork server's child
        if server.is_alive():
            server.kill()
            server.join(5)
    elif server.poll() is None:
        server.kill()
        server.wait(5)
    shutil.rmtree(folder, ignore_errors=True)


# -- the server ---------------------------------------------------------------------------------


def _serve_forked(inherited: Any, path: str, ready: Any) -> None:
    """The server of the fork server's children (``inherited``: what a spawned process has)."""
    del inherited

    def said_ready() -> None:
        ready.send("ready")
        ready.close()

    _serve(path, said_ready, real_exit=False)


def _serve(path: str, ready: Any, real_exit: bool) -> tuple[dict[str, Any], list[int], list[str]]:
    """Accept commands on ``path``; fork each into a process of its own; tell each client the
    command's wait status, and kill a command whose client is gone. With ``real_exit``, a
    forked command returns from here (the request, its descriptors and the base ``sys.path``)
    to run at the server script's top level; otherwise it ends in :func:`_run`."""
    import importlib
    import selectors
    import subprocess

    _die_with_parent(signal.SIGKILL)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the test's captured output belongs to the test that started it
        os.dup2(devnull, fd)
    os.close(devnull)
    for name in ["testutils", *_PRELOAD]:
        importlib.import_module(name)
    base_path = json.loads(
        subprocess.run(
            [sys.executable, "-E", "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    running: dict[int, socket.socket] = {}
    ready()
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                client, _ = listener.accept()
                try:  # a client that died while it asked must not end the server
                    received = _receive(client)
                except (OSError, ValueError):
                    client.close()
                    continue
                if received is None:
                    continue
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
                pid = os.fork()
                if pid == 0:  # the command: none of the server's files stays open in it
                    signal.set_wakeup_fd(-1)
                    selector.close()
                    for sock in [listener, client, *running.values()]:
                        sock.close()
                    os.close(wake_read)
                    os.close(wake_write)
                    _die_with_parent(signal.SIGKILL)
                    if real_exit:
                        return (*received, base_path)
                    _run(*received, base_path)
                for fd in received[1]:
                    os.close(fd)
                running[pid] = client
                try:
                    client.sendall(f"pid {pid}\n".encode())
                except OSError:  # its client is gone already: so is the command
                    del running[pid]
                    client.close()
                    os.kill(pid, signal.SIGKILL)
                    continue
                selector.register(client, selectors.EVENT_READ, pid)
            elif key.fileobj == wake_read:
                os.read(wake_read, 4096)
            else:  # a client closed its end: it is gone (killed); so is its command
                with contextlib.suppress(OSError):
                    if key.fileobj.recv(1) == b"":  # type: ignore[union-attr]
                        os.kill(key.data, signal.SIGKILL)
                        selector.unregister(key.fileobj)
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            client = running.pop(pid, None)
            if client is not None:
                with contextlib.suppress(OSError):
                    selector.unregister(client)
                with contextlib.suppress(OSError):
                    client.sendall(f"status {status}\n".encode())
                client.close()


def _receive(client: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """A command's request and its standard streams' descriptors, or None (client closed)."""
    header, fds, _, _ = socket.recv_fds(client, _HEADER.size, 3)
    if len(header) < _HEADER.size or len(fds) != 3:
        client.close()
        for fd in fds:
            os.close(fd)
        return None
    (size,) = _HEADER.unpack(header)
    body = b""
    while len(body) < size:
        chunk = client.recv(size - len(body))
        if not chunk:
            break
        body += chunk
    return json.loads(body), fds


def _become(request: dict[str, Any], fds: list[int], base_path: list[str]) -> Any:
    """In the forked process: become the command (streams, environment, working directory,
    signal handlers, ``sys.path``, a fresh ``__main__`` and ``multiprocessing`` main
    process); the new ``__main__`` module."""
    import io
    import itertools
    import multiprocessing.context as mp_context
    import multiprocessing.process as mp_process
    import types

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    env: dict[str, str] = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter starts
    unbuffered = request["unbuffered"] or bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout, sys.stderr = (
        io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False),
            encoding="utf-8",
            errors="backslashreplace" if fd == 2 else "strict",
            line_buffering=fd == 2 or os.isatty(fd),
            write_through=unbuffered,
        )
        for fd in (1, 2)
    )
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr  # type: ignore[misc]
    # A main process of its own, with the default start method, as a fresh interpreter has
    # (the server may be a fork server's child): the command may start processes.
    mp_process._current_process = _MainProcess()  # type: ignore[attr-defined]
    mp_process._parent_process = None  # type: ignore[attr-defined]
    mp_process._children = set()  # type: ignore[attr-defined]
    mp_process._process_counter = itertools.count(1)  # type: ignore[attr-defined]
    mp_context._default_context._actual_context = None  # type: ignore[attr-defined]
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    mode, target = request["mode"], request["target"]
    first = {"-c": "", "-m": os.getcwd()}.get(mode, os.path.dirname(os.path.realpath(target)))
    sys.path[:] = [first, *extra, *base_path]
    if any(os.path.isfile(os.path.join(p, "sitecustomize.py")) for p in extra):
        # As the interpreter's start imports it (a test's hook into every process of a job:
        # kill_points); an error in it fails the command.
        sys.modules.pop("sitecustomize", None)
        __import__("sitecustomize")
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    return main


def _run_command(request: dict[str, Any], main: Any) -> None:
    """Run the command as ``python`` would: its ``sys.argv``, its code in ``main``."""
    import runpy

    mode, target, args = request["mode"], request["target"], request["args"]
    if mode == "-m":
        sys.argv = ["-m", *args]
        runpy._run_module_as_main(target)  # type: ignore[attr-defined]
        return
    sys.argv = ["-c" if mode == "-c" else target, *args]
    if mode == "-c":
        source, filename = target, "<string>"
    else:
        main.__file__ = target
        with open(target, "rb") as f:
            source, filename = f.read(), target
    exec(compile(source, filename, "exec"), main.__dict__)


def _run(request: dict[str, Any], fds: list[int], base_path: list[str]) -> None:
    """In the forked process: become the command, run it, exit as Python would (threads,
    ``atexit``) with ``os._exit``."""
    import atexit
    import threading

    from rank_processes import skip_torch_library_finalizers

    code = 70  # setting up the command failed
    try:
        main = _become(request, fds, base_path)
        code = 0
        _run_command(request, main)
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException as e:
        if code == 70:
            import traceback

            os.write(2, f"preloaded_python: {traceback.format_exc()}".encode())
            os._exit(70)
        # The traceback from the command's first frame on, as the interpreter prints it.
        sys.excepthook(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        code = -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
    finally:
        try:
            threading._shutdown()  # type: ignore[attr-defined]
            skip_torch_library_finalizers()  # the process ends with os._exit
            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError):
                    stream.flush()
            if code < 0:  # as CPython ends on an uncaught KeyboardInterrupt
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            os._exit(code)


def _run_to_the_interpreter_s_end(request: dict[str, Any], main: Any) -> None:
    """Run the command at the server script's top level and leave as ``python`` leaves: a
    ``SystemExit`` propagates (the interpreter's finalisation, then C ``exit()`` with its
    C++ destructors); an uncaught exception is printed from the command's first frame on,
    kept in ``sys.last_*``, and ends the process with status 1; an uncaught
    ``KeyboardInterrupt`` ends it, after the finalisation, by SIGINT."""
    try:
        _run_command(request, main)
        return
    except SystemExit:
        raise
    except BaseException as e:
        error = e
    error.__traceback__ = _from_the_command(error.__traceback__)
    sys.last_type, sys.last_value, sys.last_traceback = type(error), error, error.__traceback__
    try:
        sys.excepthook(type(error), error, error.__traceback__)
    except BaseException as hook_error:
        hook_error.__traceback__ = _from_the_command(hook_error.__traceback__)
        print("Error in sys.excepthook:", file=sys.stderr)
        sys.__excepthook__(type(hook_error), hook_error, hook_error.__traceback__)
        print("\nOriginal exception was:", file=sys.stderr)
        sys.__excepthook__(type(error), error, error.__traceback__)
    if type(error) is KeyboardInterrupt:
        _end_by_sigint_at_exit()
        raise SystemExit(signal.SIGINT) from None
    raise SystemExit(1) from None


def _from_the_command(tb: Any) -> Any:
    """``tb`` from the command's first frame on: without this file's frames."""
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def _end_by_sigint_at_exit() -> None:
    """Make C ``exit(SIGINT)`` end the process by SIGINT before any other exit handler (the
    last registered runs first), as CPython kills itself with SIGINT after its finalisation
    instead of returning from ``main``: ``signal(status, SIG_DFL)``, then ``raise(status)``,
    through glibc's ``on_exit`` (whose handlers get the exit status first)."""
    import ctypes

    libc = ctypes.CDLL(None)
    for name in ("raise", "signal"):
        address = ctypes.cast(getattr(libc, name), ctypes.c_void_p)
        libc.on_exit(address, None)


def _MainProcess() -> Any:
    """What ``multiprocessing.current_process()`` is in a fresh interpreter."""
    from multiprocessing.process import AuthenticationString, BaseProcess

    main = BaseProcess.__new__(BaseProcess)
    main.__dict__.update(
        _identity=(), _name="MainProcess", _parent_pid=None, _popen=None, _closed=False,
        _config={"authkey": AuthenticationString(os.urandom(32)), "semprefix": "/mp"},
    )  # fmt: skip
    return main


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _die_with_parent(signum: int) -> None:
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signum)  # PR_SET_PDEATHSIG


# -- the stand-in (runs as ``python -S -E preloaded_python.py ARGS``) -----------------------------


def _parse(args: list[str]) -> dict[str, Any] | None:
    """What ``python ARGS`` would run, or None for what only the real interpreter does."""
    unbuffered = False
    while args and args[0] == "-u":
        unbuffered, args = True, args[1:]
    if len(args) >= 2 and args[0] in ("-c", "-m"):
        return {"mode": args[0], "target": args[1], "args": args[2:], "unbuffered": unbuffered}
    if args and not args[0].startswith("-"):
        return {"mode": "script", "target": args[0], "args": args[1:], "unbuffered": unbuffered}
    return None


def _stand_in(args: list[str], server_env: str) -> None:
    request = _parse(args)
    path = os.environ.get(server_env)
    connection = None
    if request is not None and path:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(path)
        except OSError:
            connection = None
    if request is None or connection is None:
        os.execv(sys.executable, [sys.executable, *args])
    request.update(env=dict(os.environ), cwd=os.getcwd())
    body = json.dumps(request).encode()
    socket.send_fds(connection, [_HEADER.pack(len(body))], [0, 1, 2])
    connection.sendall(body)
    replies = connection.makefile("r")
    pid = int(replies.readline().split()[1])

    def forward(signum: int, frame: object) -> None:
        del frame
        with contextlib.suppress(OSError):
            os.kill(pid, signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
        signal.signal(signum, forward)
    line = replies.readline()
    if not line:  # the server is gone
        os._exit(70)
    status = int(line.split()[1])
    if os.WIFSIGNALED(status):  # end by the same signal
        signum = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's cannot be set
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)
    os._exit(os.waitstatus_to_exitcode(status))


def _ready_on(fd: int) -> Any:
    def ready() -> None:
        os.write(fd, b"ready")
        os.close(fd)

    return ready


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:  # the server of real_exit commands; below, a command
        _command = _serve(sys.argv[2], _ready_on(int(sys.argv[3])), real_exit=True)
        _main = _become(*_command)
        _run_to_the_interpreter_s_end(_command[0], _main)
        del _command, _main
    elif sys.argv[1:2] == [_REAL_EXIT]:
        _stand_in(sys.argv[2:], EXIT_SERVER_ENV)
    else:
        _stand_in(sys.argv[1:], SERVER_ENV)
