"""A native call that could take the process down, tried first in a child process, where a
crash is an answer instead of the end of the run.

Native code that picks its instructions wrongly does not raise: the CPU stops the process
(SIGILL on an instruction it lacks, as vLLM's AMX kernels do on a CPU without AMX), and with it
a notebook's kernel, a benchmark or a test worker. So the kit tries such a call once, small, in
a child Python (`try_in_child`), and runs it in its own process only after the child lived; a
child that died says why in words, and the caller skips that path with the reason.
"""
from __future__ import annotations

import signal
import subprocess
import sys

# What a signal that ends a process running native code usually means.
SIGNAL_MEANING = {
    signal.SIGILL: "an instruction this CPU does not have",
    signal.SIGSEGV: "a memory access fault",
    signal.SIGBUS: "a memory access fault",
    signal.SIGABRT: "an abort in native code",
    signal.SIGFPE: "an arithmetic fault",
    signal.SIGKILL: "killed, most often for memory",
}


def death_reason(returncode: int, stderr: str) -> str:
    """In words, why a child ended with `returncode` (negative: the signal that killed it)."""
    if returncode < 0:
        sig = signal.Signals(-returncode)
        meaning = SIGNAL_MEANING.get(sig)
        return f"killed by {sig.name}" + (f" ({meaning})" if meaning else "")
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {returncode}"


def try_in_child(code: str, *args: str, timeout: float = 300,
                 env: dict | None = None) -> str | None:
    """Run `code` in a child Python, with `args` as its sys.argv[1:] (`env`: its environment,
    default this one's): None when it ran to the end with exit status 0, else why not, in one
    line."""
    try:
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"did not finish in {timeout:.0f} s"
    except OSError as e:
        return f"could not start a child process ({e})"
    return None if done.returncode == 0 else death_reason(done.returncode, done.stderr)
