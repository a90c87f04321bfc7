"""The config, translated once: validation (`validate`) and the frozen specs (`specs`)."""
