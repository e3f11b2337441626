""":mod:`preloaded_python`'s stand-in ends a command as the real interpreter ends it
(``real_exit=True``): the same status, output and error output as ``sys.executable`` for
the same code, down to what only the interpreter's finalisation and C ``exit()`` do.

Each case runs the code under both and compares; the code imports no torch, so the real
interpreter costs milliseconds here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import preloaded_python
import pytest
from testutils import patient

ENDINGS = {
    "exit-code": "import sys\nprint('out')\nsys.exit(7)",
    "exit-message": "import sys\nsys.exit('a message instead of a code')",
    "falls-off-the-end": "print('done')",
    # atexit handlers run after the non-daemon threads, in reverse order of registration
    "atexit-after-threads": (
        "import atexit, threading, time\n"
        "atexit.register(print, 'first registered, last run')\n"
        "atexit.register(print, 'atexit')\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()"
    ),
    "uncaught-exception": (
        "import atexit\natexit.register(print, 'atexit ran')\n"
        "def inner():\n    raise ValueError('the script fails')\n"
        "def outer():\n    inner()\nouter()"
    ),
    "exception-in-excepthook": (
        "import sys\ndef hook(*a):\n    raise RuntimeError('hook fails')\n"
        "sys.excepthook = hook\nraise ValueError('original')"
    ),
    # CPython ends by SIGINT after its finalisation (the atexit line is printed first)
    "keyboard-interrupt": (
        "import atexit\natexit.register(print, 'atexit ran')\nraise KeyboardInterrupt"
    ),
    "killed-by-a-signal": "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)",
    # the module teardown of the finalisation: __main__'s objects are freed
    "module-teardown": (
        "class Noisy:\n    def __del__(self):\n        print('freed at the interpreter end')\n"
        "kept = Noisy()"
    ),
    # what the uncaught exception's frames hold lives until the finalisation (sys.last_*)
    "exception-kept-until-finalisation": (
        "class Noisy:\n    def __del__(self):\n        print('freed', flush=True)\n"
        "def fails():\n    held = Noisy()\n    raise ValueError('x')\nfails()"
    ),
    # C exit(): C stdio's buffer is flushed, the handlers C++ static destructors are
    # registered as (__cxa_atexit) run
    "c-stdio-flushed-at-exit": "import ctypes\nctypes.CDLL(None).printf(b'from C stdio\\n')",
    "c-atexit-handler": (
        "import ctypes\nlibc = ctypes.CDLL(None)\n"
        "abort = ctypes.cast(libc.abort, ctypes.c_void_p)\n"
        "libc.__cxa_atexit(abort, None, None)  # SIGABRT if C exit() runs"
    ),
}


def _run(python: list[str], code: str) -> tuple[int, str, str]:
    result = subprocess.run(
        [*python, "-c", code], capture_output=True, text=True, timeout=patient(60)
    )
    return result.returncode, result.stdout, result.stderr


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_command_ends_as_the_real_interpreter_ends_it(ending: str) -> None:
    code = ENDINGS[ending]
    real = _run([sys.executable], code)
    assert _run(preloaded_python.command(real_exit=True), code) == real


def test_the_real_interpreter_s_endings_are_what_these_cases_mean() -> None:
    """The cases above see what they are about (a case that cannot tell would prove nothing),
    and the other stand-in, which ends with ``os._exit``, fails the ones about the
    interpreter's own end."""
    statuses = {name: _run([sys.executable], code) for name, code in ENDINGS.items()}
    assert statuses["keyboard-interrupt"][0] == -signal.SIGINT
    assert statuses["keyboard-interrupt"][1] == "atexit ran\n"
    assert statuses["killed-by-a-signal"][0] == -signal.SIGTERM
    assert statuses["c-atexit-handler"][0] == -signal.SIGABRT
    assert statuses["c-stdio-flushed-at-exit"][1] == "from C stdio\n"
    assert statuses["module-teardown"][1] == "freed at the interpreter end\n"
    assert statuses["uncaught-exception"][0] == 1
    assert 'File "<string>", line 4, in inner' in statuses["uncaught-exception"][2]
    assert "Error in sys.excepthook" in statuses["exception-in-excepthook"][2]
    assert statuses["exception-kept-until-finalisation"][1] == "freed\n"
    forked = preloaded_python.command()
    for name in ("c-atexit-handler", "module-teardown"):
        assert _run(forked, ENDINGS[name]) != statuses[name], name


def test_a_signal_to_the_stand_in_ends_the_command_by_it() -> None:
    """Forwarded: SIGTERM to the stand-in ends the command by SIGTERM; SIGINT raises
    KeyboardInterrupt in it, which ends it by SIGINT after its ``atexit`` handlers."""
    code = (
        "import atexit, sys, time\natexit.register(print, 'atexit ran')\n"
        "print('waiting', flush=True)\ntime.sleep(600)"
    )
    for signum in (signal.SIGTERM, signal.SIGINT):
        command = preloaded_python.command(real_exit=True)
        proc = subprocess.Popen(
            [*command, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "waiting\n"
            os.kill(proc.pid, signum)
            out, err = proc.communicate(timeout=patient(60))
        finally:
            proc.kill()
            proc.communicate()
        assert proc.returncode == -signum, err
        if signum == signal.SIGINT:
            assert out == "atexit ran\n" and err.rstrip().endswith("KeyboardInterrupt")


def test_a_script_has_its_arguments_environment_directory_and_main(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys, __main__\n"
        "print(sys.argv, os.environ['THE_VARIABLE'], os.getcwd(), sys.path[0])\n"
        "print(__name__, __main__.__file__, sys.stdin.read())\n"
    )
    outputs = [
        subprocess.run(
            [*python, str(script), "a", "b"],
            input="from stdin",
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "THE_VARIABLE": "set"},
            timeout=patient(60),
        )
        for python in ([sys.executable], preloaded_python.command(real_exit=True))
    ]
    assert outputs[0].returncode == 0 and "from stdin" in outputs[0].stdout
    assert [o.stdout for o in outputs[1:]] == [outputs[0].stdout]


def test_a_command_killed_with_its_stand_in_is_killed(tmp_path: Path) -> None:
    """SIGKILL to the stand-in (a test's timeout kills it) takes the command along."""
    pid_file = tmp_path / "pid"
    code = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
    code += "print('started', flush=True)\ntime.sleep(600)"
    proc = subprocess.Popen(
        [*preloaded_python.command(real_exit=True), "-c", code], stdout=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"started\n"
    proc.kill()
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    pid = int(pid_file.read_text())
    end = time.monotonic() + patient(60)
    while _alive(pid):
        assert time.monotonic() < end, "the command outlived its stand-in"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
