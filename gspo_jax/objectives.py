"""`gspo_jax.objectives`: the public path of `gspo_jax.algorithm.objectives` (the algorithm lives in
gspo_jax/algorithm/). This module *is* that one: importing either gives the same object."""

import sys

from gspo_jax.algorithm import objectives as _module

sys.modules[__name__] = _module
