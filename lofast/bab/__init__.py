"""Branch and bound over ReLU activation patterns: a driver independent of the bounding method
(`driver`), a plain-torch bounder for sequential Linear/ReLU networks (`sequential`); the
auto_LiRPA bounder for lofast models is `lofast.crown.beta`."""

from lofast.bab.driver import (
    HEURISTICS,
    BabResult,
    BabSettings,
    BoundBatch,
    Bounder,
    Domain,
    branch_and_bound,
    choose_babsr,
    choose_widest,
    split,
)
from lofast.bab.sequential import SequentialBounder

__all__ = ["HEURISTICS", "BabResult", "BabSettings", "BoundBatch", "Bounder", "Domain",
           "SequentialBounder", "branch_and_bound", "choose_babsr", "choose_widest", "split"]
