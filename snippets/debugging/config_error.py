"""Six heads for a hidden size of 64: the config check stops it before a model is built.

    python snippets/debugging/config_error.py
"""

from snippets.models.gpt import ConfigError, get_config
from snippets.labs.lab1_sweep import LAB1_CONFIGS  # snippets/models/lab1/

try:
    get_config(LAB1_CONFIGS / "bad-heads-6.json")
except ConfigError as err:
    print(f"ConfigError: {err}")
