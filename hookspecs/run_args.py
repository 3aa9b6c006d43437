"""The checks of :class:`hookspecs.run.TrainingRun`'s arguments: each turns a host's value into
the type the run keeps, or refuses it with a message naming the call, the argument, the value
and the fix. A leaf module: it imports nothing of the contract.
"""

from __future__ import annotations

import contextlib
import operator
import signal
from typing import Any


def catchable_signals(handle_signals: Any) -> tuple[int, ...]:
    """``handle_signals`` as signal numbers, refused (naming the value) where one is not a
    signal or cannot be caught: found here, not half-way through installing the handlers."""
    uncatchable = {
        getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name)
    }
    try:
        signums = tuple(dict.fromkeys(signal.Signals(s) for s in handle_signals))  # (once each)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"TrainingRun: handle_signals={handle_signals!r} is not a tuple of signals "
            f"({error}); pass signal numbers, e.g. (signal.SIGTERM,)"
        ) from None
    bad = [s.name for s in signums if s in uncatchable]
    if bad:
        raise ValueError(
            f"TrainingRun: handle_signals={handle_signals!r} names {', '.join(bad)}, which no "
            "process can catch; drop it (SIGTERM is what schedulers send before killing)"
        )
    return tuple(int(s) for s in signums)


def step_number(where: str, name: str, value: Any) -> int:
    """``value`` as an int (a numpy integer too: ``__index__``); a bool, a float (``0.0 ==
    0``) or anything else is refused, naming ``where``'s argument ``name`` and the value."""
    if not isinstance(value, bool):
        with contextlib.suppress(TypeError):
            return operator.index(value)
    raise TypeError(
        f"{where}: {name} must be an integer, got {value!r} ({type(value).__name__}); "
        f"pass {name} as an int (int({name}) for a whole number read as a float, e.g. "
        "from JSON, or held in a tensor)"
    )


def count(where: str, name: str, value: Any) -> int:
    """A count of positions as an int: an integer of any kind, or a whole number held as a
    float or in a one-element tensor (a float mask's ``sum()``); anything else is refused,
    naming ``where``'s argument ``name`` and the value."""
    if not isinstance(value, (bool, str, bytes)):
        with contextlib.suppress(TypeError):
            return operator.index(value)
        with contextlib.suppress(TypeError, ValueError, RuntimeError):
            number = float(value)
            if number.is_integer():
                return int(number)
    raise TypeError(
        f"{where}: {name} must be a whole number, got {value!r} ({type(value).__name__}); "
        f"pass the count of token positions (int(loss_mask.sum()))"
    )
