"""Third-party start-up notices that say nothing is wrong, dropped by the command lines.

Every CPU run of `python -m gspo_jax.main` (and `python -m tools.aot`) printed transformers'
"PyTorch was not found" (this project uses its tokenizers only) and JAX's "Unable to
initialize backend 'tpu'" (libtpu not installed: the run is meant for the CPU). The entry
points call `quiet_known_notices()` before anything imports those libraries; importing this
module changes nothing. Every other notice of theirs still shows, a libtpu that is installed
but fails to start included.
"""

from __future__ import annotations

import logging


def quiet_known_notices() -> None:
    logging.getLogger("transformers").addFilter(not_missing_torch)
    logging.getLogger("jax._src.xla_bridge").addFilter(not_missing_libtpu)


def not_missing_torch(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("PyTorch was not found.")


def not_missing_libtpu(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not (
        message.startswith("Unable to initialize backend 'tpu'")
        and "libtpu.so: cannot open shared object file" in message
    )
