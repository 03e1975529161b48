"""The names of the hyper-parameters a step graph takes as values the trainer sets.

Each parameter group of the optimizer (``ngdist.optim``, torch's ``param_groups``) is one
optimizer node whose learning rate is a value of role ``hyper``: ``ngdist.lr`` for group 0,
``ngdist.lr.<i>`` for group i. The frontends name them so, the trainer sets them
(``trainer.set_lr``, a followed torch scheduler). A group whose momentum (SGD, RMSprop) or
beta1 (Adam, AdamW, Adamax, NAdam, RAdam) a torch scheduler cycles reads it from
``ngdist.momentum`` / ``ngdist.momentum.<i>`` likewise.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

LR = "ngdist.lr"
MOMENTUM = "ngdist.momentum"
_LR_RE = re.compile(r"ngdist\.lr(?:\.(\d+))?")


def lr_name(group: int) -> str:
    """The learning rate of parameter group ``group``."""
    return LR if group == 0 else f"{LR}.{group}"


def momentum_name(group: int) -> str:
    """The scheduled momentum (or beta1) of parameter group ``group``."""
    return MOMENTUM if group == 0 else f"{MOMENTUM}.{group}"


def lr_groups(names: Iterable[str]) -> dict[int, str]:
    """{group index: its learning rate's name} for the learning rates among ``names``."""
    out = {}
    for name in names:
        m = _LR_RE.fullmatch(name)
        if m:
            out[int(m.group(1) or 0)] = name
    return dict(sorted(out.items()))
