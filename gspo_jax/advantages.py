"""`gspo_jax.advantages`: the public path of `gspo_jax.algorithm.advantages` (the algorithm lives in
gspo_jax/algorithm/). This module *is* that one: importing either gives the same object."""

import sys

from gspo_jax.algorithm import advantages as _module

sys.modules[__name__] = _module
