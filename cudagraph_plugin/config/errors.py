"""How a broken configuration is reported: one error listing every violation.

Each :class:`Violation` names the field(s), their value, what is wrong and the fix, and
quotes the phrase megatron-core (0.16.1 and 0.19.2), Megatron-LM or Megatron-Bridge use for
the same constraint, so a pasted error finds its explanation. :class:`Note` is what a rule
could not check here (said, never raised).

Pure Python (the contract's error type is the only import).
"""

from __future__ import annotations

import dataclasses

from hookspecs.errors import ConfigurationError

# Where the reference phrases come from.
MCORE = "megatron-core"  # the same text in 0.16.1 and 0.19.2
MCORE_16 = "megatron-core 0.16"
MCORE_19 = "megatron-core 0.19"
MLM = "Megatron-LM"
BRIDGE = "Megatron-Bridge"


@dataclasses.dataclass(frozen=True)
class Violation:
    """One broken constraint: the field(s) involved, their value, what is wrong, the fix,
    and the phrases megatron-core / Megatron-LM / Megatron-Bridge use for it."""

    fields: tuple[str, ...]
    value: str
    problem: str
    fix: str
    references: tuple[tuple[str, str], ...] = ()

    @property
    def text(self) -> str:
        """The problem with its reference phrases quoted: ``... (megatron-core: "...")``."""
        if not self.references:
            return self.problem
        quoted = "; ".join(f'{source}: "{phrase}"' for source, phrase in self.references)
        return f"{self.problem} ({quoted})"

    def format(self) -> str:
        return f"{', '.join(self.fields)} = {self.value}: {self.text}\n     fix: {self.fix}"


class CudaGraphConfigError(ConfigurationError):
    """The CUDA-graph configuration cannot work; ``violations`` lists every problem. A
    ``ValueError`` (through the contract's :class:`~hookspecs.ConfigurationError`, which
    hosts catch to print it without a traceback)."""

    def __init__(self, violations: list[Violation]) -> None:
        self.violations = list(violations)
        lines = [f"{len(self.violations)} problem(s) with the CUDA graph configuration:"]
        lines += [f"  {i}. {v.format()}" for i, v in enumerate(self.violations, 1)]
        super().__init__("\n".join(lines))


@dataclasses.dataclass(frozen=True)
class Note:
    """Something a rule could not check here (said, never raised)."""

    text: str
