"""The one error a learner is meant to read: a setting is wrong, and the message says what to
change. Every layer raises it before heavy work starts; `python -m kit` prints it without a
traceback."""


class ConfigError(ValueError):
    """A parameter is wrong; the message says which and what to change."""
