"""The one error a learner is meant to read: a setting is wrong, and the message says what to
change. Every layer raises it before heavy work starts; `python -m kit` prints it without a
traceback, and so does a notebook (`brief_in_notebooks`)."""


class ConfigError(ValueError):
    """A parameter is wrong; the message says which and what to change."""


def one_line(shell, etype, value, tb, tb_offset=None) -> list[str]:
    """IPython's handler for a `ConfigError`: the message alone, as the cell's error output (so
    a headless run still fails at that cell), no traceback through the kit above it."""
    stb = [f"{etype.__name__}: {value}"]
    shell._showtraceback(etype, value, stb)
    return stb


def brief_in_notebooks() -> None:
    """In a notebook's kernel, show a `ConfigError` as its one line: a participant who writes
    `block_size = 17` reads what to change, not 36 lines through kit/config. Unexpected errors
    keep their traceback. Outside IPython, nothing."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None and ConfigError not in shell.custom_exceptions:
        shell.set_custom_exc((ConfigError,), one_line)
