"""What one step drafts: the options the adaptive policy chooses among."""

from __future__ import annotations

from typing import NamedTuple


class DraftShape(NamedTuple):
    """What one step drafts: a chain of `depth` tokens, or the configured tree. A named tuple: the policy
    keys its tables by shape every step, and a frozen dataclass's generated hash and equality would be a
    third of its host time."""

    depth: int
    tree: bool = False

    @property
    def name(self) -> str:
        return "tree" if self.tree else f"chain{self.depth}"

    @property
    def drafts(self) -> bool:
        """False for depth 0: the target verifies the root alone and the draft extend is deferred
        (speculative/catch_up.py)."""
        return self.tree or self.depth > 0
